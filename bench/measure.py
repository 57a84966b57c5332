"""Timing, FLOPs, errors, memory and the environment that makes a number meaningful."""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import platform
import statistics
import subprocess
import time

import torch

import attnforge
from attnforge.backends.reference import kernels as reference
from attnforge.dispatch import costs
from attnforge.testing import rel_error

FLOP_FORMULA = ("forward: 2 * batch * heads * seqlen_q * seqlen_k * (head_dim + head_dim_v), halved when causal "
                "(= 4*B*H*N^2*d for d = dv); with a sliding window, 2 * batch * heads * (visible query-key pairs) * "
                "(head_dim + head_dim_v); forward+backward: 3.5x the forward (backward = 2.5x forward, "
                "FlashAttention's benchmark convention)")
TIMING = ("CUDA events via triton.testing.do_bench (L2 flushed between runs), quantiles 0.5/0.1/0.9 of the "
          "repetitions; on CPU time.perf_counter around each call")
PEAK_MEM = "device memory one call allocates at its peak beyond what was allocated before it (inputs excluded)"


flops = costs.flop_count  # the one FLOP formula (FLOP_FORMULA above says it in words)


def step(fn, q, k, v, dout, mode: str):
    """The timed callable of ``fn(q, k, v)``: the forward under no_grad, or forward and backward (with ``dout``)
    for "fwd+bwd" on copies of the inputs that require grad."""
    if mode == "fwd":
        def run():
            with torch.no_grad():
                fn(q, k, v)
        return run
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    return lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout)


def time_ms(fn, device: torch.device, warmup_ms: float, rep_ms: float) -> tuple[float, float, float]:
    """(median, p10, p90) milliseconds per call of ``fn``."""
    if device.type == "cuda":
        import triton.testing

        median, p10, p90 = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.1, 0.9])
        return median, p10, p90
    deadline = time.perf_counter() + warmup_ms / 1e3
    while time.perf_counter() < deadline:
        fn()
    samples, deadline = [], time.perf_counter() + rep_ms / 1e3
    while time.perf_counter() < deadline or len(samples) < 5:
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    # "inclusive": the deciles lie within the samples. The default ("exclusive") extrapolates past the
    # fastest and slowest of a few samples, down to a negative p10.
    deciles = statistics.quantiles(samples, n=10, method="inclusive")
    return statistics.median(samples), deciles[0], deciles[-1]


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` runners, one per round, from a Williams design (a balanced Latin square, the crossover trials'
    tool): over the whole list (``n`` rounds for even ``n``; ``2n`` for odd, each row of the square followed by its
    mirror) each runner takes every position equally often and follows every other equally often (once for even
    ``n``, twice for odd), so that neither a round's start nor the runner timed before favours any. The first ``n``
    rounds open with ``n`` different runners."""
    base, low, high = [0], 1, n - 1
    while len(base) < n:
        base.append(low)
        low += 1
        if len(base) < n:
            base.append(high)
            high -= 1
    orders = [[(i + r) % n for i in base] for r in range(n)]
    if n % 2 == 0:
        return orders
    # odd n: each row then its mirror, so that a run of fewer rounds than the list is as balanced as it can be
    return [order for row in orders for order in (row, row[::-1])]


def round_count(runners: int, rounds: int | None = None) -> int:
    """How many rounds interleaved_ms runs for ``runners`` runners: ``rounds``, or (None) the whole balanced design
    (balanced_orders); callers that split a time budget among the rounds divide by it."""
    return len(balanced_orders(runners)) if rounds is None else rounds


def interleaved_ms(runners: dict, rounds: int | None = None, warmup_ms: float = 25,
                   rep_ms: float = 200, contexts: dict | None = None,
                   device: torch.device | None = None) -> dict[str, list[float]]:
    """CUDA runners timed in rounds, each once per round (time_ms's median), in balanced_orders (``rounds`` None:
    all of them, the full balance): {name: [ms, one per round]}. An untimed pass over every runner comes first, so
    that the first runner timed follows the same kind of work as the others. What a runner follows matters on the
    H200 at its power cap: a kernel timed right after a slow, low-power one runs at a higher clock. (Rotating the
    order alone, benchmarks/dispatch_check.py timed attnforge's sdpa backend always right after triton_fa2, its
    slowest and least power-hungry kernel, and measured it up to 8% above the same SDPA call made by stock torch
    later in the same rounds; rotated and every other round reversed, the first runner opened two rounds of three,
    and attnforge's automatic choice measured 5-6% below the same kernel forced in two rows; in two rounds of the
    balanced orders of three runners, sdpa followed triton_fa2 in both, and `attnforge tune --costs` measured its
    d=256 forwards 3-5% above what the checks found: benchmarks/results/2026-12-03-h200-retune/.) ``contexts``: a
    context factory by runner name, entered around each of that runner's timings; ``device``: default cuda."""
    names, device = list(runners), device or torch.device("cuda")
    contexts = contexts or {}

    def timed(name: str, warmup: float, rep: float) -> float:
        with contexts.get(name, contextlib.nullcontext)():  # (a runner's context: entered around its timing only)
            return time_ms(runners[name], device, warmup, rep)[0]

    for name in names:
        timed(name, warmup_ms, warmup_ms)
    times = {name: [] for name in names}
    orders = balanced_orders(len(names))
    for r in range(round_count(len(names), rounds)):
        for i in orders[r % len(orders)]:
            times[names[i]].append(timed(names[i], warmup_ms, rep_ms))
    return times


def wall_us_per_call(impls: dict, calls: int, repeats: int, sync) -> dict:
    """Median host wall time per call (us) of each implementation in ``impls`` (name -> fn): ``calls``
    queued back to back, then ``sync()``, ``repeats`` times, the implementations taking turns so that
    drift in the host's speed hits them alike. On a GPU, with a tiny problem, this is the launch path."""
    for fn in impls.values():  # warm-up: decision caches, compilation, torch's own dispatch caches
        for _ in range(calls):
            fn()
    sync()
    samples = {name: [] for name in impls}
    for _ in range(repeats):
        for name, fn in impls.items():
            t0 = time.perf_counter_ns()
            for _ in range(calls):
                fn()
            sync()
            samples[name].append((time.perf_counter_ns() - t0) / calls / 1e3)
    return {name: statistics.median(s) for name, s in samples.items()}


def peak_mem_bytes(fn, device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool, window: tuple[int, int]) -> int:
    """The (query, key) pairs a sliding window (FlashAttention's, bottom-right aligned; causal bounds the right side
    at 0) leaves visible: the work a kernel that skips the hidden blocks has to do."""
    left, right = window
    rows = torch.arange(seqlen_q, dtype=torch.int64) + (seqlen_k - seqlen_q)
    lo = (rows - left).clamp(min=0) if left >= 0 else torch.zeros_like(rows)
    hi = rows if causal else ((rows + right).clamp(max=seqlen_k - 1) if right >= 0 else torch.full_like(rows, seqlen_k - 1))
    return int((hi.clamp(max=seqlen_k - 1) - lo + 1).clamp(min=0).sum())


def describe_features(features) -> str:
    """ " window=(L, R) softcap=C sinks alibi" for the features a configuration has ("" for none)."""
    parts = [f"window=({features.window[0]}, {features.window[1]})" if features.window != (-1, -1) else "",
             f"softcap={features.softcap:g}" if features.softcap else "",
             "sinks" if features.sinks is not None else "", "alibi" if features.alibi_slopes is not None else ""]
    return "".join(" " + p for p in parts if p)


def reference_outputs(q, k, v, *, causal, scale, dout=None, features=None):
    """Output (and gradients) from attnforge's reference kernels in higher precision than the inputs:
    fp32 for fp16/bf16, fp64 for fp32 (bshd in, bshd out), with the configuration's score features. The errors
    are measured against these."""
    from attnforge.api import _causal_mask

    wide = torch.float64 if q.dtype == torch.float32 else torch.float32
    q32, k32, v32 = (t.detach().to(wide).transpose(1, 2) for t in (q, k, v))
    kw = {}
    mask = _causal_mask(causal)
    if features is not None:
        mask = _causal_mask(causal, features.window)
        slopes = features.alibi_slopes
        kw = dict(softcap=features.softcap,
                  alibi_slopes=None if slopes is None else slopes.to(wide).expand(q.shape[0], -1).contiguous())
    sinks = None if features is None or features.sinks is None else features.sinks.to(wide)
    out, lse = reference.forward(q32, k32, v32, mask=mask, scale=scale, sinks=sinks, **kw)
    grads = None
    if dout is not None:
        grads = reference.backward(q32, k32, v32, out, lse, dout.to(wide).transpose(1, 2), mask=mask, scale=scale,
                                   **kw)
        grads = tuple(g.transpose(1, 2) for g in grads)
    return out.transpose(1, 2), grads


def errors(out, grads, ref_out, ref_grads) -> dict:
    result = {"out_error": rel_error(out, ref_out), "grad_error": None, "grad_errors": None}
    if grads is not None and ref_grads is not None:
        each = {n: rel_error(g, r) for n, g, r in zip(("dq", "dk", "dv"), grads, ref_grads)}
        result.update(grad_error=max(each.values()), grad_errors=each)
    return result


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpu_state(device: torch.device) -> dict | None:
    """Clocks, power and temperature as nvidia-smi reads them now (None off NVIDIA)."""
    if device.type != "cuda" or torch.version.cuda is None:
        return None
    fields = ["name", "driver_version", "pstate", "clocks.sm", "clocks.max.sm", "clocks.mem", "power.draw",
              "power.limit", "temperature.gpu", "utilization.gpu"]
    try:
        run = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits",
                              "-i", str(device.index or 0)], capture_output=True, text=True, timeout=20)
        values = [x.strip() for x in run.stdout.strip().split(",")]
        if run.returncode or len(values) != len(fields):
            return {"error": (run.stderr or run.stdout).strip()[:200]}
        return dict(zip((f.replace(".", "_") for f in fields), values))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}


def environment(device: torch.device) -> dict:
    spec = attnforge.dispatch.detect(device)
    env = {
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
        "triton": _version("triton"),
        "nvidia_cutlass_dsl": _version("nvidia-cutlass-dsl"),
        "flash_attn_4": _version("flash-attn-4"),
        "flash_attn": _version("flash-attn"),
        "attnforge": attnforge.__version__,
        "device": {"name": spec.name, "arch": spec.arch, "vendor": spec.vendor,
                   "multiprocessors": spec.multiprocessors, "smem_per_block": spec.smem_per_block},
        "gpu_state_before": gpu_state(device),
    }
    return env

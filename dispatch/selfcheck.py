"""Self-check on first use: before a (backend, variant, device) first serves a call in a process, it
runs a tiny problem of the same variant (dtype, head dims, causality, GQA, odd lengths) against fp64
math (on the CPU): a forward variant its output, a backward variant its dQ, dK and dV from fp64's
output and LSE. A variant that disagrees beyond tolerance (or gives NaN) is disabled: the
Decision lists it as rejected with "self-check failed: ...", the fallback is logged, and the call goes
to the next backend. A tiny problem that raises (out of memory, a broken compiler cache, a bad
environment) disables the variant in this process only ("self-check could not run: ..."): nothing is
written, and the next process checks again.

Verdicts (passes and numerical disagreements) are kept on disk per device (<cache>/selfcheck/), each
with the attnforge, torch, triton and nvidia-cutlass-dsl versions it was reached with, and is ignored
once any of those differs; so a machine runs each check once per software stack. Records of any other
shape are ignored. ``ATTNFORGE_SELFCHECK`` set to 0, false, no or off (any case, spaces around ignored)
turns the checks off. The reference backend is the oracle and is not checked. Meant first for kernels
that were compiled but never run on their hardware (cute_sm100).
"""

from __future__ import annotations

import concurrent.futures
import functools
import importlib.metadata
import json
import logging
import re
import time

import torch

from .._version import __version__
from ..runtime.cache import default_cache_dir, write_atomic
from ..runtime.env import on_unless_turned_off
from .call import Call, KVCache, Varlen
from .problem import DTYPES, KV_CACHE_DTYPES, Problem

logger = logging.getLogger("attnforge")
ENV_VAR = "ATTNFORGE_SELFCHECK"
UNCHECKED = frozenset({"reference"})  # the oracle itself
# The tiny problem: odd lengths that cross a 128-row/128-key tile edge, two query heads per kv head.
BATCH, HEADS_Q, HEADS_KV, SEQLEN_Q, SEQLEN_K = 1, 2, 1, 133, 161
# A softcapped variant runs its tiny problem with this cap: near the unit scores' size, so the tanh bends them.
SOFTCAP = 2.0
# ... and one whose cap is above dispatch.problem.SMALL_SOFTCAP with this (the kernels may differ: cute_sm90's FIXED_MAX)
LARGE_SOFTCAP = 64.0
# An fp8 KV cache's (key, value) descales in the tiny problem: not 1, so that a kernel that drops one is caught.
FP8_KV_DESCALES = (0.5, 2.0)
# ALiBi's geometric slopes for the tiny problem's HEADS_Q heads (2^(-8 i / heads)).
ALIBI_SLOPES = tuple(2.0 ** (-8.0 * i / HEADS_Q) for i in range(1, HEADS_Q + 1))

_verdicts: dict[str, tuple[str, ...]] = {}  # this process: key -> reasons (empty: passed)
costs: list[tuple[str, float]] = []  # (key, seconds) of the checks this process ran


def enabled() -> bool:
    return on_unless_turned_off(ENV_VAR)


def key_of(backend, variant, problem: Problem, backward: bool = False) -> str:
    d = problem.device
    return (f"{'bwd:' if backward else ''}{backend.name}|{variant.name if variant is not None else ''}|{problem.dtype}|"
            f"d{problem.head_dim}/{problem.head_dim_v}|{problem.mask.describe() or 'full'}"
            f"{''.join('|' + f for f in problem.score_features)}|{d.name}|{d.arch}")


@functools.lru_cache(maxsize=1)
def versions() -> dict[str, str | None]:
    """The software a verdict was reached with (None: not installed); a record with others is ignored."""
    def installed(dist):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None
    return {"attnforge": __version__, "torch": torch.__version__, "triton": installed("triton"),
            "nvidia-cutlass-dsl": installed("nvidia-cutlass-dsl")}


def _store_path(problem: Problem):
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{problem.device.name}-{problem.device.arch}")
    return default_cache_dir() / "selfcheck" / f"{slug}.json"


def _read(path) -> dict:
    """The records in ``path`` ({} when it is missing, unreadable or not a JSON object)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _stored(record) -> tuple[str, ...] | None:
    """The reasons a record holds, or None when it is not a whole record of this software stack."""
    if not isinstance(record, dict) or record.get("versions") != versions():
        return None
    ok, reasons = record.get("ok"), record.get("reasons")
    if not isinstance(ok, bool) or not isinstance(reasons, list) or not all(isinstance(r, str) for r in reasons):
        return None
    if ok == bool(reasons):
        return None
    return tuple(reasons)


def _write(path, key: str, reasons: tuple[str, ...], seconds: float) -> None:
    data = _read(path)
    data[key] = {"ok": not reasons, "reasons": list(reasons), "seconds": round(seconds, 4), "versions": versions()}
    try:
        write_atomic(path, json.dumps(data, indent=1, sort_keys=True).encode())
    except OSError:
        pass  # a read-only cache only costs the next process a check


def reasons(backend, variant, problem: Problem, backward: bool = False) -> tuple[str, ...]:
    """Why ``backend`` must not serve ``problem`` with ``variant`` (with ``backward``, a backward variant) on this
    machine after its self-check (empty: fine). Runs the check the first time a key is seen (in this process
    and, via the disk, on this machine)."""
    if not enabled() or backend.name in UNCHECKED or not problem.device.present:
        return ()
    key = key_of(backend, variant, problem, backward)
    if key in _verdicts:
        return _verdicts[key]
    try:
        path = _store_path(problem)
    except OSError:  # a bad ATTNFORGE_CACHE_DIR: checks are kept in this process only
        path = None
    stored = _stored(_read(path).get(key)) if path is not None else None
    if stored is not None:
        _verdicts[key] = stored
        return stored
    t0 = time.perf_counter()
    why, lasting = _outcome(backend, variant, problem, backward)
    seconds = time.perf_counter() - t0
    costs.append((key, seconds))
    _verdicts[key] = why
    if lasting and path is not None:
        _write(path, key, why, seconds)
    if why and lasting:
        logger.warning("self-check of %s failed on %s (%s); it is disabled on this machine until the "
                       "check's record in %s is removed", key, problem.device.name, "; ".join(why), path)
    elif why:
        logger.warning("self-check of %s could not run on %s (%s); it is disabled in this process "
                       "only", key, problem.device.name, "; ".join(why))
    return why


def _outcome(backend, variant, problem: Problem, backward: bool = False) -> tuple[tuple[str, ...], bool]:
    """(reasons, lasting): the check's verdict, and whether it says something about the variant (a pass
    or a numerical disagreement, kept on disk) rather than about this process (an exception)."""
    try:
        # whatever default device the caller set, and whatever torch SDPA kernels an enclosing sdpa_kernel()
        # allows: the check judges the variant, not the caller's context
        with torch.device(problem.device.torch_device), _every_sdpa_kernel():
            return (_run_backward if backward else _run)(backend, variant, problem), True
    except Exception as exc:  # noqa: BLE001 - out of memory, a broken cache or toolkit: not the variant's verdict
        return (f"self-check could not run: the tiny problem raised {type(exc).__name__}: {str(exc)[:200]}; "
                f"disabled in this process only, retried by the next process",), False


def _every_sdpa_kernel():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                        SDPBackend.CUDNN_ATTENTION])


def _tiny_inputs(problem: Problem):
    """The tiny problem's (q, k, v, dout, scale, features) on the device, in the problem's dtype: fresh seeded
    random inputs and the variant's score features, each with values that change the answer (a sink above some
    rows' scores)."""
    device, dtype = problem.device.torch_device, DTYPES[problem.dtype]
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(heads, seqlen, dim):
        return torch.randn(BATCH, heads, seqlen, dim, generator=g, device="cpu").to(device=device, dtype=dtype)

    q, k, v = (rand(HEADS_Q, SEQLEN_Q, problem.head_dim), rand(HEADS_KV, SEQLEN_K, problem.head_dim),
               rand(HEADS_KV, SEQLEN_K, problem.head_dim_v))
    features = dict(softcap=(LARGE_SOFTCAP if problem.softcap_large else SOFTCAP) if problem.softcap else 0.0,
                    sinks=torch.randn(HEADS_Q, generator=g, device="cpu").to(device) if problem.sinks else None,
                    alibi_slopes=(torch.tensor(ALIBI_SLOPES, device=device).expand(BATCH, HEADS_Q).contiguous()
                                  if problem.alibi else None))
    dout = rand(HEADS_Q, SEQLEN_Q, problem.head_dim_v) if dtype != torch.float8_e4m3fn else None
    return q, k, v, dout, problem.head_dim ** -0.5, features


def _on_host(x):
    """A tensor (or each tensor value of a dict) copied to the CPU; anything else as it is."""
    if isinstance(x, dict):
        return {name: _on_host(value) for name, value in x.items()}
    return x.cpu() if isinstance(x, torch.Tensor) else x


def _tiny_cache(problem: Problem, k: torch.Tensor, v: torch.Tensor):
    """(KVCache or None, k, v): for a KV-cache problem, the tiny problem's k and v (batch, heads_kv, SEQLEN_K,
    head_dim) written into a cache whose positions past SEQLEN_K hold NaN (a cache's unwritten memory may, and a
    kernel must not let it through): rows of a contiguous cache, or pages of the problem's page size, sequence b's
    in order from page b * pages-per-sequence (so its answer is the dense one). Otherwise (None, k, v)."""
    if not problem.kv_cache:
        return None, k, v
    device = problem.device.torch_device
    size = problem.kv_page_size or SEQLEN_K + 15  # (contiguous: a row with room past the keys)
    per_sequence = -(-SEQLEN_K // size)

    def cache_of(x):
        rows = torch.full((BATCH, x.shape[1], per_sequence * size, x.shape[3]), float("nan"), dtype=x.dtype,
                          device=device)
        rows[:, :, :SEQLEN_K] = x
        if not problem.kv_page_size:
            return rows
        return rows.unflatten(2, (per_sequence, size)).transpose(1, 2).flatten(0, 1)  # (pages, heads_kv, size, d)

    seqlens = torch.full((BATCH,), SEQLEN_K, dtype=torch.int32, device=device)
    table = (torch.arange(BATCH * per_sequence, dtype=torch.int32, device=device).view(BATCH, per_sequence)
             if problem.kv_cache == "paged" else None)
    descale = (torch.tensor(FP8_KV_DESCALES, device=device)[:, None, None].expand(2, BATCH, HEADS_KV).contiguous()
               if problem.kv_dtype else None)
    return KVCache(seqlens, None, table, SEQLEN_K, descale=descale), cache_of(k), cache_of(v)


def _tiny_varlen(problem: Problem):
    """For a packed-batch problem, the tiny problem as a packed batch of its one sequence (its answer is the
    dense one)."""
    if not problem.varlen:
        return None
    device = problem.device.torch_device
    return Varlen(torch.tensor([0, SEQLEN_Q], dtype=torch.int32, device=device),
                  torch.tensor([0, SEQLEN_K], dtype=torch.int32, device=device), SEQLEN_Q, SEQLEN_K)


def _run(backend, variant, problem: Problem) -> tuple[str, ...]:
    """The tiny problem run by ``variant``, on the device, against fp64 math on the same (rounded) inputs.
    Raises what the variant raises."""
    from ..backends.reference import math_attention
    from ..testing import error_and_bound, fp8_peer, rel_error

    dtype = DTYPES[problem.dtype]
    q, k, v, _, scale, features = _tiny_inputs(problem)
    if problem.kv_dtype:  # the cache holds fp8; the answer is of what it stands for
        k8, v8 = k.to(KV_CACHE_DTYPES[problem.kv_dtype]), v.to(KV_CACHE_DTYPES[problem.kv_dtype])
        cache, k_cache, v_cache = _tiny_cache(problem, k8, v8)
        out, _ = backend.forward(variant, Call(q, k_cache, v_cache, scale, problem.mask, cache=cache, **features))
        k, v = (x.float() * d for x, d in zip((k8, v8), FP8_KV_DESCALES))
        k, v = k.to(dtype), v.to(dtype)  # (exact for fp8 values times a power of two)
    else:
        cache, k_cache, v_cache = _tiny_cache(problem, k, v)
        out, _ = backend.forward(variant, Call(q, k_cache, v_cache, scale, problem.mask, cache=cache,
                                               varlen=_tiny_varlen(problem), **features))
    # the oracle and torch's peer run on the CPU (the tiny problem is microseconds there): the check then adds no
    # GPU math library's start-up (cuBLAS's) to a process's first call
    out, q, k, v, features = (_on_host(x) for x in (out, q, k, v, features))
    ref, _ = math_attention(q.double(), k.double(), v.double(), mask=problem.mask, scale=scale,
                            **{n: x.double() if isinstance(x, torch.Tensor) else x for n, x in features.items()})
    if not torch.isfinite(out).all():
        return ("self-check failed: NaN or inf in the output of a tiny problem",)
    if problem.dtype == "fp8":  # as the FP8 tests: relative Frobenius error, at most 1.2x that of rounding P to
        # e4m3 (FP8's own error; torch has no fp8 matmul to compare with)
        err = rel_error(out, ref)
        peer_rel = rel_error(fp8_peer(q.float(), k.float(), v.float(), mask=problem.mask, scale=scale), ref)
        if not err <= 1.2 * peer_rel + 2 ** -8:
            return (f"self-check failed: relative error {err:.3g} against fp64 math on a tiny problem "
                    f"(FP8's own, P rounded to e4m3: {peer_rel:.3g})",)
        return ()
    # the test suite's rule (testing.assert_close): twice torch's own error computing the same thing in this
    # dtype, plus sqrt(reduction length) units of rounding
    peer, _ = math_attention(q, k, v, mask=problem.mask, scale=scale,
                             **{n: x.to(dtype) if isinstance(x, torch.Tensor) else x for n, x in features.items()})
    err, bound, peer_err = error_and_bound(out, ref, peer, ulps=4 * max(SEQLEN_K, problem.head_dim) ** 0.5)
    if err > bound:
        return (f"self-check failed: max error {err:.3g} against fp64 math on a tiny problem "
                f"(bound {bound:.3g}; torch's own {problem.dtype} error {peer_err:.3g})",)
    return ()


def _with_autograd(fn):
    """fn() in a thread of its own: the references take gradients by autograd, and a backward's first use may come
    where autograd is off for this thread: inside torch.no_grad(), autograd's own backward pass, or a torch.library
    operator's kernel (the dispatcher excludes autograd below its autograd key, which torch.enable_grad() does not
    undo). A new thread starts with autograd's defaults."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn).result()


def _run_backward(backend, variant, problem: Problem) -> tuple[str, ...]:
    """The tiny problem's gradients by the backward ``variant``, on the device, from fp64 math's output (rounded
    to the dtype) and LSE, against fp64 math's gradients; judged by the rule of _run on each of dQ, dK and dV.
    Raises what the variant raises."""
    from ..testing import error_and_bound, oracle, peer_error

    q, k, v, dout, scale, features = _tiny_inputs(problem)
    fp64 = dict(mask=problem.mask, scale=scale, dout=_on_host(dout), **_on_host(features))
    host = [_on_host(x) for x in (q, k, v)]
    (ref_out, ref_lse, ref_grads), (_, peer_grads) = _with_autograd(
        lambda: (oracle(*host, **fp64), peer_error(*host, **fp64)))  # on the CPU, as in _run
    call = Call(q, k, v, scale, problem.mask, varlen=_tiny_varlen(problem), **features)
    grads = backend.backward(variant, call, ref_out.to(q.device, q.dtype), ref_lse.to(q.device, torch.float32), dout)
    for name, x, ref, peer in zip(("dq", "dk", "dv"), map(_on_host, grads), ref_grads, peer_grads):
        if not torch.isfinite(x).all():
            return (f"self-check failed: NaN or inf in the backward's {name} on a tiny problem",)
        err, bound, peer_err = error_and_bound(x, ref, peer, ulps=8 * max(SEQLEN_Q, SEQLEN_K, problem.head_dim) ** 0.5)
        if err > bound:
            return (f"self-check failed: the backward's {name} is off by {err:.3g} against fp64 math on a tiny "
                    f"problem (bound {bound:.3g}; torch's own {problem.dtype} error {peer_err:.3g})",)
    return ()


def clear() -> None:
    """Forget this process's verdicts (the disk records stay)."""
    _verdicts.clear()
    costs.clear()

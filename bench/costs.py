"""``attnforge tune --costs``: measure each eligible plan (a forward backend; with grad, a forward+backward
pair) of this GPU over a grid of problem classes, and write the cost table the dispatcher ranks plans by
(dispatch/costs.py). Each plan runs forced, on the same fresh random inputs as the others, timed in interleaved
rounds (bench.measure.interleaved_ms: CUDA-event medians); the FLOPs are dispatch.costs.flops."""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import statistics
import subprocess

import torch

import attnforge
from attnforge.dispatch import costs
from attnforge.dispatch.device import detect
from attnforge.dispatch.priority import priority
from attnforge.dispatch.problem import DTYPES
from attnforge.dispatch.select import plan_name

from . import measure

# Never timed: the reference materialises N x N scores (it exists for correctness, not speed).
UNTIMED = ("reference",)


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool
    modes: tuple[str, ...] = costs.MODES


# Tokens per call (batch x seqlen) of the default grid: FlashAttention's benchmark budget, and one 8x smaller
# so that smaller calls (a few sequences, fewer CTAs) are measured too: an entry reaches a factor of 2 in
# batch x heads (dispatch/costs.py). 8k is measured for itself: averaging 4k's and 16k's ranks misrouted an 8k GQA
# causal training call (sdpa pair 509.9 TFLOP/s against cute_sm90's 529.8, benchmarks/dispatch_check.py, H200).
TOKENS = ((16384, (512, 1024, 4096, 8192, 16384)), (2048, (512, 1024, 2048, 4096)))


# Measured whatever the head dims asked for, at head dim 128: model shapes the grid's classes do not reach.
MODEL_SHAPES = (
    Shape(8, 16, 4, 512, 8192, 128, False),  # cross-attention / chunked prefill against a long context
    # Llama-style GQA 32/8 prefill: cute_sm90's backward runs one CTA per (key block, KV head), so its grid follows
    # batch x KV heads, which the 16/4 class at 8k halves. There the balanced tune measured its pair 498 against
    # sdpa's 507 TFLOP/s, while at 32/8 it ran 512-529 against 503-505 (H200, two same-run checks,
    # benchmarks/results/2026-12-03-h200-retune/).
    Shape(2, 32, 8, 8192, 8192, 128, True),
    Shape(64, 32, 8, 1, 8192, 128, False, ("fwd",)),  # decode against 8k cached keys
    Shape(1, 16, 4, 65536, 65536, 128, True),
)


def default_grid(head_dims=(64, 80, 96, 128, 192, 256), tokens: tuple[int, ...] | None = None) -> list[Shape]:
    """16k and 2k tokens per call (``tokens``: some of those) at 2048 / head_dim query heads (FlashAttention's
    benchmark shape), at 512..16k tokens per sequence, MHA and GQA 4:1, full and causal; plus MODEL_SHAPES
    (cross-attention, Llama-style GQA prefill, decode and one long sequence, at head dim 128)."""
    budgets = [(t, seqlens) for t, seqlens in TOKENS if tokens is None or t in tokens]
    if tokens is not None and len(budgets) != len(set(tokens)):
        raise ValueError(f"tokens per call must be among {', '.join(str(t) for t, _ in TOKENS)}, got {tokens}")
    grid = []
    for (tokens, seqlens), d, causal, group in itertools.product(budgets, head_dims, (False, True), (1, 4)):
        heads = max(group, 2048 // d // group * group)
        for seqlen in seqlens:
            grid.append(Shape(max(1, tokens // seqlen), heads, heads // group, seqlen, seqlen, d, causal))
    return grid + list(MODEL_SHAPES)


def _inputs(shape: Shape, dtype, gen, device):
    def rand(heads, seqlen):
        return torch.randn(shape.batch, heads, seqlen, shape.head_dim, device=device, generator=gen).to(dtype)
    q, k, v = rand(shape.heads_q, shape.seqlen_q), rand(shape.heads_kv, shape.seqlen_k), rand(shape.heads_kv, shape.seqlen_k)
    return q, k, v, torch.randn(q.shape, device=device, generator=gen).to(dtype)


def measure_grid(grid: list[Shape], dtype: str = "bf16", warmup_ms: float = 25, rep_ms: float = 60,
                 progress=print, device: str = "cuda", rounds: int | None = None) -> list[dict]:
    """One entry per (shape, mode, plan) that ran: its TFLOP/s (dispatch.costs.flops over the median). The plans of
    a (shape, mode) are timed in ``rounds`` interleaved rounds (measure.interleaved_ms: an untimed pass, then
    measure.balanced_orders; None: the whole balanced design, 6 rounds for 3 plans; ``rep_ms`` split among them, each after ``warmup_ms``: short warm-ups let the clock
    state the previous plan left bias the next, benchmarks/dispatch_check.py), the median of the rounds kept; on the
    CPU one after another."""
    names = [n for n in priority(detect(torch.device(device))) if n not in UNTIMED]
    gen = torch.Generator(device=device).manual_seed(0)
    entries = []
    for i, shape in enumerate(grid, 1):
        q, k, v, dout = _inputs(shape, DTYPES[dtype], gen, device)
        for mode in shape.modes:
            runners, problems = {}, {}
            for name in names:
                decision = attnforge.explain(q, k, v, causal=shape.causal, needs_grad=mode == "fwd+bwd", backend=name)
                if not decision.ok:
                    continue
                plan = plan_name(name, decision.backward)

                def fn(q, k, v, name=name):
                    return attnforge.attention(q, k, v, causal=shape.causal, backend=name)

                run = measure.step(fn, q, k, v, dout, mode)
                try:
                    run()  # compiles and self-checks before any timing
                except Exception as exc:  # a plan that fails here is left out of the table, and said
                    progress(f"  {plan} {mode}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
                    continue
                runners[plan], problems[plan] = run, decision.problem
            if q.device.type == "cuda":
                count = measure.round_count(len(runners), rounds)
                times = measure.interleaved_ms(runners, count, warmup_ms, rep_ms / count)
            else:
                times = {plan: [measure.time_ms(run, q.device, warmup_ms, rep_ms)[0]] for plan, run in runners.items()}
            for plan, ms_list in times.items():
                ms = statistics.median(ms_list)
                tflops = costs.flops(problems[plan], mode) / (ms * 1e-3) / 1e12
                entries.append({"plan": plan, "mode": mode, "dtype": dtype, "head_dim": shape.head_dim,
                                "head_dim_v": shape.head_dim, "causal": shape.causal, "batch": shape.batch,
                                "heads_q": shape.heads_q, "heads_kv": shape.heads_kv, "seqlen_q": shape.seqlen_q,
                                "seqlen_k": shape.seqlen_k, "tflops": float(f"{tflops:.4g}"), "ms": float(f"{ms:.4g}")})
        progress(f"[{i}/{len(grid)}] {shape}: " + ", ".join(
            f"{e['plan']} {e['mode']} {e['tflops']:.0f}" for e in entries if _same(e, shape)))
    return entries


def _same(entry: dict, shape: Shape) -> bool:
    return all(entry[f] == getattr(shape, f) for f in ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k",
                                                         "head_dim", "causal"))


def table_document(entries: list[dict], command: str, device: str = "cuda") -> dict:
    """The cost-table document (dispatch.costs.SCHEMA) for this machine's GPU."""
    spec = detect(torch.device(device))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    env = measure.environment(torch.device(device))
    versions = {k: env.get(k) for k in ("torch", "cuda", "cudnn", "triton", "nvidia_cutlass_dsl", "attnforge")}
    return {"schema": costs.SCHEMA, "arch": spec.arch, "device": spec.name,
            "measured": datetime.date.today().isoformat(), "command": command, "commit": commit,
            "versions": versions, "flop_formula": costs.flop_count.__doc__.strip(),
            "timing": measure.TIMING + "; a (shape, mode)'s plans in interleaved rounds after an untimed pass "
                      "(a balanced Latin square of orders), the median of the rounds", "entries": entries}


_ENTRY_KEY = ("plan", "mode", "dtype", "head_dim", "head_dim_v", "causal", "batch", "heads_q", "heads_kv", "seqlen_q",
              "seqlen_k")


def merge_documents(docs: list[dict], where: list[str]) -> dict:
    """One cost-table document from tables measured in parts (``attnforge tune --costs --head-dim ...`` runs) on one
    kind of GPU: every entry once (the first document's where two measured the same class and plan), each part's
    date, command, commit and versions kept under "parts"."""
    tables = [costs.parse(doc, name) for doc, name in zip(docs, where)]
    archs = {(t.arch, doc["device"]) for t, doc in zip(tables, docs)}
    if len(archs) != 1:
        raise costs.CostTableError(f"cannot merge tables of different GPUs: {sorted(archs)} (a GPU model's own "
                                   "table ships as dispatch/costs/<arch>-<name>.json, a device table)")
    seen, entries = set(), []
    for doc in docs:
        for entry in doc["entries"]:
            key = tuple(entry[f] for f in _ENTRY_KEY)
            if key not in seen:
                seen.add(key)
                entries.append(entry)
    # a document merged before brings its own parts
    parts = [part for doc in docs for part in doc.get("parts") or [{k: doc.get(k) for k in ("measured", "command",
                                                                                          "commit", "versions")}]]
    first = docs[0]
    merged = {**first, "measured": max(doc["measured"] for doc in docs),
              "command": " + ".join(doc["command"] for doc in docs), "commit": first.get("commit"),
              "parts": parts, "entries": entries}
    costs.parse(merged, "the merged table")
    return merged

"""``attnforge bench``: attnforge side by side with the attention kernels importable here, on the
same fresh random inputs in the same run, with what makes each number meaningful recorded."""

from __future__ import annotations

import dataclasses
import itertools
import statistics

import torch

import attnforge

from . import measure, report
from .impls import Features, implementations

__all__ = ["BenchConfig", "implementations", "run"]


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    dtypes: tuple[str, ...] = ("bf16",)
    head_dims: tuple[int, ...] = (64, 128)
    seqlens: tuple[int, ...] = (1024, 4096, 16384)
    tokens: int = 16384  # batch = tokens // seqlen, as FlashAttention's benchmark
    heads: int | None = None  # default: 2048 // head_dim (hidden size 2048, FlashAttention's benchmark)
    kv_heads: int | None = None  # default: heads
    causal: tuple[bool, ...] = (False, True)
    modes: tuple[str, ...] = ("fwd", "fwd+bwd")
    impls: tuple[str, ...] = ("auto", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "fa4")
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    # 1: each implementation timed once, one after another; more: the implementations of a configuration and mode
    # timed in that many interleaved rounds (measure.interleaved_ms: balanced orders after an untimed pass), each
    # row's median_ms the median of its rounds' medians, so that what the GPU's clock did while one of them ran
    # (at the power cap it drifts by several percent from one timing to the next) does not decide a ratio
    rounds: int = 1
    seed: int = 0
    device: str = "cuda"
    # score features timed in every configuration: a sliding window (left, right; -1 unbounded, FlashAttention's),
    # a softcap (0: none), a sink logit per query head, ALiBi slopes per query head
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    sinks: bool = False
    alibi: bool = False

    def check(self) -> None:
        known = implementations()
        unknown = [i for i in self.impls if i not in known]
        if unknown:
            raise attnforge.UnknownNameError(f"unknown implementation(s) {', '.join(unknown)}; known: {', '.join(known)}")
        bad_modes = [m for m in self.modes if m not in ("fwd", "fwd+bwd")]
        if bad_modes:
            raise attnforge.InvalidInputError(f"unknown mode(s) {', '.join(bad_modes)}; use fwd, fwd+bwd")
        for name in self.dtypes:
            attnforge.dispatch.dtype_name(name)
        from attnforge.api import _check_window

        _check_window(self.window)
        attnforge.dispatch.problem.check_softcap(self.softcap)
        if self.rounds < 1:
            raise attnforge.InvalidInputError(f"rounds must be at least 1, not {self.rounds}")


QUICK = BenchConfig(dtypes=("fp32",), head_dims=(64,), seqlens=(128, 256), tokens=512, heads=2,
                    impls=("auto", "reference", "sdpa-math"), warmup_ms=5, rep_ms=30, device="cpu")


def _inputs(dtype: torch.dtype, batch, seqlen, heads, kv_heads, head_dim, gen, device):
    def rand(h):  # fresh random data, never zeros; (batch, seqlen, heads, dim) = FlashAttention's layout
        return torch.randn(batch, seqlen, h, head_dim, generator=gen, device=device).to(dtype)
    return rand(heads), rand(kv_heads), rand(kv_heads)


def _features(cfg: BenchConfig, heads: int, gen, device) -> Features:
    """The configuration's score features, with fresh sink logits (some above the scores, some below) and ALiBi's
    geometric slopes 2^(-8 i / heads)."""
    sinks = (torch.randn(heads, generator=gen, device=device) * 2.0).float() if cfg.sinks else None
    slopes = (torch.tensor([2.0 ** (-8.0 * i / heads) for i in range(1, heads + 1)], device=device)
              if cfg.alibi else None)
    return Features(tuple(cfg.window), float(cfg.softcap), sinks, slopes)


def _flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal, mode, features: Features) -> float:
    """FlashAttention's convention (measure.FLOP_FORMULA); with a window, the visible (query, key) pairs only."""
    if features.window == (-1, -1):
        return measure.flops(batch, heads, seqlen_q, seqlen_k, head_dim, head_dim, causal, mode)
    pairs = measure.visible_pairs(seqlen_q, seqlen_k, causal, features.window)
    return 2.0 * batch * heads * pairs * 2 * head_dim * (3.5 if mode == "fwd+bwd" else 1.0)


def _checked_call(impl, q, k, v, dout, causal, scale, mode, device, ref, features):
    """(the timed callable, its errors against the reference and peak memory): correctness first, on the same inputs
    the timing uses."""
    fn = impl.make(causal, scale, features)
    needs_grad = mode == "fwd+bwd"
    q, k, v = (t.detach().requires_grad_(needs_grad) for t in (q, k, v))
    out = fn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dout) if needs_grad else None
    errs = measure.errors(out, grads, *ref(needs_grad))
    call = measure.step(fn, q, k, v, dout, mode)
    return call, {"peak_mem_bytes": measure.peak_mem_bytes(call, device), **errs}


def run(cfg: BenchConfig, progress=print, checkpoint=None) -> dict:
    """Run the grid; returns the report (see report.SCHEMA) with one row per (config, impl).
    ``checkpoint(report)`` is called after each configuration with the results so far."""
    cfg.check()
    device = torch.device(cfg.device)
    known = implementations()
    env = measure.environment(device)
    # Every peer bench knows, and whether it can run here (so a missing one is listed with why).
    env["peers"] = {name: impl.why_not(device, None) or "available" for name, impl in known.items()}
    unavailable = {}
    results = []
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    grid = list(itertools.product(cfg.dtypes, cfg.head_dims, cfg.seqlens, cfg.causal))
    for n, (dtype_name, head_dim, seqlen, causal) in enumerate(grid, 1):
        dtype = attnforge.dispatch.DTYPES[attnforge.dispatch.dtype_name(dtype_name)]
        heads = cfg.heads or max(1, 2048 // head_dim)
        kv_heads = cfg.kv_heads or heads
        batch = max(1, cfg.tokens // seqlen)
        scale = head_dim ** -0.5
        q, k, v = _inputs(dtype, batch, seqlen, heads, kv_heads, head_dim, gen, device)
        dout = torch.randn(q.shape, generator=gen, device=device).to(dtype)
        features = _features(cfg, heads, gen, device)
        cache = {}

        def ref(with_grads):  # computed once per configuration, only if something ran
            if with_grads not in cache:
                cache[with_grads] = measure.reference_outputs(q, k, v, causal=causal, scale=scale,
                                                              dout=dout if with_grads else None, features=features)
            return cache[with_grads]

        progress(f"[{n}/{len(grid)}] {dtype_name} d={head_dim} seqlen={seqlen} batch={batch} heads={heads}/{kv_heads} "
                 f"{'causal' if causal else 'full'}{measure.describe_features(features)}")
        for mode in cfg.modes:
            rows, calls, contexts = {}, {}, {}
            for name in cfg.impls:
                row, call = _checked_row(known[name], name, mode, dtype_name, q, k, v, dout, causal, scale, device,
                                         ref, features, unavailable)
                rows[name] = row
                if call is not None and cfg.rounds == 1:  # timed right after its check
                    _time_row(row, lambda: dict(zip(("median_ms", "p10_ms", "p90_ms"), measure.time_ms(
                        call, device, cfg.warmup_ms, cfg.rep_ms))), known[name].context, device)
                elif call is not None:
                    calls[name], contexts[name] = call, known[name].context
            if calls:  # cfg.rounds > 1: every checked implementation, in interleaved rounds
                _time_rounds(rows, calls, contexts, device, cfg)
            for row in rows.values():
                if row["status"] == "ok" and row["median_ms"] is not None:
                    row["tflops"] = _flops(batch, heads, seqlen, seqlen, head_dim, causal, mode, features) / (
                        row["median_ms"] * 1e-3) / 1e12
            results.extend(rows.values())
        if checkpoint is not None:
            checkpoint(_report(cfg, env, unavailable, results))
    env["gpu_state_after"] = measure.gpu_state(device)
    return _report(cfg, env, unavailable, results)


def _time_row(row: dict, measure_fields, context, device) -> None:
    """``row`` updated with ``measure_fields()`` run inside ``context()``; a failure is the row's error, not the
    run's."""
    try:
        with context():
            row.update(measure_fields())
    except Exception as exc:  # a peer that refuses a config is a result, not a crash
        _failed([row], exc, device)


def _time_rounds(rows: dict, calls: dict, contexts: dict, device, cfg) -> None:
    """The rows of ``calls`` updated with their timing in cfg.rounds interleaved rounds: the median of the rounds'
    medians, the fastest and slowest round as p10_ms and p90_ms, and every round's median (round_ms)."""
    try:
        rounds = measure.interleaved_ms(calls, cfg.rounds, cfg.warmup_ms, cfg.rep_ms, contexts, device)
    except Exception as exc:  # one that fails in a later round fails the rounds of all (they share them)
        _failed([rows[name] for name in calls], exc, device)
        return
    for name, ms in rounds.items():
        rows[name].update(median_ms=statistics.median(ms), p10_ms=min(ms), p90_ms=max(ms), round_ms=ms)


def _failed(rows: list, exc: Exception, device: torch.device) -> None:
    reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
    for row in rows:
        row.update(status="error", reason=reason)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _checked_row(impl, name, mode, dtype_name, q, k, v, dout, causal, scale, device, ref, features, unavailable):
    """(the result row of ``impl`` for this configuration and mode without its timing, and its checked timed
    callable; None where it is unavailable, unsupported or failed its check, which the row then says)."""
    batch, seqlen, heads, head_dim = q.shape
    row = {"impl": name, "dtype": dtype_name, "batch": batch, "heads": heads, "kv_heads": k.shape[2],
           "seqlen_q": seqlen, "seqlen_k": seqlen, "head_dim": head_dim, "head_dim_v": head_dim,
           "causal": causal, "dropout_p": 0.0, "mode": mode, "status": "ok", "reason": None,
           "median_ms": None, "p10_ms": None, "p90_ms": None, "tflops": None, "peak_mem_bytes": None,
           "out_error": None, "grad_error": None, "grad_errors": None, "decision": None,
           "window": list(features.window), "softcap": features.softcap, "sinks": features.sinks is not None,
           "alibi": features.alibi_slopes is not None}
    why = impl.why_not(device, q.dtype)
    lacking = sorted(features.names() - impl.features)
    if lacking and not why:
        why = f"{impl.summary} has no {', '.join(lacking)} here"
    if why:
        unavailable[name] = why
        return {**row, "status": "unavailable", "reason": why}, None
    if impl.is_attnforge:
        decision = attnforge.explain(q, k, v, layout="bshd", causal=causal, needs_grad=mode == "fwd+bwd",
                                     backend=impl.attnforge_backend, window_size=features.window,
                                     softcap=features.softcap, sinks=features.sinks is not None,
                                     alibi=features.alibi_slopes is not None)
        row["decision"] = decision.to_dict()
        if not decision.ok:
            return {**row, "status": "unsupported",
                    "reason": f"attnforge cannot serve it: {str(decision).splitlines()[0]}"}, None
    try:
        with impl.context():
            call, fields = _checked_call(impl, q, k, v, dout, causal, scale, mode, device, ref, features)
            if impl.reports_decision and attnforge.last_decision() is not None:
                fields["decision"] = attnforge.last_decision().to_dict()
    except Exception as exc:  # a peer that refuses a config is a result, not a crash
        _failed([row], exc, device)
        return row, None
    row.update(fields)
    return row, call


def _report(cfg, env, unavailable, results) -> dict:
    return {
        "schema": report.SCHEMA,
        "environment": env,
        "settings": {"config": dataclasses.asdict(cfg), "flop_formula": measure.FLOP_FORMULA,
                     "timing": measure.TIMING, "peak_mem": measure.PEAK_MEM,
                     "errors": ("relative Frobenius norm against attnforge's reference kernels on the same inputs, "
                                "in fp32 (fp64 for fp32 inputs); grad_error is the largest of dq, dk, dv")},
        "unavailable": unavailable,
        "results": results,
    }

"""Opt-in autotuning of triton_fa2's tiles on the local GPU (`attnforge tune`).

For each head dim it times every rendered tile of the family that passes the variant table's
check() for this arch (forward and backward separately, causal and not, fresh random inputs,
medians of triton.testing.do_bench), verifies each against the table's own pick on the same inputs,
and persists the winners per arch in the build cache folder. variants.pick() then prefers a
persisted winner (if it still passes check()); `attnforge explain` shows "(tuned)".
"""

from __future__ import annotations

import datetime
import json
import pathlib

import torch

from ...codegen import Source
from ...runtime import generated
from ...runtime.cache import write_atomic
from . import variants
from .variants import winners_path

TEMPLATES = {"fwd": "triton_fa2_fwd.py.jinja", "bwd": "triton_fa2_bwd.py.jinja"}


def candidates(family: str, arch: str, head_dim: int) -> list:
    fwd, bwd = variants.all_tiles()
    return [t for t in (fwd if family == "fwd" else bwd) if not variants.check(t, arch, head_dim)]


def _module(tile):
    family = "fwd" if isinstance(tile, variants.FwdTile) else "bwd"
    return generated.load(Source.of(TEMPLATES[family], tile.params(), tile.module))


def tune(head_dims=(64, 128), seqlen: int = 4096, dtype=torch.bfloat16, progress=print) -> dict:
    """Time the candidates on the current GPU; returns the winners document (not yet saved)."""
    import triton.testing

    from ...dispatch.device import detect

    device = torch.device("cuda", torch.cuda.current_device())
    arch = detect(device).arch
    gen = torch.Generator(device=device).manual_seed(0)
    doc = {"arch": arch, "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
           "triton": triton.__version__, "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
               timespec="seconds"), "seqlen": seqlen, "fwd": {}, "bwd": {}, "timings": []}
    for d in head_dims:
        batch, heads = max(1, 16384 // seqlen), max(1, 2048 // d)
        q, k, v, dout = (torch.randn(batch, heads, seqlen, d, device=device, generator=gen).to(dtype) for _ in range(4))
        for family in ("fwd", "bwd"):
            base, _ = variants.pick(variants.FWD if family == "fwd" else variants.BWD, arch, d, tuned=False)
            totals = {}
            for causal in (False, True):
                out, lse = torch.empty_like(q), torch.empty(q.shape[:3], device=device)
                _module(variants.pick(variants.FWD, arch, d, tuned=False)[0]).launch(q, k, v, out, lse, causal=causal,
                                                                                  scale=d ** -0.5)
                expected = None
                for tile in [base] + [t for t in candidates(family, arch, d) if t != base]:
                    mod = _module(tile)
                    if family == "fwd":
                        o, l2 = torch.empty_like(q), torch.empty_like(lse)
                        call = lambda: mod.launch(q, k, v, o, l2, causal=causal, scale=d ** -0.5)  # noqa: E731
                        result = lambda: o  # noqa: E731
                    else:
                        grads = [torch.empty_like(t) for t in (q, k, v)]
                        call = lambda: mod.launch(q, k, v, out, lse, dout, *grads, causal=causal, scale=d ** -0.5)  # noqa: E731
                        result = lambda: torch.cat([g.flatten() for g in grads])  # noqa: E731
                    try:
                        call()
                        got = result().float()
                        if expected is None:
                            expected = got.clone()
                        error = ((got - expected).norm() / expected.norm()).item()
                        if not error < 1e-2:  # NaN fails too
                            raise ValueError(f"differs from the table's pick by {error:.2e}")
                        ms = triton.testing.do_bench(call, return_mode="median")
                    except Exception as exc:  # a candidate that cannot run here is skipped, and said so
                        progress(f"  {family} d={d} {'causal' if causal else 'full'} {tile.describe()}: skipped ({exc})")
                        continue
                    totals[tile] = totals.get(tile, 0.0) + ms
                    doc["timings"].append({"family": family, "head_dim": d, "causal": causal, "tile": tile.describe(),
                                           "median_ms": ms})
                    progress(f"  {family} d={d} {'causal' if causal else 'full'} {tile.describe()}: {ms:.3f} ms")
            ran_both = {t: ms for t, ms in totals.items()
                        if sum(x["tile"] == t.describe() and x["family"] == family and x["head_dim"] == d
                               for x in doc["timings"]) == 2}
            best = min(ran_both, key=ran_both.get)
            doc[family][str(d)] = best.params()
            progress(f"{family} d={d}: {best.describe()} ({ran_both[best]:.3f} ms causal+full; table's pick "
                     f"{base.describe()}: {ran_both.get(base, float('nan')):.3f} ms)")
    return doc


def save(doc: dict, cache_dir=None) -> pathlib.Path:
    path = winners_path(doc["arch"], cache_dir)
    write_atomic(path, json.dumps(doc, indent=1).encode())  # a reader sees the old winners or the new
    variants.clear_tuned()  # the decisions made before hold the old picks: the caller clears them
    return path

"""Measured speed as data: per device arch, the throughput each plan (a forward backend, or a forward+backward
pair) reached over a grid of problem classes, and the prediction the dispatcher ranks eligible plans by.

A table is a JSON file in ``dispatch/costs/<arch>.json`` written by ``attnforge tune --costs`` on a GPU
of that arch (it records the device, date, versions, commit and command). A file is data: it is validated
when loaded, and a table that does not validate is ignored with a warning (the dispatcher then keeps its
preference order), never half-read. A device table, ``dispatch/costs/<arch>-<device>.json``, holds classes
measured on one GPU model (its "device", as torch names the GPU) and speaks for that GPU where it measures the
problem's class; a decision ranks its plans by one table, never by figures of two GPUs (tables_for).

Prediction: the entry of the same plan, mode, dtype class, head dims, causality and GQA-ness whose shape is
nearest in log2 of (seqlen_q, seqlen_k, batch x heads_q), each within a factor of 2 (entries equally near, as
for a problem between two measured classes, are averaged); the predicted time is the problem's FLOPs over
that TFLOP/s. fp16 uses bf16's figures (the same kernels and tiles). Anything
else is "unmeasured", as are windows, mask tensors, top-left causal, dropout, softcap, sinks, ALiBi, KV caches
and packed (varlen) batches (tables time none of them: a KV-cache call runs other kernels than the dense call of its
shape, triton_fa2's split-KV kernel or cute_sm90's KV_CACHE one).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
from importlib import resources

from .problem import Problem

logger = logging.getLogger("attnforge")

SCHEMA = "attnforge-costs/1"
MODES = ("fwd", "fwd+bwd")
_DTYPE_CLASS = {"fp16": "bf16"}
_REACH = 1.0  # log2 distance per dimension an entry still covers (a factor of 2)
_ENTRY_FIELDS = {"plan": str, "mode": str, "dtype": str, "head_dim": int, "head_dim_v": int, "causal": bool,
                 "batch": int, "heads_q": int, "heads_kv": int, "seqlen_q": int, "seqlen_k": int,
                 "tflops": (int, float)}


def flop_count(batch, heads, seqlen_q, seqlen_k, head_dim, head_dim_v, causal, mode) -> float:
    """FlashAttention's benchmark convention: 2·B·Hq·Nq·Nk·(d + dv) for the forward, halved when causal
    (square), and 3.5x that for forward+backward."""
    fwd = 2.0 * batch * heads * seqlen_q * seqlen_k * (head_dim + head_dim_v) / (2 if causal else 1)
    return fwd * (3.5 if mode == "fwd+bwd" else 1.0)


def flops(problem: Problem, mode: str) -> float:
    """flop_count of ``problem``."""
    return flop_count(problem.batch, problem.heads_q, problem.seqlen_q, problem.seqlen_k, problem.head_dim,
                      problem.head_dim_v, problem.causal, mode)


@dataclasses.dataclass(frozen=True)
class Entry:
    plan: str
    mode: str
    dtype: str
    head_dim: int
    head_dim_v: int
    causal: bool
    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    tflops: float


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A plan's predicted time for a problem, and where the figure came from."""

    ms: float
    tflops: float
    source: str

    def describe(self) -> str:
        return f"predicted {self.ms:.3g} ms ({self.tflops:.0f} TFLOP/s, {self.source})"


@dataclasses.dataclass(frozen=True)
class CostTable:
    arch: str
    source: str  # "measured on NVIDIA H200 2026-12-01", said with every estimate
    entries: tuple[Entry, ...]
    device: str = ""  # the GPU it was measured on, as torch names it

    def estimate(self, plan: str, problem: Problem, mode: str) -> Estimate | None:
        """The predicted time of ``plan`` on ``problem`` (None: no entry covers its class)."""
        m = problem.mask
        if (m.windowed or m.tensor or m.top_left or problem.dropout or problem.score_features or problem.varlen
                or problem.kv_cache):
            return None  # classes tables do not measure: dense figures would mislead
        dtype = _DTYPE_CLASS.get(problem.dtype, problem.dtype)
        nearest, distance = [], math.inf
        for e in self._by_class.get((plan, mode, dtype, problem.head_dim, problem.head_dim_v, problem.causal,
                                     problem.gqa), ()):
            parts = [abs(math.log2(max(a, 1) / max(b, 1))) for a, b in (
                (problem.seqlen_q, e.seqlen_q), (problem.seqlen_k, e.seqlen_k),
                (problem.batch * problem.heads_q, e.batch * e.heads_q))]
            if max(parts) > _REACH:
                continue
            if sum(parts) < distance - 1e-9:
                nearest, distance = [e], sum(parts)
            elif sum(parts) <= distance + 1e-9:
                nearest.append(e)  # as near as the nearest (a problem between two measured classes): averaged
        if not nearest or not problem.seqlen_q or not problem.seqlen_k:
            return None
        tflops = sum(e.tflops for e in nearest) / len(nearest)
        return Estimate(flops(problem, mode) / (tflops * 1e12) * 1e3, tflops, self.source)

    @functools.cached_property
    def _by_class(self) -> dict:
        out: dict = {}
        for e in self.entries:
            key = (e.plan, e.mode, e.dtype, e.head_dim, e.head_dim_v, e.causal, e.heads_q != e.heads_kv)
            out.setdefault(key, []).append(e)
        return out


class CostTableError(ValueError):
    """A cost table that does not validate (the message names the file and the problem)."""


def parse(doc: dict, where: str) -> CostTable:
    """Validate a cost-table document; CostTableError names what is wrong."""
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise CostTableError(f"{where}: not an {SCHEMA} document")
    for field in ("arch", "device", "measured", "command"):
        if not isinstance(doc.get(field), str) or not doc[field]:
            raise CostTableError(f"{where}: {field!r} must be a non-empty string")
    if not isinstance(doc.get("entries"), list):
        raise CostTableError(f"{where}: 'entries' must be a list")
    entries = []
    for i, raw in enumerate(doc["entries"]):
        if not isinstance(raw, dict):
            raise CostTableError(f"{where}: entry {i} is not an object")
        for field, kind in _ENTRY_FIELDS.items():
            value = raw.get(field)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise CostTableError(f"{where}: entry {i}: {field!r} must be {getattr(kind, '__name__', 'a number')}, "
                                     f"got {value!r}")
        if raw["mode"] not in MODES or not (raw["tflops"] > 0 and math.isfinite(raw["tflops"])):
            raise CostTableError(f"{where}: entry {i}: mode must be one of {MODES} and tflops positive and finite")
        entries.append(Entry(**{f: raw[f] for f in _ENTRY_FIELDS}))
    return CostTable(doc["arch"], f"measured on {doc['device']} {doc['measured']}", tuple(entries), doc["device"])


@functools.lru_cache(maxsize=None)
def table(arch: str) -> CostTable | None:
    """The shipped cost table of ``arch``, or None (none shipped, or one that does not validate: warned)."""
    try:
        text = resources.files(__package__).joinpath("costs", f"{arch}.json").read_text(encoding="utf-8")
    except (FileNotFoundError, OSError):
        return None
    return from_text(text, arch)


@functools.lru_cache(maxsize=None)
def device_table(arch: str, device: str) -> CostTable | None:
    """The shipped device table of ``arch`` measured on ``device`` (``dispatch/costs/<arch>-*.json`` whose
    "device" is ``device``), or None."""
    try:
        files = sorted(f for f in resources.files(__package__).joinpath("costs").iterdir()
                       if f.name.startswith(f"{arch}-") and f.name.endswith(".json"))
    except (FileNotFoundError, OSError):
        return None
    for f in files:
        found = from_text(f.read_text(encoding="utf-8"), arch, f"dispatch/costs/{f.name}")
        if found is not None and found.device == device:
            return found
    return None


def tables_for(problem: Problem, plans: list[str], mode: str) -> tuple[CostTable | None, dict]:
    """The table a decision ranks ``plans`` by, and its estimates ({plan: Estimate or None}): the device table of
    the problem's GPU where it estimates any of them (figures of the GPU that runs the call), else the arch
    table. One table for all plans: figures of two GPUs are never compared."""
    arch_table = table(problem.device.arch)
    for t in (device_table(problem.device.arch, problem.device.name), arch_table):
        if t is None:
            continue
        estimates = {plan: t.estimate(plan, problem, mode) for plan in plans}
        if any(e is not None for e in estimates.values()):
            return t, estimates
    return arch_table, {plan: None for plan in plans}


def from_text(text: str, arch: str, where: str | None = None) -> CostTable | None:
    """The table in ``text`` if it validates as ``arch``'s, else None with a warning."""
    where = where or f"dispatch/costs/{arch}.json"
    try:
        parsed = parse(json.loads(text), where)
    except (ValueError, TypeError) as e:
        logger.warning("ignoring %s: %s", where, e)
        return None
    if parsed.arch != arch:
        logger.warning("ignoring %s: it is the table of %s", where, parsed.arch)
        return None
    return parsed

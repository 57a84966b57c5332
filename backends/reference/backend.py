"""The last resort on every device and, fed fp64, the oracle the other backends are tested against."""

from __future__ import annotations

import torch

from ...dispatch.problem import Problem
from ...dispatch.registry import Backend, Planned
from ...dispatch.support import Support
from ...dispatch.variant import TorchVariant
from . import kernels


def _no_autocast(t):
    return torch.autocast(t.device.type, enabled=False)


class ReferenceBackend(Backend):
    name = "reference"
    summary = "attnforge's tiled online softmax in PyTorch, fp32 accumulation (fp64 for fp64 inputs)"
    last_resort = True
    support = Support(
        vendors=frozenset({"nvidia", "amd", "cpu"}),
        dtypes=frozenset({"fp16", "bf16", "fp32", "fp64"}),
        top_left=True, window=True,  # the mask model's rule, written once in torch (dispatch/mask.py)
        softcap=True, sinks=True, alibi=True,
        dropout=False,  # the dropout mask would have to be regenerated in backward; sdpa serves dropout
        kv_cache=frozenset({"contiguous", "paged"}),  # each sequence's keys gathered, then computed alone (slow)
    )

    def _variant(self, problem: Problem) -> TorchVariant:
        acc = "fp64" if problem.dtype == "fp64" else "fp32"
        return TorchVariant(f"torch ops, key tiles of {kernels.BLOCK_N}, {acc} accumulation")

    def _plan(self, problem: Problem) -> Planned:
        return self._variant(problem), []

    def _plan_backward(self, problem: Problem) -> Planned:
        if problem.kv_cache:
            return None, ["its KV-cache path has no backward"]
        return self._variant(problem), []

    def forward(self, variant, call):
        if call.cache is not None:
            return self._forward_kvcache(call)
        with _no_autocast(call.q):  # its fp32 (fp64) accumulation is the point: autocast must not lower it
            return kernels.forward(call.q, call.k, call.v, mask=call.mask, scale=call.scale, softcap=call.softcap,
                                   sinks=call.sinks, alibi_slopes=call.alibi_slopes)

    def backward(self, variant, call, out, lse, dout, dlse=None):
        with _no_autocast(call.q):
            return kernels.backward(call.q, call.k, call.v, out, lse, dout, mask=call.mask, scale=call.scale, dlse=dlse,
                                    softcap=call.softcap, alibi_slopes=call.alibi_slopes)

    def _forward_kvcache(self, call):
        """Each sequence on its own: its cache positions gathered (a view of a contiguous cache, a copy of its
        pages), then the dense forward. Reads the lengths and block table on the host."""
        cache = call.cache
        ends = cache.seqlens.tolist()
        starts = cache.leftpad.tolist() if cache.leftpad is not None else [0] * len(ends)
        pages = cache.block_table.tolist() if cache.block_table is not None else None
        outs, lses = [], []
        with _no_autocast(call.q):
            for b, (start, end) in enumerate(zip(starts, ends)):
                keys, values = (_positions(t, b, start, end, pages) for t in (call.k, call.v))
                out, lse = kernels.forward(call.q[b:b + 1], keys[None], values[None], mask=call.mask, scale=call.scale,
                                           softcap=call.softcap, sinks=call.sinks)
                outs.append(out[0])
                lses.append(lse[0])
        return torch.stack(outs), torch.stack(lses)


def _positions(cache: torch.Tensor, b: int, start: int, end: int, pages) -> torch.Tensor:
    """Cache positions [start, end) of sequence b as (heads_kv, end - start, head_dim): from its row of a
    contiguous (batch, heads_kv, positions, head_dim) cache, or from the pages (page, heads_kv, row, head_dim)
    its block table row names."""
    if pages is None:
        return cache[b, :, start:end]
    size = cache.shape[2]
    index = torch.arange(start, end, device=cache.device)
    page = torch.tensor(pages[b], device=cache.device, dtype=torch.long)[index // size]
    return cache[page, :, index % size].transpose(0, 1)

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
        kv_cache_dtypes=frozenset({"fp8", "fp8_fnuz"}),  # gathered keys and values dequantised by their descales
        kv_leftpad=True,  # (positions [leftpad, length) gathered)
        kv_unchecked=True,  # (it reads the lengths and pages on the host as it runs)
        varlen=True,  # each sequence of a packed batch computed alone, on views (slow)
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
        if call.varlen is not None:
            return self._forward_varlen(call)
        with _no_autocast(call.q):  # its fp32 (fp64) accumulation is the point: autocast must not lower it
            return kernels.forward(call.q, call.k, call.v, mask=call.mask, scale=call.scale, softcap=call.softcap,
                                   sinks=call.sinks, alibi_slopes=call.alibi_slopes)

    def backward(self, variant, call, out, lse, dout, dlse=None):
        if call.varlen is not None:
            return self._backward_varlen(call, out, lse, dout, dlse)
        with _no_autocast(call.q):
            return kernels.backward(call.q, call.k, call.v, out, lse, dout, mask=call.mask, scale=call.scale, dlse=dlse,
                                    softcap=call.softcap, alibi_slopes=call.alibi_slopes)

    def _forward_kvcache(self, call):
        """Each sequence on its own: its cache positions gathered (a view of a contiguous cache, a copy of its
        pages), then the dense forward. Reads the lengths and block table on the host."""
        cache = call.cache
        if call.q.shape[0] == 0:  # no sequences: nothing to stack
            return (call.q.new_empty((*call.q.shape[:3], call.v.shape[3])),
                    call.q.new_empty(call.q.shape[:3], dtype=kernels.accumulation_dtype(call.q.dtype)))
        ends = cache.seqlens.tolist()
        starts = cache.leftpad.tolist() if cache.leftpad is not None else [0] * len(ends)
        pages = cache.block_table.tolist() if cache.block_table is not None else None
        outs, lses = [], []
        with _no_autocast(call.q):
            for b, (start, end) in enumerate(zip(starts, ends)):
                keys, values = (_positions(t, b, start, end, pages) for t in (call.k, call.v))
                if cache.descale is not None:  # an fp8 cache: the values it stands for, in fp32
                    keys, values = (x.float() * d[b][:, None, None] for x, d in zip((keys, values), cache.descale))
                out, lse = kernels.forward(call.q[b:b + 1], keys[None], values[None], mask=call.mask, scale=call.scale,
                                           softcap=call.softcap, sinks=call.sinks)
                outs.append(out[0])
                lses.append(lse[0])
        return torch.stack(outs), torch.stack(lses)


    def _forward_varlen(self, call):
        """Each sequence of a packed batch ((1, heads, total, dim) views) on its own: the dense forward on views of
        its rows, written into the packed output and LSE. Reads the offsets on the host."""
        q, v = call.q, call.v
        out = q.new_zeros((1, q.shape[2], q.shape[1], v.shape[3])).transpose(1, 2)  # (total_q, heads, dv) memory
        lse = torch.empty(q.shape[:3], dtype=kernels.accumulation_dtype(q.dtype), device=q.device)
        with _no_autocast(q):
            for b, rows, keys in _sequences(call.varlen):
                o, s = kernels.forward(q[:, :, rows], call.k[:, :, keys], v[:, :, keys], mask=call.mask,
                                       scale=call.scale, softcap=call.softcap, sinks=call.sinks,
                                       alibi_slopes=_slopes_of(call.alibi_slopes, b))
                out[:, :, rows], lse[:, :, rows] = o, s
        return out, lse

    def _backward_varlen(self, call, out, lse, dout, dlse):
        """The dense backward per sequence, as _forward_varlen; keys no query row of theirs sees get 0."""
        q, k, v = call.q, call.k, call.v
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        with _no_autocast(q):
            for b, rows, keys in _sequences(call.varlen):
                grads = kernels.backward(q[:, :, rows], k[:, :, keys], v[:, :, keys], out[:, :, rows], lse[:, :, rows],
                                         dout[:, :, rows], mask=call.mask, scale=call.scale,
                                         dlse=None if dlse is None else dlse[:, :, rows], softcap=call.softcap,
                                         alibi_slopes=_slopes_of(call.alibi_slopes, b))
                for full, part, where in zip((dq, dk, dv), grads, (rows, keys, keys)):
                    full[:, :, where] = part
        return dq, dk, dv


def _sequences(packed):
    """(sequence index, its query rows, its key rows) of a Varlen's sequences that have query rows."""
    bounds_q, bounds_k = packed.bounds()
    for b in range(len(bounds_q) - 1):
        if bounds_q[b + 1] > bounds_q[b]:
            yield b, slice(bounds_q[b], bounds_q[b + 1]), slice(bounds_k[b], bounds_k[b + 1])


def _slopes_of(slopes, b: int):
    """Sequence b's row of (sequences, heads_q) ALiBi slopes, or None."""
    return None if slopes is None else slopes[b:b + 1]


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

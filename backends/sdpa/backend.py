"""PyTorch SDPA as a backend: torch picks its own kernel (flash, cuDNN, mem-efficient, math).

Two things SDPA does differently from FlashAttention are mended here:
- ``is_causal`` is aligned top-left. For seqlen_q < seqlen_k the lower-right causal bias gives
  FlashAttention's bottom-right alignment; for seqlen_q > seqlen_k the first seqlen_q - seqlen_k
  query rows see no key, so SDPA runs causal on the last seqlen_k rows only (a square problem,
  where both alignments agree) and the others are 0, instead of the NaN torch warns its fused
  kernels may give there.
- It returns no LSE, so it declines ``return_lse``.

And three things where SDPA's answer is wrong on some device:
- A zero scale (or one that is 0 in fp32) with causal gives NaN rows: shared.inputs.nonnegative_scale
  folds it into q.
- Where torch materialises the lower-right causal bias and adds it to the scores (the CPU, and the GPU
  where no fused kernel takes the call), a NaN or infinite key or value that the bias hides from a row still
  reaches that row (NaN + -inf, inf + -inf, 0 * NaN). Only the last seqlen_q - 1 keys are hidden from any
  row: the rows a non-finite one among them is hidden from are computed again without it (_hidden_tail).
- An attn_mask row that hides every key gives 0 on the CPU but not on the GPU: such rows are set to 0,
  attention()'s answer for a row that sees no key (_mask_tensor).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

from ...dispatch.device import TORCH_ONLY
from ...dispatch.problem import DTYPES, Problem
from ...dispatch.registry import Backend, Planned
from ...dispatch.support import Support
from ...dispatch.variant import TorchVariant
from ..shared.inputs import nonnegative_scale


class SdpaBackend(Backend):
    name = "sdpa"
    summary = "torch.nn.functional.scaled_dot_product_attention (torch picks flash, cuDNN, efficient or math)"
    autograd_native = True
    support = Support(
        vendors=frozenset({"nvidia", "amd", "cpu", TORCH_ONLY}),  # TORCH_ONLY: mps, xpu, meta... (torch's own kernels)
        dtypes=frozenset({"fp16", "bf16", "fp32", "fp64"}),
        return_lse=False,
        empty=False,  # torch's fused kernels disagree on zero-sized inputs; reference handles them
        top_left=True, mask_tensor=True,  # attnforge.sdpa() passes SDPA's own masks through
        window=True,  # as a materialised (seqlen_q, seqlen_k) mask: see _windowed
        varlen=True,  # a packed batch one sequence at a time (a launch or more each): see _packed
        nondeterministic_backward=("torch's SDPA kernel computes it, in a summation order attnforge does not control; "
                                   "torch.use_deterministic_algorithms governs it"),
        follows_torch_determinism=True,
    )

    def _plan(self, problem: Problem) -> Planned:
        return TorchVariant(self._kernel(problem)), []

    def _kernel(self, problem: Problem) -> str:
        """The SDPA kernel torch reports for these shapes (asked on stand-in tensors) where it can say."""
        if problem.device.vendor == TORCH_ONLY:
            return (f"torch's SDPA: attnforge has no kernels for {problem.device.arch} devices; "
                    "torch picks its kernel at run time")
        if problem.mask.windowed:
            return (f"a sliding window as a materialised {problem.seqlen_q} x {problem.seqlen_k} mask (O(seqlen_q * "
                    "seqlen_k) memory); kernel chosen by torch at run time")
        if not problem.device.present:
            return "kernel chosen by torch at run time (device not present to ask)"
        if problem.mask.tensor or problem.mask.top_left:
            return "kernel chosen by torch at run time (SDPA's own mask semantics)"
        if problem.causal and problem.seqlen_q < problem.seqlen_k:
            return "kernel chosen by torch at run time (lower-right causal bias)"
        seqlen_q = min(problem.seqlen_q, problem.seqlen_k) if problem.causal else problem.seqlen_q
        try:
            def standin(heads, seqlen, dim):
                base = torch.empty((1, 1, 1, dim), dtype=DTYPES[problem.dtype], device=problem.device.torch_device)
                return base.expand(problem.batch, heads, seqlen, dim)

            q = standin(problem.heads_q, seqlen_q, problem.head_dim)
            k = standin(problem.heads_kv, problem.seqlen_k, problem.head_dim)
            v = standin(problem.heads_kv, problem.seqlen_k, problem.head_dim_v)
            choice = torch._fused_sdp_choice(q, k, v, dropout_p=0.5 if problem.dropout else 0.0,
                                             is_causal=problem.causal, enable_gqa=problem.gqa)
            return f"torch reports {SDPBackend(choice).name} for these shapes"
        except Exception as exc:  # private API: if it moves, say so rather than fail the decision
            return f"kernel chosen by torch at run time ({type(exc).__name__} asking torch)"

    def forward(self, variant, call):
        if call.varlen is not None:
            return self._packed(variant, call), None
        q, scale = nonnegative_scale(call.q, call.scale)
        k, v, mask = call.k, call.v, call.mask
        causal = mask.causal
        seqlen_q, seqlen_k = q.shape[2], k.shape[2]
        kwargs = dict(dropout_p=call.dropout_p, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        if mask.tensor:  # SDPA's own semantics, as attnforge.sdpa() promises
            return _mask_tensor(q, k, v, call.attn_mask, kwargs), None
        if mask.windowed:
            return _windowed(q, k, v, mask, kwargs), None
        if mask.top_left:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs), None
        if not causal or seqlen_q == seqlen_k:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **kwargs), None
        if seqlen_q < seqlen_k:
            return _lower_right(q, k, v, kwargs), None
        blind = seqlen_q - seqlen_k  # rows that see no key
        out = F.scaled_dot_product_attention(q[:, :, blind:], k, v, is_causal=True, **kwargs)
        return F.pad(out, (0, 0, blind, 0)), None


    def _packed(self, variant, call):
        """A packed batch ((1, heads, total, dim) views): each sequence through SDPA on views of its rows, written
        into the packed output (rows of a sequence with no key stay 0). Reads the offsets on the host; torch
        autograd records the copies, so gradients reach every sequence."""
        q, v = call.q, call.v
        out = q.new_zeros((1, q.shape[2], q.shape[1], v.shape[3])).transpose(1, 2)  # (total_q, heads, dv) memory
        bounds_q, bounds_k = call.varlen.bounds()
        for b in range(len(bounds_q) - 1):
            rows, keys = slice(bounds_q[b], bounds_q[b + 1]), slice(bounds_k[b], bounds_k[b + 1])
            if rows.stop > rows.start and keys.stop > keys.start:
                part = call._replace(q=q[:, :, rows], k=call.k[:, :, keys], v=v[:, :, keys], varlen=None)
                out[:, :, rows] = self.forward(variant, part)[0]
        return out


def _mask_tensor(q, k, v, attn_mask, kwargs):
    """SDPA with an explicit mask, rows that the mask hides every key from set to 0 (on the GPU SDPA gives
    them a nonzero row). One pass over the mask, which the kernel reads anyway."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **kwargs)
    if attn_mask is None:  # (the self-check's tiny problem carries no mask)
        return out
    if attn_mask.dtype == torch.bool:
        blind = ~attn_mask.any(-1)
    else:
        blind = (attn_mask == float("-inf")).all(-1)
    return out.masked_fill(blind[..., None], 0.0)


# At most this many (query, key) pairs, the lower-right mask is materialised here rather than asked of
# torch.nn.attention.bias, whose import pulls in dynamo (~1 s on a first call): tiny calls, such as the
# self-check's, stay fast to start, and at that size the mask is smaller than one tile of scores.
_MATERIALISE_AT_MOST = 1 << 16


def _windowed(q, k, v, mask, kwargs):
    """A sliding window (with or without causal) through SDPA with the mask materialised by the mask model's
    rule. Rows the window hides every key from give 0 (_mask_tensor). An additive mask would let a non-finite key
    or value reach the rows it hides from (NaN + -inf, inf + -inf, 0 * NaN): the keys with a non-finite entry in k
    or v are zeroed, and the rows that do see one set to NaN (counted by a (seqlen_k x seqlen_q) product, no
    (batch, heads) copy of the mask; no host read). NaN there is exact math's answer but for two cases it
    approximates: an infinite value alone in its column (exact: +-inf) and a key whose score is -inf (exact: it
    drops out)."""
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    rows = torch.arange(seqlen_q, device=q.device)[:, None]
    cols = torch.arange(seqlen_k, device=q.device)[None, :]
    visible = ~mask.hidden(rows, cols, seqlen_q, seqlen_k)
    bad = ~(k.isfinite().all(-1) & v.isfinite().all(-1))  # (batch, heads_kv, seqlen_k)
    out = _mask_tensor(q, k.masked_fill(bad[..., None], 0.0), v.masked_fill(bad[..., None], 0.0), visible, kwargs)
    sees_bad = (bad.to(torch.float32) @ visible.T.to(torch.float32)) > 0  # (batch, heads_kv, seqlen_q)
    return out.masked_fill(sees_bad.repeat_interleave(q.shape[1] // k.shape[1], 1)[..., None], float("nan"))


def _lower_right(q, k, v, kwargs):
    """Causal with seqlen_q < seqlen_k through SDPA's lower-right bias. Where torch runs it in a fused kernel
    (masked by index, as its own _dispatch decides) that is all; where the mask is materialised and added to
    the scores, a hidden non-finite key or value would reach the rows it is hidden from (NaN + -inf, inf + -inf,
    0 * NaN): see _hidden_tail."""
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    if seqlen_q == 1:  # the one query sees every key
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    if seqlen_q * seqlen_k > _MATERIALISE_AT_MOST and _fused_lower_right(q, k, v, kwargs):
        from torch.nn.attention.bias import causal_lower_right

        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(seqlen_q, seqlen_k), **kwargs)
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device).tril(seqlen_k - seqlen_q)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, **kwargs)
    return _hidden_tail(out, q, k, v, kwargs)


def _hidden_tail(out, q, k, v, kwargs):
    """``out`` of the materialised lower-right path, with the rows a hidden non-finite key or value reached made
    exact. Only the last seqlen_q - 1 keys are hidden from any row, tail key t from exactly the rows before
    r(t) = t - (seqlen_k - seqlen_q). With t1 < t2 < ... the tail keys that have a non-finite entry (in any batch
    or head), rows [r(t_i), r(t_i+1)) see t1 ... t_i and no later one: computed again on the keys before t_i+1,
    no key hidden from them is non-finite, so SDPA is exact there (rows [0, r(t1)) on the keys before t1); the rows
    from r(t_last) on see every such key and keep ``out``. One host read of whether the tail is finite, on this
    (mask-materialising) path only."""
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    if q.device.type == "meta":
        return out
    first = seqlen_k - seqlen_q + 1  # keys before it are seen by every row
    finite = k[:, :, first:].isfinite().all(-1) & v[:, :, first:].isfinite().all(-1)  # (batch, heads_kv, tail)
    bad = (~finite.flatten(0, 1).all(0)).nonzero().flatten()  # tail keys with a non-finite entry somewhere
    if bad.numel() == 0:
        return out
    parts, start = [], 0
    for t in (first + bad).tolist():
        stop = t - (seqlen_k - seqlen_q)  # the first row that sees key t
        if stop > start:
            rows = torch.arange(start, stop, device=q.device)[:, None]
            visible = torch.arange(t, device=q.device)[None, :] <= rows + (seqlen_k - seqlen_q)
            parts.append(F.scaled_dot_product_attention(q[:, :, start:stop], k[:, :, :t], v[:, :, :t],
                                                        attn_mask=visible, **kwargs))
        start = stop
    return torch.cat((*parts, out[:, :, start:]), 2)


def _fused_lower_right(q, k, v, kwargs) -> bool:
    """Whether torch runs the lower-right bias in a flash or memory-efficient kernel (the test
    torch.nn.attention.bias.CausalBias makes before it falls back to materialising the bias)."""
    if q.device.type != "cuda":  # torch's fused lower-right kernels are CUDA's (ROCm's too)
        return False
    params = SDPAParams(q, k, v, None, kwargs["dropout_p"], False, kwargs["enable_gqa"])
    return can_use_flash_attention(params) or can_use_efficient_attention(params)

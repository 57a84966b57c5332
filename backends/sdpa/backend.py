"""PyTorch SDPA as a backend: torch picks its own kernel (flash, cuDNN, mem-efficient, math).

Two things SDPA does differently from FlashAttention are mended here:
- ``is_causal`` is aligned top-left. For seqlen_q < seqlen_k the lower-right causal bias gives
  FlashAttention's bottom-right alignment; for seqlen_q > seqlen_k the first seqlen_q - seqlen_k
  query rows see no key, so SDPA runs causal on the last seqlen_k rows only (a square problem,
  where both alignments agree) and the others are 0, instead of the NaN torch warns its fused
  kernels may give there.
- It returns no LSE, so it declines ``return_lse``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.nn.attention.bias import causal_lower_right

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
        vendors=frozenset({"nvidia", "amd", "cpu"}),
        dtypes=frozenset({"fp16", "bf16", "fp32", "fp64"}),
        return_lse=False,
        empty=False,  # torch's fused kernels disagree on zero-sized inputs; reference handles them
        top_left=True, mask_tensor=True,  # attnforge.sdpa() passes SDPA's own masks through
    )

    def _plan(self, problem: Problem) -> Planned:
        return TorchVariant(self._kernel(problem)), []

    def _kernel(self, problem: Problem) -> str:
        """The SDPA kernel torch reports for these shapes (asked on stand-in tensors) where it can say."""
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
        q, scale = nonnegative_scale(call.q, call.scale)
        k, v, mask = call.k, call.v, call.mask
        causal = mask.causal
        seqlen_q, seqlen_k = q.shape[2], k.shape[2]
        kwargs = dict(dropout_p=call.dropout_p, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        if mask.tensor or mask.top_left:  # SDPA's own semantics, as attnforge.sdpa() promises
            return F.scaled_dot_product_attention(q, k, v, attn_mask=call.attn_mask, is_causal=mask.top_left,
                                                  **kwargs), None
        if not causal or seqlen_q == seqlen_k:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **kwargs), None
        if seqlen_q < seqlen_k:
            bias = causal_lower_right(seqlen_q, seqlen_k)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, **kwargs), None
        blind = seqlen_q - seqlen_k  # rows that see no key
        out = F.scaled_dot_product_attention(q[:, :, blind:], k, v, is_causal=True, **kwargs)
        return F.pad(out, (0, 0, blind, 0)), None

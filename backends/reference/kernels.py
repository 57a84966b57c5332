"""The reference kernels: FlashAttention's tiled online softmax written with torch ops.

Forward walks K/V in blocks keeping a running max ``m``, sum ``l`` and unnormalised accumulator,
rescaled by exp(m_old - m_new) at each block, exactly as the GPU kernels do; backward recomputes
the probabilities from the saved LSE (FA2 Algorithm 2). Accumulation is fp32, or fp64 for fp64
inputs, which makes it the test oracle. GQA is computed by viewing q as (batch, heads_kv, group,
seqlen, d) against k/v broadcast over the group: no copies of k or v.

Masking is the package's one mask model (dispatch/mask.py): with causal, key j is visible to query i
iff j <= i + (Nk - Nq) (aligned bottom-right, FlashAttention's), or j <= i with ``top_left``; a query
row that sees no key gives output 0 and LSE -inf.

Non-finite inputs give what exact math gives: a NaN query row gives a NaN output row and LSE, a NaN key
makes NaN exactly the rows that see it (its score is masked after the product), and a NaN or infinite
value reaches only the rows that see it. A hidden value's weight is 0, and 0 * NaN is NaN in a matmul, so
where some value is not finite (checked once per call) the product runs on the finite values and the
non-finite ones are put back where a visible key carries them (see _nonfinite_values).
"""

from __future__ import annotations

import torch

from ...dispatch.mask import CAUSAL, NONE, Mask

BLOCK_N = 128  # keys per tile; bounds the score tile at (batch*heads, seqlen_q, 128)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _grouped(q: torch.Tensor, heads_kv: int, acc: torch.dtype) -> torch.Tensor:
    # (B, Hq, N, D) -> (B, Hkv, G, N, D): query head h uses kv head h // G, as FlashAttention does.
    return q.unflatten(1, (heads_kv, q.shape[1] // heads_kv)).to(acc)


def as_mask(causal: bool = False, mask: Mask | None = None) -> Mask:
    """``mask`` if given, else the bottom-right causal mask or none (the ``causal=`` shorthand)."""
    return mask if mask is not None else CAUSAL if causal else NONE


def _hidden(start: int, width: int, seqlen_q: int, seqlen_k: int, mask: Mask, device) -> torch.Tensor | None:
    """(seqlen_q, width) bool: which keys of [start, start + width) the mask hides from each query row
    (None: it hides none)."""
    rows = torch.arange(seqlen_q, device=device)[:, None]
    cols = torch.arange(start, start + width, device=device)[None, :]
    return mask.hidden(rows, cols, seqlen_q, seqlen_k)


def _mask_tile(s: torch.Tensor, start: int, seqlen_q: int, seqlen_k: int, mask: Mask) -> torch.Tensor:
    hidden = _hidden(start, s.shape[-1], seqlen_q, seqlen_k, mask, s.device)
    return s if hidden is None else s.masked_fill(hidden, float("-inf"))


def _visible(start: int, block_n: int, seqlen_q: int, seqlen_k: int, mask: Mask, device) -> torch.Tensor:
    """(seqlen_q, keys of the tile) bool: which keys of [start, start + block_n) each query row sees."""
    width = min(start + block_n, seqlen_k) - start
    hidden = _hidden(start, width, seqlen_q, seqlen_k, mask, device)
    return ~hidden if hidden is not None else torch.ones(seqlen_q, width, dtype=torch.bool, device=device)


def _has_nonfinite_values(v: torch.Tensor, mask: Mask) -> bool:
    """Whether the values need _nonfinite_values: only a mask hides keys, and only a non-finite hidden value
    would leak (0 * NaN). One reduction per call (a device sync off the CPU: the reference is the last resort)."""
    return mask.by_rule and v.numel() > 0 and not bool(torch.isfinite(v).all())


def _nonfinite_values(visible: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Where (rows x value columns) a visible key carries a NaN, a +inf and a -inf value: 0/1 products, which
    no non-finite number enters, over v (..., keys, dv) and visible (rows, keys)."""
    vis = visible.to(v.dtype)
    return tuple((vis @ kind(v).to(v.dtype)) > 0 for kind in (torch.isnan, torch.isposinf, torch.isneginf))


def _put_back(out: torch.Tensor, nan: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    """out with the sum of a visible non-finite value where the row is not NaN already: NaN for a NaN or for
    +inf and -inf together, else the infinity (every visible key's weight is positive in exact math)."""
    special = torch.where(nan | (pos & neg), float("nan"), torch.where(pos, float("inf"), float("-inf")))
    return torch.where((nan | pos | neg) & ~out.isnan(), special.to(out.dtype), out)


def capped(s: torch.Tensor, softcap: float) -> torch.Tensor:
    """Scaled scores under a softcap: softcap * tanh(s / softcap) (unchanged for softcap 0)."""
    return softcap * torch.tanh(s / softcap) if softcap else s


def alibi_bias(slopes: torch.Tensor, start: int, width: int, seqlen_q: int, seqlen_k: int, heads_kv: int, acc_t):
    """-slope * |i + seqlen_k - seqlen_q - j| for keys [start, start + width), as (batch, heads_kv, group, rows,
    width) from (batch, heads_q) slopes."""
    rows = torch.arange(seqlen_q, device=slopes.device)[:, None]
    cols = torch.arange(start, start + width, device=slopes.device)[None, :]
    distance = (rows + (seqlen_k - seqlen_q) - cols).abs().to(acc_t)
    return -slopes.to(acc_t).unflatten(1, (heads_kv, -1))[..., None, None] * distance


def _key_tile(qg, k, v, start, block_n, scale, mask, acc_t, softcap: float = 0.0, alibi_slopes=None):
    """Key/value tile [start, start + block_n) broadcast over the query group, and its (capped, biased, masked)
    scores."""
    kb = k[:, :, start:start + block_n].to(acc_t).unsqueeze(2)
    vb = v[:, :, start:start + block_n].to(acc_t).unsqueeze(2)
    s = capped((qg @ kb.transpose(-1, -2)) * scale, softcap)
    if alibi_slopes is not None:
        s = s + alibi_bias(alibi_slopes, start, kb.shape[-2], qg.shape[-2], k.shape[2], k.shape[1], acc_t)
    if mask.by_rule:
        s = _mask_tile(s, start, qg.shape[-2], k.shape[2], mask)
    return kb, vb, s


def forward(q, k, v, *, causal: bool = False, scale: float, block_n: int = BLOCK_N, mask: Mask | None = None,
            softcap: float = 0.0, sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None):
    """Returns (out in q's dtype, LSE in fp32 (fp64 for fp64 inputs)). Shapes (B, H, N, D). ``softcap`` > 0
    caps the scaled scores (capped()). ``sinks`` (heads_q,): each row's softmax starts from its head's sink, a
    logit with no value (running max = the sink, sum = 1), so a row that sees no key gives 0 with LSE = sink."""
    mask = as_mask(causal, mask)
    acc_t = accumulation_dtype(q.dtype)
    batch, heads_q, seqlen_q, _ = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    if heads_q == 0 or batch == 0:
        return q.new_zeros(*q.shape[:3], v.shape[3]), torch.full(q.shape[:3], float("-inf"), dtype=acc_t, device=q.device)
    qg = _grouped(q, heads_kv, acc_t)
    m = torch.full(qg.shape[:-1], float("-inf"), dtype=acc_t, device=q.device)
    l = torch.zeros_like(m)
    if sinks is not None:
        m = sinks.to(acc_t).reshape(1, heads_kv, -1, 1).expand(m.shape).clone()
        l = torch.ones_like(m)
    acc = torch.zeros(*qg.shape[:-1], v.shape[-1], dtype=acc_t, device=q.device)
    nonfinite = _has_nonfinite_values(v, mask)
    flags = None
    for start in range(0, seqlen_k, block_n):
        _, vb, s = _key_tile(qg, k, v, start, block_n, scale, mask, acc_t, softcap, alibi_slopes)
        if nonfinite:
            visible = _visible(start, block_n, seqlen_q, seqlen_k, mask, q.device)
            tile_flags = _nonfinite_values(visible, vb)
            flags = tile_flags if flags is None else tuple(a | b for a, b in zip(flags, tile_flags))
            vb = torch.where(vb.isfinite(), vb, 0.0)
        m_new = torch.maximum(m, s.amax(-1))  # (NaN-propagating: a NaN score makes the row NaN)
        m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet: avoid inf - inf
        p = torch.exp(s - m_safe[..., None])
        alpha = torch.exp(m - m_safe)
        l = alpha * l + p.sum(-1)
        acc = alpha[..., None] * acc + p @ vb
        m = m_new
    # Rows that saw no key: l = 0 -> output 0, LSE -inf. A NaN row has l = NaN and must stay NaN.
    seen = l != 0
    out = torch.where(seen[..., None], acc / torch.where(seen, l, 1.0)[..., None], 0.0)
    lse = torch.where(seen, m + torch.log(torch.where(seen, l, 1.0)), float("-inf"))
    if flags is not None:
        out = _put_back(out, *flags)
    return out.flatten(1, 2).to(q.dtype), lse.flatten(1, 2)


def backward(q, k, v, out, lse, dout, *, causal: bool = False, scale: float, block_n: int = BLOCK_N,
             mask: Mask | None = None, dlse=None, softcap: float = 0.0, alibi_slopes=None):
    """(dq, dk, dv) in the inputs' dtypes, recomputing P = exp(S - LSE) tile by tile. ``dlse``, the LSE's
    gradient (or None): dLSE/dS = P, so dS = P * (dP - (delta - dlse)). With ``softcap``, S is the capped score
    and dS is carried back through the cap."""
    mask = as_mask(causal, mask)
    acc_t = accumulation_dtype(q.dtype)
    batch, heads_q, seqlen_q, _ = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    dk = torch.zeros(k.shape, dtype=acc_t, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc_t, device=v.device)
    if heads_q == 0 or batch == 0:
        return torch.zeros_like(q), dk.to(k.dtype), dv.to(v.dtype)
    qg = _grouped(q, heads_kv, acc_t)
    dog = _grouped(dout, heads_kv, acc_t)
    delta = (dog * _grouped(out, heads_kv, acc_t)).sum(-1)  # D_i = rowsum(dO * O)
    if dlse is not None:  # (a row with LSE -inf has P = 0: its dlse has no effect)
        delta = delta - _grouped(dlse, heads_kv, acc_t)
    # A row with no key has LSE -inf and P = 0; +inf makes exp(S - LSE) exactly 0 there, not NaN.
    lse_g = _grouped(lse, heads_kv, acc_t).masked_fill(lse.unflatten(1, (heads_kv, -1)) == float("-inf"), float("inf"))
    dq = torch.zeros_like(qg)
    for start in range(0, seqlen_k, block_n):
        kb, vb, s = _key_tile(qg, k, v, start, block_n, scale, mask, acc_t, softcap, alibi_slopes)
        p = torch.exp(s - lse_g[..., None])
        dv[:, :, start:start + block_n] = (p.transpose(-1, -2) @ dog).sum(2)  # sum over the query-head group
        dp = dog @ vb.transpose(-1, -2)
        ds = p * (dp - delta[..., None])
        if softcap:  # through the cap: d capped / d s = 1 - tanh^2, at the capped scores before bias and mask
            ds = ds * (1.0 - (capped((qg @ kb.transpose(-1, -2)) * scale, softcap) / softcap) ** 2)
        dq += (ds @ kb) * scale
        dk[:, :, start:start + block_n] = (ds.transpose(-1, -2) @ qg).sum(2) * scale
    return dq.flatten(1, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def math_attention(q, k, v, *, causal: bool = False, scale: float | None = None, mask: Mask | None = None,
                   softcap: float = 0.0, sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None):
    """Plain materialised attention (scores, softmax, matmul) in the inputs' dtype: the textbook
    definition with FlashAttention's masking conventions (``causal`` aligns bottom-right; ``mask``, a
    dispatch.mask.Mask, says more). Meant for fp64 checks at small sizes."""
    mask = as_mask(causal, mask)
    p, lse = math_probabilities(q, k, causal=causal, scale=scale, mask=mask, softcap=softcap, sinks=sinks,
                                alibi_slopes=alibi_slopes)
    v = v.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    if not _has_nonfinite_values(v, mask):
        return p @ v, lse
    visible = _visible(0, k.shape[2], q.shape[2], k.shape[2], mask, q.device)
    return _put_back(p @ torch.where(v.isfinite(), v, 0.0), *_nonfinite_values(visible, v)), lse


def math_probabilities(q, k, *, causal: bool = False, scale: float | None = None, mask: Mask | None = None,
                       softcap: float = 0.0, sinks: torch.Tensor | None = None,
                       alibi_slopes: torch.Tensor | None = None):
    """The softmax probabilities P (batch, heads_q, seqlen_q, seqlen_k) of math_attention and its LSE
    (``softcap``: of the capped scores; torch autograd differentiates through the tanh). ``sinks``
    (heads_q,): one more score per row, its head's sink, in the softmax and the LSE but not in P."""
    mask = as_mask(causal, mask)
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = capped((q @ k.transpose(-1, -2)) * scale, softcap)
    if alibi_slopes is not None:  # (batch or 1, heads_q) slopes; the bias is (batch, heads_q, rows, keys)
        slopes = alibi_slopes.expand(q.shape[0], q.shape[1])
        s = s + alibi_bias(slopes, 0, seqlen_k, seqlen_q, seqlen_k, q.shape[1], s.dtype).flatten(1, 2)
    if mask.by_rule:
        s = _mask_tile(s, 0, seqlen_q, seqlen_k, mask)
    if sinks is not None:  # the sink as one more key with no value: softmax over [s, sink], then drop it
        sink = sinks.to(s.dtype)[None, :, None, None].expand(*s.shape[:-1], 1)
        full = torch.cat((s, sink), -1)
        return torch.softmax(full, -1)[..., :-1], torch.logsumexp(full, -1)
    dead = (s == float("-inf")).all(-1, keepdim=True)  # rows that see no key: output 0, LSE -inf
    s = s.masked_fill(dead, 0.0)  # keeps softmax and its gradient free of NaN on those rows
    p = torch.softmax(s, -1).masked_fill(dead, 0.0)
    lse = torch.logsumexp(s, -1).masked_fill(dead.squeeze(-1), float("-inf"))
    return p, lse

"""On an H100/H200: the compiled cute_sm90 kernels against fp64 math, with outputs poisoned (NaN)
before the call so any element the kernel fails to write shows. Odd lengths, GQA/MQA, seqlen_q !=
seqlen_k both ways with bottom-right causal (rows that see no key: 0 out, LSE -inf), every head dim.
The API matrix in tests/test_api.py covers the dispatch path and the triton_fa2 backward."""

import math

import pytest
import torch

from attnforge.backends.cute_sm90 import variants
from attnforge.testing import assert_close, needs_gpu, oracle, peer_error

pytestmark = [pytest.mark.gpu, needs_gpu((9, 0), "sm90")]


def planned(dtype: str, head_dim: int, causal: bool):
    """The Sm90Variant the backend runs for (dtype, head_dim, causal): the table's pick, as the planner makes it."""
    from attnforge.dispatch import registered

    from attnforge.backends.cute_sm90.backend import Sm90Variant

    built = registered()["cute_sm90"].variants(dtypes=(dtype,), head_dims=(head_dim,), causal=(causal,), strict=True)
    (variant,) = [v for v in built if isinstance(v, Sm90Variant)]  # the backward's variants come with it
    return variant


# (batch, heads_q, heads_kv, seqlen_q, seqlen_k)
SHAPES = [(1, 2, 2, 1, 1), (2, 3, 3, 17, 17), (1, 4, 2, 113, 1023), (1, 4, 1, 1023, 113), (2, 2, 2, 300, 700),
          (1, 8, 8, 1024, 1024)]


# Every 16-bit head dim the table serves in bf16; fp16 at the model head dims, and at 40 and 72, which the
# kernel pads (to 48 and 80) with TMA's zero fill.
MODEL_HEAD_DIMS = (32, 40, 48, 64, 72, 80, 96, 112, 128, 160, 192, 256)
DTYPE_HEAD_DIMS = [("bf16", d) for d in variants.HEAD_DIMS_OF["16bit"]] + [("fp16", d) for d in MODEL_HEAD_DIMS]


@pytest.mark.parametrize("dtype, head_dim", DTYPE_HEAD_DIMS, ids=lambda x: str(x))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_poisoned_outputs_match_fp64(shape, dtype, causal, head_dim, gen):
    from attnforge.backends.cute_sm90.backend import run_kernel

    b, hq, hkv, nq, nk = shape
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    q, k, v = (torch.randn(b, h, n, head_dim, generator=gen).to("cuda", torch_dtype)
               for h, n in ((hq, nq), (hkv, nk), (hkv, nk)))
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device="cuda")
    variant = planned(dtype, head_dim, causal)
    run_kernel(variant.kernel, variant.tile, q, k, v, out, lse, head_dim ** -0.5 * math.log2(math.e), causal=causal)
    ref, ref_lse, _ = oracle(q, k, v, causal=causal)
    peer, _ = peer_error(q, k, v, causal=causal)
    ulps = 4 * math.sqrt(max(nk, head_dim))
    assert_close("out", out, ref, peer, ulps=ulps)
    assert_close("lse", lse, ref_lse, ref_lse.float(), ulps=ulps)
    if causal and nq > nk:
        assert (out[:, :, :nq - nk] == 0).all() and (lse[:, :, :nq - nk] == float("-inf")).all()


def fp8_lse_bound(q, k, tile) -> float:
    """How far the FP8 kernel's LSE may be from fp64's on these (dequantised) q and k.

    S = Q K^T comes from the FP8 WGMMA, which accumulates with about 14 bits of precision on Hopper
    (DeepSeek-V3 technical report, section 3.3.2): the LSE may be off by that much of the largest
    accumulated magnitude, scale * sum_k |q_ik k_jk| (twice 2^-14, for the rounding of each partial sum).
    With row sums by MMA (variants: row_sum_mma) the LSE is that of the e4m3-rounded P the output is
    normalised by, so it may differ from the exact one by the rounding of P's sum: each value within 2^-4
    relative (3 mantissa bits), or below e4m3's smallest normal 2^-6 within 2^-10 absolute, against a sum
    of at least 2^8 (P is 2^8 at the row max): |log(sum)| change <= -log(1 - 2^-4 - nk * 2^-18)."""
    group, nk, head_dim = q.shape[1] // k.shape[1], k.shape[2], q.shape[-1]
    magnitude = (q.double().abs() @ k.double().abs().repeat_interleave(group, 1).transpose(-1, -2)).max().item()
    p_rounding = -math.log1p(-(2 ** -4 + nk * 2 ** -18)) if tile.row_sum_mma else 0.0
    return 2 * 2 ** -14 * head_dim ** -0.5 * magnitude + 1e-5 + p_rounding


FP8_SHAPES = [(1, 2, 2, 1, 1), (2, 4, 2, 113, 1023), (1, 4, 1, 1023, 113), (1, 8, 8, 1024, 1024)]


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("shape", FP8_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp8_with_descales_matches_fp64_on_the_dequantised_inputs(shape, causal, head_dim, gen):
    """Error against fp64 math on the dequantised inputs at most 1.2x that of PyTorch rounding P to
    e4m3 the same way (testing.fp8_peer), plus the bf16 rounding of the output (2^-8 relative): FP8's
    own error, not a hand-loosened bound."""
    import attnforge
    from attnforge.testing import fp8_peer, rel_error

    b, hq, hkv, nq, nk = shape
    x = [torch.randn(b, h, n, head_dim, generator=gen).to("cuda") for h, n in ((hq, nq), (hkv, nk), (hkv, nk))]
    # per-(batch, kv head) scales as a quantiser would pick them: amax / 448 (e4m3's largest normal)
    descale = [(t.reshape(b, hkv, -1).abs().amax(-1) / 448).float() for t in x]
    per_head = [d.repeat_interleave(t.shape[1] // hkv, 1)[:, :, None, None] for d, t in zip(descale, x)]
    fp8 = [(t / d).to(torch.float8_e4m3fn) for t, d in zip(x, per_head)]
    deq = [f.float() * d for f, d in zip(fp8, per_head)]
    out, lse = attnforge.attention(*fp8, causal=causal, return_lse=True, q_descale=descale[0], k_descale=descale[1],
                                   v_descale=descale[2], backend="cute_sm90")
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    ref, ref_lse, _ = oracle(*deq, causal=causal)
    inherent = rel_error(fp8_peer(*deq, causal=causal), ref)
    assert rel_error(out, ref) <= 1.2 * inherent + 2 ** -8, (rel_error(out, ref), inherent)
    finite = ref_lse.isfinite()
    assert torch.equal(lse[~finite], ref_lse[~finite].float()) and not lse.isnan().any()
    lse_err = (lse.double() - ref_lse)[finite].abs().max().item() if finite.any() else 0.0
    bound = fp8_lse_bound(deq[0], deq[1], variants.pick("fp8", head_dim)[0])
    assert lse_err <= bound, (lse_err, bound)
    if causal and nq > nk:
        assert (out[:, :, :nq - nk] == 0).all()


@pytest.mark.parametrize("dtype", ("bf16", "fp8"))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_negative_scale_matches_fp64(dtype, causal, gen):
    """A negative scale (the kernels bound their exponentials by the max of the unscaled scores, so the
    backend hands them -q and -scale) gives softmax(q k^T * scale) v, as for a positive one. Scores of
    std |scale| * sqrt(d) ~ 8: without the negation P overflows e4m3 at once, bf16 soon after."""
    import attnforge
    from attnforge.testing import fp8_peer, rel_error

    b, hq, hkv, nq, nk, d, scale = 1, 4, 2, 113, 1023, 128, -0.7
    torch_dtype = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[dtype]
    q, k, v = (torch.randn(b, h, n, d, generator=gen).to("cuda").to(torch_dtype)
               for h, n in ((hq, nq), (hkv, nk), (hkv, nk)))
    out, lse = attnforge.attention(q, k, v, causal=causal, scale=scale, return_lse=True, backend="cute_sm90")
    ref, ref_lse, _ = oracle(q.float(), k.float(), v.float(), causal=causal, scale=scale)
    if dtype == "fp8":
        inherent = rel_error(fp8_peer(q.float(), k.float(), v.float(), causal=causal, scale=scale), ref)
        assert not out.isnan().any() and rel_error(out, ref) <= 1.2 * inherent + 2 ** -8, (rel_error(out, ref), inherent)
    else:
        peer, _ = peer_error(q, k, v, causal=causal, scale=scale)
        assert_close("out", out, ref, peer, ulps=4 * math.sqrt(nk))
        assert_close("lse", lse, ref_lse, ref_lse.float(), ulps=4 * math.sqrt(nk))


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_fp8_kernel_writes_every_element(causal, gen):
    """The FP8 kernel called directly with NaN-poisoned outputs: odd lengths, GQA."""
    from attnforge.backends.cute_sm90.backend import run_kernel
    from attnforge.backends.cute_sm90.v_layout import prepare_v_fp8

    b, hq, hkv, nq, nk, d = 2, 6, 2, 333, 517, 128
    q, k, v = (torch.randn(b, h, n, d, generator=gen).to("cuda").to(torch.float8_e4m3fn)
               for h, n in ((hq, nq), (hkv, nk), (hkv, nk)))
    out = torch.full((b, hq, nq, d), float("nan"), device="cuda", dtype=torch.bfloat16)
    lse = torch.full((b, hq, nq), float("nan"), device="cuda")
    variant = planned("fp8", d, causal)
    run_kernel(variant.kernel, variant.tile, q, k, prepare_v_fp8(v), out, lse,
               d ** -0.5 * math.log2(math.e), causal=causal, descale=torch.ones(3, b, hkv, device="cuda"))
    assert not out.isnan().any() and not lse.isnan().any()


@pytest.mark.parametrize("max_ctas", (1, 3, 7))
@pytest.mark.parametrize("dtype", ("bf16", "fp8"))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_persistent_ctas_cover_every_tile(head_dim, causal, dtype, max_ctas, gen):
    """Few CTAs for many tiles (2 x 5 heads x 3-8 m blocks): each persistent CTA loops over many tiles,
    across heads and batches, so a tile that is skipped, run twice or given another tile's head, batch
    or K/V stage shows against fp64 math on a NaN-poisoned output. Causal kernels take one CTA per tile
    and must ignore max_ctas."""
    from attnforge.backends.cute_sm90.backend import run_kernel
    from attnforge.backends.cute_sm90.v_layout import prepare_v_fp8
    from attnforge.testing import fp8_peer, rel_error

    b, hq, hkv, nq, nk = 2, 5, 5, 401, 389
    torch_dtype = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[dtype]
    q, k, v = (torch.randn(b, hq, n, head_dim, generator=gen).to("cuda").to(torch_dtype) for n in (nq, nk, nk))
    out = torch.full((b, hq, nq, head_dim), float("nan"), device="cuda",
                     dtype=torch.bfloat16 if dtype == "fp8" else torch_dtype)
    lse = torch.full((b, hq, nq), float("nan"), device="cuda")
    variant = planned(dtype, head_dim, causal)
    kernel, tile = variant.kernel, variant.tile
    scale_log2 = head_dim ** -0.5 * math.log2(math.e)
    if dtype == "fp8":  # (a tail-split kernel plans for max_ctas SMs: few SMs, many pieces)
        run_kernel(kernel, tile, q, k, prepare_v_fp8(v), out, lse, scale_log2, causal=causal,
                   descale=torch.ones(3, b, hkv, device="cuda"), ctas=max_ctas)
    else:
        run_kernel(kernel, tile, q, k, v, out, lse, scale_log2, causal=causal, ctas=max_ctas)
    ref, ref_lse, _ = oracle(q.float(), k.float(), v.float(), causal=causal)
    assert not out.isnan().any() and not lse.isnan().any()
    if dtype == "fp8":
        inherent = rel_error(fp8_peer(q.float(), k.float(), v.float(), causal=causal), ref)
        assert rel_error(out, ref) <= 1.2 * inherent + 2 ** -8, (rel_error(out, ref), inherent)
    else:
        peer, _ = peer_error(q, k, v, causal=causal)
        assert_close("out", out, ref, peer, ulps=4 * math.sqrt(nk))
        assert_close("lse", lse, ref_lse, ref_lse.float(), ulps=4 * math.sqrt(nk))


SPLIT_PICKS = [(kind, d) for kind, d, tile in variants.picks() if tile.tail_split]


@pytest.mark.skipif(not SPLIT_PICKS, reason="no picked cute_sm90 tile has tail_split")
@pytest.mark.parametrize("kind,head_dim", SPLIT_PICKS, ids=lambda x: str(x))
@pytest.mark.parametrize("plan", ((16, 2, 2), (0, 18, 3), (17, 1, 11), (0, 18, 11), (18, 0, 1)),
                         ids=lambda p: "full%d-tail%d-pieces%d" % p)
def test_tail_split_pieces_match_fp64(kind, head_dim, plan, gen, monkeypatch):
    """Given plans (whole tiles, tail tiles, pieces per tail tile) on 18 tiles of 11 key blocks (2 x 3 heads,
    seqlen_q 3 tiles less a few rows, seqlen_k not a multiple of the key block): up to one key block per piece.
    NaN-poisoned outputs and workspaces, so a row no piece wrote, or a slot the combine read unwritten, shows."""
    from attnforge.backends.cute_sm90 import tail_split
    from attnforge.backends.cute_sm90.backend import Sm90Variant, run_kernel
    from attnforge.backends.cute_sm90.v_layout import prepare_v_fp8
    from attnforge.testing import fp8_peer, rel_error

    tile, _ = variants.pick(kind, head_dim)
    b, h, nq, nk = 2, 3, 3 * tile.tile_m - 5, 11 * tile.tile_n - 7
    p = tail_split.Plan(*plan)
    assert p.check(b * h * 3, 11) == []
    torch_dtype = torch.float8_e4m3fn if kind == "fp8" else torch.bfloat16
    q, k, v = (torch.randn(b, h, n, head_dim, generator=gen).to("cuda").to(torch_dtype) for n in (nq, nk, nk))
    out = torch.full((b, h, nq, head_dim), float("nan"), device="cuda", dtype=torch.bfloat16)
    lse = torch.full((b, h, nq), float("nan"), device="cuda")
    real_workspaces = tail_split.workspaces
    monkeypatch.setattr(tail_split, "workspaces", lambda *a: tuple(w.fill_(float("nan")) for w in real_workspaces(*a)))
    kernel = Sm90Variant(tile, kind, head_dim, "fp8" if kind == "fp8" else "bf16", False).kernel
    scale_log2 = head_dim ** -0.5 * math.log2(math.e)
    if kind == "fp8":
        run_kernel(kernel, tile, q, k, prepare_v_fp8(v), out, lse, scale_log2, causal=False, plan=p,
                   descale=torch.ones(3, b, h, device="cuda"))
    else:
        run_kernel(kernel, tile, q, k, v, out, lse, scale_log2, causal=False, plan=p)
    assert not out.isnan().any() and not lse.isnan().any()
    ref, ref_lse, _ = oracle(q.float(), k.float(), v.float(), causal=False)
    if kind == "fp8":
        inherent = rel_error(fp8_peer(q.float(), k.float(), v.float(), causal=False), ref)
        assert rel_error(out, ref) <= 1.2 * inherent + 2 ** -8, (rel_error(out, ref), inherent)
        lse_err = (lse.double() - ref_lse).abs().max().item()
        assert lse_err <= fp8_lse_bound(q, k, tile), lse_err
    else:
        peer, _ = peer_error(q, k, v, causal=False)
        assert_close("out", out, ref, peer, ulps=4 * math.sqrt(nk))
        assert_close("lse", lse, ref_lse, ref_lse.float(), ulps=4 * math.sqrt(nk))


@pytest.mark.parametrize("seqlen", (1, 17, 113, 1023, 4096))
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_v_layout_kernel_matches_the_torch_version(seqlen, head_dim, gen):
    """The Triton V^T kernel against the torch permute-and-copy, byte for byte, on a poisoned output;
    V as a strided view too ((batch, seqlen, heads, dim) storage, as attention(layout="bshd") passes it)."""
    from attnforge.backends.cute_sm90 import v_layout

    v = torch.randn(2, seqlen, 3, head_dim, generator=gen).to("cuda").to(torch.float8_e4m3fn).transpose(1, 2)
    for tensor in (v, v.contiguous()):
        want = v_layout.prepare_v_fp8_torch(tensor).view(torch.uint8)
        poisoned = torch.full(want.shape, 0x7F, dtype=torch.uint8, device="cuda")  # e4m3 NaN
        got = v_layout.prepare_v_fp8(tensor, out=poisoned)
        assert got.dtype == torch.float8_e4m3fn and got.shape == want.shape
        assert torch.equal(got.view(torch.uint8), want)


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_fp8_backward_is_the_bf16_backward_of_the_dequantised_inputs(causal, gen):
    """Gradients with respect to the fp8 tensors: descale * (gradient at the dequantised inputs), then
    stored by autograd in the inputs' dtype (e4m3). Checked against the fp64 oracle's gradients put
    through the same chain rule and rounding: at most 2x the error that rounding alone makes, plus
    bf16's backward error (2^-7 relative)."""
    import attnforge
    from attnforge.testing import rel_error

    b, hq, hkv, nq, nk, d = 1, 4, 2, 257, 300, 128
    x = [torch.randn(b, h, n, d, generator=gen).to("cuda") for h, n in ((hq, nq), (hkv, nk), (hkv, nk))]
    # amax / 448 per (batch, kv head), as a quantiser picks them: larger values would not fit e4m3 (NaN)
    descale = [(t.reshape(b, hkv, -1).abs().amax(-1) / 448).float() for t in x]
    per_head = [s.repeat_interleave(t.shape[1] // hkv, 1)[:, :, None, None] for s, t in zip(descale, x)]
    fp8 = [(t / s).to(torch.float8_e4m3fn).requires_grad_() for t, s in zip(x, per_head)]
    out = attnforge.attention(*fp8, causal=causal, q_descale=descale[0], k_descale=descale[1], v_descale=descale[2])
    decision = attnforge.last_decision()
    assert decision.forward.backend == "cute_sm90" and decision.backward.backend == "cute_sm90"
    assert decision.backward.variant.dtype == "bf16"
    dout = torch.randn(out.shape, generator=gen).to("cuda", torch.bfloat16)
    grads = torch.autograd.grad(out, fp8, dout)
    deq = [f.detach().double() * s for f, s in zip(fp8, per_head)]
    _, _, ref = oracle(*deq, causal=causal, dout=dout)
    for name, g, r, s in zip(("dq", "dk", "dv"), grads, ref, per_head):
        want = r * s  # chain rule through x = x8 * descale
        rounding = rel_error(want.to(torch.float8_e4m3fn).double(), want)
        assert g.dtype == torch.float8_e4m3fn
        assert rel_error(g.double(), want) <= 2 * rounding + 2 ** -7, (name, rel_error(g.double(), want), rounding)


# Non-finite inputs, zero scales and descales, masks that hide a whole row (issue 19, items 2 to 5): the
# fused GPU kernels against the fp64 oracle. (heads_q, heads_kv, seqlen_q, seqlen_k, causal): causal both
# ways, so rows that see no key (1023 > 113) and keys hidden from most rows (113 < 1023), and no mask.
NONFINITE_CASES = [(4, 2, 113, 1023, True), (2, 2, 300, 77, True), (4, 1, 129, 257, False)]
GPU_BACKENDS = ("cute_sm90", "triton_fa2", "sdpa")


def nan_cases():
    # triton_fa2's forward checks the value rows of its masked tiles (templates/triton_fa2_fwd.py.jinja), so a NaN
    # value is exact there too; the other fused kernels are held to test_a_nan_value_stays_near_its_key_tile.
    tensors = {"triton_fa2": ("q", "k", "v")}
    return [pytest.param(b, t, c, id=f"{b}-{t}-" + "x".join(map(str, c)))
            for b in GPU_BACKENDS for t in tensors.get(b, ("q", "k")) for c in NONFINITE_CASES]


@pytest.mark.parametrize("backend,tensor,case", nan_cases())
def test_a_nan_reaches_exactly_the_rows_that_see_it(backend, tensor, case, gen):
    """A NaN query row gives a NaN output row; a NaN key NaN in exactly the rows that see it (sdpa's lower-right
    causal bias used to spread it to every row on the CPU; here torch's fused kernels). Rows that see no key
    stay 0. (A NaN value reaches the rows of its tile: 0 * NaN in P @ V, in every fused kernel.)"""
    from attnforge import attention
    from attnforge.dispatch.mask import CAUSAL, NONE
    from attnforge.testing import assert_nan_rows, poison, sees

    hq, hkv, nq, nk, causal = case
    mask = CAUSAL if causal else NONE
    q, k, v = (torch.randn(1, h, n, 128, generator=gen).to("cuda", torch.bfloat16) for h, n in ((hq, nq), (hkv, nk), (hkv, nk)))
    visible = sees(mask, nq, nk)
    indices = [nq - 1] if tensor == "q" else sorted({0, int(visible.any(0).nonzero()[-1]), nk - 1})
    for index in indices:
        qn, kn, vn, rows = poison(q, k, v, tensor, index, mask)
        out = attention(qn, kn, vn, causal=causal, backend=backend)
        ref, _, _ = oracle(qn, kn, vn, causal=causal)
        peer, _ = peer_error(q, k, v, causal=causal)
        assert_nan_rows("out", out, ref, peer, rows, ulps=4 * math.sqrt(nk))
        blind = ~visible.any(-1).to("cuda")
        assert (out[:, :, blind] == 0).all()


# Rows a fused kernel may wrongly make NaN around a NaN value row: those of the query blocks whose key range
# holds its key tile. 256 bounds every tile these kernels run (cute_sm90's tile_m up to 192, torch's fused ones
# 128): one query block on each side of the first row that sees the key.
VALUE_LEAK_ROWS = 256


@pytest.mark.parametrize("backend", ("cute_sm90", "sdpa"))
@pytest.mark.parametrize("case", NONFINITE_CASES, ids=lambda c: "x".join(map(str, c)))
def test_a_nan_value_stays_near_its_key_tile(backend, case, gen):
    """A NaN value row makes every row that sees it NaN (never hidden), and other rows match the oracle, except
    rows near its key tile: P @ V multiplies the tile's masked zeros by it (0 * NaN), in cute_sm90 and in torch's
    fused kernels alike (as in FlashAttention and cuDNN). The README's known issues state this bound."""
    from attnforge import attention
    from attnforge.dispatch.mask import CAUSAL, NONE
    from attnforge.testing import assert_close, poison, sees

    hq, hkv, nq, nk, causal = case
    mask = CAUSAL if causal else NONE
    q, k, v = (torch.randn(1, h, n, 128, generator=gen).to("cuda", torch.bfloat16) for h, n in ((hq, nq), (hkv, nk), (hkv, nk)))
    visible = sees(mask, nq, nk)
    for index in sorted({0, int(visible.any(0).nonzero()[-1]), nk - 1}):
        qn, kn, vn, rows = poison(q, k, v, "v", index, mask)
        out = attention(qn, kn, vn, causal=causal, backend=backend)
        ref, _, _ = oracle(qn, kn, vn, causal=causal)
        peer, _ = peer_error(q, k, v, causal=causal)
        rows, got = rows.cpu(), out.isnan().all(-1).cpu()
        assert (got | ~rows).all(), "a row that sees the NaN value is not NaN"
        assert (out.isnan().any(-1).cpu() == got).all(), "a row is NaN in some columns only"
        leaked = got & ~rows
        seen_by = visible[:, index].nonzero()
        if leaked.any():
            first = int(seen_by[0]) if len(seen_by) else nq
            leaked_rows = leaked.any(0).any(0).nonzero().flatten()
            assert leaked[:, hq // hkv:].sum() == 0, "the NaN reached a query head of another kv head"
            assert (leaked_rows - first).abs().max() < VALUE_LEAK_ROWS, (index, leaked_rows.tolist())
        keep = (~got).to(out.device)
        assert_close("out", out[keep], ref.to(out.device)[keep], peer.to(out.device)[keep], ulps=4 * math.sqrt(nk))


@pytest.mark.parametrize("backend", ("cute_sm90", "triton_fa2"))
@pytest.mark.parametrize("tensor", ("q", "k"))
def test_a_nan_row_has_a_nan_lse(backend, tensor, gen):
    """The LSE of a row with a NaN score is NaN, not the -inf of a row that sees no key (triton_fa2 took
    l > 0 for "saw a key"; cute_sm90's epilogue tests total > 0 the same way, see
    templates/cute_sm90_fwd.py.jinja, epilogue)."""
    from attnforge import attention
    from attnforge.dispatch.mask import CAUSAL
    from attnforge.testing import assert_nan_rows, poison

    hq, hkv, nq, nk = 4, 2, 113, 1023
    q, k, v = (torch.randn(1, h, n, 128, generator=gen).to("cuda", torch.bfloat16) for h, n in ((hq, nq), (hkv, nk), (hkv, nk)))
    qn, kn, vn, rows = poison(q, k, v, tensor, nq - 1 if tensor == "q" else nk - 3, CAUSAL)
    _, lse = attention(qn, kn, vn, causal=True, return_lse=True, backend=backend)
    _, ref_lse, _ = oracle(qn, kn, vn, causal=True)
    assert_nan_rows("lse", lse, ref_lse, ref_lse.float(), rows, ulps=4 * math.sqrt(nk))


@pytest.mark.parametrize("dtype", (torch.float16, torch.float32, torch.float64), ids=str)
def test_sdpa_lower_right_causal_keeps_a_nan_key_in_its_rows(dtype, gen):
    """sdpa with causal and seqlen_q < seqlen_k on the GPU: fp16/fp32 run torch's fused kernels (masked by
    index), fp64 the materialised bias, which the backend guards against a hidden NaN key."""
    from attnforge import attention
    from attnforge.dispatch.mask import CAUSAL
    from attnforge.testing import assert_nan_rows, poison

    q, k, v = (torch.randn(2, h, n, 64, generator=gen).to("cuda", dtype) for h, n in ((4, 37), (2, 300), (2, 300)))
    for index in (0, 280, 299):
        qn, kn, vn, rows = poison(q, k, v, "k", index, CAUSAL)
        out = attention(qn, kn, vn, causal=True, backend="sdpa")
        ref, _, _ = oracle(qn, kn, vn, causal=True)
        peer, _ = peer_error(q, k, v, causal=True)
        assert_nan_rows("out", out, ref, peer, rows, ulps=4 * math.sqrt(300))


@pytest.mark.parametrize("scale", (0.0, 1e-60))
@pytest.mark.parametrize("backend,dtype", [("cute_sm90", "bf16"), ("cute_sm90", "fp8"), ("triton_fa2", "bf16"),
                                           ("sdpa", "bf16"), ("sdpa", "fp32")])
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_a_zero_scale_is_the_mean_of_the_visible_values(causal, backend, dtype, scale, gen):
    """scale=0 (or one that is 0 in fp32): every score 0, the output the mean of the values each row sees. It
    gave NaN rows with causal through sdpa, and through the CuTe kernels, which scale after masking (-inf * 0)."""
    from attnforge import attention
    from attnforge.testing import fp8_peer, rel_error

    b, hq, hkv, nq, nk, d = 1, 4, 2, 113, 1023, 128
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}[dtype]
    q, k, v = (torch.randn(b, h, n, d, generator=gen).to("cuda").to(torch_dtype) for h, n in ((hq, nq), (hkv, nk), (hkv, nk)))
    out = attention(q, k, v, causal=causal, scale=scale, backend=backend)
    ref, _, _ = oracle(q.float(), k.float(), v.float(), causal=causal, scale=0.0)
    assert not out.isnan().any()
    if dtype == "fp8":
        inherent = rel_error(fp8_peer(q.float(), k.float(), v.float(), causal=causal, scale=0.0), ref)
        assert rel_error(out, ref) <= 1.2 * inherent + 2 ** -8, (rel_error(out, ref), inherent)
    else:
        peer, _ = peer_error(q, k, v, causal=causal, scale=0.0)
        assert_close("out", out, ref, peer, ulps=4 * math.sqrt(nk))


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32), ids=str)
@pytest.mark.parametrize("kind", ("bool", "float"))
def test_sdpa_mask_row_that_hides_every_key_gives_zero(kind, dtype, gen):
    """attnforge.sdpa with an attn_mask row that hides every key: 0 (the H200's kernels gave a nonzero row,
    0.367 measured), the rest as fp64 math."""
    import attnforge

    b, h, nq, nk, d = 2, 4, 77, 301, 64
    q, k, v = (torch.randn(b, h, n, d, generator=gen).to("cuda", dtype) for n in (nq, nk, nk))
    keep = torch.rand(b, 1, nq, nk, generator=gen) > 0.5
    keep[..., 0] = True
    keep[0, 0, 5], keep[1, 0, 76], keep[1, 0, 0] = False, False, False
    keep = keep.to("cuda")
    mask = keep if kind == "bool" else torch.zeros(keep.shape, device="cuda", dtype=dtype).masked_fill(~keep, float("-inf"))
    out = attnforge.sdpa(q, k, v, attn_mask=mask)
    blind = ~keep.any(-1).expand(b, h, nq)
    assert (out[blind] == 0).all() and not out.isnan().any()
    scores = (q.double() @ k.double().transpose(-1, -2) / d ** 0.5).masked_fill(~keep, float("-inf"))
    ref = torch.softmax(scores, -1).nan_to_num(0.0) @ v.double()
    peer = torch.softmax((q @ k.transpose(-1, -2) / d ** 0.5).masked_fill(~keep, float("-inf")), -1).nan_to_num(0.0) @ v
    assert_close("out", out[~blind], ref[~blind], peer[~blind], ulps=4 * math.sqrt(nk))


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("shape", ((2, 4, 2, 113, 1023), (2, 4, 2, 1023, 113)), ids=lambda s: "x".join(map(str, s)))
def test_fp8_zero_descales_match_fp64_on_the_dequantised_inputs(shape, causal, gen):
    """q_descale or k_descale 0 for one (batch, kv head): every score 0, uniform over the visible keys; v_descale
    0: output 0. The kernel made NaN of them (-inf * 0); the backend now hands it a score scale bounded away
    from 0 (score_descale). Each (batch, kv head) within FP8's own error, as
    test_fp8_with_descales_matches_fp64_on_the_dequantised_inputs bounds it."""
    import attnforge
    from attnforge.testing import fp8_peer, rel_error

    b, hq, hkv, nq, nk = shape
    d, group = 128, hq // hkv
    x = [torch.randn(b, h, n, d, generator=gen).to("cuda") for h, n in ((hq, nq), (hkv, nk), (hkv, nk))]
    descale = [(t.reshape(b, hkv, -1).abs().amax(-1) / 448).float() for t in x]
    per_head = [s.repeat_interleave(t.shape[1] // hkv, 1)[:, :, None, None] for s, t in zip(descale, x)]
    fp8 = [(t / s).to(torch.float8_e4m3fn) for t, s in zip(x, per_head)]
    descale[0][0, 0], descale[1][0, 1], descale[2][1, 0] = 0.0, 0.0, 0.0  # (1, 1) keeps its descales
    per_head = [s.repeat_interleave(t.shape[1] // hkv, 1)[:, :, None, None] for s, t in zip(descale, x)]
    deq = [f.float() * s for f, s in zip(fp8, per_head)]
    out, lse = attnforge.attention(*fp8, causal=causal, return_lse=True, q_descale=descale[0], k_descale=descale[1],
                                   v_descale=descale[2], backend="cute_sm90")
    ref, ref_lse, _ = oracle(*deq, causal=causal)
    assert not out.isnan().any() and out.isfinite().all() and not lse.isnan().any()
    assert (out[1, :group] == 0).all()
    peer = fp8_peer(*deq, causal=causal)
    finite = ref_lse.isfinite()
    assert torch.equal(lse[~finite], ref_lse[~finite].float())
    tile = variants.pick("fp8", d)[0]
    for bi in range(b):
        for hi in range(hkv):
            heads = slice(hi * group, (hi + 1) * group)
            got, want, inherent = out[bi, heads], ref[bi, heads], rel_error(peer[bi, heads], ref[bi, heads])
            assert rel_error(got, want) <= 1.2 * inherent + 2 ** -8, (bi, hi, rel_error(got, want), inherent)
            rows = finite[bi, heads]
            err = (lse[bi, heads].double() - ref_lse[bi, heads])[rows].abs().max().item() if rows.any() else 0.0
            bound = fp8_lse_bound(deq[0][bi:bi + 1, heads], deq[1][bi:bi + 1, hi:hi + 1], tile)
            assert err <= bound, (bi, hi, err, bound)

"""Which devices and problems get cute_sm90, and the reasons when they do not."""

import pytest
import torch

from attnforge import BackendUnavailableError, attention, explain, use_backend
from attnforge.backends.cute_sm90 import bwd_variants, variants
from attnforge.backends.cute_sm90 import compile as cc
from attnforge.backends.cute_sm90.backend import Sm90Variant
from attnforge.backends.cute_sm90.backward import Sm90BwdVariant
from attnforge.dispatch.problem import SMALL_SOFTCAP


@pytest.mark.parametrize("device", ("H100", "H200"))
@pytest.mark.parametrize("dtype", ("fp16", "bf16"))
@pytest.mark.parametrize("head_dim", (64, 128, 256, 96))
def test_hopper_chooses_cute_sm90_and_says_which_backward_follows(device, dtype, head_dim):
    d = explain(device=device, dtype=dtype, head_dim=head_dim, seqlen_q=4096, heads=16, kv_heads=4,
                causal=True, needs_grad=True)
    assert d.forward.backend == "cute_sm90" and not d.fallback
    tile = variants.pick("16bit", head_dim)[0]  # the table's pick, compiled for this dtype and causality
    assert d.forward.variant == Sm90Variant(tile, "16bit", head_dim, dtype, True)
    assert d.forward.describe() == f"fwd {tile.describe()}"
    tile, why = bwd_variants.pick(head_dim, masked=True)
    if tile is not None:  # its own backward follows (no table here: the preference order)
        assert d.backward.backend == "cute_sm90" and d.backward.variant == Sm90BwdVariant(tile, head_dim, dtype, True)
    else:  # head dims whose backward is turned off (bwd_variants.PADDED_SERVED, SPLIT_HEAD_DIM_SERVED)
        assert d.backward.backend == "triton_fa2" and d.backward.variant.family == "bwd"
        assert d.backward.reasons_of("cute_sm90") == tuple(why)


# every head dim the backward serves in 16 bits; FP8's at the head dims its forward serves
FORCED_BACKWARD_CASES = [(dtype, d) for d in bwd_variants.HEAD_DIMS if bwd_variants.pick(d, masked=True)[0] is not None
                         for dtype in ("fp16", "bf16", "fp8") if d in variants.HEAD_DIMS_OF[cc.KIND[dtype]]]


@pytest.mark.parametrize("dtype, head_dim", FORCED_BACKWARD_CASES, ids=str)
@pytest.mark.parametrize("causal", (False, True))
def test_forced_cute_sm90_runs_its_own_backward(dtype, head_dim, causal):
    """Forcing cute_sm90 takes its backward where the table has one; FP8's runs in bf16 on the dequantised inputs."""
    d = explain(device="H100", dtype=dtype, head_dim=head_dim, seqlen_q=1000, heads=8, kv_heads=2, causal=causal,
                needs_grad=True, backend="cute_sm90")
    assert d.backward.backend == "cute_sm90"
    tile = bwd_variants.pick(head_dim, masked=causal)[0]
    assert d.backward.variant == Sm90BwdVariant(tile, head_dim, "bf16" if dtype == "fp8" else dtype, causal)
    assert d.backward.describe().startswith(f"bwd {tile.describe()}")
    assert ("dequantised" in d.backward.note) == (dtype == "fp8")


@pytest.mark.parametrize(("kw", "reason"), [
    (dict(dtype="fp32", head_dim=128), "dtype fp32 is not supported; supports bf16, fp16, fp8"),
    (dict(dtype="bf16", head_dim=512), "head_dim 512 > 256"),
    (dict(dtype="bf16", head_dim=100), "head_dim 100 has no cute_sm90 kernel for 16bit inputs (has every multiple "
                                       "of 8 up to 256)"),
    (dict(dtype="fp8", head_dim=96), "head_dim 96 has no cute_sm90 kernel for fp8 inputs (has 64, 128, 256)"),
    (dict(dtype="bf16", head_dim=128, dropout_p=0.1), "dropout_p > 0 is not supported"),
])
def test_fallbacks_say_why(kw, reason):
    d = explain(device="H100", seqlen_q=1024, **kw)
    assert d.forward.backend != "cute_sm90" and d.fallback
    assert reason in d.forward.reasons_of("cute_sm90")


@pytest.mark.parametrize("head_dim", (40, 80, 112, 160))
def test_head_dims_triton_fa2_lacks_train_on_cute_sm90s_padded_backward(head_dim):
    """cute_sm90 serves the forward, and its backward follows it at head dims triton_fa2 does not have: the next
    kernel up with zero-filled columns (bwd_variants.kernel_head_dim). No cost table here: the preference order
    decides."""
    d = explain(device="H200", dtype="bf16", head_dim=head_dim, seqlen_q=4096, causal=True)
    assert d.forward.backend == "cute_sm90"
    d = explain(device="H200", dtype="bf16", head_dim=head_dim, seqlen_q=4096, causal=True, needs_grad=True)
    assert (d.forward.backend, d.backward.backend) == ("cute_sm90", "cute_sm90"), d
    assert d.backward.variant.tile.params(head_dim)["head_dim_padded"] == bwd_variants.kernel_head_dim(head_dim)


def test_forcing_it_where_it_cannot_serve_raises_with_reasons():
    with use_backend("cute_sm90"):
        d = explain(device="L40S", dtype="bf16", head_dim=128, seqlen_q=1024)
        assert d.forward.backend is None
        assert d.forward.reasons_of("cute_sm90") == ("arch sm89 is not served; serves sm90",)
    q = torch.randn(1, 2, 8, 64)
    with pytest.raises(BackendUnavailableError, match="cute_sm90 +rejected +device cpu"):
        attention(q, q, q, backend="cute_sm90")


def test_blackwell_does_not_get_it():
    d = explain(device="B200", dtype="bf16", head_dim=128, seqlen_q=1024)
    assert "cute_sm90" not in [c.backend for c in d.forward.candidates]
    d = explain(device="B200", dtype="bf16", head_dim=128, seqlen_q=1024, backend="cute_sm90")
    assert d.forward.reasons_of("cute_sm90") == ("arch sm100 is not served; serves sm90",)


def test_shapes_where_triton_fa2_measured_faster_go_there_unless_forced(monkeypatch):
    # the table is empty today (cute_sm90 leads at every length timed); the routing is tested on an entry
    monkeypatch.setitem(variants.TRITON_FASTER, ("16bit", 64), (1024, 4096, "H200: 332 vs 289 TFLOP/s"))
    d = explain(device="H200", dtype="bf16", head_dim=64, seqlen_q=1024)
    assert d.forward.backend == "triton_fa2"
    (reason,) = d.forward.reasons_of("cute_sm90")
    assert reason.startswith("triton_fa2 measured faster at head_dim 64 with 1024 <= seqlen_k < 4096 (H200: 332 vs 289")
    assert explain(device="H200", dtype="bf16", head_dim=64, seqlen_q=4096).forward.backend == "cute_sm90"
    assert explain(device="H200", dtype="bf16", head_dim=64, seqlen_q=128).forward.backend == "cute_sm90"
    assert explain(device="H200", dtype="bf16", head_dim=128, seqlen_q=1024).forward.backend == "cute_sm90"
    forced = explain(device="H200", dtype="bf16", head_dim=64, seqlen_q=1024, backend="cute_sm90")
    assert forced.forward.backend == "cute_sm90"


def test_every_measured_shape_goes_to_cute_sm90_today():
    for head_dim in (64, 128, 256):
        for seqlen in (128, 1024, 2048, 4096, 16384):
            assert explain(device="H200", dtype="bf16", head_dim=head_dim, seqlen_q=seqlen).forward.backend == "cute_sm90"


def test_fp8_backward_runs_in_bf16_on_the_dequantised_inputs_and_the_decision_says_so():
    d = explain(device="H200", dtype="fp8", head_dim=128, seqlen_q=4096, needs_grad=True)
    assert d.forward.backend == "cute_sm90" and d.backward.backend == "cute_sm90"
    assert d.forward.variant.dtype == "fp8" and d.backward.variant.dtype == "bf16"
    assert d.backward.describe().endswith("(in bf16 on the dequantised fp8 inputs: there is no FP8 backward; not bitwise "
                                          "reproducible (deterministic=True: dQ summed in key-block order))")


@pytest.mark.parametrize(("dtype", "cap", "alibi", "fixed"), [
    ("bf16", 30.0, False, True), ("bf16", SMALL_SOFTCAP, False, True), ("bf16", 64.0, False, False),
    ("fp16", 30.0, False, False), ("bf16", 30.0, True, False)])
def test_a_small_softcap_in_bf16_takes_the_fixed_max_forward(dtype, cap, alibi, fixed):
    """FIXED_MAX serves bf16 caps up to SMALL_SOFTCAP without ALiBi; the others keep the running max."""
    d = explain(device="H100", dtype=dtype, head_dim=128, seqlen_q=4096, softcap=cap, alibi=alibi, backend="cute_sm90")
    variant = d.forward.variant
    assert variant.softcap and variant.fixed_max == fixed
    assert d.problem.softcap_large == (cap > SMALL_SOFTCAP)
    assert ("fixed max" in d.forward.describe()) == fixed
    assert variant.module.endswith("_fixedmax") == fixed

"""Bad input gets a clear error that names the problem."""

import pytest
import torch

from attnforge import InvalidInputError, UnknownNameError, attention, explain, sdpa


def qkv(b=1, hq=4, hkv=2, nq=8, nk=8, d=16, dv=None, dtype=torch.float32):
    return (torch.randn(b, hq, nq, d, dtype=dtype), torch.randn(b, hkv, nk, d, dtype=dtype),
            torch.randn(b, hkv, nk, dv or d, dtype=dtype))


@pytest.mark.parametrize(("change", "message"), [
    (lambda q, k, v: (q[0], k, v), r"q must be 4-D \(batch, heads, seqlen, head_dim\) for layout 'bhsd', got shape \(4, 8, 16\)"),
    (lambda q, k, v: (q, k, v[None]), r"v must be 4-D"),
    (lambda q, k, v: (q, k[:, :, :, :8], v), r"q and k must have the same head_dim, got 16 and 8"),
    (lambda q, k, v: (q[:, :3], k, v), r"heads of q \(3\) must be a multiple of heads of k/v \(2\)"),
    (lambda q, k, v: (q, k, v[:, :1]), r"k and v must have the same number of heads, got 2 and 1"),
    (lambda q, k, v: (q, k, v[:, :, :5]), r"k and v must have the same seqlen, got 8 and 5"),
    (lambda q, k, v: (torch.cat([q, q]), k, v), r"batch sizes differ: q 2, k 1, v 1"),
    (lambda q, k, v: (q, k.double(), v), r"q is torch.float32 but k is torch.float64"),
    (lambda q, k, v: (q, k, v.to("meta")), r"q is on cpu but v is on meta"),
    (lambda q, k, v: (q.int(), k.int(), v.int()), r"integer dtype torch.int32 is not supported; use fp16, bf16 or fp32"),
    (lambda q, k, v: (q.numpy(), k, v), r"q must be a torch.Tensor, got ndarray"),
    (lambda q, k, v: (q[..., :0], k[..., :0], v), r"head_dim must be > 0"),
])
def test_bad_tensors(change, message):
    with pytest.raises(InvalidInputError, match=message):
        attention(*change(*qkv()))


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(layout="sbhd"), r"layout must be one of \('bhsd', 'bshd'\), got 'sbhd'"),
    (dict(dropout_p=1.0), r"dropout_p must be a number in \[0, 1\), got 1.0"),
    (dict(dropout_p=-0.1), r"dropout_p must be a number in \[0, 1\)"),
    (dict(scale=float("nan")), r"scale must be a finite number or None, got nan"),
    (dict(scale="0.1"), r"scale must be a finite number or None"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(InvalidInputError, match=message):
        attention(*qkv(), **kwargs)


def test_bshd_shapes_are_read_as_bshd():
    q, k, v = (t.transpose(1, 2) for t in qkv(nq=8, nk=6))  # (b, n, h, d)
    assert attention(q, k, v, layout="bshd").shape == (1, 8, 4, 16)
    with pytest.raises(InvalidInputError, match="heads of q"):
        attention(q, k, v)  # read as bhsd: 8 "heads" of q against 6 of k


def test_unknown_names():
    with pytest.raises(UnknownNameError, match="unknown backend 'flash2'; known backends"):
        attention(*qkv(), backend="flash2")
    with pytest.raises(UnknownNameError, match="unknown device profile 'V100'"):
        explain(device="V100", dtype="bf16", head_dim=64, seqlen_q=128)
    with pytest.raises(UnknownNameError, match="unknown dtype 'fp4'"):
        explain(dtype="fp4", head_dim=64, seqlen_q=128)


def test_explain_needs_shapes_or_all_three_tensors():
    with pytest.raises(InvalidInputError, match="explain\\(\\) without tensors needs dtype, head_dim"):
        explain(seqlen_q=128)
    q, k, v = qkv()
    with pytest.raises(InvalidInputError, match="q, k and v together"):
        explain(q, k)
    with pytest.raises(InvalidInputError, match="heads_q \\(6\\) must be a multiple of heads_kv \\(4\\)"):
        explain(dtype="bf16", head_dim=64, seqlen_q=128, heads=6, kv_heads=4)
    with pytest.raises(InvalidInputError, match="seqlen_q must be a non-negative integer, got -1"):
        explain(dtype="bf16", head_dim=64, seqlen_q=-1)


def test_explain_accepts_torch_dtypes_and_names():
    for dtype in (torch.bfloat16, "bf16", "bfloat16", "torch.bfloat16"):
        assert explain(dtype=dtype, head_dim=64, seqlen_q=128).problem.dtype == "bf16"
    assert explain(dtype="e4m3", head_dim=64, seqlen_q=128).problem.dtype == "fp8"
    q, k, v = qkv()
    d = explain(q, k, v, device="H100", causal=True)
    assert d.problem.device.arch == "sm90" and d.problem.heads_q == 4 and d.problem.heads_kv == 2


@pytest.mark.parametrize("bad", [None, [[1.0]], 0.5])
def test_q_that_is_not_a_tensor_is_named(bad):
    """The FP8 check used to read q.dtype first: an AttributeError instead of the validation's message."""
    _, k, v = qkv()
    with pytest.raises(InvalidInputError, match=f"q must be a torch.Tensor, got {type(bad).__name__}"):
        attention(bad, k, v)


@pytest.mark.parametrize("causal", ["yes", 1, None, torch.tensor(True)])
def test_causal_must_be_a_bool(causal):
    with pytest.raises(InvalidInputError, match="causal must be a bool"):
        attention(*qkv(), causal=causal)
    with pytest.raises(InvalidInputError, match="is_causal must be a bool"):
        sdpa(*qkv(hkv=4), is_causal=causal)
    with pytest.raises(InvalidInputError, match="causal must be a bool"):
        explain(*qkv(), causal=causal)


def test_numpy_scalars_are_accepted():
    import numpy as np

    q, k, v = qkv()
    want = attention(q, k, v, scale=0.5, causal=True)
    for scale in (np.float32(0.5), np.float64(0.5), np.float16(0.5)):
        torch.testing.assert_close(attention(q, k, v, scale=scale, causal=np.bool_(True)), want, rtol=0, atol=0)
    with pytest.raises(InvalidInputError, match="scale must be a finite number or None"):
        attention(q, k, v, scale=np.float32("inf"))


@pytest.mark.parametrize(("mask", "message"), [
    (lambda: torch.ones(8, 8, dtype=torch.int64), r"attn_mask must be a bool tensor or of float32 or query's dtype \(torch.float16\), got torch.int64"),
    (lambda: torch.zeros(8, 8, dtype=torch.float64), r"attn_mask must be a bool tensor .* got torch.float64"),
    (lambda: torch.ones(8, dtype=torch.bool), r"attn_mask must have 2 to 4 dimensions .* got shape \(8\)"),
    (lambda: torch.ones(1, 1, 1, 8, 8, dtype=torch.bool), r"attn_mask must have 2 to 4 dimensions"),
    (lambda: torch.ones(8, 7, dtype=torch.bool), r"attn_mask of shape \(8, 7\) does not broadcast to \(batch, heads, seqlen_q, seqlen_k\) = \(1, 4, 8, 8\)"),
    (lambda: torch.ones(3, 1, 8, 8, dtype=torch.bool), r"attn_mask of shape \(3, 1, 8, 8\) does not broadcast"),
    (lambda: torch.ones(8, 8, dtype=torch.bool, device="meta"), r"attn_mask is on meta but query is on cpu"),
    (lambda: [[True] * 8] * 8, r"attn_mask must be a torch.Tensor or None, got list"),
])
def test_bad_sdpa_masks_are_named(mask, message):
    q, k, v = qkv(hkv=4, dtype=torch.float16)
    with pytest.raises(InvalidInputError, match=message):
        sdpa(q, k, v, attn_mask=mask())


def test_good_sdpa_masks_are_accepted():
    q, k, v = qkv(hkv=4, dtype=torch.float16)
    for mask in (torch.zeros(8, 8), torch.zeros(4, 1, 8, dtype=torch.float16), torch.ones(1, 8, 8, dtype=torch.bool)):
        torch.testing.assert_close(sdpa(q, k, v, attn_mask=mask),
                                   torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_fp8_calls_with_a_k_that_is_not_a_tensor_are_named():
    q = torch.randn(1, 2, 8, 16).to(torch.float8_e4m3fn)
    with pytest.raises(InvalidInputError, match="k must be a torch.Tensor, got NoneType"):
        attention(q, None, q)
    with pytest.raises(InvalidInputError, match="q must be a torch.Tensor, got NoneType"):
        attention(None, q, q, q_descale=torch.ones(1, 2))

"""Bad input gets a clear error that names the problem."""

import pytest
import torch

from attnforge import InvalidInputError, UnknownNameError, attention, explain


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

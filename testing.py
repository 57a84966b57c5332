"""Helpers for checking attention numerics, shared by attnforge's tests, bench and demo.

The rule (FlashAttention's tests use the same idea): a backend's error against the fp64 oracle may
be at most ``factor`` times PyTorch's own error computing the same thing in the same dtype, plus a
few units of that dtype's rounding. So the tolerance follows the dtype instead of being loosened
by hand, and NaN never passes.
"""

from __future__ import annotations

import torch

from .backends.reference import math_attention


def rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| (Frobenius) in fp64; 0 when both are empty or zero."""
    diff, norm = (x.double() - ref.double()).norm().item(), ref.double().norm().item()
    return diff / norm if norm else diff


def oracle(q, k, v, *, causal: bool = False, mask=None, scale: float | None = None, dout: torch.Tensor | None = None,
           dlse: torch.Tensor | None = None, softcap: float = 0.0, sinks: torch.Tensor | None = None,
           alibi_slopes: torch.Tensor | None = None):
    """fp64 math on the given (already rounded) inputs: (out, lse) and, with ``dout``, (dq, dk, dv) (with
    ``dlse`` too, the gradients of both outputs; with ``sinks``, dsinks as a fourth); ``softcap`` caps the
    scores, ``sinks`` (heads_q,) adds a logit per head to each row's softmax."""
    q64, k64, v64 = (t.detach().double().requires_grad_(dout is not None) for t in (q, k, v))
    s64 = None if sinks is None else sinks.detach().double().requires_grad_(dout is not None)
    slopes = None if alibi_slopes is None else alibi_slopes.detach().double()
    out, lse = math_attention(q64, k64, v64, causal=causal, mask=mask, scale=scale, softcap=softcap, sinks=s64,
                              alibi_slopes=slopes)
    inputs = (q64, k64, v64) if s64 is None else (q64, k64, v64, s64)
    grads = None if dout is None else _grads(out, lse, inputs, dout.double(), dlse)
    return out.detach(), lse.detach(), grads


def _grads(out, lse, inputs, dout, dlse):
    if dlse is None:
        return torch.autograd.grad(out, inputs, dout)
    return torch.autograd.grad((out, lse), inputs, (dout, dlse.to(lse.dtype)))


def peer_error(q, k, v, *, causal: bool = False, mask=None, scale: float | None = None, dout: torch.Tensor | None = None,
               dlse: torch.Tensor | None = None, softcap: float = 0.0, sinks: torch.Tensor | None = None,
               alibi_slopes: torch.Tensor | None = None):
    """PyTorch's own materialised attention in the inputs' dtype: (out, grads) to measure that
    dtype's inherent error against the oracle (``dlse``: the LSE's gradient as well)."""
    qs, ks, vs = (t.detach().clone().requires_grad_(dout is not None) for t in (q, k, v))
    ss = None if sinks is None else sinks.detach().clone().to(q.dtype).requires_grad_(dout is not None)
    slopes = None if alibi_slopes is None else alibi_slopes.detach().to(q.dtype)
    out, lse = math_attention(qs, ks, vs, causal=causal, mask=mask, scale=scale, softcap=softcap, sinks=ss,
                              alibi_slopes=slopes)
    grads = None if dout is None else _grads(out, lse, (qs, ks, vs) if ss is None else (qs, ks, vs, ss), dout, dlse)
    return out.detach(), grads


def assert_close(name: str, x: torch.Tensor, ref: torch.Tensor, peer: torch.Tensor, *, factor: float = 2.0,
                 ulps: float = 4.0) -> None:
    """Assert max|x - ref| <= factor * max|peer - ref| + ulps * eps(dtype) * max(max|ref|, 1) where ref is
    finite, the same infinities (an LSE of -inf) where it is not, and no NaN."""
    assert x.shape == ref.shape, f"{name}: shape {tuple(x.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(x).any(), f"{name}: NaN in result"
    finite = torch.isfinite(ref)
    assert torch.equal(x[~finite].double(), ref[~finite].double()), f"{name}: infinities differ from the oracle's"
    x, ref, peer = x[finite], ref[finite], peer[finite]
    if ref.numel() == 0:
        return
    err, bound, peer_err = error_and_bound(x, ref, peer, factor=factor, ulps=ulps)
    assert err <= bound, f"{name}: max error {err:.3e} > {bound:.3e} (PyTorch's own error in {x.dtype}: {peer_err:.3e})"


def error_and_bound(x: torch.Tensor, ref: torch.Tensor, peer: torch.Tensor, *, factor: float = 2.0,
                    ulps: float = 4.0) -> tuple[float, float, float]:
    """assert_close's rule as numbers: (max|x - ref|, its bound, max|peer - ref|), the bound being
    factor * max|peer - ref| + ulps * eps(x's dtype) * max(max|ref|, 1). For finite, non-empty ref."""
    err = (x.double() - ref.double()).abs().max().item()
    peer_err = (peer.double() - ref.double()).abs().max().nan_to_num(float("inf")).item()
    # The floor is a few units of rounding at the result's scale, at least unit scale: an exactly-zero
    # reference (dq when a row sees one key) still leaves fp32 rounding of O(1) intermediates.
    bound = factor * peer_err + ulps * torch.finfo(x.dtype).eps * max(ref.abs().max().item(), 1.0)
    return err, bound, peer_err


def fp8_peer(q, k, v, *, causal: bool = False, mask=None, scale: float | None = None, p_scale: float = 256.0) -> torch.Tensor:
    """The error an FP8 P @ V cannot avoid, computed by PyTorch: fp64 math on the (dequantised) inputs
    except that P, scaled by ``p_scale`` as FP8 kernels do, is rounded to e4m3 before P @ V. Its error
    against ``oracle`` is FP8 attention's inherent error (~3.6% relative for N(0,1) values: e4m3 keeps
    3 mantissa bits)."""
    from .backends.reference.kernels import math_probabilities

    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    p, _ = math_probabilities(q64, k64, causal=causal, mask=mask, scale=scale)
    p = (p * p_scale).float().to(torch.float8_e4m3fn).double() / p_scale
    return p @ v64.repeat_interleave(q64.shape[1] // k64.shape[1], 1)


def needs_gpu(capability: tuple[int, int], name: str):
    """A pytest skipif mark for tests that need a GPU of this compute capability; the reason says so."""
    import pytest

    have = torch.cuda.is_available() and torch.cuda.get_device_capability() == capability
    return pytest.mark.skipif(not have, reason=f"needs an {name} GPU")


def run_interpreter_tests(folder) -> None:
    """Run the pytest files in ``folder`` (or that one file) in a process of their own with TRITON_INTERPRET=1 (Triton reads
    the variable when kernels are decorated, so it cannot be switched on inside a running process);
    fail with the tail of their output unless they all pass and none is skipped."""
    import os
    import pathlib
    import subprocess
    import sys

    folder = pathlib.Path(folder)
    ini = next(p / "pytest.ini" for p in folder.parents if (p / "pytest.ini").is_file())
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(ini), str(folder)],
                         env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=1800)
    tail = "\n".join(run.stdout.splitlines()[-40:]) + run.stderr[-2000:]
    assert run.returncode == 0, tail
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], tail


def sees(mask, seqlen_q: int, seqlen_k: int, device="cpu") -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool: whether query row i sees key j under ``mask`` (a dispatch.mask.Mask)."""
    rows = torch.arange(seqlen_q, device=device)[:, None]
    cols = torch.arange(seqlen_k, device=device)[None, :]
    hidden = mask.hidden(rows, cols, seqlen_q, seqlen_k)
    return torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device) if hidden is None else ~hidden


def assert_grads_close(grads, ref_grads, peer_grads, q, k, v, dout, mask, scale: float, ulps: float) -> None:
    """assert_close for (dq, dk, dv) of (batch, heads, seqlen, dim) inputs, except where a row sees exactly one
    key: there P = 1, dS = P (dP - delta) is exactly 0 and that row's dq (and the key's dk) is pure cancellation
    for any LSE-based backward (delta = rowsum(dO * O) against dP = dO V^T), while PyTorch's autograd cancels
    exactly. Those are bounded by the cancellation's rounding, ulps * eps * scale * max|dO||V| * max|K| (|Q|)."""
    one_key = sees(mask, q.shape[2], k.shape[2], q.device).sum(-1) == 1  # (seqlen_q,)
    group = q.shape[1] // k.shape[1]
    eps = torch.finfo(grads[0].dtype).eps
    dp = (dout.abs().double() @ v.detach().abs().double().repeat_interleave(group, 1).transpose(-1, -2)).max()
    for name, g, r, p in zip(("dq", "dk", "dv"), grads, ref_grads, peer_grads):
        if name == "dv" or not one_key.any():
            assert_close(name, g, r, p, ulps=ulps)
            continue
        other = (k if name == "dq" else q).detach().abs().max().double()
        bound = ulps * eps * scale * dp * other
        if name == "dq":
            keep = ~one_key
            if keep.any():
                assert_close(name, g[:, :, keep], r[:, :, keep], p[:, :, keep], ulps=ulps)
            loose = g[:, :, one_key]
            assert not loose.isnan().any() and (loose - r[:, :, one_key]).abs().max() <= bound, name
        else:  # a key's dk sums over rows, some of which may see only it
            assert not g.isnan().any() and (g - r).abs().max() <= max(bound, error_and_bound(g, r, p, ulps=ulps)[1]), name


def assert_nan_rows(name: str, x: torch.Tensor, ref: torch.Tensor, peer: torch.Tensor, nan_rows: torch.Tensor,
                    **tolerance) -> None:
    """x, an output (batch, heads, seqlen_q, d) or an LSE (batch, heads, seqlen_q), is NaN in every element of
    the rows ``nan_rows`` (bool, broadcast to (batch, heads, seqlen_q)) and nowhere else; elsewhere it matches
    ``ref`` as assert_close says. The oracle must agree on where the NaN are: a NaN is neither hidden as a
    masked row (0, LSE -inf) nor spread to rows that do not see it."""
    want = nan_rows.to(x.device)
    want = (want[..., None] if x.dim() == 4 else want).expand(x.shape)
    assert torch.equal(ref.isnan().to(x.device), want), f"{name}: the oracle's NaN are not in the rows expected"
    got = x.isnan()
    assert torch.equal(got, want), (f"{name}: {int((got & ~want).sum())} NaN elements where none was expected, "
                                    f"{int((want & ~got).sum())} expected NaN elements are not NaN")
    assert_close(name, x[~want], ref.to(x.device)[~want], peer.to(x.device)[~want], **tolerance)


def poison(q, k, v, tensor: str, index: int, mask):
    """Copies of q, k, v (batch, heads, seqlen, d) with NaN in row ``index`` of ``tensor`` ("q", "k" or "v"),
    batch 0, head 0, and the (batch, heads_q, seqlen_q) bool rows that exact math makes NaN under ``mask``:
    that query row if it sees any key; for a key or value, the rows of kv head 0's query heads that see it.
    Measure PyTorch's own error (peer_error) on the clean inputs: its materialised P @ V carries a NaN value to
    every row (0 * NaN), and an infinite peer error would let any answer pass."""
    q, k, v = (t.detach().clone() for t in (q, k, v))
    visible = sees(mask, q.shape[2], k.shape[2], q.device)
    rows = torch.zeros(q.shape[:3], dtype=torch.bool, device=q.device)
    target = {"q": q, "k": k, "v": v}[tensor]
    target[0, 0, index] = float("nan")
    if tensor == "q":
        rows[0, 0, index] = visible[index].any()
    else:
        rows[0, :q.shape[1] // k.shape[1]] = visible[:, index]
    return q, k, v, rows

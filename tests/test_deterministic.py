"""deterministic=True (FlashAttention's flag): only backwards that sum in a fixed order serve it, the others are
rejected with the reason, the Decision says whether the chosen backward is bitwise reproducible, and the default
keeps the fastest backward."""

import pytest
import torch

import attnforge
from attnforge import InvalidInputError, explain
from attnforge.dispatch import select


def test_forcing_cute_sm90_with_deterministic_takes_its_reproducible_kernel():
    d = explain(device="H100", dtype="bf16", head_dim=128, seqlen_q=2048, heads=8, needs_grad=True,
                backend="cute_sm90", deterministic=True)
    assert d.forward.backend == "cute_sm90" and d.backward.backend == "cute_sm90"
    assert d.backward.variant.deterministic and "key-block order" in d.backward.variant.describe()
    assert d.backward.note == "bitwise reproducible (dQ summed in key-block order)"
    default = explain(device="H100", dtype="bf16", head_dim=128, seqlen_q=2048, heads=8, needs_grad=True,
                      backend="cute_sm90")
    assert default.backward.backend == "cute_sm90" and not default.backward.variant.deterministic
    assert default.backward.note == "not bitwise reproducible (deterministic=True: dQ summed in key-block order)"


def test_the_note_does_not_offer_a_deterministic_kernel_that_would_not_serve():
    """A windowed call: cute_sm90's deterministic backward has no window, so the note of its default backward says
    that deterministic=True takes another backend's backward, and why, instead of offering its own."""
    d = explain(device="H100", dtype="bf16", head_dim=128, seqlen_q=2048, heads=8, needs_grad=True,
                backend="cute_sm90", causal=True, window_size=(255, 0))
    assert d.backward.backend == "cute_sm90" and d.backward.variant.window
    assert d.backward.note == ("not bitwise reproducible (deterministic=True takes another backend's backward: its "
                               "deterministic backward has no sliding window (the default one has))")
    fixed = explain(device="H100", dtype="bf16", head_dim=128, seqlen_q=2048, heads=8, needs_grad=True,
                    backend="cute_sm90", causal=True, window_size=(255, 0), deterministic=True)
    assert fixed.backward.backend == "triton_fa2" and fixed.backward.note == "bitwise reproducible"


def test_forcing_cute_sm90_with_deterministic_where_its_backward_does_not_serve():
    """d=192 with a window has no cute_sm90 backward (its 256 kernel has no WINDOW form): the next backward that is
    reproducible (triton_fa2's, no atomics) runs."""
    d = explain(device="H100", dtype="bf16", head_dim=192, seqlen_q=2048, heads=8, needs_grad=True,
                backend="cute_sm90", causal=True, window_size=(255, 0), deterministic=True)
    assert d.forward.backend == "cute_sm90" and d.backward.backend == "triton_fa2"
    assert d.backward.note == "bitwise reproducible"


@pytest.mark.cost_tables
def test_auto_training_leaves_sdpa_whose_backward_is_torchs():
    select.decide.cache_clear()
    shape = dict(device="H100", dtype="bf16", head_dim=128, seqlen_q=1024, batch=16, heads=16, causal=True,
                 needs_grad=True)
    assert explain(**shape).forward.backend == "sdpa"  # the measured fastest pair at N=1k causal
    d = explain(**shape, deterministic=True)
    assert d.ok and d.forward.backend != "sdpa" and d.backward.note.startswith("bitwise reproducible")
    (reason,) = d.forward.reasons_of("sdpa")
    assert reason.startswith("deterministic=True: its backward is not bitwise reproducible (torch's SDPA kernel")
    assert "deterministic" in d.problem.describe()


def _where_the_cute_pair_measured_fastest() -> dict:
    """explain() arguments for the shipped sm90 table's longest bf16 d=128 causal class whose fastest measured
    training pair is cute_sm90's: the test follows the table rather than one shape it held once."""
    from attnforge.dispatch import costs

    best = {}
    for e in costs.table("sm90").entries:
        if (e.mode, e.dtype, e.head_dim, e.causal) == ("fwd+bwd", "bf16", 128, True) and e.seqlen_q == e.seqlen_k:
            key = (e.seqlen_q, e.batch, e.heads_q, e.heads_kv)
            if key not in best or e.tflops > best[key].tflops:
                best[key] = e
    (n, batch, heads, kv_heads), _ = max((item for item in best.items() if item[1].plan == "cute_sm90+cute_sm90"),
                                         key=lambda item: item[0])
    return dict(device="H100", dtype="bf16", head_dim=128, seqlen_q=n, batch=batch, heads=heads, kv_heads=kv_heads,
                causal=True, needs_grad=True)


@pytest.mark.cost_tables
def test_auto_training_takes_cute_sm90s_deterministic_kernel_where_its_pair_measured_fastest():
    """Where the shipped table measured cute_sm90's forward and backward the fastest pair, deterministic=True keeps
    the pair, with the kernel that adds dQ in key-block order."""
    select.decide.cache_clear()
    shape = _where_the_cute_pair_measured_fastest()
    default = explain(**shape)
    assert (default.forward.backend, default.backward.backend) == ("cute_sm90", "cute_sm90")
    assert not default.backward.variant.deterministic
    d = explain(**shape, deterministic=True)
    assert (d.forward.backend, d.backward.backend) == ("cute_sm90", "cute_sm90") and d.backward.variant.deterministic
    assert d.backward.note == "bitwise reproducible (dQ summed in key-block order)"


def test_inference_is_unaffected():
    shape = dict(device="H100", dtype="bf16", head_dim=128, seqlen_q=16384, heads=16, causal=True)
    assert explain(**shape, deterministic=True).forward == explain(**shape).forward


def test_a_deterministic_cpu_step_is_bitwise_reproducible(gen):
    q, k, v = (torch.randn(2, 4, 67, 32, generator=gen).requires_grad_() for _ in range(3))
    dout = torch.randn(2, 4, 67, 32, generator=gen)
    grads = []
    for _ in range(2):
        out = attnforge.attention(q, k, v, causal=True, deterministic=True)
        grads.append(torch.autograd.grad(out, (q, k, v), dout))
    d = attnforge.last_decision()
    assert d.backward.backend == "reference" and d.backward.note == "bitwise reproducible"
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    ref = torch.autograd.grad(attnforge.attention(q, k, v, causal=True), (q, k, v), dout)  # the default path
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grads[0], ref))


@pytest.mark.parametrize("value", ("yes", 1, None))
def test_deterministic_must_be_a_bool(value, gen):
    q = torch.randn(1, 1, 4, 8, generator=gen)
    with pytest.raises(InvalidInputError, match="deterministic must be a bool"):
        attnforge.attention(q, q, q, deterministic=value)


@pytest.mark.parametrize("feature", [dict(softcap=30.0), dict(alibi=True)])
def test_deterministic_training_with_softcap_or_alibi_takes_triton_fa2s_backward(feature):
    """cute_sm90's deterministic backward has no softcap or ALiBi (the default one has): deterministic=True takes
    triton_fa2's (bitwise reproducible) and the Decision says why."""
    shape = dict(device="H100", dtype="bf16", head_dim=128, seqlen_q=2048, heads=8, needs_grad=True, causal=True)
    assert explain(**shape, **feature).backward.backend == "cute_sm90"
    fixed = explain(**shape, **feature, deterministic=True)
    assert fixed.backward.backend == "triton_fa2" and fixed.backward.note == "bitwise reproducible"
    assert fixed.backward.reasons_of("cute_sm90") == (
        "its deterministic backward has no softcap or ALiBi (the default one has)",)


@pytest.fixture(params=[False, True], ids=["strict", "warn_only"])
def torch_deterministic_algorithms(request):
    """torch.use_deterministic_algorithms(True) for the test (strict or warn_only), restored after it."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=request.param)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_torchs_deterministic_flag_binds_training_as_deterministic_true_does(torch_deterministic_algorithms):
    """Under torch.use_deterministic_algorithms(True), as torch's own SDPA kernels do, a call that needs a backward
    takes a bitwise reproducible one: cute_sm90 forced runs its key-block-order kernel, and the Decision says why."""
    shape = dict(device="H100", dtype="bf16", head_dim=128, seqlen_q=2048, heads=8, needs_grad=True)
    d = explain(**shape, backend="cute_sm90")
    assert d.problem.deterministic and d.problem.torch_deterministic
    assert d.backward.backend == "cute_sm90" and d.backward.variant.deterministic
    assert d.backward.note == "bitwise reproducible (dQ summed in key-block order)"
    assert "deterministic (torch)" in d.problem.describe()
    inference = explain(**{**shape, "needs_grad": False}, backend="cute_sm90")
    assert not inference.problem.deterministic and not inference.problem.torch_deterministic


@pytest.mark.cost_tables
def test_torchs_deterministic_flag_leaves_sdpa_to_torchs_rules(torch_deterministic_algorithms):
    """deterministic=True refuses sdpa (its backward's order is torch's to choose), but under torch's own flag torch
    chooses a reproducible one (or refuses), so sdpa stays: the shape where the table measured sdpa's pair fastest
    keeps it, with the note saying so, while cute_sm90 forced there takes its deterministic kernel."""
    select.decide.cache_clear()
    shape = dict(device="H100", dtype="bf16", head_dim=128, seqlen_q=1024, batch=16, heads=16, causal=True,
                 needs_grad=True)
    d = explain(**shape)
    assert (d.forward.backend, d.backward.backend) == ("sdpa", "sdpa")
    assert d.backward.note == ("torch autograd through its forward, as torch.use_deterministic_algorithms(True) has "
                               "torch's kernels run it")
    cute = explain(**shape, backend="cute_sm90")
    assert cute.backward.variant.deterministic


def test_torchs_deterministic_flag_on_a_cpu_step(torch_deterministic_algorithms, gen):
    """attention() with grad under torch's flag: the Decision is recorded as deterministic (torch), the gradients
    are bitwise reproducible, and once the flag is off the same call signature decides afresh."""
    q, k, v = (torch.randn(2, 4, 67, 32, generator=gen).requires_grad_() for _ in range(3))
    dout = torch.randn(2, 4, 67, 32, generator=gen)
    grads = [torch.autograd.grad(attnforge.attention(q, k, v, causal=True), (q, k, v), dout) for _ in range(2)]
    d = attnforge.last_decision()
    assert d.problem.deterministic and d.problem.torch_deterministic
    assert d.backward.note in ("bitwise reproducible", "torch autograd through its forward, as "
                               "torch.use_deterministic_algorithms(True) has torch's kernels run it")
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    with torch.no_grad():
        attnforge.attention(q, k, v, causal=True)
    assert not attnforge.last_decision().problem.torch_deterministic
    torch.use_deterministic_algorithms(False)
    attnforge.attention(q, k, v, causal=True)
    assert not attnforge.last_decision().problem.deterministic


def test_torchs_deterministic_flag_binds_packed_training(torch_deterministic_algorithms, gen):
    q, k, v = (torch.randn(40, 2, 32, generator=gen).requires_grad_() for _ in range(3))
    cu = torch.tensor([0, 17, 40], dtype=torch.int32)
    attnforge.attention_varlen(q, k, v, cu, cu, 23, 23, causal=True)
    d = attnforge.last_decision()
    assert d.problem.varlen and d.problem.deterministic and d.problem.torch_deterministic

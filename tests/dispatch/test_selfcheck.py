"""The self-check on first use: a deliberately broken variant is caught, the call still gets the right
answer through the fallback, and the Decision and the log say why; verdicts persist per machine."""

import logging

import pytest
import torch

import attnforge
from attnforge.dispatch import registered, selfcheck
from attnforge.dispatch.mask import CAUSAL
from attnforge.dispatch.variant import TorchVariant
from attnforge.testing import oracle, rel_error


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNFORGE_CACHE_DIR", str(tmp_path))
    selfcheck.clear()
    yield tmp_path
    selfcheck.clear()


def broken_sdpa(monkeypatch):
    """sdpa's forward, but off by 10% (a stand-in for a kernel that compiles and runs and is wrong)."""
    sdpa = registered()["sdpa"]
    real = type(sdpa).forward

    def wrong(self, variant, call):
        out, lse = real(self, variant, call)
        return out * 1.1, lse

    monkeypatch.setattr(type(sdpa), "forward", wrong)


def test_broken_variant_is_caught_and_the_call_falls_back(fresh, monkeypatch, caplog, gen):
    broken_sdpa(monkeypatch)
    q, k, v = (torch.randn(1, 4, 37, 32, generator=gen) for _ in range(3))
    with caplog.at_level(logging.INFO, logger="attnforge"):
        out = attnforge.attention(q, k, v, causal=True)
    d = attnforge.last_decision()
    assert d.forward.backend == "reference" and d.fallback  # cpu prefers sdpa; reference took over
    (reason,) = d.forward.reasons_of("sdpa")
    assert reason.startswith("self-check failed: max error")
    assert rel_error(out, oracle(q, k, v, causal=True)[0]) < 1e-5  # the right answer all the same
    messages = [r.getMessage() for r in caplog.records]
    assert any("self-check of sdpa|" in m and "failed" in m for m in messages)
    assert any("-> reference instead of sdpa (self-check failed" in m for m in messages)
    # forcing the disabled backend raises with the reason, it is never silently replaced
    with pytest.raises(attnforge.BackendUnavailableError, match="self-check failed"):
        attnforge.attention(q, k, v, causal=True, backend="sdpa")


def test_verdicts_are_kept_per_machine_and_checks_run_once(fresh, monkeypatch, gen):
    q, k, v = (torch.randn(1, 2, 20, 16, generator=gen) for _ in range(3))
    attnforge.attention(q, k, v)
    assert len(selfcheck.costs) == 1 and selfcheck.costs[0][0].startswith("sdpa|")
    (record,) = (fresh / "selfcheck").glob("*.json")
    attnforge.dispatch.clear_caches()
    selfcheck.clear()  # a new process: the verdict comes from the disk, nothing runs
    attnforge.attention(q, k, v)
    assert selfcheck.costs == []
    broken_sdpa(monkeypatch)  # a good verdict on disk stands (the check runs once per machine and version)
    attnforge.dispatch.clear_caches()
    selfcheck.clear()  # another new process: only the record on disk knows
    assert attnforge.explain(q, k, v).forward.backend == "sdpa" and selfcheck.costs == []
    assert record.is_file()


def test_it_can_be_turned_off(fresh, monkeypatch, gen):
    monkeypatch.setenv("ATTNFORGE_SELFCHECK", "0")
    broken_sdpa(monkeypatch)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=gen) for _ in range(3))
    attnforge.attention(q, k, v)
    assert attnforge.last_decision().forward.backend == "sdpa" and selfcheck.costs == []


def test_profiles_are_never_self_checked(fresh):
    attnforge.explain(device="H100", dtype="bf16", head_dim=128, seqlen_q=4096)
    assert selfcheck.costs == []


class _FakeFp8Backend:
    """An FP8 'kernel' on the CPU: attention of the e4m3 inputs with P rounded to e4m3 (what an FP8 kernel
    computes), bf16 out; ``bias`` breaks it."""

    name, bias = "fake_fp8", 0.0

    def forward(self, variant, call):
        from attnforge.testing import fp8_peer

        assert variant == TorchVariant("fake")  # the variant checked is the one run
        q, k, v = call.q, call.k, call.v
        out = fp8_peer(q.float(), k.float(), v.float(), mask=call.mask, scale=call.scale)
        return (out + self.bias).to(torch.bfloat16), None


@pytest.mark.parametrize(("bias", "passes"), [(0.0, True), (0.05, False)])
def test_fp8_variants_are_judged_against_fp8_rounding_of_p(fresh, bias, passes):
    from attnforge.dispatch.device import detect
    from attnforge.dispatch.problem import Problem

    backend = _FakeFp8Backend()
    backend.bias = bias
    problem = Problem(1, 2, 1, 133, 161, 64, 64, "fp8", detect(torch.device("cpu")), mask=CAUSAL)
    reasons = selfcheck.reasons(backend, TorchVariant("fake"), problem)
    assert (reasons == ()) == passes, reasons
    assert selfcheck.costs and selfcheck.costs[-1][0] == selfcheck.key_of(backend, TorchVariant("fake"), problem)
    if not passes:
        assert reasons[0].startswith("self-check failed: relative error"), reasons

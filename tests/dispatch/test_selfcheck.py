"""The self-check on first use: a deliberately broken variant is caught, the call still gets the right
answer through the fallback, and the Decision and the log say why; verdicts persist per machine."""

import json
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


def raising_sdpa(monkeypatch, exc):
    """sdpa's forward raising ``exc`` (out of memory, a broken compiler cache: nothing about the kernel's numbers)."""
    def fail(self, variant, call):
        raise exc
    monkeypatch.setattr(type(registered()["sdpa"]), "forward", fail)


def test_an_exception_in_the_tiny_problem_disables_for_this_process_only(fresh, monkeypatch, gen):
    raising_sdpa(monkeypatch, RuntimeError("CUDA out of memory (stand-in)"))
    q, k, v = (torch.randn(1, 2, 20, 16, generator=gen) for _ in range(3))
    out = attnforge.attention(q, k, v)
    d = attnforge.last_decision()
    assert d.forward.backend == "reference" and d.fallback
    (reason,) = d.forward.reasons_of("sdpa")
    assert reason.startswith("self-check could not run: the tiny problem raised RuntimeError: CUDA out of memory")
    assert "retried by the next process" in reason
    assert rel_error(out, oracle(q, k, v)[0]) < 1e-5
    records = [json.loads(p.read_text()) for p in (fresh / "selfcheck").glob("*.json")]
    assert not any(key.startswith("sdpa|") for r in records for key in r), records  # nothing persisted
    monkeypatch.undo()  # the next process, with the trouble gone: checks again and serves with sdpa
    monkeypatch.setenv("ATTNFORGE_CACHE_DIR", str(fresh))
    attnforge.dispatch.clear_caches()
    selfcheck.clear()
    attnforge.attention(q, k, v)
    assert attnforge.last_decision().forward.backend == "sdpa"
    assert [key for key, _ in selfcheck.costs if key.startswith("sdpa|")]


def test_verdicts_of_another_software_stack_are_ignored(fresh, monkeypatch, gen):
    broken_sdpa(monkeypatch)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=gen) for _ in range(3))
    attnforge.attention(q, k, v)
    assert attnforge.last_decision().forward.backend == "reference"
    (path,) = (fresh / "selfcheck").glob("*.json")
    record = next(r for key, r in json.loads(path.read_text()).items() if key.startswith("sdpa|"))
    assert record["versions"] == selfcheck.versions() and record["versions"]["torch"] == torch.__version__
    assert set(record["versions"]) == {"attnforge", "torch", "triton", "nvidia-cutlass-dsl"}
    data = json.loads(path.read_text())
    for r in data.values():
        r["versions"]["torch"] = "0.0.1"  # reached with another torch
    path.write_text(json.dumps(data))
    monkeypatch.undo()
    monkeypatch.setenv("ATTNFORGE_CACHE_DIR", str(fresh))
    attnforge.dispatch.clear_caches()
    selfcheck.clear()
    attnforge.attention(q, k, v)
    assert attnforge.last_decision().forward.backend == "sdpa"  # checked anew, and it passes now
    assert any(key.startswith("sdpa|") for key, _ in selfcheck.costs)


@pytest.mark.parametrize("content", ["[]", "null", "42", '"x"', '{"%s": []}', '{"%s": null}', '{"%s": 42}',
                                     '{"%s": {"ok": "yes", "reasons": []}}', '{"%s": {"ok": false, "reasons": "x"}}',
                                     '{"%s": {"ok": true}}', '{"%s": {"ok": true, "reasons": [1]}}', "{not json"])
def test_verdict_files_of_any_shape_never_crash_dispatch(fresh, gen, content):
    from attnforge.dispatch.device import detect
    from attnforge.dispatch.problem import Problem

    q, k, v = (torch.randn(1, 2, 20, 16, generator=gen) for _ in range(3))
    problem = Problem(1, 2, 2, 20, 20, 16, 16, "fp32", detect(torch.device("cpu")))
    path = selfcheck._store_path(problem)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = selfcheck.key_of(registered()["sdpa"], registered()["sdpa"].plan(problem)[0], problem)
    path.write_text(content.replace("%s", key) if "%s" in content else content)
    out = attnforge.attention(q, k, v)
    assert rel_error(out, oracle(q, k, v)[0]) < 1e-5
    assert attnforge.last_decision().forward.backend == "sdpa"
    assert selfcheck.costs  # the bad record was no verdict: the check ran


@pytest.mark.parametrize("value", ["0", "OFF", "False", "0 ", " no", "Off\n"])
def test_selfcheck_off_in_any_case_and_spacing(fresh, monkeypatch, gen, value):
    monkeypatch.setenv("ATTNFORGE_SELFCHECK", value)
    assert not selfcheck.enabled()
    broken_sdpa(monkeypatch)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=gen) for _ in range(3))
    attnforge.attention(q, k, v)
    assert attnforge.last_decision().forward.backend == "sdpa" and selfcheck.costs == []


@pytest.mark.parametrize("value", ["1", "on", "yes", "", "anything"])
def test_selfcheck_stays_on_otherwise(monkeypatch, value):
    monkeypatch.setenv("ATTNFORGE_SELFCHECK", value)
    assert selfcheck.enabled()


def test_a_cpu_call_under_a_meta_default_device_works_on_first_use(fresh, gen):
    """The tiny problem's inputs are made on the call's device, not on torch's ambient default device."""
    q, k, v = (torch.randn(1, 2, 37, 16, generator=gen) for _ in range(3))
    with torch.device("meta"):
        out = attnforge.attention(q, k, v, causal=True)
    assert out.device.type == "cpu"
    assert rel_error(out, oracle(q, k, v, causal=True)[0]) < 1e-5
    d = attnforge.last_decision()
    assert d.forward.backend == "sdpa" and not d.forward.reasons_of("sdpa")
    assert any(key.startswith("sdpa|") for key, _ in selfcheck.costs)  # the check ran, and passed


def test_the_check_is_not_bound_by_an_enclosing_sdpa_kernel_context(monkeypatch, tmp_path):
    """An sdpa_kernel() that allows only a kernel the tiny problem cannot use (cuDNN on the CPU) must not
    disable sdpa: the check runs with every torch kernel allowed."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attnforge.dispatch import registered, selfcheck
    from attnforge.dispatch.problem import Problem
    from attnforge.dispatch.device import detect

    monkeypatch.setenv("ATTNFORGE_CACHE_DIR", str(tmp_path))
    selfcheck.clear()
    problem = Problem(batch=1, heads_q=2, heads_kv=1, seqlen_q=5, seqlen_k=7, head_dim=16, head_dim_v=16,
                      dtype="fp32", device=detect("cpu"))
    backend = registered()["sdpa"]
    variant, _ = backend.plan(problem)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        assert selfcheck.reasons(backend, variant, problem) == ()


class _FeatureBackend(attnforge.dispatch.registry.Backend):
    """The reference's kernels as a device backend; ``drops`` names a score feature it ignores (a kernel whose
    feature is broken)."""

    name, drops = "feature_check", None

    def forward(self, variant, call):
        if self.drops:
            call = call._replace(**{self.drops: 0.0 if self.drops == "softcap" else None})
        return registered()["reference"].forward(variant, call)


@pytest.mark.parametrize("feature", ["softcap", "sinks", "alibi"])
def test_the_tiny_problem_exercises_the_variants_score_features(fresh, feature):
    """A softcap, sinks or ALiBi variant is checked with that feature switched on (and verdicts are keyed by it):
    a kernel that ignores it fails, one that applies it passes."""
    import dataclasses

    from attnforge.dispatch.device import detect
    from attnforge.dispatch.problem import Problem

    plain = Problem(1, 2, 1, 133, 161, 64, 64, "fp32", detect(torch.device("cpu")), mask=CAUSAL)
    problem = dataclasses.replace(plain, **{feature: True})
    backend = _FeatureBackend()
    assert selfcheck.key_of(backend, TorchVariant("x"), problem) != selfcheck.key_of(backend, TorchVariant("x"), plain)
    assert selfcheck.reasons(backend, TorchVariant("x"), problem) == ()
    selfcheck.clear()
    backend.drops = {"alibi": "alibi_slopes"}.get(feature, feature)
    (reason,) = selfcheck.reasons(backend, TorchVariant("y"), problem)
    assert reason.startswith("self-check failed: max error"), reason


def checked_reference(monkeypatch, factor=1.0):
    """The reference backend under the self-check (it is the oracle, so normally exempt), its backward's
    gradients times ``factor``."""
    monkeypatch.setattr(selfcheck, "UNCHECKED", frozenset())
    reference = registered()["reference"]
    real = type(reference).backward

    def scaled(self, variant, call, out, lse, dout, dlse=None):
        return tuple(g * factor for g in real(self, variant, call, out, lse, dout, dlse))

    monkeypatch.setattr(type(reference), "backward", scaled)


def test_a_backward_variant_is_checked_on_first_use(fresh, monkeypatch, gen):
    checked_reference(monkeypatch)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=gen) for _ in range(3))
    d = attnforge.explain(q, k, v, causal=True, needs_grad=True, backend="reference")
    assert d.backward.backend == "reference"
    assert [key for key, _ in selfcheck.costs if key.startswith("bwd:reference|")], selfcheck.costs


@pytest.mark.parametrize("factor, passes", [(1.0, True), (1.1, False)])
def test_a_backward_first_met_with_grad_mode_off_is_still_judged(fresh, monkeypatch, gen, factor, passes):
    """A backward decided where grad mode is off (inside torch.no_grad(), or inside autograd's backward pass, as
    when a backward op decides its own plan) is judged like any other, not disabled by the oracle's autograd."""
    checked_reference(monkeypatch, factor)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=gen) for _ in range(3))
    with torch.no_grad():
        d = attnforge.explain(q, k, v, causal=True, needs_grad=True, backend="reference")
    if passes:
        assert d.backward.backend == "reference"
    else:
        assert d.backward.reasons_of("reference")[0].startswith("self-check failed: the backward's dq is off by")


def test_a_backward_first_met_inside_an_operator_is_still_judged(fresh, monkeypatch, gen):
    """A backward decided inside a torch.library operator's kernel (attnforge's own backward ops decide there), where
    the dispatcher has switched autograd off below its autograd key whatever grad mode says, is judged like any
    other, not disabled by the oracle's autograd."""
    checked_reference(monkeypatch, factor=1.0)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=gen) for _ in range(3))
    seen = []

    @torch.library.custom_op("attnforge_tests::decide_inside", mutates_args=())
    def decide_inside(x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            seen.append(attnforge.explain(q, k, v, causal=True, needs_grad=True, backend="reference"))
        return x.clone()

    decide_inside(q)
    assert seen[0].backward.backend == "reference", seen[0].backward.reasons_of("reference")


def test_a_wrong_backward_is_caught_and_forcing_it_says_why(fresh, monkeypatch, gen):
    checked_reference(monkeypatch, factor=1.1)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=gen).requires_grad_() for _ in range(3))
    d = attnforge.explain(q, k, v, causal=True, needs_grad=True, backend="reference")
    (reason,) = d.backward.reasons_of("reference")
    assert reason.startswith("self-check failed: the backward's dq is off by"), reason
    with pytest.raises(attnforge.BackendUnavailableError, match="no backend can run the backward"):
        attnforge.attention(q, k, v, causal=True, backend="reference")


def test_a_packed_batch_variant_is_checked_on_its_own_path(fresh, monkeypatch, gen):
    """A packed (varlen) batch runs a backend's packed path, which its dense check does not cover: its tiny problem
    runs packed (one sequence), so a broken packed path is caught while the dense one stays in service."""
    sdpa = type(registered()["sdpa"])
    real = sdpa._packed
    monkeypatch.setattr(sdpa, "_packed", lambda self, variant, call: real(self, variant, call) * 1.1)
    lengths = [5, 0, 40]
    q = torch.randn(sum(lengths), 4, 32, generator=gen)
    k, v = (torch.randn(sum(lengths), 2, 32, generator=gen) for _ in range(2))
    cu = torch.tensor([0, 5, 5, 45], dtype=torch.int32)
    out = attnforge.attention_varlen(q, k, v, cu, cu, 40, 40, causal=True)
    d = attnforge.last_decision()
    assert d.forward.backend == "reference" and d.forward.reasons_of("sdpa")[0].startswith("self-check failed")
    ref, _, _ = oracle(q[5:].transpose(0, 1)[None], k[5:].transpose(0, 1)[None], v[5:].transpose(0, 1)[None],
                       causal=True)
    assert rel_error(out[5:], ref[0].transpose(0, 1)) < 1e-5
    attnforge.attention(q[None, :5].transpose(1, 2), k[None, :5].transpose(1, 2), v[None, :5].transpose(1, 2))
    assert attnforge.last_decision().forward.backend == "sdpa"  # the dense path passed its own check


@pytest.mark.parametrize("kv_cache, page_size", [("contiguous", 0), ("paged", 16), ("paged", 50), ("paged", 256)])
def test_a_kv_cache_variant_is_judged_on_a_cache_with_nan_past_the_keys(kv_cache, page_size):
    """The tiny KV-cache problem's cache holds NaN past its keys (in rows, or pages of the problem's page size, the
    last one part-filled): the reference, which reads only each sequence's positions, passes; a kernel that lets a
    position past the length in (here: the reference told every row is full) is caught."""
    problem = attnforge.explain(device="cpu", dtype="fp32", head_dim=32, seqlen_q=7, seqlen_k=64, kv_cache=kv_cache,
                                page_size=page_size, backend="reference").problem
    reference = registered()["reference"]
    variant, _ = reference.plan(problem)
    assert selfcheck._run(reference, variant, problem) == ()

    class ReadsPastTheKeys(type(reference)):
        def forward(self, variant, call):
            capacity = call.k.shape[2] * (call.cache.block_table.shape[1] if call.cache.block_table is not None else 1)
            full = call.cache._replace(seqlens=torch.full_like(call.cache.seqlens, capacity))
            return super().forward(variant, call._replace(cache=full))

    assert selfcheck._run(ReadsPastTheKeys(), variant, problem) == (
        "self-check failed: NaN or inf in the output of a tiny problem",)

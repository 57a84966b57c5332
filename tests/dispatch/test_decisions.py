"""Decisions for every profile x dtype x head dim, checked against what the backends declare."""

import json
import logging

import pytest

import attnforge
from attnforge import BackendUnavailableError, UnknownNameError, explain, use_backend
from attnforge.dispatch import PROFILES, decide, priority, registered
from attnforge.dispatch.decision import ABSENT, CHOSEN, ELIGIBLE, REJECTED

DTYPES = ("fp16", "bf16", "fp32", "fp8")
HEAD_DIMS = (64, 128, 256, 512)


@pytest.mark.parametrize("device", PROFILES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("needs_grad", (False, True))
def test_decision_matrix_follows_declarations(device, dtype, head_dim, needs_grad):
    d = explain(device=device, dtype=dtype, head_dim=head_dim, seqlen_q=1024, heads=8, kv_heads=2,
                causal=True, needs_grad=needs_grad)
    built = registered()
    assert [c.backend for c in d.forward.candidates] == list(priority(PROFILES[device]))
    assert d.preferred == priority(PROFILES[device])[0]
    seen_chosen = False
    for c in d.forward.candidates:
        if c.backend not in built:
            assert c.verdict == ABSENT and c.reasons == ("not in this build of attnforge",)
            continue
        declared = built[c.backend].supports(d.problem) or built[c.backend].passed_over(d.problem)
        if declared:  # every rejection carries the backend's own sentences, and nothing is skipped
            assert c.verdict == REJECTED and list(c.reasons) == declared
            assert all(isinstance(r, str) and len(r) > 10 for r in c.reasons)
        else:
            assert c.verdict == (ELIGIBLE if seen_chosen else CHOSEN)
            seen_chosen = True
    assert (d.forward.backend is not None) == seen_chosen
    assert d.fallback == (d.forward.backend != d.preferred)
    if needs_grad and d.forward.backend:
        assert d.backward is not None and d.backward.backend is not None
    else:
        assert (d.backward is None) == (not needs_grad)
    json.dumps(d.to_dict())  # JSON-ready


@pytest.mark.parametrize("device", PROFILES)
def test_fp8_is_served_on_hopper_only_and_refused_with_reasons_elsewhere(device):
    d = explain(device=device, dtype="fp8", head_dim=128, seqlen_q=4096)
    if PROFILES[device].arch == "sm90":
        assert d.forward.backend == "cute_sm90" and d.ok
        return
    assert d.forward.backend is None and not d.ok
    for c in d.forward.candidates:
        if c.verdict == REJECTED:
            assert any("dtype fp8 is not supported" in r for r in c.reasons)
    assert "NONE: no backend can serve this" in str(d)


def test_h100_fp32_shows_the_fallback_and_why():
    d = explain(device="H100", dtype="fp32", head_dim=128, seqlen_q=4096, heads=32, kv_heads=8)
    assert d.forward.backend == "sdpa" and d.fallback and d.preferred == "cute_sm90"
    text = str(d)
    assert "fallback: cute_sm90 is preferred on sm90 but dtype fp32 is not supported; supports bf16, fp16, fp8" in text
    assert "kernel chosen by torch at run time (device not present to ask)" in text


def test_cpu_gets_sdpa_without_fallback_and_reference_for_lse():
    d = explain(device="cpu", dtype="bf16", head_dim=64, seqlen_q=128)
    assert d.forward.backend == "sdpa" and not d.fallback
    d = explain(device="cpu", dtype="bf16", head_dim=64, seqlen_q=128, return_lse=True)
    assert d.forward.backend == "reference" and d.fallback
    assert d.forward.reasons_of("sdpa") == ("return_lse=True is not supported (it does not give the LSE)",)


def test_dropout_goes_to_sdpa_and_reference_says_why():
    d = explain(device="A100", dtype="bf16", head_dim=64, seqlen_q=128, dropout_p=0.1, return_lse=True)
    assert d.forward.backend is None
    assert d.forward.reasons_of("reference") == ("dropout_p > 0 is not supported",)
    d = explain(device="A100", dtype="bf16", head_dim=64, seqlen_q=128, dropout_p=0.1)
    assert d.forward.backend == "sdpa"


def test_backward_is_decided_and_recorded():
    d = explain(device="cpu", dtype="fp32", head_dim=64, seqlen_q=128, needs_grad=True, return_lse=True)
    assert d.forward.backend == "reference" and d.backward.backend == "reference"
    assert d.backward.reasons_of("sdpa")[0].startswith("its backward is torch autograd")
    d = explain(device="cpu", dtype="fp32", head_dim=64, seqlen_q=128, needs_grad=True)
    assert d.backward.backend == "sdpa" and d.backward.variant is None
    assert d.backward.describe() == "torch autograd through its forward, not bitwise reproducible"
    assert "backward: sdpa" in str(d)


def test_empty_problems_go_to_reference():
    d = explain(device="H100", dtype="bf16", head_dim=64, seqlen_q=16, seqlen_k=0)
    assert d.forward.backend == "reference"
    assert "empty problem" in d.forward.reasons_of("sdpa")[0]


def test_forced_backend_that_cannot_serve_raises_with_reasons():
    with use_backend("sdpa"):
        d = explain(device="cpu", dtype="bf16", head_dim=64, seqlen_q=128, return_lse=True)
        assert d.forward.backend is None and d.how == "forced by use_backend()"
        assert [c.backend for c in d.forward.candidates] == ["sdpa"]  # never silently replaced
    import torch
    q = torch.randn(1, 1, 8, 16)
    with pytest.raises(BackendUnavailableError, match="return_lse=True is not supported"):
        attnforge.attention(q, q, q, return_lse=True, backend="sdpa")
    with pytest.raises(BackendUnavailableError, match="cute_sm100 +rejected +device cpu"):
        attnforge.attention(q, q, q, backend="cute_sm100")
    with pytest.raises(BackendUnavailableError, match="cute_sm90 +rejected +device cpu"):
        attnforge.attention(q, q, q, backend="cute_sm90")


def test_forcing_precedence_argument_then_context_then_env(monkeypatch):
    kw = dict(device="cpu", dtype="fp32", head_dim=64, seqlen_q=64)
    monkeypatch.setenv("ATTNFORGE_BACKEND", "reference")
    d = explain(**kw)
    assert d.forward.backend == "reference" and d.how == "forced by ATTNFORGE_BACKEND"
    with use_backend("sdpa"):
        assert explain(**kw).how == "forced by use_backend()"
        with use_backend(None):
            assert explain(**kw).how == "forced by ATTNFORGE_BACKEND"
        d = explain(**kw, backend="reference")
        assert d.how == "forced by the backend= argument" and d.forward.backend == "reference"
    monkeypatch.setenv("ATTNFORGE_BACKEND", "auto")
    assert explain(**kw).how == "auto"
    monkeypatch.setenv("ATTNFORGE_BACKEND", "flash9")
    with pytest.raises(UnknownNameError, match="ATTNFORGE_BACKEND='flash9': unknown backend"):
        explain(**kw)


def test_unknown_backend_names_are_refused_early():
    with pytest.raises(UnknownNameError, match="unknown backend 'flash'; known backends: triton_fa2"):
        with use_backend("flash"):
            pass


def test_decisions_are_cached_and_fallbacks_logged_once(caplog):
    kw = dict(device="B200", dtype="bf16", head_dim=256, seqlen_q=2048, causal=True)
    with caplog.at_level(logging.INFO, logger="attnforge"):
        first = explain(**kw)
        for _ in range(3):
            assert explain(**kw) is first
        explain(device="cpu", dtype="bf16", head_dim=128, seqlen_q=2048)  # not a fallback: silent
    records = [r for r in caplog.records if r.name == "attnforge"]
    assert len(records) == 1
    assert "-> triton_fa2 instead of cute_sm100 (head_dim 256 > 128)" in records[0].getMessage()
    # the logger's name says attnforge: a format that shows it ("%(name)s: %(message)s") must not say it twice
    assert not records[0].getMessage().startswith("attnforge")
    assert decide.cache_info().hits >= 3


def test_a100_gets_triton_fa2_with_its_variant_and_head_dim_512_falls_back():
    d = explain(device="A100", dtype="bf16", head_dim=128, seqlen_q=4096, causal=True, needs_grad=True)
    assert d.forward.backend == "triton_fa2" and not d.fallback
    assert d.forward.describe() == "fwd 64x64 w8 s2 pointer"
    assert d.forward.variant.name.startswith("fwd_m64_n64_w8_s2_ptr.sm80.bf16.d128.causal")
    assert d.backward.backend == "triton_fa2" and d.backward.describe().startswith("bwd dkdv")
    d = explain(device="A100", dtype="bf16", head_dim=512, seqlen_q=4096)
    assert d.forward.backend == "sdpa" and d.fallback
    assert "head_dim 512 > 256" in d.forward.reasons_of("triton_fa2")
    d = explain(device="A100", dtype="bf16", head_dim=80, seqlen_q=4096)
    assert d.forward.reasons_of("triton_fa2") == (
        "head_dim 80 has no triton_fa2 variant (has 32, 64, 96, 128, 192, 256)",)


def test_triton_fa2_on_cpu_only_in_the_interpreter():
    d = explain(device="cpu", dtype="fp16", head_dim=64, seqlen_q=128, backend="triton_fa2")
    assert d.forward.backend is None
    assert "runs on the CPU only in Triton's interpreter" in d.forward.reasons_of("triton_fa2")[0]


@pytest.mark.parametrize(("device", "arch"), [("MI250X", "gfx90a"), ("MI300X", "gfx942"), ("MI355X", "gfx950")])
def test_cdna_gets_triton_rocm(device, arch):
    d = explain(device=device, dtype="bf16", head_dim=128, seqlen_q=8192, causal=True, needs_grad=True)
    assert d.forward.backend == "triton_rocm" and d.backward.backend == "triton_rocm" and not d.fallback
    for choice in (d.forward, d.backward):
        assert "waves_per_eu=" in choice.describe() and "mfma=" in choice.describe()
    assert d.forward.describe().startswith("fwd ") and d.backward.describe().startswith("bwd ")


def test_rdna_and_fp8_fall_back_from_triton_rocm_with_reasons():
    d = explain(device="RX7900XTX", dtype="bf16", head_dim=128, seqlen_q=4096)
    assert d.forward.backend == "sdpa" and d.fallback
    assert d.forward.reasons_of("triton_rocm") == ("arch gfx1100 is not served; serves cpu, gfx90a, gfx942, gfx950",)
    d = explain(device="MI300X", dtype="fp8", head_dim=128, seqlen_q=4096)
    assert "dtype fp8 is not supported; supports bf16, fp16" in d.forward.reasons_of("triton_rocm")


def test_decisions_are_queryable_after_the_fact():
    import torch

    assert attnforge.last_decision() is None and attnforge.decisions() == []
    q = torch.randn(1, 2, 8, 16)
    attnforge.attention(q, q, q)
    first = attnforge.last_decision()
    assert first.forward.backend == "sdpa" and first.problem.seqlen_q == 8
    for _ in range(3):
        attnforge.attention(q, q, q)  # the same signature: logged once
    attnforge.attention(q, q, q, return_lse=True)
    assert attnforge.last_decision().forward.backend == "reference"
    assert attnforge.decisions() == [first, attnforge.last_decision()]
    attnforge.attention(q, q, q)
    assert attnforge.last_decision() is first and len(attnforge.decisions()) == 2


@pytest.mark.parametrize(("value", "forced", "how"), [
    ("auto", None, "auto"), ("AUTO", None, "auto"), (" Auto ", None, "auto"), ("", None, "auto"), ("  ", None, "auto"),
    ("reference", "reference", "forced by ATTNFORGE_BACKEND"),
    (" Reference\n", "reference", "forced by ATTNFORGE_BACKEND"),
    ("SDPA", "sdpa", "forced by ATTNFORGE_BACKEND"),
])
def test_env_backend_ignores_surrounding_whitespace_and_case(monkeypatch, value, forced, how):
    """ATTNFORGE_BACKEND as attnforge's other variables: stripped, compared case-insensitively."""
    monkeypatch.setenv("ATTNFORGE_BACKEND", value)
    d = explain(device="cpu", dtype="fp32", head_dim=64, seqlen_q=64)
    assert d.how == how and (forced is None or d.forward.backend == forced)
    import torch
    q = torch.randn(1, 1, 8, 16)
    attnforge.attention(q, q, q)
    assert attnforge.last_decision().how == how


def test_env_backend_unknown_name_is_quoted_as_set(monkeypatch):
    monkeypatch.setenv("ATTNFORGE_BACKEND", " Flash9 ")
    with pytest.raises(UnknownNameError, match="ATTNFORGE_BACKEND=' Flash9 ': unknown backend 'flash9'"):
        explain(device="cpu", dtype="fp32", head_dim=64, seqlen_q=64)

"""What cute_sm90 says about attention_with_kvcache calls on Hopper: the KV_CACHE kernel it would run (contiguous, or
paged with the load size variants.page_rows gives), the calls it refuses and why, and that automatic dispatch passes
it over for triton_fa2's split-KV kernel for decode-shaped calls (and for every call with variants.KV_CACHE_AUTO
off)."""

import math

import pytest

from attnforge import explain
from attnforge.backends.cute_sm90 import variants
from attnforge.backends.cute_sm90.backend import Sm90Variant
from attnforge.dispatch.problem import Problem

PREFILL = dict(device="H200", dtype="bf16", seqlen_q=512, seqlen_k=8192, batch=4, heads=32, kv_heads=8, causal=True)


@pytest.mark.parametrize("head_dim", (64, 80, 96, 128, 256))
@pytest.mark.parametrize("page_size", (0, 16, 64, 256, 1024))
def test_forced_it_runs_its_kv_cache_kernel_loading_pages_in_pieces(head_dim, page_size):
    d = explain(head_dim=head_dim, kv_cache="paged" if page_size else "contiguous", page_size=page_size,
                backend="cute_sm90", **PREFILL)
    tile = variants.pick("16bit", head_dim)[0]
    rows = math.gcd(tile.tile_n, page_size) if page_size else 0
    assert d.forward.backend == "cute_sm90"
    assert d.forward.variant == Sm90Variant(tile, "16bit", head_dim, "bf16", True,
                                            kv_cache="paged" if page_size else "contiguous", page_rows=rows)
    assert rows == 0 or (rows % 8 == 0 and tile.tile_n % rows == 0 and page_size % rows == 0)
    assert d.forward.variant.module.endswith(f"_paged{rows}" if page_size else "_kvcache")


def test_automatic_dispatch_takes_it_for_chunked_prefill():
    for page_size in (0, 16, 64):
        d = explain(head_dim=128, kv_cache="paged" if page_size else "contiguous", page_size=page_size, **PREFILL)
        assert d.forward.backend == "cute_sm90"
        assert d.forward.variant.module.endswith(f"_paged{page_size}" if page_size else "_kvcache")


def test_turned_off_automatic_dispatch_passes_it_over_for_triton_fa2_and_says_why(monkeypatch):
    monkeypatch.setattr(variants, "KV_CACHE_AUTO", False)
    d = explain(head_dim=128, kv_cache="paged", page_size=64, **PREFILL)
    assert d.forward.backend == "triton_fa2"
    assert d.forward.reasons_of("cute_sm90") == (variants.KV_CACHE_NOT_AUTO,)


def test_a_decode_shaped_call_is_passed_over_with_its_own_reason():
    prefill = explain(head_dim=128, kv_cache="paged", page_size=64, **PREFILL)
    assert prefill.forward.backend == "cute_sm90"
    decode = explain(head_dim=128, kv_cache="paged", page_size=64, **{**PREFILL, "seqlen_q": 1})
    assert decode.forward.backend == "triton_fa2"
    (reason,) = decode.forward.reasons_of("cute_sm90")
    assert reason.startswith("seqlen_q 1 < its tile's 128 query rows: triton_fa2's split-KV kernel")


@pytest.mark.parametrize("page_size, reason", [
    (12, "page_size 12: its pages and the tile's 128-key blocks share no multiple of 8 rows"),
    (1, "page_size 1: its pages and the tile's 128-key blocks share no multiple of 8 rows"),
    (0, "the page size is not given")])
def test_page_sizes_it_cannot_load_are_refused_with_the_reason(page_size, reason):
    d = explain(head_dim=128, kv_cache="paged", page_size=page_size, backend="cute_sm90", **PREFILL)
    assert d.forward.backend is None
    (got,) = d.forward.reasons_of("cute_sm90")
    assert got.startswith(reason)
    assert explain(head_dim=128, kv_cache="paged", page_size=page_size, **PREFILL).forward.backend == "triton_fa2"


def _problem(**fields) -> Problem:
    base = explain(head_dim=128, kv_cache="contiguous", **PREFILL).problem
    return Problem(**{**base.__dict__, **fields})


@pytest.mark.parametrize("fields, reason", [
    (dict(kv_leftpad=True), "cache_leftpad is not supported"),
    (dict(kv_unchecked=True), "check_inputs=False is not supported"),
    (dict(kv_dtype="fp8"), "an fp8 (e4m3) KV cache is not supported")])
def test_what_its_kv_cache_kernels_do_not_take_is_refused_with_the_reason(fields, reason):
    from attnforge.dispatch.registry import get

    reasons = get("cute_sm90").supports(_problem(**fields))
    assert any(r.startswith(reason) for r in reasons), reasons
    assert get("triton_fa2").supports(_problem(**fields)) == []


def test_the_template_refuses_kv_cache_forms_it_does_not_compile():
    tile = variants.pick("16bit", 128)[0]
    with pytest.raises(ValueError, match="page_rows 12 must be a multiple of 8"):
        tile.params(128, kv_cache="paged", page_rows=12)
    with pytest.raises(ValueError, match="separate kernels"):
        tile.params(128, kv_cache="contiguous", varlen=True)
    with pytest.raises(ValueError, match="reads no KV cache"):
        variants.pick("fp8", 128)[0].params(128, "fp8", kv_cache="contiguous")
    assert tile.params(128, kv_cache="paged", page_rows=16)["page_rows"] == 16

"""cute_sm100 with no Blackwell GPU: the variant table's check, dispatch, and every variant compiled for
sm_100a (in a child process set up for that arch) with its SASS showing the Blackwell path: UTCHMMA
(tcgen05 MMA), UTMALDG (TMA), LDTM/STTM (tensor memory loads and stores), UTCBAR (tcgen05.commit)."""

import collections
import importlib.util
import re

import pytest

from attnforge import explain
from attnforge.backends.cute_sm100 import variants
from attnforge.backends.cute_sm100.variants import Sm100FwdTile, check
from attnforge.dispatch import registered
from attnforge.runtime.triton_aot import cuobjdump, resources


def test_every_head_dim_has_a_valid_pick():
    assert [d for d, _ in variants.picks()] == list(variants.HEAD_DIMS)
    for head_dim, tile in variants.picks():
        assert not check(tile, head_dim) and tile.tmem_columns(head_dim) <= variants.TMEM_COLUMNS


@pytest.mark.parametrize(("tile", "head_dim", "needle"), [
    (Sm100FwdTile(128, 256, 2), 512, "tensor-memory columns, a CTA has 512"),
    (Sm100FwdTile(128, 128, 4), 128, "KiB of shared memory, sm100 has 227 KiB"),
    (Sm100FwdTile(64, 128), 128, "tile_m must be 128"),
    (Sm100FwdTile(128, 80), 128, "tile_n must be a multiple of 32"),
    (Sm100FwdTile(), 96, "head_dim 96 has no cute_sm100 kernel"),
])
def test_check_names_what_is_wrong(tile, head_dim, needle):
    assert any(needle in r for r in check(tile, head_dim)), check(tile, head_dim)


def test_b200_chooses_it_and_triton_fa2_runs_the_backward():
    d = explain(device="B200", dtype="bf16", head_dim=128, seqlen_q=8192, causal=True, needs_grad=True)
    assert d.forward.backend == "cute_sm100" and not d.fallback
    assert d.backward.backend == "triton_fa2"
    d = explain(device="B200", dtype="bf16", head_dim=256, seqlen_q=8192)
    assert d.forward.backend == "triton_fa2" and "head_dim 256 > 128" in d.forward.reasons_of("cute_sm100")
    assert "cute_sm100" not in [c.backend for c in explain(device="H100", dtype="bf16", head_dim=128,
                                                             seqlen_q=64).forward.candidates]


VARIANTS = registered()["cute_sm100"].variants()  # every variant the planner can pick: what `attnforge build` compiles


def test_the_variants_are_the_table_picks_in_both_16_bit_dtypes_and_causalities():
    from attnforge.backends.cute_sm100 import compile as cc
    from attnforge.backends.cute_sm100.backend import Sm100Variant

    assert sorted(v.name for v in VARIANTS) == sorted(
        Sm100Variant(tile, head_dim, dtype, causal).name for head_dim, tile in variants.picks()
        for dtype in ("fp16", "bf16") for causal in (False, True))
    assert all(v.build.arch == cc.ARCH == "sm_100a" and v.build.cache_name == "cute_sm100" for v in VARIANTS)


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.name for v in VARIANTS])
def test_variant_compiles_for_sm100a_with_tcgen05_tma_and_tmem(tmp_path, variant):
    if any(importlib.util.find_spec(m) is None for m in ("cutlass", "tvm_ffi")):
        pytest.skip("nvidia-cutlass-dsl or apache-tvm-ffi is not installed (pip install 'attnforge[cute]')")
    from attnforge.runtime import cute

    # Always in a child process set up for sm_100a (as `attnforge build` does from a process set up for
    # another arch): importing cutlass here for sm_100a would fix this whole session's CuTe DSL to it.
    cute._in_child(variant.build, "dump", str(tmp_path))
    (cubin,) = tmp_path.glob("*.sm_100a.cubin")
    sass = cuobjdump("-sass", str(cubin))
    seen = collections.Counter(re.findall(r"\b(UTCHMMA|UTMALDG|LDTM|STTM|UTCBAR)\b", sass))
    assert all(seen[i] for i in ("UTCHMMA", "UTMALDG", "LDTM", "STTM", "UTCBAR")), seen
    usage = resources(cubin.read_bytes())
    assert usage["stack_bytes"] <= variant.tile.accepted_spill_bytes and usage["local_bytes"] == 0, usage


# `attnforge build --features window,softcap,sinks,alibi,window+softcap+sinks+alibi`: the feature kernels, bf16
EVERY_FEATURE = frozenset({"window", "softcap", "sinks", "alibi"})
FEATURES = [v for v in registered()["cute_sm100"].variants(dtypes=("bf16",), features=(
    *(frozenset({f}) for f in sorted(EVERY_FEATURE)), EVERY_FEATURE)) if v.features]


def test_b200_takes_it_for_windows_softcap_sinks_and_alibi():
    d = explain(device="B200", dtype="bf16", head_dim=128, seqlen_q=8192, causal=True, window_size=(1023, 0),
                softcap=30.0, needs_grad=True)
    assert d.forward.backend == "cute_sm100" and d.forward.variant.window and d.forward.variant.softcap
    assert d.forward.variant.name.endswith("_window_softcap.bf16.causal")
    assert d.backward.backend == "triton_fa2" and d.backward.variant.local and d.backward.variant.softcap
    sinks = explain(device="B200", dtype="bf16", head_dim=128, seqlen_q=8192, sinks=True)
    assert sinks.forward.backend == "cute_sm100" and sinks.forward.variant.sinks
    alibi = explain(device="B200", dtype="bf16", head_dim=128, seqlen_q=8192, alibi=True)
    assert alibi.forward.backend == "cute_sm100" and alibi.forward.variant.alibi
    assert {v.features for v in FEATURES} == {("window",), ("softcap",), ("sinks",), ("alibi",),
                                              ("window", "softcap", "sinks", "alibi")}


def tcgen05_kernel(variant, tmp_path):
    """(SASS, resource usage) of ``variant`` compiled for sm_100a, after checking it uses tcgen05 MMAs, TMA loads and
    tensor memory (LDTM/STTM, UTCBAR)."""
    from attnforge.runtime import cute

    cute._in_child(variant.build, "dump", str(tmp_path))  # (in a child process: see above)
    (cubin,) = tmp_path.glob("*.sm_100a.cubin")
    sass = cuobjdump("-sass", str(cubin))
    seen = collections.Counter(re.findall(r"\b(UTCHMMA|UTMALDG|LDTM|STTM|UTCBAR)\b", sass))
    assert all(seen[i] for i in ("UTCHMMA", "UTMALDG", "LDTM", "STTM", "UTCBAR")), seen
    return sass, resources(cubin.read_bytes())


@pytest.mark.parametrize("variant", FEATURES, ids=[v.name for v in FEATURES])
def test_feature_variant_compiles_for_sm100a_with_one_tanh_per_score(tmp_path, variant):
    if any(importlib.util.find_spec(m) is None for m in ("cutlass", "tvm_ffi")):
        pytest.skip("nvidia-cutlass-dsl or apache-tvm-ffi is not installed (pip install 'attnforge[cute]')")
    sass, usage = tcgen05_kernel(variant, tmp_path)
    # SOFTCAP: tanh.approx (MUFU.TANH) once per score a softmax thread holds (its row of the block), once in the
    # kernel's one key-block loop; none without it
    tanh = len(re.findall(r"MUFU\.TANH", sass))
    assert tanh == (variant.tile.tile_n if variant.softcap else 0), tanh
    assert usage["stack_bytes"] <= variant.tile.accepted_spill_bytes and usage["local_bytes"] == 0, usage


# `attnforge build --features varlen,varlen+window+softcap+sinks+alibi`: the packed (VARLEN) forwards, bf16
VARLEN = [v for v in registered()["cute_sm100"].variants(dtypes=("bf16",), features=(
    frozenset({"varlen"}), EVERY_FEATURE | {"varlen"})) if v.varlen]
# measured here (stack bytes): the non-causal packed kernels keep 120 (the plain ones 104); not timed (no B200)
VARLEN_SPILL_BYTES = 120


def test_b200_takes_it_for_packed_batches():
    d = explain(device="B200", dtype="bf16", head_dim=128, seqlen_q=4096, batch=8, causal=True, needs_grad=True,
                varlen=True)
    assert d.forward.backend == "cute_sm100" and d.forward.variant.varlen
    assert d.forward.variant.name.endswith("_varlen.bf16.causal") and "packed (varlen)" in d.forward.variant.describe()
    assert d.backward.backend == "triton_fa2" and d.backward.variant.varlen
    assert len(VARLEN) == len(variants.HEAD_DIMS) * 2 * 2


@pytest.mark.parametrize("variant", VARLEN, ids=[v.name for v in VARLEN])
def test_varlen_variant_compiles_for_sm100a(tmp_path, variant):
    if any(importlib.util.find_spec(m) is None for m in ("cutlass", "tvm_ffi")):
        pytest.skip("nvidia-cutlass-dsl or apache-tvm-ffi is not installed (pip install 'attnforge[cute]')")
    _, usage = tcgen05_kernel(variant, tmp_path)
    assert usage["stack_bytes"] <= max(variant.tile.accepted_spill_bytes, VARLEN_SPILL_BYTES), usage
    assert usage["local_bytes"] == 0, usage

"""Every variant the table can pick compiles for sm_90a on this machine (no GPU needed), and the SASS
uses what Hopper offers: HGMMA (WGMMA), UTMALDG (TMA loads), UTMASTG (TMA stores, where the table asks),
USETMAXREG (register reallocation between producer and consumer warpgroups), with no register spills beyond those
the table accepts. The backward variants too: their five GEMMs' shapes, UTMAREDG (dQ's TMA reduce-add), STSM."""

import collections
import dataclasses
import importlib.util
import re
from unittest import mock

import pytest

from attnforge.backends.cute_sm90 import bwd_variants
from attnforge.backends.cute_sm90 import compile as cc
from attnforge.backends.cute_sm90 import variants
from attnforge.backends.cute_sm90.backend import Sm90Variant
from attnforge.backends.cute_sm90.backward import Sm90BwdVariant
from attnforge.dispatch import registered
from attnforge.runtime import cute
from attnforge.runtime.triton_aot import cuobjdump, resources

# find_spec, not importorskip: importing cutlass here would fix its target arch for the whole session
pytestmark = pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("cutlass", "tvm_ffi")),
                                reason="nvidia-cutlass-dsl or apache-tvm-ffi is not installed (pip install 'attnforge[cute]')")


def served_and_not():
    """Yields twice: with the table's tiles for unmasked calls not served and served (bwd_variants.
    UNMASKED_ONLY_SERVED: d=128's 80-row tile)."""
    for served in (False, True):
        with mock.patch.object(bwd_variants, "UNMASKED_ONLY_SERVED", served):
            yield served


def either_way(make) -> list:
    """make()'s variants both ways of served_and_not(): what `attnforge build` compiles now, and with that flag
    turned off, each once."""
    return list({v.name: v for _ in served_and_not() for v in make()}.values())


# the backward's head dims the planner serves (bwd_variants.pick: every multiple of 8 up to 256)
SERVED_BWD_HEAD_DIMS = [d for d in bwd_variants.HEAD_DIMS if bwd_variants.pick(d, masked=True)[0] is not None]
# the backward kernels' own head dims, compiled here in every form; a head dim between them runs the next kernel up
# with zero-filled columns (bwd_variants.kernel_head_dim), the same code with another column bound, compiled here on
# a sample (PADDED_BWD below) rather than all 29
KERNEL_BWD_HEAD_DIMS = [d for d in SERVED_BWD_HEAD_DIMS if bwd_variants.kernel_head_dim(d) == d]
# the one-warpgroup-per-64-keys kernels' WINDOW, SOFTCAP, ALIBI and VARLEN forms (the head-dim-256 kernel's are
# compiled below, SPLIT_FEATURE_BWD)
FEATURE_BWD_HEAD_DIMS = [d for d in KERNEL_BWD_HEAD_DIMS if not bwd_variants.pick(d, masked=True)[0].split_head_dim]
# every variant the planner can pick (now, and with unmasked-only tiles turned off): what `attnforge build` compiles
ALL = either_way(registered()["cute_sm90"].variants)
VARIANTS = [v for v in ALL if isinstance(v, Sm90Variant)]
BWD_VARIANTS = [v for v in ALL if isinstance(v, Sm90BwdVariant)]
KERNEL_BWD = [v for v in BWD_VARIANTS if v.head_dim in KERNEL_BWD_HEAD_DIMS]
# deterministic=True's kernels (`attnforge build --deterministic`), in one dtype
DETERMINISTIC = [v for v in either_way(lambda: registered()["cute_sm90"].variants(
    dtypes=("bf16",), head_dims=KERNEL_BWD_HEAD_DIMS, deterministic=True))
                 if isinstance(v, Sm90BwdVariant) and v.deterministic]


def picks_either_way(head_dim: int, causal: bool) -> set:
    """bwd_variants.pick's tiles for the call with unmasked-only tiles served and not (see either_way)."""
    return {bwd_variants.pick(head_dim, masked=causal)[0] for _ in served_and_not()}


def test_the_variants_are_the_table_picks_in_every_dtype_and_causality():
    assert sorted(v.name for v in VARIANTS) == sorted(
        Sm90Variant(tile, kind, head_dim, dtype, causal).name for kind, head_dim, tile in variants.picks()
        for dtype in cc.DTYPES if cc.KIND[dtype] == kind for causal in (False, True))
    assert all(v.build.arch == cc.ARCH == "sm_90a" and v.build.module == v.module for v in VARIANTS)
    assert sorted(v.name for v in BWD_VARIANTS) == sorted({
        Sm90BwdVariant(tile, d, dtype, causal).name for d in SERVED_BWD_HEAD_DIMS for dtype in ("fp16", "bf16")
        for causal in (False, True) for tile in picks_either_way(d, causal)})
    assert len(ALL) == len(VARIANTS) + len(BWD_VARIANTS)


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.name for v in VARIANTS])
def test_variant_compiles_for_sm90a_with_wgmma_and_tma(tmp_path, variant):
    kind, head_dim, tile, dtype, causal = variant.kind, variant.head_dim, variant.tile, variant.dtype, variant.causal
    cute.compile_to(variant.build, str(tmp_path))
    (cubin,) = tmp_path.glob("*.sm_90a.cubin")
    sass = cuobjdump("-sass", str(cubin))
    seen = collections.Counter(m.split(".")[0] for m in re.findall(r"\b(?:[HQ]GMMA|UTMALDG|USETMAXREG)\.[\w.]+", sass))
    mma = "QGMMA" if dtype == "fp8" else "HGMMA"  # QGMMA: the 8-bit WGMMA
    assert seen[mma] and seen["UTMALDG"] and seen["USETMAXREG"] == 2, seen
    # cuobjdump leaves F16 (the default) unsaid
    element, k = {"fp16": ("", 16), "bf16": (r"\.BF16", 16), "fp8": (r"\.E4M3\.E4M3", 32)}[dtype]
    assert re.search(rf"{mma}\.64x{tile.tile_n}x{k}\.F32{element}\s", sass)  # S = Q K^T, one key block
    assert re.search(rf"{mma}\.64x{variants.padded_head_dim(head_dim, kind)}x{k}\.F32{element}\s", sass)  # O += P V (N: the padded head dim)
    # row sums of P by the tensor core (P times ones, N = 8) exactly where the table asks for them
    assert bool(re.search(rf"{mma}\.64x8x{k}\.F32{element}\s", sass)) == tile.row_sum_mma
    # the TMA-store epilogue (stmatrix into shared memory, then UTMASTG) exactly where the table asks for it
    assert bool(re.search(r"\bUTMASTG\.", sass)) == bool(re.search(r"\bSTSM\.", sass)) == tile.tma_store
    # ptxas serializes WGMMAs it cannot keep in flight (C7512-C7514: registers, accumulators touched
    # mid-flight): a serialized kernel waits after every WGMMA, as many waits as WGMMAs
    mmas, waits = len(re.findall(r"\b[HQ]GMMA\.", sass)), len(re.findall(r"WARPGROUP\.DEPBAR", sass))
    assert waits < mmas / 2, f"WGMMAs serialized: {waits} waits for {mmas} WGMMAs"
    # One exp2 per score: a thread holds tile_n / 2 scores of a block, and the softmax is compiled once
    # for the first block and once per key-block loop (non-causal one, causal two), plus one rescale
    # exp2 per row (two rows). More means the exponentials are computed twice (the DSL's conversion of
    # a 16-bit P once caused that: 130 MUFU.EX2 per block for 64 scores).
    copies = 3 if causal else 2
    ex2 = len(re.findall(r"MUFU\.EX2", sass))
    assert ex2 <= copies * (tile.tile_n // 2 + 2), f"{ex2} MUFU.EX2 for {copies} softmax copies of {tile.tile_n // 2} scores"
    usage = resources(cubin.read_bytes())
    assert usage["stack_bytes"] <= tile.accepted_spill_bytes and usage["local_bytes"] == 0, usage  # no spills beyond those accepted


def test_disk_cache_builds_once_and_keys_on_the_variant(tmp_path):
    kind, head_dim, tile = variants.picks()[0]
    build = Sm90Variant(tile, kind, head_dim, "bf16", False).build
    path, built = cute.build_cached(build, tmp_path)
    assert built and path.is_file() and path.stat().st_size > 0 and path.parent == tmp_path / "cute_sm90"
    assert path == cute.cache_path(build, tmp_path)
    assert cute.build_cached(build, tmp_path) == (path, False)
    assert cute.cache_path(dataclasses.replace(build, causal=True), tmp_path) != path
    assert cute.cache_path(dataclasses.replace(build, dtype="fp16"), tmp_path) != path
    other_kind, other_dim, other_tile = variants.picks()[1]  # another tile: another rendered module
    assert cute.cache_path(Sm90Variant(other_tile, other_kind, other_dim, "bf16", False).build, tmp_path) != path


# `attnforge build --features window,softcap,sinks,alibi,window+softcap+sinks+alibi` for bf16: the feature forwards
EVERY_FEATURE = frozenset({"window", "softcap", "sinks", "alibi"})
FEATURES = [v for v in registered()["cute_sm90"].variants(dtypes=("bf16",), head_dims=(64, 128, 256), features=(
    *(frozenset({f}) for f in sorted(EVERY_FEATURE)), EVERY_FEATURE)) if isinstance(v, Sm90Variant) and v.features]
# d=64's tile (3 consumer warpgroups at 128 registers) spills a little more with a feature's registers: measured
# here (stack bytes of the compiled kernel), 136 at most (window + softcap), against 16 without; not yet timed
FEATURE_SPILL_BYTES = {64: 136}


def test_build_features_give_the_forward_feature_kernels_and_no_fp8_or_backward_ones():
    assert {v.features for v in FEATURES} == {("window",), ("softcap",), ("sinks",), ("alibi",),
                                              ("window", "softcap", "sinks", "alibi")}
    # head dims x (feature sets + the softcap's FIXED_MAX twin: bf16, no ALiBi) x causality
    assert len(FEATURES) == 3 * (5 + 1) * 2
    assert {v.features for v in FEATURES if v.fixed_max} == {("softcap",)}
    fp8 = registered()["cute_sm90"].variants(dtypes=("fp8",), features=(frozenset({"window"}),))
    assert not any(v.window for v in fp8)


@pytest.mark.parametrize("variant", FEATURES, ids=[v.name for v in FEATURES])
def test_feature_variant_compiles_with_one_tanh_per_score_and_no_more_spills(tmp_path, variant):
    cute.compile_to(variant.build, str(tmp_path))
    (cubin,) = tmp_path.glob("*.sm_90a.cubin")
    sass = cuobjdump("-sass", str(cubin))
    assert re.search(r"\bHGMMA\.", sass) and re.search(r"\bUTMALDG\.", sass)
    # SOFTCAP: tanh.approx (MUFU.TANH) once per score of each compiled softmax copy (the first block, then one per
    # key-block loop: non-causal one, causal two, a window three: right edge, inside, left edge); none without it
    copies = 4 if variant.window else (3 if variant.causal else 2)
    tanh = len(re.findall(r"MUFU\.TANH", sass))
    assert tanh == (copies * variant.tile.tile_n // 2 if variant.softcap else 0), tanh
    # FIXED_MAX: no row max per block (one FMNMX sets up the fixed offset, and exp2_fma clamps its inputs by one);
    # the running max takes one per score
    fmnmx = len(re.findall(r"\bFMNMX\b", sass))
    on_fma = copies * variant.tile.tile_n // 2 // variant.tile.exp2_fma_every if variant.tile.exp2_fma_every else 0
    assert fmnmx <= 2 + on_fma if variant.fixed_max else fmnmx >= copies * variant.tile.tile_n // 2, fmnmx
    assert (variant.tile.exp2_fma_every == 3) == (variant.fixed_max and variant.head_dim <= 64)
    usage = resources(cubin.read_bytes())
    allowed = max(variant.tile.accepted_spill_bytes, FEATURE_SPILL_BYTES.get(variant.head_dim, 0))
    assert usage["stack_bytes"] <= allowed and usage["local_bytes"] == 0, usage


# exp2 on the FMA pipe for one in 2 or 4 softmax columns (Sm90FwdTile.exp2_fma_every) in the softcap forwards of
# d=64 and d=128, causal: an option of the table, not yet picked
EXP2_FMA = [dataclasses.replace(v, tile=dataclasses.replace(v.tile, exp2_fma_every=every))
            for v in FEATURES if v.features == ("softcap",) and v.causal and v.head_dim in (64, 128) for every in (2, 4)]


@pytest.mark.parametrize("variant", EXP2_FMA, ids=[v.name for v in EXP2_FMA])
def test_exp2_on_the_fma_pipe_takes_its_columns_off_mufu(tmp_path, variant):
    cute.compile_to(variant.build, str(tmp_path))
    (cubin,) = tmp_path.glob("*.sm_90a.cubin")
    sass = cuobjdump("-sass", str(cubin))
    copies, every, scores = 3, variant.tile.exp2_fma_every, variant.tile.tile_n // 2  # causal: three softmax copies
    on_mufu = scores - scores // every
    ex2 = len(re.findall(r"MUFU\.EX2", sass))
    # each copy's MUFU columns, plus its two rows' rescale exp2s
    assert copies * on_mufu <= ex2 <= copies * (on_mufu + 2), (ex2, copies * on_mufu)
    assert len(re.findall(r"MUFU\.TANH", sass)) == copies * scores  # the cap's tanh stays on MUFU
    mmas, waits = len(re.findall(r"\bHGMMA\.", sass)), len(re.findall(r"WARPGROUP\.DEPBAR", sass))
    assert waits < mmas / 2, f"WGMMAs serialized: {waits} waits for {mmas} WGMMAs"
    usage = resources(cubin.read_bytes())
    allowed = max(variant.tile.accepted_spill_bytes, FEATURE_SPILL_BYTES.get(variant.head_dim, 0))
    assert usage["stack_bytes"] <= allowed and usage["local_bytes"] == 0, usage


# `attnforge build --features varlen,varlen+window+softcap+sinks+alibi` for bf16: the packed (VARLEN) forwards, one per
# tile family (d=8: a padded head dim)
VARLEN = [v for v in registered()["cute_sm90"].variants(dtypes=("bf16",), head_dims=(8, 64, 96, 128, 192, 256),
                                                        features=(frozenset({"varlen"}), EVERY_FEATURE | {"varlen"}))
          if isinstance(v, Sm90Variant) and v.varlen]
# measured here (stack bytes): d=64's causal kernel keeps 24 (16 without VARLEN); with every feature the 2-warpgroup
# tiles spill too (d=96 112, d=128 16, d=192 40; 0 with VARLEN alone or the features alone), d=64 136 as without
# VARLEN. Not yet timed.
VARLEN_SPILL_BYTES = {64: 24}
VARLEN_FEATURE_SPILL_BYTES = {64: 136, 96: 112, 128: 16, 192: 40}


def test_build_features_varlen_gives_the_packed_forwards():
    assert len(VARLEN) == 6 * 2 * 2 and all(v.kind == "16bit" and "_varlen" in v.module for v in VARLEN)
    fp8 = registered()["cute_sm90"].variants(dtypes=("fp8",), features=(frozenset({"varlen"}),))
    assert fp8 and not any(getattr(v, "varlen", False) for v in fp8)


@pytest.mark.parametrize("variant", VARLEN, ids=[v.name for v in VARLEN])
def test_varlen_variant_compiles_with_tma_loads_and_both_stores(tmp_path, variant):
    """One CTA per tile (no persistent loop), TMA loads from each sequence's offset, and O stored by TMA where a
    warpgroup's rows end inside the sequence, from registers (STG) where they cross its end."""
    cute.compile_to(variant.build, str(tmp_path))
    (cubin,) = tmp_path.glob("*.sm_90a.cubin")
    sass = cuobjdump("-sass", str(cubin))
    assert re.search(r"\bHGMMA\.", sass) and re.search(r"\bUTMALDG\.", sass)
    # the dense kernels store only the LSE from registers (two rows a thread: 2 STG); O's register path adds more
    assert re.search(r"\bUTMASTG\.", sass) and len(re.findall(r"\bSTG\.", sass)) > 2
    usage = resources(cubin.read_bytes())
    allowed = max(variant.tile.accepted_spill_bytes, (VARLEN_FEATURE_SPILL_BYTES if variant.features
                                                      else VARLEN_SPILL_BYTES).get(variant.head_dim, 0))
    assert usage["stack_bytes"] <= allowed and usage["local_bytes"] == 0, usage


# attention_with_kvcache's kernels (KV_CACHE, PAGED): per tile family, the page loads the planner can pick
# (variants.page_rows: the most rows dividing both the tile's keys and the page size), both causalities
KV_CACHE_LOADS = {64: (64, 16), 80: (16,), 96: (16,), 128: (128, 64, 16), 256: (64,)}
# measured here (stack bytes): d=64's causal kernels 16 contiguous (as without a cache), 32 paged; the others 0. Not
# yet run on a GPU.
KV_CACHE_SPILL_BYTES = {64: 32}


def kv_cache_sass(tmp_path, variant) -> tuple[str, int]:
    """Compile a KV_CACHE variant for sm_90a; its SASS and UTMALDG count, having checked what each has: WGMMA, register
    reallocation, O's TMA store, a shared-memory store (the zeroed stale rows of V) and no spill beyond the table's."""
    folder = tmp_path / variant.module
    cute.compile_to(variant.build, str(folder))
    (cubin,) = folder.glob("*.sm_90a.cubin")
    sass = cuobjdump("-sass", str(cubin))
    assert re.search(r"\bHGMMA\.", sass) and re.search(r"\bUTMASTG\b", sass) and re.search(r"\bSTS\.", sass)
    assert len(re.findall(r"\bUSETMAXREG\.", sass)) == 2
    usage = resources(cubin.read_bytes())
    allowed = max(variant.tile.accepted_spill_bytes, KV_CACHE_SPILL_BYTES.get(variant.head_dim, 0))
    assert usage["stack_bytes"] <= allowed and usage["local_bytes"] == 0, usage
    return sass, len(re.findall(r"\bUTMALDG\.", sass))


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("head_dim", sorted(KV_CACHE_LOADS))
def test_kv_cache_kernels_load_each_block_in_page_pieces(tmp_path, head_dim, causal):
    """A contiguous cache's kernel loads Q, K and V by TMA as the dense one does, one TMA load per box of columns
    each; a paged one loads each K and V block in TILE_N // PAGE_ROWS pieces by a loop over the same TMA loads (of
    PAGE_ROWS rows: the GPU tests check what they load), so its SASS has as many."""
    tile, _ = variants.pick("16bit", head_dim)
    contiguous = Sm90Variant(tile, "16bit", head_dim, "bf16", causal, kv_cache="contiguous")
    _, loads = kv_cache_sass(tmp_path, contiguous)
    assert loads % 3 == 0  # (Q, K and V: the same column boxes)
    for rows in KV_CACHE_LOADS[head_dim]:
        paged = Sm90Variant(tile, "16bit", head_dim, "bf16", causal, kv_cache="paged", page_rows=rows)
        assert kv_cache_sass(tmp_path, paged)[1] == loads, rows


def test_kv_cache_kernel_with_every_score_feature_compiles_without_spills(tmp_path):
    tile, _ = variants.pick("16bit", 128)
    variant = Sm90Variant(tile, "16bit", 128, "bf16", True, window=True, softcap=True, sinks=True, alibi=True,
                          kv_cache="paged", page_rows=16)
    kv_cache_sass(tmp_path, variant)


def backward_sass(tmp_path, variant, spill_bytes: int) -> str:
    """Compile a backward variant for sm_90a and return its SASS, having checked what every backward kernel has: TMA
    loads, dQ's TMA reduce-add, dS stored by stmatrix, register reallocation between producer and consumers, WGMMAs
    not serialized (unless the table accepts it), and no spill beyond ``spill_bytes`` (or the tile's own)."""
    cute.compile_to(variant.build, str(tmp_path))
    (cubin,) = tmp_path.glob("*.sm_90a.cubin")
    sass = cuobjdump("-sass", str(cubin))
    seen = collections.Counter(m.split(".")[0] for m in re.findall(
        r"\b(?:UTMALDG|UTMAREDG|UBLKRED|USETMAXREG|STSM)\.[\w.]+", sass))
    dq_reduce = "UBLKRED" if variant.tile.flat_dq else "UTMAREDG"  # flat_dq: a 1-D bulk reduce-add, no TMA tile
    assert seen["UTMALDG"] and seen[dq_reduce] and seen["STSM"] and seen["USETMAXREG"] == 2, seen
    mmas, waits = len(re.findall(r"\bHGMMA\.", sass)), len(re.findall(r"WARPGROUP\.DEPBAR", sass))
    assert (waits < mmas / 2) != variant.tile.accepts_serialized_wgmma, f"{waits} waits for {mmas} WGMMAs"
    usage = resources(cubin.read_bytes())
    allowed = max(variant.tile.accepted_spill_bytes, spill_bytes)
    assert usage["stack_bytes"] <= allowed and usage["local_bytes"] == 0, usage
    return sass


# `attnforge build --features window`: the backward's WINDOW kernels, bf16, both head dims and causalities
WINDOW_BWD = [v for v in registered()["cute_sm90"].variants(dtypes=("bf16",), head_dims=FEATURE_BWD_HEAD_DIMS,
                                                             features=(frozenset({"window"}),))
              if isinstance(v, Sm90BwdVariant) and v.window]
# d=64's backward tile spills a little more with the window's bounds (measured here: 40 stack bytes, 8 without)
WINDOW_BWD_SPILL_BYTES = {64: 40}


@pytest.mark.parametrize("variant", WINDOW_BWD, ids=[v.name for v in WINDOW_BWD])
def test_window_backward_compiles_with_its_gemms_unserialized(tmp_path, variant):
    assert len(WINDOW_BWD) == 2 * len(FEATURE_BWD_HEAD_DIMS)
    backward_sass(tmp_path, variant, WINDOW_BWD_SPILL_BYTES.get(variant.head_dim, 0))


# `attnforge build --features softcap,alibi,window+softcap+alibi`: the backward's SOFTCAP and ALIBI kernels, bf16
FEATURE_BWD = [v for v in either_way(lambda: registered()["cute_sm90"].variants(
    dtypes=("bf16",), head_dims=FEATURE_BWD_HEAD_DIMS,
    features=(frozenset({"softcap"}), frozenset({"alibi"}), frozenset({"window", "softcap", "alibi"}))))
    if isinstance(v, Sm90BwdVariant) and (v.softcap or v.alibi)]
# measured here (stack bytes, causal/full): d=128 softcap 0/8, alibi 0/16, all three 128 (with VARLEN); d=64
# softcap 72/80, alibi 40, window+softcap+alibi 344 (the 128-row query block leaves no registers for the tanh
# and slope arithmetic); timed on the H200 they still ran 1.4-1.8x triton_fa2's backward (docs/performance.md).
# With dK/dV stored by TMA at d=64 (the table's tile since 2026-12-06) window+softcap+alibi takes 408, full and
# causal (its GPU tests pass; that kernel's speed was not timed again).
FEATURE_BWD_SPILL_BYTES = {64: 408, 128: 128}


@pytest.mark.parametrize("variant", FEATURE_BWD, ids=[v.name for v in FEATURE_BWD])
def test_softcap_and_alibi_backward_compile_with_one_tanh_and_log_per_score(tmp_path, variant):
    # three feature sets, causal and not; the softcap and ALiBi sets without a mask on each tile the table holds
    unmasked_tiles = sum(bwd_variants.table_tile(d, masked=False)[0] != bwd_variants.table_tile(d, masked=True)[0]
                         for d in FEATURE_BWD_HEAD_DIMS)
    assert len(FEATURE_BWD) == 3 * 2 * len(FEATURE_BWD_HEAD_DIMS) + 2 * unmasked_tiles
    sass = backward_sass(tmp_path, variant, FEATURE_BWD_SPILL_BYTES[variant.head_dim])
    # per score of S^T (tile_m / 2 a thread) in each of the step's copies (masked and not; split_loops with a window
    # a third, the masked blocks past its far edge): one MUFU.EX2 for P; with SOFTCAP one MUFU.TANH for the cap and one
    # MUFU.LG2 for its derivative (tanh recovered from P)
    per_copy = variant.tile.tile_m // 2
    copies = 3 if variant.tile.split_loops and (variant.window or variant.varlen) else 2
    counts = [len(re.findall(rf"MUFU\.{op}\b", sass)) for op in ("EX2", "TANH", "LG2")]
    assert counts == [copies * per_copy] + [copies * per_copy if variant.softcap else 0] * 2, counts


# The backward's packed (VARLEN) kernels, bf16, with and without the window: what `attnforge build --features
# varlen,varlen+window` builds (bwd_variants.PACKED)
VARLEN_BWD = either_way(lambda: [
    Sm90BwdVariant(bwd_variants.staging_for(bwd_variants.pick(d, masked=causal or window)[0], window, True, False,
                                            False), d, "bf16", causal, False, window, True)
    for d in FEATURE_BWD_HEAD_DIMS for window in (False, True) for causal in (False, True)])
# measured here (stack bytes): d=64 causal 40 (8 dense; 24 with the window), d=128 causal 8 (0 dense)
VARLEN_BWD_SPILL_BYTES = {64: 40, 128: 8}


@pytest.mark.parametrize("variant", VARLEN_BWD, ids=[v.name for v in VARLEN_BWD])
def test_varlen_backward_compiles_with_tma_loads_reduce_add_and_its_gemms_unserialized(tmp_path, variant):
    backward_sass(tmp_path, variant, VARLEN_BWD_SPILL_BYTES.get(variant.head_dim, 0))


# Backwards of head dims below their kernel's (bwd_variants.kernel_head_dim: the smallest there is, 8, and model head
# dims 80 and 192 on the 64, 128 and 256 kernels), served where bwd_variants.PADDED_SERVED
PADDED_BWD = [Sm90BwdVariant(bwd_variants.table_tile(d, masked=causal)[0], d, dtype, causal) for d in (8, 80, 192)
              for dtype, causal in (("bf16", True), ("fp16", False))]
# measured here (stack bytes, by kernel head dim): on the 64 kernel, d=8 and d=40 keep 8-16 (8 at d=64: the column
# predicate of dK's and dV's stores adds a little); 80 and 96 on the 128 kernel and 192 on the 256 kernel none
PADDED_BWD_SPILL_BYTES = {64: 16}
# the one-warpgroup-per-64-keys backwards here; the head-dim-256 (split_head_dim) ones below
UNSPLIT_BWD = [v for v in KERNEL_BWD + DETERMINISTIC + PADDED_BWD if not v.tile.split_head_dim]


def test_padded_backwards_run_the_next_kernel_and_are_served():
    assert bwd_variants.PADDED_SERVED
    assert [bwd_variants.kernel_head_dim(v.head_dim) for v in PADDED_BWD[::2]] == [64, 128, 256]
    for v in PADDED_BWD:
        params = v.tile.params(v.head_dim)
        assert (params["head_dim"], params["head_dim_padded"]) == (v.head_dim, bwd_variants.kernel_head_dim(v.head_dim))
        with mock.patch.object(bwd_variants, "UNMASKED_ONLY_SERVED", True):
            assert bwd_variants.pick(v.head_dim, masked=v.causal) == bwd_variants.table_tile(v.head_dim,
                                                                                           masked=v.causal)
    assert all(bwd_variants.kernel_head_dim(d) == d for d in bwd_variants.KERNEL_HEAD_DIMS)
    assert not any(d % 8 for d in SERVED_BWD_HEAD_DIMS)


@pytest.mark.parametrize("variant", UNSPLIT_BWD, ids=[v.name for v in UNSPLIT_BWD])
def test_backward_variant_compiles_for_sm90a_with_wgmma_tma_and_reduce_add(tmp_path, variant):
    tile, head_dim = variant.tile, bwd_variants.kernel_head_dim(variant.head_dim)  # the WGMMAs' head dim
    padded = head_dim != variant.head_dim
    sass = backward_sass(tmp_path, variant, PADDED_BWD_SPILL_BYTES.get(head_dim, 0) if padded else 0)
    element = r"\.BF16" if variant.dtype == "bf16" else ""  # cuobjdump leaves F16 (the default) unsaid
    # S^T = K Q^T and dP^T = V dO^T: 64 keys per warpgroup by tile_m queries, both operands from shared memory
    assert re.search(rf"HGMMA\.64x{tile.tile_m}x16\.F32{element} R\d+, gdesc\[UR\d+\], RZ, !UPT", sass)
    # dV += P^T dO and dK += dS^T Q: the A operand from registers, dO and Q read transposed
    assert len(re.findall(rf"HGMMA\.64x{head_dim}x16\.F32{element} R\d+, R\d+, gdesc\[UR\d+\]\.tnspB", sass)) >= 2
    # dQ = dS K: dS and K both read transposed from shared memory, split across the two warpgroups (dq_transposed:
    # dQ^T = K^T dS^T, 64 of dQ's columns by tile_m queries per warpgroup)
    dq_shape = f"64x{tile.tile_m}" if tile.dq_transposed else f"64x{head_dim if tile.tile_m == 128 else head_dim // 2}"
    assert re.search(rf"HGMMA\.{dq_shape}x16\.F32{element} R\d+, gdesc\[UR\d+\]\.tnspA\.tnspB", sass)
    # deterministic: the dQ warp's acquire loads of a query block's count and its release add; in the others neither
    ordered = [bool(re.search(rf"\b{op}\S*\.STRONG\.GPU", sass)) for op in ("LDG", "REDG")]
    assert ordered == [variant.deterministic] * 2, ordered


# The backward tiles' template options (bwd_variants.Sm90BwdTile: stats_ahead, ds_key_major, tma_store_dkv), which
# benchmarks/sweep_bwd_sm90.py --twin times beside the table's tiles: each alone and all together where the table's
# check accepts them, on the kernel head dims 64 and 128, causal bf16 (stats_ahead needs tile_m / 4 registers more:
# refused at d=64's 128 rows); each on the table's tile with every option off first (d=128's has tma_store_dkv)
OPTIONS = ("stats_ahead", "ds_key_major", "tma_store_dkv", "stats_ahead+ds_key_major+tma_store_dkv")
NO_OPTIONS = dict.fromkeys(OPTIONS[-1].split("+"), False)  # (the last: all three)
OPTION_TWINS = [Sm90BwdVariant(twin, d, "bf16", True) for d in (64, 128) for fields in OPTIONS
                for twin in [dataclasses.replace(bwd_variants.table_tile(d, masked=True)[0],
                                                 **{**NO_OPTIONS, **dict.fromkeys(fields.split("+"), True)})]
                if not bwd_variants.check(twin, d)]


def test_the_option_twins_the_check_accepts():
    assert [(v.head_dim, v.tile.stats_ahead, v.tile.ds_key_major, v.tile.tma_store_dkv) for v in OPTION_TWINS] == [
        (64, False, True, False), (64, False, False, True),
        (128, True, False, False), (128, False, True, False), (128, False, False, True), (128, True, True, True)]


@pytest.mark.parametrize("variant", OPTION_TWINS, ids=[v.name for v in OPTION_TWINS])
def test_backward_options_compile_to_their_instructions(tmp_path, variant):
    """ds_key_major: dS stored by the transposing stmatrix and read by dQ's WGMMA untransposed (only K, its B operand,
    read transposed); stats_ahead: LSE loads between S^T's WGMMA and the first wait for it (none without: the base
    kernel's first loads come after the wait); tma_store_dkv: dK and dV by TMA stores (two each: a 128-byte swizzle
    box holds 64 columns), no global store from a thread. No spill beyond the table tile's, but 8 bytes with
    stats_ahead alone (measured here: d=128 causal keeps two values on the stack; with the other options too, none)."""
    sass = backward_sass(tmp_path, variant, 8 if variant.tile.stats_ahead and not variant.tile.ds_key_major else 0)
    head_dim, tile = variant.head_dim, variant.tile
    stores = (len(re.findall(r"\bUTMASTG\.", sass)), bool(re.search(r"\bSTG\.", sass)))
    assert stores == ((2 * head_dim // 64, False) if variant.tile.tma_store_dkv else (0, True)), stores
    dq_cols = head_dim if tile.tile_m == 128 else head_dim // 2
    assert bool(re.search(r"\bSTSM\.16\.MT88", sass)) == tile.ds_key_major
    assert bool(re.search(rf"HGMMA\.64x{dq_cols}x16\.F32\.BF16 R\d+, gdesc\[UR\d+\]\.tnspA\.tnspB", sass)) != tile.ds_key_major
    first_mma = re.search(rf"HGMMA\.64x{tile.tile_m}x16\.F32\.BF16 R\d+, gdesc\[UR\d+\], RZ, !UPT", sass)
    first_wait = re.search(r"WARPGROUP\.DEPBAR", sass[first_mma.end():])
    assert bool(re.search(r"\bLDS\b", sass[first_mma.end():first_mma.end() + first_wait.start()])) == tile.stats_ahead


# FlashAttention-3's 80-row query block at head dim 128 (dq_transposed: dQ^T = K^T dS^T), which benchmarks/sweep_bwd_sm90.py
# --twin tile_m=80+dq_transposed times beside the table's tile: causal and not, with the other options, deterministic
# in fp16, and the packed form (its LSE rows padded to multiples of 80). (Its WINDOW form keeps 72 bytes on the stack,
# measured here: not one of these.)
DQ_TRANSPOSED_TILE = bwd_variants.Sm90BwdTile(80, dq_transposed=True)
DQ_TRANSPOSED = [Sm90BwdVariant(DQ_TRANSPOSED_TILE, 128, "bf16", False),
                 Sm90BwdVariant(DQ_TRANSPOSED_TILE, 128, "bf16", True),
                 Sm90BwdVariant(dataclasses.replace(DQ_TRANSPOSED_TILE, ds_key_major=True, tma_store_dkv=True), 128,
                                "bf16", False),
                 Sm90BwdVariant(DQ_TRANSPOSED_TILE, 128, "fp16", False, True),
                 Sm90BwdVariant(DQ_TRANSPOSED_TILE, 128, "bf16", False, False, False, True)]


def test_the_transposed_dq_tile_is_checked():
    assert bwd_variants.check(DQ_TRANSPOSED_TILE, 128) == []
    assert bwd_variants.check(dataclasses.replace(DQ_TRANSPOSED_TILE, dq_transposed=False), 128)  # 80 rows need it
    assert bwd_variants.check(DQ_TRANSPOSED_TILE, 64)  # 64 columns of dQ per warpgroup: head dim 128 only
    assert bwd_variants.check(dataclasses.replace(DQ_TRANSPOSED_TILE, stats_ahead=True), 128)  # (registers)
    assert bwd_variants.check(dataclasses.replace(DQ_TRANSPOSED_TILE, tile_m=72), 128)  # (K steps of 16)


@pytest.mark.parametrize("variant", DQ_TRANSPOSED, ids=[v.name for v in DQ_TRANSPOSED])
def test_the_transposed_dq_backward_compiles_to_its_gemm_shapes(tmp_path, variant):
    """S^T and dP^T 64 keys x 80 queries per warpgroup (both operands K-major); dQ^T = K^T dS^T 64 columns x 80
    queries with K^T read transposed (and dS too, unless ds_key_major stores it keys-contiguous); dV and dK 64 keys x
    128 columns over the 80 queries (five K steps), P^T and dS^T from registers. No spill, WGMMAs not serialized."""
    sass = backward_sass(tmp_path, variant, 0)
    shapes = collections.Counter(re.sub(r"R\d+", "R", m) for m in re.findall(
        r"HGMMA\.64x\d+x16\.F32(?:\.BF16)? R\d+, (?:R\d+, )?gdesc\[UR\d+\][.\w]*", sass))
    f32 = "F32.BF16" if variant.dtype == "bf16" else "F32"  # (fp16's inputs go unnamed)
    dq = "gdesc[UR].tnspA" + ("" if variant.tile.ds_key_major else ".tnspB")
    assert set(shapes) == {f"HGMMA.64x80x16.{f32} R, gdesc[UR]", f"HGMMA.64x80x16.{f32} R, {dq}",
                           f"HGMMA.64x128x16.{f32} R, R, gdesc[UR].tnspB"}, shapes
    blocks = shapes[f"HGMMA.64x128x16.{f32} R, R, gdesc[UR].tnspB"] // 10  # (the loop bodies: dV, dK 5 each)
    assert blocks and shapes[f"HGMMA.64x80x16.{f32} R, gdesc[UR]"] == 16 * blocks  # S^T, dP^T: 8 K steps each
    assert shapes[f"HGMMA.64x80x16.{f32} R, {dq}"] == 8 * blocks  # dQ^T: 8 K steps of 128 keys


# The head-dim-256 backward (split_head_dim), both dtypes and causalities, with its deterministic form
SPLIT_BWD = [v for v in KERNEL_BWD + DETERMINISTIC + PADDED_BWD if v.tile.split_head_dim]


FEATURE_FLAGS = ("window", "varlen", "softcap", "alibi")
# its WINDOW, SOFTCAP, ALIBI and VARLEN forms, bf16, each alone and together, causal and not
SPLIT_FEATURE_BWD = [Sm90BwdVariant(bwd_variants.BWD[256][0], 256, "bf16", causal, False,
                                    **{flag: flag in kinds for flag in FEATURE_FLAGS})
                     for kinds in (("window",), ("softcap",), ("alibi",), ("varlen",), ("window", "varlen"),
                                   ("window", "softcap", "alibi"), FEATURE_FLAGS)
                     for causal in (False, True)]
# measured here (stack bytes): 8 for VARLEN alone, causal; 0 for every other form
SPLIT_FEATURE_BWD_SPILL_BYTES = 8


def test_the_head_dim_256_backward_serves_its_feature_forms_only_once_turned_on(monkeypatch):
    tile = bwd_variants.BWD[256][0]
    assert tile.split_head_dim and bwd_variants.SPLIT_HEAD_DIM_SERVED and 256 in SERVED_BWD_HEAD_DIMS
    assert len([v for v in SPLIT_BWD if v.head_dim == 256]) == 6  # fp16 and bf16, causal and not; bf16 deterministic
    assert bwd_variants.pick(256, masked=True) == (tile, [])
    assert bwd_variants.feature_reasons(tile, window=False, varlen=False, softcap=False, alibi=False) == []
    every_kind = [frozenset({kind}) for kind in FEATURE_FLAGS]

    def built_feature_forms():  # what `attnforge build --features window,varlen,softcap,alibi` adds at 256
        return [v for v in registered()["cute_sm90"].variants(dtypes=("bf16",), head_dims=(256,), features=every_kind)
                if isinstance(v, Sm90BwdVariant) and any(getattr(v, flag) for flag in FEATURE_FLAGS)]

    served = bwd_variants.SPLIT_HEAD_DIM_FEATURES_SERVED
    for flag in FEATURE_FLAGS:
        flags = dict.fromkeys(FEATURE_FLAGS, False) | {flag: True}
        assert bwd_variants.feature_reasons(tile, **flags) == ([] if served else
                                                              [bwd_variants.SPLIT_HEAD_DIM_FEATURES_REASON])
    assert len(built_feature_forms()) == (8 if served else 0)
    monkeypatch.setattr(bwd_variants, "SPLIT_HEAD_DIM_FEATURES_SERVED", True)
    assert bwd_variants.feature_reasons(tile, **dict.fromkeys(FEATURE_FLAGS, True)) == []
    assert len(built_feature_forms()) == 8  # each feature alone, causal and not


def assert_split_gemms(sass: str, variant) -> None:
    """The head-dim-256 kernel's five GEMMs in its SASS: the head dim split between the warpgroups."""
    tile = variant.tile
    element = r"\.BF16" if variant.dtype == "bf16" else ""
    half = bwd_variants.kernel_head_dim(variant.head_dim) // 2  # the WGMMAs' head dim, split
    # S^T = K Q^T and dP^T = V dO^T: 64 keys by half the query block per warpgroup, both operands from shared memory
    assert re.search(rf"HGMMA\.64x{tile.tile_m // 2}x16\.F32{element} R\d+, gdesc\[UR\d+\], RZ, !UPT", sass)
    # dV += P^T dO and dK += dS^T Q: P^T and dS^T from shared memory (no register A operand), dO and Q read
    # transposed, half the head dim per warpgroup
    assert len(re.findall(rf"HGMMA\.64x{half}x16\.F32{element} R\d+, gdesc\[UR\d+\]\.tnspB", sass)) >= 2
    assert not re.search(r"HGMMA\.\S+ R\d+, R\d+, gdesc", sass)
    # dQ = dS K: dS and K read transposed, half the head dim per warpgroup
    assert re.search(rf"HGMMA\.64x{half}x16\.F32{element} R\d+, gdesc\[UR\d+\]\.tnspA\.tnspB", sass)


@pytest.mark.parametrize("variant", SPLIT_BWD, ids=[v.name for v in SPLIT_BWD])
def test_head_dim_256_backward_splits_the_head_dim_between_its_warpgroups(tmp_path, variant):
    assert_split_gemms(backward_sass(tmp_path, variant, 0), variant)


@pytest.mark.parametrize("variant", SPLIT_FEATURE_BWD, ids=[v.name for v in SPLIT_FEATURE_BWD])
def test_head_dim_256_feature_backwards_compile_split_with_one_tanh_and_log_per_score(tmp_path, variant):
    sass = backward_sass(tmp_path, variant, SPLIT_FEATURE_BWD_SPILL_BYTES)
    assert_split_gemms(sass, variant)
    # per score of this warpgroup's S^T (64 keys by half the query block, over 128 threads) in each of the step's
    # two copies (masked and not): one MUFU.EX2 for P; with SOFTCAP one MUFU.TANH and one MUFU.LG2
    per_copy = 64 * (variant.tile.tile_m // 2) // 128
    counts = [len(re.findall(rf"MUFU\.{op}\b", sass)) for op in ("EX2", "TANH", "LG2")]
    assert counts == [2 * per_copy] + [2 * per_copy if variant.softcap else 0] * 2, counts


# dv_ahead, the head-dim-256 kernel's option that benchmarks/sweep_bwd_sm90.py --twin dv_ahead times beside the table's
# tile: causal and not, and with tma_store_dkv. (Measured here: 16 stack bytes, 24 causal, 8 with tma_store_dkv; two
# named-barrier ids the dQ handoff computes per warpgroup are what ptxas keeps there.)
DV_AHEAD_TILE = dataclasses.replace(bwd_variants.table_tile(256, masked=True)[0], dv_ahead=True)
DV_AHEAD = [Sm90BwdVariant(DV_AHEAD_TILE, 256, "bf16", False), Sm90BwdVariant(DV_AHEAD_TILE, 256, "bf16", True),
            Sm90BwdVariant(dataclasses.replace(DV_AHEAD_TILE, tma_store_dkv=True), 256, "bf16", True)]


def test_dv_ahead_is_for_the_split_head_dim_tile_only():
    assert bwd_variants.check(DV_AHEAD_TILE, 256) == []
    assert bwd_variants.check(dataclasses.replace(bwd_variants.table_tile(128, masked=True)[0], dv_ahead=True), 128)


def step_events(sass: str) -> list[str]:
    """The head-dim-256 kernel's step in issue order: the P^T barrier (named barrier 7, both consumer warpgroups: 256
    threads), the dS barrier (1), dV's or dK's WGMMA (their last K steps), dQ's (its first) and the waits that leave
    one WGMMA group running."""
    dv = r"HGMMA\.64x128x16\.F32\.BF16 R\d+, gdesc\[UR\d+\]\.tnspB, R\d+, gsb0"  # dV's and dK's last K steps
    dq = r"HGMMA\.64x128x16\.F32\.BF16 R\d+, gdesc\[UR\d+\]\.tnspA\.tnspB, RZ"  # dQ's first
    events = re.findall(rf"BAR\.SYNC\.DEFER_BLOCKING 0x7, 0x100|BAR\.SYNC\.DEFER_BLOCKING 0x1, 0x100|{dv}|{dq}|"
                        r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1", sass)
    return ["p_bar" if "0x7" in e else "ds_bar" if "0x1, 0x100" in e else "dq" if "RZ" in e else
            "wait1" if "DEPBAR" in e else "dv_or_dk" for e in events]


def dk_and_dq(tile) -> list[str]:
    """dK's and dQ's WGMMAs in the tile's issue order (dk_before_dq), then the wait that leaves the second running."""
    return (["dv_or_dk", "dq"] if tile.dk_before_dq else ["dq", "dv_or_dk"]) + ["wait1"]


@pytest.mark.parametrize("variant", DV_AHEAD, ids=[v.name for v in DV_AHEAD])
def test_dv_ahead_issues_dv_between_the_p_barrier_and_the_ds_barrier(tmp_path, variant):
    """In each copy of the step (masked and not), after S^T's wait: P^T stored, the P^T barrier, dV's WGMMA (P^T
    from shared memory), the wait for dP^T that leaves dV running, then the dS barrier and the dQ and dK WGMMAs."""
    sass = backward_sass(tmp_path, variant, 24)
    assert_split_gemms(sass, variant)
    step = ["wait1", "p_bar", "dv_or_dk", "wait1", "ds_bar", *dk_and_dq(variant.tile)]  # (the first wait: S^T)
    assert step_events(sass) == step * 2, step_events(sass)


# The head-dim-256 table tile issues dK before dQ (bwd_variants.py: with one Q stage, Q is released for the next
# block's load while dQ's WGMMA runs); FlashAttention-4's two Q stages and one dO stage, which one dQ staging buffer
# shared by the warpgroups makes room for, are benchmarks/sweep_bwd_sm90.py's
# --twin q_stages=2+do_stages=1+shared_dq_staging: both compiled here, deterministic too (its dQ warp's turns).
TABLE_256 = bwd_variants.table_tile(256, masked=True)[0]
TWO_Q_STAGES_TILE = dataclasses.replace(TABLE_256, q_stages=2, do_stages=1, shared_dq_staging=True)
ISSUE_ORDER = [Sm90BwdVariant(TABLE_256, 256, "bf16", False),
               Sm90BwdVariant(TWO_Q_STAGES_TILE, 256, "bf16", True),
               Sm90BwdVariant(TWO_Q_STAGES_TILE, 256, "bf16", False, True)]


def test_two_q_stages_fit_at_head_dim_256_only_with_one_shared_dq_staging_buffer():
    assert TABLE_256.dk_before_dq and bwd_variants.check(TWO_Q_STAGES_TILE, 256) == []
    assert TWO_Q_STAGES_TILE.smem_bytes(256) <= bwd_variants.SMEM_BYTES
    unshared = dataclasses.replace(TWO_Q_STAGES_TILE, shared_dq_staging=False)
    assert any("shared memory" in r for r in bwd_variants.check(unshared, 256))


@pytest.mark.parametrize("variant", ISSUE_ORDER, ids=[v.name for v in ISSUE_ORDER])
def test_head_dim_256_step_issues_dv_then_dk_and_dq_in_the_tiles_order(tmp_path, variant):
    """Without dv_ahead, after the dS barrier: dV's WGMMA, then dK's and dQ's in the tile's order and the wait that
    leaves the last one running, in each copy of the step (masked and not)."""
    sass = backward_sass(tmp_path, variant, 0)
    assert_split_gemms(sass, variant)
    step = ["wait1", "ds_bar", "dv_or_dk", *dk_and_dq(variant.tile)]  # (the first wait: S^T)
    assert step_events(sass) == step * 2, step_events(sass)


# unmasked_first, an option benchmarks/sweep_bwd_sm90.py --twin unmasked_first times beside the table's tiles: the
# query-block loop's unmasked step first in the code, the masked one (the causal mask's FSELs) second
UNMASKED_FIRST = [Sm90BwdVariant(dataclasses.replace(bwd_variants.table_tile(128, masked=True)[0], unmasked_first=on),
                                 128, "bf16", True) for on in (False, True)]


@pytest.mark.parametrize("variant", UNMASKED_FIRST, ids=[v.name for v in UNMASKED_FIRST])
def test_unmasked_first_orders_the_loops_two_step_copies(tmp_path, variant):
    sass = backward_sass(tmp_path, variant, 0)
    # each copy of the step zero-initialises three accumulators (S^T, dP^T, dQ): the fourth begins the second copy
    starts = [m.start() for m in re.finditer(r"HGMMA\.\S+ R\d+, gdesc\[UR\d+\]\S*, RZ, !UPT", sass)]
    assert len(starts) == 6, len(starts)
    copies = sass[starts[0]:starts[3]], sass[starts[3]:]
    selects = [len(re.findall(r"\bFSEL\b", copy)) for copy in copies]
    masked_copy = 1 if variant.tile.unmasked_first else 0
    assert selects[masked_copy] and not selects[1 - masked_copy], selects


# split_loops, an option benchmarks/sweep_bwd_sm90.py --twin split_loops times beside the table's tiles: each query
# head's masked query blocks, then its unmasked ones, in loops of their own (with a window or a packed batch, the masked
# ones past the window's far edge or a sequence's end in a third), one copy of the step in each; no more spill than the
# table's tile is allowed in the same form (dense, all features, packed)
def split_loops_twin(head_dim: int, **features) -> Sm90BwdVariant:
    tile = bwd_variants.table_tile(head_dim, masked=True)[0]
    tile = bwd_variants.staging_for(tile, features.get("window", False), features.get("varlen", False),
                                    features.get("softcap", False), features.get("alibi", False))
    return Sm90BwdVariant(dataclasses.replace(tile, split_loops=True), head_dim, "bf16", True, **features)


SPLIT_LOOPS = [(split_loops_twin(64), 0, 2), (split_loops_twin(128), 0, 2),
               (split_loops_twin(128, window=True, softcap=True, alibi=True), FEATURE_BWD_SPILL_BYTES[128], 3),
               (split_loops_twin(64, varlen=True), VARLEN_BWD_SPILL_BYTES[64], 3)]


@pytest.mark.parametrize("variant, spill_bytes, copies", SPLIT_LOOPS, ids=[v.name for v, _, _ in SPLIT_LOOPS])
def test_split_loops_give_each_range_its_own_step(tmp_path, variant, spill_bytes, copies):
    assert bwd_variants.check(variant.tile, variant.head_dim) == []
    sass = backward_sass(tmp_path, variant, spill_bytes)
    # each copy of the step zero-initialises three accumulators (S^T, dP^T, dQ): copies in the loops' order
    starts = [m.start() for m in re.finditer(r"HGMMA\.\S+ R\d+, gdesc\[UR\d+\]\S*, RZ, !UPT", sass)]
    assert len(starts) == 3 * copies, len(starts)
    if not (variant.window or variant.varlen):  # the causal mask's selects in the first (masked) copy only
        selects = [len(re.findall(r"\bFSEL\b", copy)) for copy in (sass[starts[0]:starts[3]], sass[starts[3]:])]
        assert selects[0] and not selects[1], selects


def test_split_loops_and_unmasked_first_do_not_combine():
    tile = dataclasses.replace(bwd_variants.table_tile(128, masked=True)[0], split_loops=True, unmasked_first=True)
    assert any("split_loops" in r for r in bwd_variants.check(tile, 128))


# k_first, an option benchmarks/sweep_bwd_sm90.py --twin k_first times beside the table's tiles: K and V on two stages
# of their pipeline, V's waited for in the first step, so each copy of the step carries a barrier wait more
def twin_counts(tmp_path, head_dim: int, option: str, pattern: str) -> dict[bool, int]:
    """How often ``pattern`` occurs in the SASS of the table's causal tile for ``head_dim`` with the boolean tile
    ``option`` off and on (each twin checked valid and compiled without spills)."""
    tile = bwd_variants.table_tile(head_dim, masked=True)[0]
    counts = {}
    for on in (False, True):
        twin = dataclasses.replace(tile, **{option: on})
        assert bwd_variants.check(twin, head_dim) == []
        sass = backward_sass(tmp_path / str(on), Sm90BwdVariant(twin, head_dim, "bf16", True), 0)
        counts[on] = len(re.findall(pattern, sass))
    return counts


@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_k_first_waits_for_v_in_the_first_step(tmp_path, head_dim):
    waits = twin_counts(tmp_path, head_dim, "k_first", r"SYNCS\.PHASECHK\S*TRYWAIT")
    assert waits[True] > waits[False], waits


# try_wait_first, an option benchmarks/sweep_bwd_sm90.py --twin try_wait_first times beside the table's tiles: the
# consumers' waits for Q and dO each a try-wait and then the wait, so two barrier tries more per step copy
@pytest.mark.parametrize("head_dim", (64, 128))
def test_try_wait_first_tries_q_and_do_twice(tmp_path, head_dim):
    waits = twin_counts(tmp_path, head_dim, "try_wait_first", r"SYNCS\.PHASECHK\S*TRYWAIT")
    assert waits[True] == waits[False] + 4, waits


# flat_dq, an option benchmarks/sweep_bwd_sm90.py --twin flat_dq times beside the table's tiles: each warpgroup's dQ
# share leaves registers by 128-bit stores (one per four accumulator values: two copies of the step, 64 x N / 128 / 4
# each) and is added by the 1-D bulk reduce-add, with no TMA reduce-add left
FLAT_DQ_TILES = [(d, masked) for d in bwd_variants.KERNEL_HEAD_DIMS for masked in (False, True)
                 if d != 256 or masked]  # (d=256 has one tile)


@pytest.mark.parametrize("head_dim, masked", FLAT_DQ_TILES, ids=lambda x: str(x))
def test_flat_dq_stages_by_128_bit_stores_and_one_bulk_reduce_add(tmp_path, head_dim, masked):
    tile = dataclasses.replace(bwd_variants.table_tile(head_dim, masked=masked)[0], flat_dq=True)
    assert bwd_variants.check(tile, head_dim) == []
    sass = backward_sass(tmp_path, Sm90BwdVariant(tile, head_dim, "bf16", masked), 0)
    along_n = tile.tile_m if tile.dq_transposed else head_dim // (1 if tile.tile_m == 128 else 2)
    assert len(re.findall(r"\bSTS\.128\b", sass)) == 2 * along_n // 8, along_n
    assert "UTMAREDG" not in sass and len(re.findall(r"\bUBLKRED\.G\.S\.ADD\.F32", sass)) == 2


# early_do_release, an option benchmarks/sweep_bwd_sm90.py --twin early_do_release times beside the table's tiles: dO's
# stage released once dV's WGMMA is done and before dK's is issued, which takes one WGMMA wait more in each copy of the
# step (the wait for dV, then the one for dQ), with nothing spilled
@pytest.mark.parametrize("head_dim", (64, 128))
def test_early_do_release_waits_for_dv_before_issuing_dk(tmp_path, head_dim):
    waits = twin_counts(tmp_path, head_dim, "early_do_release", r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1\b")
    assert waits[True] == waits[False] + 2, waits


def test_early_do_release_is_for_tiles_that_issue_dq_first():
    tile = dataclasses.replace(bwd_variants.table_tile(256, masked=True)[0], early_do_release=True)
    assert tile.dk_before_dq and any("early_do_release" in r for r in bwd_variants.check(tile, 256))


# longest_first, an option benchmarks/sweep_bwd_sm90.py --twin longest_first=N times beside the table's tiles: a causal
# kernel's grid is 1-D (its block index decoded into key block, kv head and batch), so its SASS reads the block index's
# x only; kernels without a causal mask, and the deterministic one (whose causal order dq_turn fixes), keep the 3-D grid
LONGEST_FIRST = [(64, True, False), (128, True, False), (256, True, False), (128, False, False), (128, True, True)]


@pytest.mark.parametrize("head_dim, causal, deterministic", LONGEST_FIRST, ids=lambda x: str(x))
def test_longest_first_decodes_a_one_dimensional_grid_in_causal_kernels_only(tmp_path, head_dim, causal,
                                                                              deterministic):
    tile = dataclasses.replace(bwd_variants.table_tile(head_dim, masked=causal)[0], longest_first=16)
    assert bwd_variants.check(tile, head_dim) == []
    variant = Sm90BwdVariant(tile, head_dim, "bf16", causal, deterministic=deterministic)
    sass = backward_sass(tmp_path, variant, 0)
    one_dimensional = causal and not deterministic
    assert "SR_CTAID.X" in sass and ("SR_CTAID.Y" in sass) != one_dimensional, variant.name


def test_longest_first_counts_kv_heads():
    tile = dataclasses.replace(bwd_variants.table_tile(128, masked=True)[0], longest_first=-1)
    assert any("longest_first" in r for r in bwd_variants.check(tile, 128))


# persistent, an option benchmarks/sweep_bwd_sm90.py --twin persistent times beside the table's tiles: the tiles that
# take it claim their tiles by one atomic add and store dK and dV by their TMA stores (two each: a 128-byte swizzle box
# holds 64 columns), spilling nothing beyond what the tile accepts (measured here: the windowed forms keep 8-16 bytes on
# the stack, d=64's window form 40 without it; the packed form what it keeps without it); the deterministic and packed
# kernels run one CTA per tile and claim none
PERSISTENT = [(64, True, {}), (128, True, {}), (128, False, {}), (96, False, {}), (128, True, {"deterministic": True}),
              (64, True, {"window": True}), (128, True, {"varlen": True})]  # (packed: dQ through the swizzled tile)


@pytest.mark.parametrize("head_dim, causal, forms", PERSISTENT, ids=str)
def test_persistent_claims_its_tiles_by_one_atomic_add(tmp_path, head_dim, causal, forms):
    tile = dataclasses.replace(bwd_variants.table_tile(head_dim, masked=True)[0], persistent=True,
                               flat_dq=not forms.get("varlen"))
    assert bwd_variants.check(tile, head_dim) == []
    variant = Sm90BwdVariant(tile, head_dim, "bf16", causal, **forms)
    spill = VARLEN_BWD_SPILL_BYTES[head_dim] if forms.get("varlen") else 16 if forms.get("window") else 0
    sass = backward_sass(tmp_path, variant, spill)
    one_per_tile = forms.get("deterministic") or forms.get("varlen")
    assert len(re.findall(r"\bATOMG\.", sass)) == (0 if one_per_tile else 1)
    stores = len(re.findall(r"\bUTMASTG\.", sass))
    assert stores == (0 if forms.get("varlen") else 2 * bwd_variants.kernel_head_dim(head_dim) // 64), stores


def test_persistent_needs_room_to_stage_dk_and_dv_and_a_tile_it_can_loop():
    def reasons(head_dim, masked=True, **fields):
        tile = dataclasses.replace(bwd_variants.table_tile(head_dim, masked=masked)[0], persistent=True, **fields)
        return " ".join(bwd_variants.check(tile, head_dim))
    assert "shared memory" in reasons(128, masked=False)  # the 80-row tile: dS's buffer and dV's beside it do not fit
    assert "split_head_dim" in reasons(256)
    assert "tma_store_dkv" in reasons(64, tma_store_dkv=False)
    assert "k_first" in reasons(128, k_first=True) and "dO stages" in reasons(128, do_stages=1)
    tile = dataclasses.replace(bwd_variants.table_tile(128, masked=True)[0], persistent=True)
    assert tile.smem_bytes(128) - bwd_variants.table_tile(128, masked=True)[0].smem_bytes(128) == 128 * 128 * 2

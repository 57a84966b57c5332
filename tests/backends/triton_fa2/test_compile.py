"""Every kernel the variant table can pick compiles with no GPU (triton.compile for a GPUTarget),
and the machine code shows what the target must use."""

import dataclasses
import re

import pytest
import torch
import triton

from attnforge.backends.triton_fa2 import variants
from attnforge.backends.triton_fa2.backend import TritonVariant
from attnforge.cli import main
from attnforge.dispatch import registered
from attnforge.runtime import triton_aot, triton_launch


def plan(archs, **kw):
    """What `attnforge build` compiles for triton_fa2's attention kernels on ``archs``: every build of every forward
    and backward variant it can pick (the KV-cache kernels: test_kvcache_kernels_compile_for_their_targets)."""
    backend = registered()["triton_fa2"]
    return list(dict.fromkeys(b for v in backend.variants(archs, strict=True, **kw) if v.family != "kvcache"
                              for b in backend.builds(v)))


# The kernels of a forward and backward variant's builds for an NVIDIA target: each kernel with a GROUP parameter
# twice, the second compiled for calls that pass GROUP = 1 (aot.at_one), as the JIT compiles those.
ATTENTION_KERNELS = ["dkdv_kernel", "dkdv_kernel.group1", "dq_kernel", "dq_kernel.group1", "fwd_kernel",
                     "fwd_kernel.group1", "preprocess_kernel"]


def kernels(builds) -> list[str]:
    """The builds' kernel names, ".group1" added where a build compiles GROUP as 1."""
    return sorted(b.kernel + (".group1" if dict(b.constexprs).get("GROUP") == 1 else "") for b in builds)


# Spills of GROUP = 1 builds, measured: the JIT compiles a call without grouped-query attention the same way, so
# these are the spills such a call has had under the JIT too (Triton 3.9; the generic builds spill nothing)
AT_ONE_SPILL_BYTES = {("sm80", 256, "dq_kernel.group1"): 8}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("kernels")


@pytest.mark.parametrize("arch", ["sm80", "sm89"])
@pytest.mark.parametrize("head_dim", variants.HEAD_DIMS)
def test_ampere_ada_kernels_use_tensor_cores_and_do_not_spill(arch, head_dim, cache):
    """Spills are asserted with the Triton release the tiles were swept with (variants.SPILL_CHECKED_WITH)."""
    builds = plan([arch], dtypes=("bf16",), head_dims=(head_dim,), causal=(True,))
    assert kernels(builds) == ATTENTION_KERNELS
    for b in builds:
        meta, _ = triton_aot.build_cached(b, cache, keep_asm=True)
        if b.kernel != "preprocess_kernel":
            assert any(i.startswith("HMMA.16816") for i in meta["instructions"]), (b.name(), meta["instructions"])
        if triton.__version__.startswith(variants.SPILL_CHECKED_WITH + "."):  # what CI installs
            allowed = AT_ONE_SPILL_BYTES.get((arch, head_dim, kernels([b])[0]), 0)
            assert meta["stack_bytes"] <= allowed, f"{b.name()} spills {meta['stack_bytes']} B to local memory"
        assert meta["shared_bytes"] <= variants.SMEM[arch], b.name()


@pytest.mark.parametrize("head_dim", (64, 128))
def test_hopper_kernels_use_wgmma_and_tma(head_dim, cache):
    # sm90's backward tiles were chosen by speed on the H200 (Triton 3.6 there); with CI's Triton
    # their dK/dV kernel spills at d=128, so spills are not asserted for sm90.
    builds = plan(["sm90"], dtypes=("bf16",), head_dims=(head_dim,), causal=(False,))
    assert kernels(builds) == ATTENTION_KERNELS
    for b in builds:
        meta, _ = triton_aot.build_cached(b, cache, keep_asm=True)
        if b.kernel == "fwd_kernel":
            assert {"UTMALDG.4D"} <= set(meta["instructions"]), meta["instructions"]
        if b.kernel != "preprocess_kernel":
            assert any(i.startswith("HGMMA.64x") for i in meta["instructions"]), (b.name(), meta["instructions"])


def test_cache_hits_and_rebuilds_corrupt_entries(tmp_path):
    (b,) = [x for x in plan(["sm80"], dtypes=("fp16",), head_dims=(64,), causal=(True,))
            if x.kernel == "fwd_kernel" and "GROUP" not in dict(x.constexprs)]
    meta, built = triton_aot.build_cached(b, tmp_path)
    assert built and (tmp_path / meta["key"] / "kernel.cubin").is_file()
    again, built = triton_aot.build_cached(b, tmp_path)
    assert not built and again == meta
    (tmp_path / meta["key"] / "kernel.cubin").write_bytes(b"torn write")
    rebuilt, built = triton_aot.build_cached(b, tmp_path)
    assert built and rebuilt["binary_bytes"] == meta["binary_bytes"]
    with_asm, built = triton_aot.build_cached(b, tmp_path, keep_asm=True)  # asm asked later: rebuilt with it
    assert built and (tmp_path / meta["key"] / "kernel.sass").read_text().count("HMMA") > 0


def test_cache_key_follows_source_and_target():
    fwd = [b for b in plan(["sm80", "sm89"], dtypes=("bf16",), head_dims=(64,)) if b.kernel == "fwd_kernel"]
    # full and causal, each generic and for GROUP = 1, on two archs
    assert len({triton_aot.fingerprint(b) for b in fwd}) == len(fwd) == 8
    # the kernel file's source is in the key: the same build naming another rendered module's file is another entry
    other = TritonVariant("fwd", variants.FwdTile(32, 32, 4, 1), "triton_fa2_fwd.py.jinja", "sm80", 64, "bf16", False)
    other_path = registered()["triton_fa2"].builds(other)[0].path
    assert other_path != fwd[0].path
    assert triton_aot.fingerprint(dataclasses.replace(fwd[0], path=other_path)) != triton_aot.fingerprint(fwd[0])


def test_build_cli(tmp_path, capsys):
    assert main(["build", "--target", "sm89", "--head-dim", "64", "--dtype", "fp16", "--list"]) == 0
    listed = capsys.readouterr().out
    assert "fwd_kernel.sm89.fp16.d64.causal" in listed and "13 kernels" in listed
    assert "dkdv_kernel.sm89.fp16.d64.causal.group1" in listed
    assert main(["build", "--target", "sm89", "--head-dim", "64", "--dtype", "fp16", "--causal", "true",
                 "--out", str(tmp_path), "--keep-asm"]) == 0
    out, err = capsys.readouterr()
    assert "7 kernels in" in out and "[7/7]" in err and "HMMA" in err
    assert len(list(tmp_path.glob("*/kernel.sass"))) == 7
    assert main(["build", "--target", "sm75", "--list"]) == 2
    assert "unknown build target 'sm75'" in capsys.readouterr().err
    # --features: the windowed kernels, and softcap with sinks in one, beside the plain ones
    assert main(["build", "--target", "sm89", "--head-dim", "64", "--dtype", "fp16", "--causal", "true",
                 "--features", "window,softcap+sinks", "--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert "fwd_kernel.sm89.fp16.d64.full.local" in "\n".join(listed) and "19 kernels" in listed[-1]
    assert any(line.endswith("fwd_kernel.sm89.fp16.d64.causal.softcap.has_sinks") for line in listed)
    with pytest.raises(SystemExit):
        main(["build", "--target", "sm89", "--features", "window+bogus", "--list"])
    assert "unknown feature bogus" in capsys.readouterr().err


def test_prebuilt_kernels_load_from_the_cache_without_compiling(tmp_path, monkeypatch):
    builds = plan(["sm90"], dtypes=("bf16",), head_dims=(64,), causal=(True,))
    assert triton_aot.load_cached(builds[0], tmp_path) is None  # nothing built yet
    for b in builds:
        triton_aot.build_cached(b, tmp_path)
    for b in builds:
        kernel = triton_aot.load_cached(b, tmp_path)
        assert kernel.metadata.name == b.kernel and kernel.metadata.num_warps == b.num_warps
    other_target = dataclasses.replace(builds[0], arch="sm80")
    assert triton_aot.load_cached(other_target, tmp_path) is None  # keyed by target: no wrong cubin
    # What a launch on an sm90 device looks up (the generated module's kernel, its constexprs, warps and
    # stages, as its launch() passes them) is what was built: the first call compiles nothing.
    monkeypatch.setattr(triton_launch, "_arch", lambda device: "sm90")
    (variant,) = [v for v in registered()["triton_fa2"].variants(["sm90"], dtypes=("bf16",), head_dims=(64,),
                                                                   causal=(True,)) if v.family == "fwd"]
    tile = variant.tile
    lookup = dict(kernel=variant.module.fwd_kernel, device=torch.device("cuda"), dtype_name="bf16",
                  constexprs=dict(HEAD_DIM=64, D=64, CAUSAL=True, LOCAL=False, SOFTCAP=False, HAS_SINKS=False,
                                  ALIBI=False, VARLEN=False),
                  num_warps=tile.num_warps,
                  num_stages=tile.num_stages)
    found = triton_launch.find_prebuilt(**lookup, cache_dir=tmp_path)
    assert found is not None and found.metadata.name == "fwd_kernel"
    assert triton_launch.find_prebuilt(**dict(lookup, constexprs=dict(HEAD_DIM=64, D=64, CAUSAL=False, LOCAL=False,
                                                                      SOFTCAP=False, HAS_SINKS=False, ALIBI=False,
                                                                      VARLEN=False)),
                                       cache_dir=tmp_path) is None  # not built: the JIT serves it
    # a sliding window's LOCAL kernel (CAUSAL folded into its window) is not built ahead of time either
    local_flags = dict(HEAD_DIM=64, D=64, CAUSAL=False, LOCAL=True, SOFTCAP=False, HAS_SINKS=False, ALIBI=False,
                       VARLEN=False)
    assert triton_launch.find_prebuilt(**dict(lookup, constexprs=local_flags), cache_dir=tmp_path) is None
    # unless `attnforge build --features window` asks: then a windowed call's kernel (its variant's module) is found
    (local,) = [v for v in registered()["triton_fa2"].variants(["sm90"], dtypes=("bf16",), head_dims=(64,),
                                                                 causal=(True,), features=(frozenset({"window"}),))
                if v.family == "fwd" and v.local]
    for b in registered()["triton_fa2"].builds(local):
        triton_aot.build_cached(b, tmp_path)
    found = triton_launch.find_prebuilt(**dict(lookup, kernel=local.module.fwd_kernel, constexprs=local_flags),
                                        cache_dir=tmp_path)
    assert found is not None and found.metadata.name == "fwd_kernel"


@pytest.mark.parametrize("backend,arch", [("triton_fa2", "sm90"), ("triton_fa2", "sm80"), ("triton_rocm", "gfx942")])
def test_varlen_kernels_compile_for_their_targets(backend, arch, cache):
    """attention_varlen's VARLEN kernels (forward and backward, pointer loads: on sm90 the plain forward tile's
    descriptor loads become pointer loads) compile for each target with no GPU, with the offsets typed int32."""
    b = registered()[backend]
    variants_ = b.variants([arch], dtypes=("bf16",), head_dims=(128,), causal=(True,),
                           features=(frozenset({"varlen"}),))
    variants_ = [v for v in variants_ if v.varlen]
    assert {v.family for v in variants_} == {"fwd", "bwd"}
    assert all(getattr(v.tile, "loads", "pointer") == "pointer" for v in variants_)
    for variant in variants_:
        builds = b.builds(variant)
        assert {x.kernel for x in builds} == set({"fwd": ("fwd_kernel",), "bwd": ("dkdv_kernel", "dq_kernel",
                                                                                "preprocess_kernel")}[variant.family])
        for build in builds:
            assert dict(build.constexprs)["VARLEN"] is True and ".varlen" in build.name()
            assert {("CU_Q", "*i32"), ("CU_K", "*i32")} & set(build.signature), build.signature
            meta, _ = triton_aot.build_cached(build, cache)
            assert meta["shared_bytes"] <= variants.SMEM[arch], build.name()


@pytest.mark.parametrize("backend,arch", [("triton_fa2", "sm90"), ("triton_fa2", "sm80"), ("triton_rocm", "gfx942")])
def test_kvcache_kernels_compile_for_their_targets(backend, arch, cache):
    """The KV-cache modules' prebuilt kernels (contiguous and paged variants, one split and fp32 partials, the combine)
    compile for each target with no GPU: the interpreter does not type-check what the compiler does."""
    b = registered()[backend]
    variants_ = b.variants([arch], dtypes=("bf16",), head_dims=(128,), causal=(True,),
                           features=(frozenset({"kvcache", "softcap"}),))
    variants_ = [v for v in variants_ if v.family == "kvcache"]
    assert all(v.softcap for v in variants_)
    assert variants_
    for variant in variants_:
        builds = b.builds(variant)
        assert {x.kernel for x in builds} == {"kvcache_kernel", "combine_kernel"}
        assert all(dict(x.constexprs)["PAGED"] == variant.paged for x in builds if x.kernel == "kvcache_kernel")
        for build in builds[:3]:  # the two kvcache_kernel specialisations (one split, partials) and one combine
            meta, _ = triton_aot.build_cached(build, cache)
            assert meta["shared_bytes"] <= variants.SMEM[arch], build.name()


@pytest.mark.parametrize("backend,arch", [("triton_fa2", "sm90"), ("triton_fa2", "sm80"), ("triton_rocm", "gfx942")])
def test_paged_kvcache_kernels_with_lookahead_compile(backend, arch, cache):
    """KVTile.lookahead (block-table entries read a key step ahead), a template option no table tile takes: the
    paged kernels of each target's d=128 decode tile compile with it, within the shared memory the tile's estimate
    names."""
    b = registered()[backend]
    variant = next(v for v in b.variants([arch], dtypes=("bf16",), head_dims=(128,), causal=(True,),
                                         features=(frozenset({"kvcache"}),)) if v.family == "kvcache" and v.paged)
    variant = dataclasses.replace(variant, tile=dataclasses.replace(variant.tile, lookahead=True))
    assert variant.tile.module.endswith("_la") and not variants.check(variant.tile, arch, 128)
    for build in [x for x in b.builds(variant) if x.kernel == "kvcache_kernel"]:
        meta, _ = triton_aot.build_cached(build, cache)
        assert meta["shared_bytes"] <= variant.tile.smem_bytes(128, arch) <= variants.SMEM[arch], build.name()


@pytest.mark.parametrize("backend,arch", [("triton_fa2", "sm90"), ("triton_fa2", "sm80"), ("triton_rocm", "gfx942")])
def test_kvcache_kernels_of_a_head_dim_between_the_tables_compile(backend, arch, cache):
    """Head dim 80 (variants.KV_HEAD_DIMS): only the KV-cache kernels are built for it (the attention kernels keep
    their head dims), padded to the 128 kernel's tile width with 80 real columns, and they compile for each target."""
    b = registered()[backend]
    planned = b.variants([arch], dtypes=("bf16",), head_dims=(80,), causal=(True,), strict=True,
                         features=(frozenset({"kvcache"}),))
    assert planned and all(v.family == "kvcache" and v.head_dim == 80 for v in planned)
    for variant in planned[:2]:  # the decode tile, contiguous and paged
        build = b.builds(variant)[0]
        assert (dict(build.constexprs)["D"], dict(build.constexprs)["HEAD_DIM"]) == (80, 128)
        meta, _ = triton_aot.build_cached(build, cache)
        assert meta["shared_bytes"] <= variants.SMEM[arch], build.name()


@pytest.mark.parametrize("arch", ["sm90", "sm89"])
def test_fp8_kvcache_kernels_compile(arch, cache):
    """The FP8_KV KV-cache kernels (e4m3 caches, fp16/bf16 queries) compile for the archs that convert e4m3 in
    hardware, with K and V typed fp8e4nv and the conversion in the machine code; sm80 has no such variant."""
    b = registered()["triton_fa2"]
    kinds = (frozenset({"kvcache", "fp8"}),)
    variants_ = [v for v in b.variants([arch], dtypes=("bf16",), head_dims=(128,), causal=(True,), features=kinds)
                 if v.family == "kvcache"]
    assert variants_ and all(v.fp8_kv for v in variants_)
    assert not [v for v in b.variants(["sm80"], dtypes=("bf16",), head_dims=(128,), features=kinds)
                if v.family == "kvcache"]
    for variant in variants_[:2]:  # contiguous and paged
        (build, *_) = b.builds(variant)
        assert dict(build.constexprs)["FP8_KV"] is True and ".fp8_kv" in build.name()
        assert {("K", "*fp8e4nv"), ("V", "*fp8e4nv"), ("DESCALE", "*fp32")} <= set(build.signature)
        meta, _ = triton_aot.build_cached(build, cache, keep_asm=True)
        sass = (cache / meta["key"] / "kernel.sass").read_text()
        assert "F2FP.F16.E4M3.UNPACK_B" in sass, build.name()  # e4m3 converted in hardware, two at a time
        assert any(i.startswith("HMMA") for i in meta["instructions"]), meta["instructions"]


@pytest.mark.parametrize("arch", ["sm90", "sm80"])
def test_prebuilt_kernels_load_their_tiles_16_bytes_at_a_time(arch, cache):
    """A prebuilt kernel is compiled as the JIT compiles the same call (row strides multiples of 16:
    aot.UNALIGNED_STRIDES), so its tiles load 16 bytes per instruction (LDG.E.128, or cp.async's
    LDGSTS.E.BYPASS.128 where the loop pipelines them) and never one 2-byte element at a time (LDG.E.U16), as builds
    with only their pointers aligned did: an element-wise, unpipelined K/V load in the backward and KV-cache kernels."""
    b = registered()["triton_fa2"]
    planned = b.variants([arch], dtypes=("bf16",), head_dims=(128,), causal=(True,), strict=True,
                         features=(frozenset(), frozenset({"kvcache"})))
    builds = [x for v in planned for x in b.builds(v)
              if x.kernel != "combine_kernel" and dict(x.constexprs).get("SPLIT", True)]
    assert {x.kernel for x in builds} == {"fwd_kernel", "dkdv_kernel", "dq_kernel", "preprocess_kernel",
                                          "kvcache_kernel"}
    for build in builds:
        assert "stride_kn" in build.aligned or build.kernel == "preprocess_kernel", build.aligned
        triton_aot.build_cached(build, cache, keep_asm=True)
        sass = (triton_aot.entry_path(build, cache) / "kernel.sass").read_text()
        assert "LDG.E.U16" not in sass, f"{build.name()} loads 2-byte elements"
        if build.kernel != "fwd_kernel" or arch == "sm80":  # (sm90's forward loads by TMA)
            assert "LDG.E.128" in sass or "LDGSTS.E.BYPASS.128" in sass, build.name()


def test_row_strides_are_specialised_only_where_the_head_dim_makes_them_multiples_of_16():
    """A head dim that is not a multiple of 16 (72) makes a natural layout's row strides not multiples of 16 either:
    its prebuilt kernel keeps them unspecialised, so that it serves those calls (as the JIT would compile them)."""
    from attnforge.backends.triton_fa2 import aot

    b = registered()["triton_fa2"]
    variant = next(v for v in b.variants(["sm90"], dtypes=("bf16",), head_dims=(72,), causal=(True,), strict=True,
                                         features=(frozenset({"kvcache"}),)) if v.family == "kvcache")
    fn = triton_aot.kernel_function(str(b.builds(variant)[0].path), "kvcache_kernel")
    for head_dim, strides in ((72, set()), (128, {"stride_qm", "stride_kn", "stride_vn", "stride_os"})):
        _, aligned = aot.signature(fn, "bf16", head_dim)
        assert strides <= set(aligned) and (strides or not [a for a in aligned if a.startswith("stride")]), aligned
        assert not aot.UNALIGNED_STRIDES & set(aligned)


def test_group_one_builds_drop_the_loop_over_the_group(cache, tmp_path):
    """Each kernel with a GROUP parameter is built a second time for the common call as Triton's JIT compiles it
    (aot.at_one): GROUP = 1, so the dK/dV kernel has no loop over the group, and sequence lengths that are
    multiples of 16 (triton_aot.COMMON_MULTIPLES_OF_16), which take further instructions off."""
    builds = [b for b in plan(["sm90"], dtypes=("bf16",), head_dims=(128,), causal=(True,)) if b.kernel == "dkdv_kernel"]
    assert kernels(builds) == ["dkdv_kernel", "dkdv_kernel.group1"]
    generic_build, common_build = sorted(builds, key=lambda b: kernels([b])[0])
    assert set(triton_aot.COMMON_MULTIPLES_OF_16) <= set(common_build.aligned) - set(generic_build.aligned)
    # the same build with its lengths unspecialised: the same cache key (a launch finds a build by its constants and
    # reads what it assumes from the entry), so it goes into a cache of its own
    any_lengths = dataclasses.replace(common_build, aligned=generic_build.aligned)
    counts = []
    for b, where in ((generic_build, cache), (any_lengths, tmp_path), (common_build, cache)):
        triton_aot.build_cached(b, where, keep_asm=True)
        sass = (triton_aot.entry_path(b, where) / "kernel.sass").read_text()
        counts.append(len(re.findall(r"^\S*\t", sass, re.M)))
    generic, at_one, common = counts
    assert at_one < 0.95 * generic and common < at_one, counts

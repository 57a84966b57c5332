"""triton_rocm's kernels compile for gfx90a, gfx942 and gfx950 with no GPU, use MFMA, and (with the
Triton release the tiles were swept with) need no scratch: no spills."""

import pytest
import triton

from attnforge.backends.triton_fa2.variants import SMEM, SPILL_CHECKED_WITH
from attnforge.backends.triton_rocm import variants
from attnforge.cli import main
from attnforge.dispatch import registered
from attnforge.runtime import triton_aot


def plan(archs, **kw):
    """What `attnforge build` compiles for triton_rocm on ``archs``: every build of every variant it can pick."""
    backend = registered()["triton_rocm"]
    return list(dict.fromkeys(b for v in backend.variants(archs, strict=True, **kw) for b in backend.builds(v)))

MFMA = {"gfx90a": "v_mfma_f32_16x16x16bf16_1k", "gfx942": "v_mfma_f32_16x16x16_bf16", "gfx950": "v_mfma_f32_16x16x32_bf16"}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("kernels")


@pytest.mark.parametrize("arch", ["gfx90a", "gfx942", "gfx950"])
@pytest.mark.parametrize("head_dim", variants.HEAD_DIMS)
def test_cdna_kernels_use_mfma_and_do_not_spill(arch, head_dim, cache):
    builds = plan([arch], dtypes=("bf16",), head_dims=(head_dim,), causal=(True,))
    assert sorted(b.kernel for b in builds) == ["dkdv_kernel", "dq_kernel", "fwd_kernel", "preprocess_kernel"]
    for b in builds:
        meta, _ = triton_aot.build_cached(b, cache)
        assert meta["binary"] == "kernel.hsaco" and dict(b.options)["waves_per_eu"] in (1, 2)
        if b.kernel != "preprocess_kernel":
            assert any(i.startswith("v_mfma_f32_") for i in meta["instructions"]), (b.name(), meta["instructions"])
        if triton.__version__.startswith(SPILL_CHECKED_WITH + "."):
            assert meta["stack_bytes"] == 0 and meta["vgpr_spills"] == 0, f"{b.name()}: {meta}"
        assert meta["shared_bytes"] <= SMEM[arch], b.name()


def test_mfma_shape_follows_the_arch_and_options(cache):
    for arch, insn in MFMA.items():
        (b,) = [x for x in plan([arch], dtypes=("bf16",), head_dims=(64,), causal=(False,)) if x.kernel == "fwd_kernel"]
        meta, _ = triton_aot.build_cached(b, cache)
        assert insn in meta["instructions"], (arch, meta["instructions"])


def test_build_cli_for_amd(tmp_path, capsys):
    assert main(["build", "--target", "gfx942", "--head-dim", "128", "--dtype", "fp16", "--causal", "false",
                 "--out", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "4 kernels in" in out and "VGPRs" in err and "v_mfma" in err
    assert len(list(tmp_path.glob("*/kernel.amdgcn"))) == 4


# The instruction that converts two cache elements of each arch's own fp8 format in hardware (for bf16 queries)
FP8_CONVERT = {"gfx942": ("fp8_fnuz", "fp8e4b8", "v_cvt_pk_f32_fp8"),  # CDNA3: e4m3fnuz, to fp32 pairs
               "gfx950": ("fp8", "fp8e4nv", "v_cvt_scalef32_pk_bf16_fp8")}  # CDNA4: OCP e4m3, straight to bf16


@pytest.mark.parametrize("arch", sorted(FP8_CONVERT))
def test_fp8_kvcache_kernels_convert_their_arch_format_in_hardware(arch, cache):
    kv_dtype, triton_type, convert = FP8_CONVERT[arch]
    backend = registered()["triton_rocm"]
    assert backend.FP8_KV_ARCHS[kv_dtype] == (arch,)
    kinds = (frozenset({"kvcache", kv_dtype}),)
    fp8 = [v for v in backend.variants([arch], dtypes=("bf16",), head_dims=(128,), causal=(True,), features=kinds)
           if v.family == "kvcache"]
    assert fp8 and all(v.kv_dtype == kv_dtype for v in fp8)
    for variant in fp8[:2]:  # contiguous and paged
        (build, *_) = backend.builds(variant)
        assert dict(build.constexprs)["FP8_KV"] is True
        assert {("K", f"*{triton_type}"), ("V", f"*{triton_type}"), ("DESCALE", "*fp32")} <= set(build.signature)
        meta, _ = triton_aot.build_cached(build, cache, keep_asm=True)
        asm = (cache / meta["key"] / "kernel.amdgcn").read_text()
        assert asm.count(convert) >= 32, build.name()  # a 64 x 128 tile of K and of V, two elements at a time
        assert any(i.startswith("v_mfma_f32_") for i in meta["instructions"]), meta["instructions"]
        if triton.__version__.startswith(SPILL_CHECKED_WITH + "."):
            assert meta["stack_bytes"] == 0 and meta["vgpr_spills"] == 0, f"{build.name()}: {meta}"
    other = "fp8" if kv_dtype == "fp8_fnuz" else "fp8_fnuz"  # the other format is not built for this arch
    assert not [v for v in backend.variants([arch], dtypes=("bf16",), head_dims=(128,),
                                            features=(frozenset({"kvcache", other}),)) if v.family == "kvcache"]
    assert not [v for v in backend.variants(["gfx90a"], dtypes=("bf16",), head_dims=(128,), features=kinds)
                if v.family == "kvcache"]  # CDNA2 has no fp8

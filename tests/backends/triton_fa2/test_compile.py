"""Every kernel the variant table can pick compiles with no GPU (triton.compile for a GPUTarget),
and the machine code shows what the target must use."""

import pytest
import triton

from attnforge.backends.triton_fa2 import variants
from attnforge.cli import main
from attnforge.codegen import build


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("kernels")


@pytest.mark.parametrize("arch", ["sm80", "sm89"])
@pytest.mark.parametrize("head_dim", variants.HEAD_DIMS)
def test_ampere_ada_kernels_use_tensor_cores_and_do_not_spill(arch, head_dim, cache):
    """Spills are asserted with the Triton release the tiles were swept with (variants.SPILL_CHECKED_WITH)."""
    for b in build.plan([arch], dtypes=("bf16",), head_dims=(head_dim,), causal=(True,)):
        meta, _ = build.build_cached(b, cache, keep_asm=True)
        if b.kernel != "preprocess_kernel":
            assert any(i.startswith("HMMA.16816") for i in meta["instructions"]), (b.name(), meta["instructions"])
        if triton.__version__.startswith(variants.SPILL_CHECKED_WITH + "."):  # what CI installs
            assert meta["stack_bytes"] == 0, f"{b.name()} spills {meta['stack_bytes']} B to local memory"
        assert meta["shared_bytes"] <= variants.SMEM[arch], b.name()


@pytest.mark.parametrize("head_dim", (64, 128))
def test_hopper_kernels_use_wgmma_and_tma(head_dim, cache):
    # sm90's backward tiles were chosen by speed on the H200 (Triton 3.6 there); with CI's Triton
    # their dK/dV kernel spills at d=128, so spills are not asserted for sm90.
    for b in build.plan(["sm90"], dtypes=("bf16",), head_dims=(head_dim,), causal=(False,)):
        meta, _ = build.build_cached(b, cache, keep_asm=True)
        if b.kernel == "fwd_kernel":
            assert {"UTMALDG.4D"} <= set(meta["instructions"]), meta["instructions"]
        if b.kernel != "preprocess_kernel":
            assert any(i.startswith("HGMMA.64x") for i in meta["instructions"]), (b.name(), meta["instructions"])


def test_cache_hits_and_rebuilds_corrupt_entries(tmp_path):
    (b,) = [x for x in build.plan(["sm80"], dtypes=("fp16",), head_dims=(64,), causal=(True,)) if x.kernel == "fwd_kernel"]
    meta, built = build.build_cached(b, tmp_path)
    assert built and (tmp_path / meta["key"] / "kernel.cubin").is_file()
    again, built = build.build_cached(b, tmp_path)
    assert not built and again == meta
    (tmp_path / meta["key"] / "kernel.cubin").write_bytes(b"torn write")
    rebuilt, built = build.build_cached(b, tmp_path)
    assert built and rebuilt["binary_bytes"] == meta["binary_bytes"]
    with_asm, built = build.build_cached(b, tmp_path, keep_asm=True)  # asm asked later: rebuilt with it
    assert built and (tmp_path / meta["key"] / "kernel.sass").read_text().count("HMMA") > 0


def test_cache_key_follows_source_and_target():
    fwd = [b for b in build.plan(["sm80", "sm89"], dtypes=("bf16",), head_dims=(64,)) if b.kernel == "fwd_kernel"]
    assert len({build.fingerprint(b) for b in fwd}) == len(fwd) == 4


def test_build_cli(tmp_path, capsys):
    assert main(["build", "--target", "sm89", "--head-dim", "64", "--dtype", "fp16", "--list"]) == 0
    listed = capsys.readouterr().out
    assert "fwd_kernel.sm89.fp16.d64.causal" in listed and "7 kernels" in listed
    assert main(["build", "--target", "sm89", "--head-dim", "64", "--dtype", "fp16", "--causal", "true",
                 "--out", str(tmp_path), "--keep-asm"]) == 0
    out, err = capsys.readouterr()
    assert "4 kernels in" in out and "[4/4]" in err and "HMMA" in err
    assert len(list(tmp_path.glob("*/kernel.sass"))) == 4
    assert main(["build", "--target", "sm75", "--list"]) == 2
    assert "unknown build target 'sm75'" in capsys.readouterr().err


def test_prebuilt_kernels_load_from_the_cache_without_compiling(tmp_path):
    builds = build.plan(["sm90"], dtypes=("bf16",), head_dims=(64,), causal=(True,))
    assert build.load_cached(builds[0], tmp_path) is None  # nothing built yet
    for b in builds:
        build.build_cached(b, tmp_path)
    for b in builds:
        kernel = build.load_cached(b, tmp_path)
        assert kernel.metadata.name == b.kernel and kernel.metadata.num_warps == b.num_warps
    other_target = build.KernelBuild(*[getattr(builds[0], f) for f in ("module", "kernel")], "sm80", "bf16", 64, True,
                                     builds[0].num_warps, builds[0].num_stages)
    assert build.load_cached(other_target, tmp_path) is None  # keyed by target: no wrong cubin

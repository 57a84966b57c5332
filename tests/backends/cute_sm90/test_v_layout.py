"""The FP8 V^T Triton kernel: in Triton's interpreter on CPU (interpreter/, in a process of its own), built
ahead of time for sm90 with no GPU, and launched from that build on an H100/H200."""

import os
import pathlib
import subprocess
import sys

import pytest

from attnforge.testing import needs_gpu, run_interpreter_tests


def test_v_layout_kernel_in_the_interpreter():
    run_interpreter_tests(pathlib.Path(__file__).parent / "interpreter" / "test_v_layout_interpreted.py")


def test_build_compiles_the_v_layout_kernel_for_sm90_with_no_gpu(tmp_path, capsys, monkeypatch):
    """`attnforge build --target sm90 --dtype fp8` includes FP8's V^T kernel; it compiles for sm90 here
    (no GPU), spilling no more than it is allowed, and loads back from the cache as a launchable kernel,
    found by the lookup runtime.triton_launch makes for prepare_v_fp8's launch on an sm90 device."""
    import torch

    from attnforge.backends.cute_sm90 import v_layout, v_layout_kernel
    from attnforge.cli import main
    from attnforge.runtime import triton_aot, triton_launch

    name = v_layout.aot_build().name()
    assert main(["build", "--target", "sm90", "--dtype", "fp8", "--backend", "cute_sm90", "--list"]) == 0
    assert name in capsys.readouterr().out
    for args in (["--dtype", "bf16"], ["--target", "sm89", "--dtype", "fp8"]):  # nothing to make V^T for
        assert main(["build", "--target", "sm90", *args, "--backend", "cute_sm90", "--list"]) == 0
        assert name not in capsys.readouterr().out
    meta, built = triton_aot.build_cached(v_layout.aot_build(), tmp_path, keep_asm=True)
    assert built and meta["stack_bytes"] <= v_layout_kernel.ACCEPTED_SPILL_BYTES, meta
    assert triton_aot.load_cached(v_layout.aot_build(), tmp_path) is not None
    # the build is the one a launch looks up (same file, module name, kernel, constants, warps and stages)
    monkeypatch.setattr(triton_launch, "_arch", lambda device: "sm90")
    found = triton_launch.find_prebuilt(v_layout_kernel.transpose_permute_keys, torch.device("cuda"), "fp8",
                                        dict(v_layout_kernel.AOT_CONSTEXPRS), v_layout_kernel.NUM_WARPS,
                                        v_layout_kernel.NUM_STAGES, cache_dir=tmp_path)
    assert found is not None and found.metadata.name == "transpose_permute_keys"
    assert triton_launch.find_prebuilt(v_layout_kernel.transpose_permute_keys, torch.device("cuda"), "fp8",
                                       dict(v_layout_kernel.AOT_CONSTEXPRS), v_layout_kernel.NUM_WARPS,
                                       v_layout_kernel.NUM_STAGES, cache_dir=tmp_path / "empty") is None


RUN_PREBUILT = """
import torch
from attnforge.backends.cute_sm90 import v_layout, v_layout_kernel
from attnforge.runtime import triton_aot
from attnforge.runtime.cache import default_cache_dir
triton_aot.build_cached(v_layout.aot_build(), default_cache_dir())
def refuse(self, grid):
    raise AssertionError("JIT launch although the kernel was built ahead of time")
type(v_layout_kernel.transpose_permute_keys).__getitem__ = refuse  # this process launches nothing else
v = torch.randn(2, 113, 3, 128, device="cuda").to(torch.float8_e4m3fn).transpose(1, 2)
want = v_layout.prepare_v_fp8_torch(v).view(torch.uint8)
poisoned = torch.full(want.shape, 0x7F, dtype=torch.uint8, device="cuda")
got = v_layout.prepare_v_fp8(v.contiguous(), out=poisoned)
assert torch.equal(got.view(torch.uint8), want)
print("prebuilt ok")
"""


@pytest.mark.gpu
@needs_gpu((9, 0), "sm90")
def test_prebuilt_v_layout_kernel_runs_on_the_gpu(tmp_path):
    """Built ahead of time into a fresh cache, the V^T kernel is launched from it (the JIT refused) and
    writes every byte the torch version does."""
    run = subprocess.run([sys.executable, "-c", RUN_PREBUILT], env=dict(os.environ, ATTNFORGE_CACHE_DIR=str(tmp_path)),
                         capture_output=True, text=True)
    assert run.returncode == 0 and "prebuilt ok" in run.stdout, run.stderr[-3000:]

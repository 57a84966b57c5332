"""`attnforge build --target sm90` compiles the cute_sm90 kernels (forward and backward) ahead of time with no
GPU, into the cache cute_sm90 loads from at run time; a later process finds them there and compiles nothing."""

import importlib.util
import os
import subprocess
import sys

import pytest

from attnforge.backends.cute_sm90 import bwd_variants, variants
from attnforge.testing import needs_gpu

D64_BF16 = variants.pick("16bit", 64)[0].module(64, "16bit")  # the table's pick, as the build names it
BWD_D64 = bwd_variants.pick(64, masked=False)[0].module(64)  # and its backward (no mask)

# find_spec, not importorskip: importing cutlass here would fix its target arch for the whole session
needs_cute = pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("cutlass", "tvm_ffi")),
                                reason="nvidia-cutlass-dsl or apache-tvm-ffi is not installed (pip install 'attnforge[cute]')")

# The variants a bf16 d=64 causal training call runs (forward and backward), as the backend plans them; compiling
# is refused, so the kernels can only come from the cache `attnforge build` filled.
REFUSE = """
from attnforge.runtime import cute
def refuse(*a, **k):
    raise AssertionError("compiled although the kernel was built ahead of time")
cute.compile_kernel = cute._in_child = refuse
"""
LOAD = REFUSE + """
from attnforge.dispatch import registered
fwd, bwd = registered()["cute_sm90"].variants(dtypes=("bf16",), head_dims=(64,), causal=(True,), strict=True)
assert (fwd.module, bwd.module) == %r, (fwd.module, bwd.module)
print("loaded", type(fwd.kernel).__name__, type(bwd.kernel).__name__)
""" % ((D64_BF16, BWD_D64),)


def test_build_lists_both_sm90_backends(capsys):
    from attnforge.cli import main

    assert main(["build", "--target", "sm90", "--dtype", "bf16,fp8", "--head-dim", "64", "--list"]) == 0
    out = capsys.readouterr().out
    assert f"cute_sm90 {D64_BF16}.bf16.causal" in out
    assert f"cute_sm90 {variants.pick('fp8', 64)[0].module(64, 'fp8')}.fp8.full" in out
    assert f"cute_sm90 {BWD_D64}.bf16.causal" in out  # its backward
    assert "dkdv_kernel.sm90.bf16.d64.causal" in out  # triton_fa2's backward, for what cute_sm90's does not serve
    assert main(["build", "--target", "sm89", "--backend", "cute_sm90", "--list"]) == 0
    assert capsys.readouterr().out.strip() == "0 kernels"


def test_build_all_leaves_out_head_dims_a_cute_backend_has_no_kernel_for(capsys):
    """With the default --backend all, a head dim only triton_fa2 has on a target builds triton_fa2's kernels
    there; forcing the CuTe backend to build it is an error that names the head dim."""
    from attnforge.cli import main

    assert main(["build", "--target", "sm90,sm100", "--head-dim", "96", "--list"]) == 0
    out = capsys.readouterr().out
    assert ".sm90.fp16.d96." in out and ".sm100.fp16.d96." in out and "cute_sm100" not in out
    assert "cute_sm90 fwd_16bit_d96_" in out  # every multiple of 8 up to 256 on sm90
    assert main(["build", "--target", "sm100", "--backend", "cute_sm100", "--head-dim", "96", "--list"]) == 2
    assert "head_dim 96 has no cute_sm100 kernel" in capsys.readouterr().err
    assert main(["build", "--target", "sm90", "--backend", "cute_sm90", "--dtype", "fp8", "--head-dim", "96",
                 "--list"]) == 2
    assert "head_dim 96 has no cute_sm90 kernel for fp8" in capsys.readouterr().err


def test_build_deterministic_adds_the_reproducible_backward_kernels(capsys):
    from attnforge.cli import main

    args = ["build", "--target", "sm90", "--backend", "cute_sm90", "--dtype", "bf16", "--head-dim", "128", "--list"]
    assert main(args) == 0
    default = capsys.readouterr().out
    assert main([*args, "--deterministic"]) == 0
    both = capsys.readouterr().out
    from attnforge.backends.cute_sm90 import bwd_variants

    full, causal = (bwd_variants.pick(128, masked=m)[0].module(128) for m in (False, True))  # each mask's served tile
    assert "_det." not in default
    assert f"{full}_det.bf16.full" in both and f"{causal}_det.bf16.causal" in both
    assert set(default.splitlines()[:-1]) < set(both.splitlines()[:-1])


@needs_cute
def test_prebuilt_kernel_is_loaded_not_compiled(tmp_path):
    env = dict(os.environ, ATTNFORGE_CACHE_DIR=str(tmp_path))
    built = subprocess.run([sys.executable, "-m", "attnforge", "build", "--target", "sm90", "--backend", "cute_sm90",
                            "--dtype", "bf16", "--head-dim", "64", "--causal", "true"],
                           env=env, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    # the forward and the backward (CuTe), and the backward's Triton kernels: row statistics and dQ's scale
    assert "4 kernels in" in built.stdout and "built in" in built.stderr
    objects = list((tmp_path / "cute_sm90").glob("*.o"))
    assert len(objects) == 2 and all(obj.stat().st_mode & 0o044 for obj in objects)  # readable by its users
    loaded = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True)
    assert loaded.returncode == 0, loaded.stderr
    assert "loaded Function Function" in loaded.stdout


@needs_cute
def test_build_jobs_compiles_in_worker_processes_into_one_cache(tmp_path):
    """--jobs 2: the kernels of two head dims (both padded by TMA's zero fill), forward and backward, compiled by
    two workers, one entry each, beside the Triton row and dQ kernels of their backward kernels' head dims (64 and
    128); a second run finds every one cached."""
    env = dict(os.environ, ATTNFORGE_CACHE_DIR=str(tmp_path))
    args = [sys.executable, "-m", "attnforge", "build", "--target", "sm90", "--backend", "cute_sm90", "--dtype", "bf16",
            "--head-dim", "40,96", "--causal", "false", "--jobs", "2"]
    built = subprocess.run(args, env=env, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    cute_kernels = [f"{kind}_16bit_d{d}_" for kind in ("fwd", "bwd") for d in (40, 96)]
    assert all(name in built.stderr for name in cute_kernels), built.stderr
    assert all(f"bwd_rows_kernel.{name}.sm90.bf16.d{d}." in built.stderr
               for name in ("row_statistics", "scale_dq") for d in (64, 128)), built.stderr
    assert built.stderr.count("built in") == 8
    assert len(list((tmp_path / "cute_sm90").glob("*.o"))) == 4
    again = subprocess.run(args, env=env, capture_output=True, text=True)
    assert again.returncode == 0 and again.stderr.count(": cached") == 8, again.stderr


RUN_PREBUILT = REFUSE + """
import torch, attnforge
from attnforge.testing import oracle, rel_error
q, k, v = (torch.randn(2, 4, 333, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
out = attnforge.attention(q, k, v, causal=True, backend="cute_sm90")
print("error", rel_error(out, oracle(q, k, v, causal=True)[0]))
"""


@needs_cute
@pytest.mark.gpu
@needs_gpu((9, 0), "sm90")
def test_prebuilt_kernel_runs_on_the_gpu(tmp_path):
    env = dict(os.environ, ATTNFORGE_CACHE_DIR=str(tmp_path))
    built = subprocess.run([sys.executable, "-m", "attnforge", "build", "--target", "sm90", "--backend", "cute_sm90",
                            "--dtype", "bf16", "--head-dim", "64", "--causal", "true"],
                           env=env, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    run = subprocess.run([sys.executable, "-c", RUN_PREBUILT], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert float(run.stdout.split("error")[1]) < 1e-2, run.stdout  # bf16 against fp64

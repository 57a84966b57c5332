"""Every benchmarks/*.py script imports against the installed attnforge and answers --help (argparse), on a
machine with no GPU: a script left on a removed internal API fails here, not on the GPU machine."""

import concurrent.futures
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).parents[2] / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py")) if BENCHMARKS.is_dir() else []


@pytest.fixture(scope="module")
def helps(tmp_path_factory):
    """Each script's `--help` run (each imports torch and attnforge: seconds apiece, so as many at a time as
    there are CPUs): name -> (exit status, stdout, stderr). From an empty folder, so that `import attnforge`
    finds the installed package and nothing lands in the checkout."""
    cwd = tmp_path_factory.mktemp("bench-scripts")

    def run(script):
        try:
            done = subprocess.run([sys.executable, str(script), "--help"], cwd=cwd, capture_output=True, text=True,
                                  timeout=300)
        except subprocess.TimeoutExpired as e:
            return None, e.stdout or "", f"timed out after 300 s\n{e.stderr or ''}"
        return done.returncode, done.stdout, done.stderr

    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        return dict(zip((s.name for s in SCRIPTS), pool.map(run, SCRIPTS)))


@pytest.mark.skipif(not SCRIPTS, reason="benchmarks/ is not part of an installed package")
@pytest.mark.parametrize("script", [s.name for s in SCRIPTS])
def test_script_prints_help(helps, script):
    code, stdout, stderr = helps[script]
    assert code == 0, f"{script} --help exited {code}:\n{stderr[-3000:]}"
    assert stdout.startswith("usage:"), stdout[:500]


TIMELINE_COMPILE = """
import pathlib, sys
from attnforge.backends.cute_sm90 import compile as cc
from attnforge.backends.cute_sm90.variants import WG3, Sm90FwdTile
from attnforge.codegen import Source
from attnforge.runtime import cute
from attnforge.runtime.generated import import_path

timeline = import_path(sys.argv[1], "timeline_cute_sm90")
tile = Sm90FwdTile(192, 96, 2, **WG3)
source = Source.of(cc.TEMPLATE, tile.params(128, "fp8"), tile.module(128, "fp8"))
path = pathlib.Path(sys.argv[2]) / "trace.py"
path.write_text(timeline.patch(source.text(), trace_m=3, trace_h=1))
cute.compile_kernel(cc.cute_build(source, "fp8", False), module=import_path(path, "trace"))
"""


@pytest.mark.skipif(not (BENCHMARKS / "timeline_cute_sm90.py").is_file(),
                    reason="benchmarks/ is not part of an installed package")
@pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("cutlass", "tvm_ffi")),
                    reason="nvidia-cutlass-dsl or apache-tvm-ffi is not installed (pip install 'attnforge[cute]')")
def test_timeline_patched_kernel_compiles(tmp_path):
    """The patches apply as text (tests/backends/cute_sm90/test_timeline_patch.py) and the patched module still
    traces and compiles for sm_90a (no GPU needed; in a child process, whose CuTe DSL targets sm_90a)."""
    script = BENCHMARKS / "timeline_cute_sm90.py"
    done = subprocess.run([sys.executable, "-c", TIMELINE_COMPILE, str(script), str(tmp_path)], cwd=tmp_path,
                          env=dict(os.environ, CUTE_DSL_ARCH="sm_90a"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


BWD_TIMELINE_COMPILE = """
import pathlib, sys
from attnforge.backends.cute_sm90 import backward, bwd_variants
from attnforge.backends.cute_sm90 import compile as cc
from attnforge.runtime import cute
from attnforge.runtime.generated import import_path

timeline = import_path(sys.argv[1], "timeline_bwd_sm90")
tile, reasons = bwd_variants.pick(128, masked=True)
variant = backward.Sm90BwdVariant(tile, 128, "bf16", True)
path = pathlib.Path(sys.argv[2]) / "trace.py"
path.write_text(timeline.patch(variant.source.text()))
cute.target(cc.ARCH)
cute.compile_kernel(variant.build, module=import_path(path, "trace"))
"""


@pytest.mark.skipif(not (BENCHMARKS / "timeline_bwd_sm90.py").is_file(),
                    reason="benchmarks/ is not part of an installed package")
@pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("cutlass", "tvm_ffi")),
                    reason="nvidia-cutlass-dsl or apache-tvm-ffi is not installed (pip install 'attnforge[cute]')")
def test_backward_timeline_patched_kernel_compiles(tmp_path):
    """benchmarks/timeline_bwd_sm90.py's patched d=128 causal backward still traces and compiles for sm_90a."""
    script = BENCHMARKS / "timeline_bwd_sm90.py"
    done = subprocess.run([sys.executable, "-c", BWD_TIMELINE_COMPILE, str(script), str(tmp_path)], cwd=tmp_path,
                          env=dict(os.environ, CUTE_DSL_ARCH="sm_90a"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]

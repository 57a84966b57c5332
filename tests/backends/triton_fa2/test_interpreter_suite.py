"""Runs interpreter/ in its own pytest process with TRITON_INTERPRET=1 (Triton reads the variable
when kernels are decorated, so it cannot be switched on inside this process)."""

import os
import pathlib
import subprocess
import sys

import numpy
import pytest
import triton
from packaging.version import Version

HERE = pathlib.Path(__file__).parent


@pytest.mark.skipif(Version(triton.__version__) < Version("3.8") and Version(numpy.__version__) >= Version("2.4"),
                    reason="Triton < 3.8's interpreter fails on range() with a runtime bound under numpy >= 2.4 "
                           "('only 0-dimensional arrays can be converted'; ../shared/notes/triton-attention.md, section 4)")
def test_interpreter_suite_passes():
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
                          str(HERE.parents[1] / "pytest.ini"), str(HERE / "interpreter")],
                         env=env, capture_output=True, text=True, timeout=1800)
    tail = "\n".join(run.stdout.splitlines()[-40:]) + run.stderr[-2000:]
    assert run.returncode == 0, tail
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], tail

"""Runs interpreter/ in its own pytest process with TRITON_INTERPRET=1 (Triton reads the variable
when kernels are decorated, so it cannot be switched on inside this process)."""

import pathlib

import numpy
import pytest
import triton
from packaging.version import Version

from attnforge.testing import run_interpreter_tests

HERE = pathlib.Path(__file__).parent


@pytest.mark.skipif(Version(triton.__version__) < Version("3.8") and Version(numpy.__version__) >= Version("2.4"),
                    reason="Triton < 3.8's interpreter fails on range() with a runtime bound under numpy >= 2.4 "
                           "('only 0-dimensional arrays can be converted'; docs/kernel-notes.md, section 5)")
def test_interpreter_suite_passes():
    run_interpreter_tests(HERE / "interpreter")

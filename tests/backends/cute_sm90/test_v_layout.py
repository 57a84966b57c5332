"""The FP8 V^T Triton kernel in Triton's interpreter on CPU (interpreter/, in a process of its own)."""

import pathlib

from attnforge.testing import run_interpreter_tests


def test_v_layout_kernel_in_the_interpreter():
    run_interpreter_tests(pathlib.Path(__file__).parent / "interpreter")

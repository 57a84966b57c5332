"""Runs interpreter/ in its own pytest process with TRITON_INTERPRET=1 (Triton reads the variable when
kernels are decorated, so it cannot be switched on inside this process)."""

import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).parent


def test_v_layout_kernel_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
                          str(HERE.parents[1] / "pytest.ini"), str(HERE / "interpreter")],
                         env=env, capture_output=True, text=True, timeout=900)
    tail = "\n".join(run.stdout.splitlines()[-40:]) + run.stderr[-2000:]
    assert run.returncode == 0, tail
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], tail

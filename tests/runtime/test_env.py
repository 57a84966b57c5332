"""Toolkit environment variables: TRITON_INTERPRET is read exactly as Triton reads it, and calls that need
CUTE_DSL_ARCH or TRITON_DEFAULT_FP_FUSION leave the user's os.environ as it was."""

import os
import subprocess
import sys

import pytest

from attnforge.runtime import env

SPELLINGS = ["1", "0", "", "true", "True", "TRUE", "false", "False", "on", "ON", "off", "yes", "Yes", "y", "Y", "no",
             "n", "2", "01", "1.0", " 1", "1 ", "t", "enable", "tRuE", "oN", "\u0130"]


@pytest.mark.parametrize("value", SPELLINGS + [None], ids=repr)
def test_triton_interpret_is_parsed_as_triton_parses_it(monkeypatch, value):
    getenv_bool = pytest.importorskip("triton._C.libtriton", reason="triton is not installed").getenv_bool
    from attnforge.backends.triton_fa2.backend import interpreting

    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    assert env.triton_interpret() == getenv_bool("TRITON_INTERPRET", False)
    assert interpreting() == getenv_bool("TRITON_INTERPRET", False)
    assert env.triton_flag("TRITON_INTERPRET", True) == getenv_bool("TRITON_INTERPRET", True)


@pytest.mark.parametrize(("value", "on"), [("false", False), ("off", False), ("no", False), ("True", True),
                                           ("yes", True), ("2", False)])
def test_triton_interpret_spellings(monkeypatch, value, on):
    """Fixed expectations (Triton 3.9's), so the test means something where Triton is missing."""
    from attnforge.backends.triton_fa2.backend import interpreting

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpreting() is on


def test_prebuilt_lookup_follows_the_same_reading(monkeypatch):
    """find_prebuilt goes to the JIT when the interpreter is on, and looks in the cache when TRITON_INTERPRET=false."""
    import torch

    from attnforge.runtime import triton_launch

    looked = []
    monkeypatch.setattr(triton_launch, "_arch", lambda device: looked.append(device) or None)
    monkeypatch.setenv("TRITON_INTERPRET", "yes")
    assert triton_launch.find_prebuilt(None, torch.device("cuda", 0), "bf16", {}, 4, 2) is None and not looked
    monkeypatch.setenv("TRITON_INTERPRET", "false")
    assert triton_launch.find_prebuilt(None, torch.device("cuda", 0), "bf16", {}, 4, 2) is None and looked


def test_scoped_restores_or_removes(monkeypatch):
    monkeypatch.delenv("ATTNFORGE_TEST_SCOPED", raising=False)
    with env.scoped("ATTNFORGE_TEST_SCOPED", "a"):
        assert os.environ["ATTNFORGE_TEST_SCOPED"] == "a"
    assert "ATTNFORGE_TEST_SCOPED" not in os.environ
    monkeypatch.setenv("ATTNFORGE_TEST_SCOPED", "user")
    with pytest.raises(KeyError), env.scoped("ATTNFORGE_TEST_SCOPED", "b"):
        raise KeyError
    assert os.environ["ATTNFORGE_TEST_SCOPED"] == "user"


@pytest.mark.parametrize(("value", "fusion"), [(None, True), ("0", False), ("1", True), ("false", False)])
def test_triton_compile_leaves_fp_fusion_unset_and_passes_it_as_an_option(monkeypatch, tmp_path, value, fusion):
    triton = pytest.importorskip("triton", reason="triton is not installed")
    from attnforge.runtime import triton_aot

    if value is None:
        monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION", raising=False)
    else:
        monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", value)
    seen = {}
    monkeypatch.setattr(triton, "compile", lambda src, target, options: seen.update(options) or "compiled")
    monkeypatch.setattr(triton_aot, "source_of", lambda build: "source")
    build = triton_aot.KernelBuild(str(tmp_path / "k.py"), "k", "k", "sm80", "fp16", 64, False, 4, 2)
    assert triton_aot.compile_kernel(build) == "compiled"
    assert seen["enable_fp_fusion"] is fusion
    assert os.environ.get("TRITON_DEFAULT_FP_FUSION") == value  # as the user left it


CUTE_TARGET = """
import os, sys
from attnforge.runtime import cute
assert "cutlass" not in sys.modules
cute.target("sm_90a")
from cutlass.cutlass_dsl import CuTeDSL
print("env", os.environ.get("CUTE_DSL_ARCH"), "dsl", CuTeDSL._get_dsl().envar.arch,
      "ready", cute.arch_ready("sm_90a"), cute.arch_ready("sm_100a"), cute.can_compile_here("sm_90a"))
"""


@pytest.mark.skipif(any(__import__("importlib").util.find_spec(m) is None for m in ("cutlass", "tvm_ffi")),
                    reason="nvidia-cutlass-dsl or apache-tvm-ffi is not installed (pip install 'attnforge[cute]')")
def test_cute_target_sets_the_arch_for_the_import_only():
    """The CuTe DSL reads CUTE_DSL_ARCH when cutlass is imported (its EnvironmentVarManager is built then):
    target() sets it around that import and removes it after; the DSL still compiles for the arch asked."""
    child_env = {k: v for k, v in os.environ.items() if k != "CUTE_DSL_ARCH"}
    done = subprocess.run([sys.executable, "-c", CUTE_TARGET], env=child_env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["env", "None", "dsl", "sm_90a", "ready", "True", "False", "True"], done.stdout

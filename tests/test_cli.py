import json
import subprocess
import sys

import pytest

from attnforge.cli import main


def test_explain_h100_fp32_shows_fallback(capsys):
    assert main(["explain", "--device", "H100", "--dtype", "fp32", "--head-dim", "128", "--seqlen-q", "4096",
                 "--heads", "32", "--kv-heads", "8"]) == 0
    out = capsys.readouterr().out
    assert "fp32 b=1 h=32/8kv nq=4096 nk=4096 d=128 on sm90 (NVIDIA H100 80GB HBM3)" in out
    assert "fallback: cute_sm90 is preferred on sm90 but dtype fp32 is not supported; supports bf16, fp16, fp8" in out
    assert "forward : sdpa" in out
    assert "triton_fa2  rejected  dtype fp32 is not supported; supports bf16, fp16" in out


@pytest.mark.parametrize(("device", "arch", "forward", "backward"), [
    ("cpu", "cpu", "sdpa", "sdpa"), ("MI300X", "gfx942", "triton_rocm", "triton_rocm"),
    ("H100", "sm90", "cute_sm90", "triton_fa2"), ("B200", "sm100", "cute_sm100", "triton_fa2"),
    ("RX7900XTX", "gfx1100", "sdpa", "sdpa")])
def test_explain_json(capsys, device, arch, forward, backward):
    assert main(["explain", "--device", device, "--dtype", "bf16", "--head-dim", "128", "--seqlen-q", "8192",
                 "--causal", "--needs-grad", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["problem"]["device"]["arch"] == arch and d["problem"]["mask"] == {"causal": True, "top_left": False, "window": [-1, -1], "tensor": False}
    assert d["forward"]["backend"] == forward and d["backward"]["backend"] == backward and d["ok"]


def test_explain_errors_exit_2(capsys):
    assert main(["explain", "--device", "V100"]) == 2
    assert "unknown device profile 'V100'" in capsys.readouterr().err


def test_doctor(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "local device:" in out and "reference" in out and "available" in out


def test_demo_and_module_entry_point():
    run = subprocess.run([sys.executable, "-m", "attnforge", "demo"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "error against fp64 math" in run.stdout
    for profile in ("A100", "H100", "B200", "MI300X", "cpu"):
        assert f"\n  {profile} " in run.stdout


def test_explain_mi300x_chooses_triton_rocm_with_amd_parameters(capsys):
    assert main(["explain", "--device", "MI300X", "--dtype", "bf16", "--head-dim", "128", "--seqlen-q", "8192",
                 "--causal", "--needs-grad"]) == 0
    out = capsys.readouterr().out
    assert "forward : triton_rocm  [fwd 64x64 w4 s1 pointer waves_per_eu=2 mfma=16]" in out
    assert "backward: triton_rocm  [bwd dkdv 128x32" in out
    assert "fallback" not in out

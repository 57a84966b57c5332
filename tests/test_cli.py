import json
import subprocess
import sys

import pytest
import torch

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
    ("H100", "sm90", "cute_sm90", "cute_sm90"), ("B200", "sm100", "cute_sm100", "triton_fa2"),
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where torch sees no GPU")
def test_explain_local_cuda_without_a_gpu_is_a_one_line_error(capsys):
    assert main(["explain", "--device", "cuda"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("attnforge: error: --device cuda: this machine has no GPU torch can use")
    assert "H100" in err  # the profiles it could name instead


def test_explain_local_cuda_index_past_the_gpus_is_a_one_line_error(capsys):
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert main(["explain", "--device", f"cuda:{count}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"attnforge: error: --device cuda:{count}: this machine has")


@pytest.mark.parametrize("json_flag", ([], ["--json"]))
def test_explain_exits_1_when_nothing_can_serve_and_still_prints_why(capsys, json_flag):
    assert main(["explain", "--device", "A100", "--dtype", "fp8", *json_flag]) == 1
    out = capsys.readouterr().out
    if json_flag:
        assert json.loads(out)["ok"] is False
    else:
        assert "NONE: no backend can serve this" in out and "dtype fp8 is not supported" in out


def test_explain_into_a_closed_pipe_is_quiet():
    """`attnforge explain --json | head`: the reader goes away; no BrokenPipeError traceback (exit 1)."""
    proc = subprocess.Popen([sys.executable, "-m", "attnforge", "explain", "--json", "--needs-grad"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # closed before the command writes (it imports torch first): its write meets EPIPE
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 1
    assert err == "", err


def test_doctor_says_what_each_backend_can_do_on_a_cpu(capsys, monkeypatch):
    """On a CPU-only machine an installed GPU backend is not "available": it serves GPUs that are not here,
    and the CPU has no multiprocessor count to print."""
    import attnforge.cli as cli
    from attnforge.dispatch import profile, registered

    monkeypatch.setattr(cli, "detect", lambda: profile("cpu"))
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    (device_line,) = [line for line in out.splitlines() if line.startswith("local device:")]
    assert "multiprocessors" not in device_line and "shared memory" not in device_line
    backends_part = out.split("\n\n")[0]  # the decision printed after it has indented rows too
    rows = {line.split()[0]: line for line in backends_part.splitlines() if line.startswith("  ")}
    assert rows["sdpa"].startswith("  sdpa        available here") and "available here" in rows["reference"]
    for name, arch in (("cute_sm90", "sm90"), ("cute_sm100", "sm100")):
        missing = registered()[name].available()
        want = "unavailable: " if missing else f"installed; serves {arch} GPUs, none here"
        assert want in rows[name], rows[name]
    if not registered()["triton_fa2"].available():
        assert "installed; not usable here: runs on the CPU only in Triton's interpreter" in rows["triton_fa2"]


def test_build_help_lists_every_target(capsys):
    from attnforge.cli import BUILD_TARGETS

    with pytest.raises(SystemExit):
        main(["build", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "gfx90a" in BUILD_TARGETS and ",".join(BUILD_TARGETS) in help_text.replace(", ", ",")


@pytest.mark.parametrize(("args", "why"), [
    (["--target", "sm90", "--dtype", "fp32"],
     ["for targets sm90, dtypes fp32:", "triton_fa2 builds fp16, bf16 at head dims", "cute_sm90 builds fp16, bf16, fp8",
      "sdpa, reference have no ahead-of-time kernels"]),
    (["--target", "sm80", "--dtype", "fp8"],
     ["for targets sm80, dtypes fp8:", "cute_sm90 builds for sm90 only",
      "triton_fa2 builds fp16, bf16 at head dims 32, 64, 96, 128, 192, 256 on sm80"]),
    (["--target", "sm89", "--dtype", "fp8", "--backend", "cute_sm90"], ["cute_sm90 builds for sm90 only"]),
])
def test_build_says_why_nothing_was_planned(capsys, args, why):
    assert main(["build", *args, "--list"]) == 0
    out, err = capsys.readouterr()
    assert out == "0 kernels\n"
    *skipped, last = err.splitlines()  # a backend that cannot build here says so first
    assert all(line.startswith("attnforge build: skipping ") for line in skipped), err
    assert last.startswith("attnforge build: nothing to build: ")
    for part in why:
        assert part in last, err


@pytest.mark.parametrize(("backend", "target", "reason"), [
    ("cute_sm90", "sm90", "cute_sm90: head_dim 100 has no cute_sm90 kernel for 16bit inputs (has every multiple of 8 "
                          "up to 256)"),
    ("cute_sm100", "sm100", "cute_sm100: head_dim 100 has no cute_sm100 kernel (has 64, 128)"),
    ("triton_fa2", "sm90", "triton_fa2 sm90: head_dim 100 has no triton_fa2 variant (has 32, 64, 96, 128, 192, 256)"),
])
def test_build_head_dim_error_says_the_head_dim_once(capsys, backend, target, reason):
    from attnforge.dispatch import registered

    if registered()[backend].available():
        pytest.skip(f"{backend} cannot build here: " + "; ".join(registered()[backend].available()))
    assert main(["build", "--target", target, "--backend", backend, "--head-dim", "100", "--list"]) == 2
    err = capsys.readouterr().err
    assert err == f"attnforge: error: {reason}\n"  # not "d=100: head_dim 100 ..."


def test_an_unusable_cache_is_a_one_line_error(capsys, monkeypatch, tmp_path):
    """A cache folder that cannot be written: one line naming the path, status 2, no traceback."""
    from attnforge.runtime import triton_aot

    path = tmp_path / "cache" / "triton_fa2"

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(triton_aot, "run", refuse)
    assert main(["build", "--target", "sm80", "--backend", "triton_fa2", "--head-dim", "64", "--dtype", "fp16",
                 "--out", str(tmp_path / "cache")]) == 2
    err = capsys.readouterr().err
    assert err == f"attnforge: error: [Errno 13] Permission denied: '{path}'\n"


def test_build_jobs_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        main(["build", "--target", "sm90", "--jobs", "0", "--list"])
    assert "--jobs: must be at least 1, got 0" in capsys.readouterr().err



def test_explain_takes_a_softcap(capsys):
    assert main(["explain", "--device", "H100", "--dtype", "bf16", "--head-dim", "128", "--seqlen-q", "4096",
                 "--softcap", "50", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["forward"]["backend"] == "cute_sm90" and "softcap" in d["forward"]["variant"]


def test_explain_takes_alibi(capsys):
    assert main(["explain", "--device", "H100", "--dtype", "bf16", "--head-dim", "128", "--seqlen-q", "4096",
                 "--alibi", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["forward"]["backend"] == "cute_sm90" and "alibi" in d["forward"]["variant"]


def test_explain_takes_varlen(capsys):
    assert main(["explain", "--device", "H100", "--dtype", "bf16", "--head-dim", "128", "--seqlen-q", "4096",
                 "--batch", "12", "--varlen", "--needs-grad", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["forward"]["backend"] == "cute_sm90" and "varlen" in d["forward"]["variant"]
    assert d["backward"]["backend"] == "cute_sm90" and "varlen" in d["backward"]["variant"]
    assert "varlen" in d["problem"]


def test_build_lists_the_varlen_kernels(capsys):
    assert main(["build", "--target", "sm90", "--backend", "triton_fa2", "--head-dim", "128", "--dtype", "bf16",
                 "--causal", "true", "--features", "varlen", "--list"]) == 0
    listed = capsys.readouterr().out
    for kernel in ("fwd_kernel", "dkdv_kernel", "dq_kernel"):
        assert f"{kernel}.sm90.bf16.d128.causal.varlen" in listed
    assert "preprocess_kernel.sm90.bf16.d128.full.varlen" in listed and "14 kernels" in listed  # beside the plain 7
    assert "dkdv_kernel.sm90.bf16.d128.causal.varlen.group1" in listed  # (GROUP = 1 builds: aot.at_one)
    assert "fwd_m128_n64_w8_s3_ptr.fwd_kernel.sm90.bf16.d128.causal.varlen" in listed  # pointer loads


def test_explain_takes_a_kv_cache(capsys):
    """A decode step against a paged e4m3fnuz cache on an MI300X: triton_rocm's fp8 KV-cache kernel; on an H100 the
    same cache has no kernel of its own (NVIDIA converts no e4m3fnuz), and the decision says so."""
    decode = ["explain", "--dtype", "bf16", "--head-dim", "128", "--seqlen-q", "1", "--seqlen-k", "8192",
              "--heads", "32", "--kv-heads", "8", "--causal", "--kv-cache", "paged", "--page-size", "64",
              "--kv-dtype", "fp8_fnuz"]
    assert main([*decode, "--device", "MI300X"]) == 0
    out = capsys.readouterr().out
    assert "paged fp8_fnuz kv cache (page 64)" in out and "forward : triton_rocm" in out and "fp8 (e4m3fnuz) cache" in out
    assert main([*decode, "--device", "H100"]) == 0
    out = capsys.readouterr().out
    assert "forward : reference" in out and "an fp8 (e4m3fnuz) KV cache is not supported" in out
    with pytest.raises(SystemExit) as exit_:  # not a cache format: argparse's usage error
        main([*decode, "--device", "H100", "--kv-dtype", "fp16"])
    assert exit_.value.code == 2 and "invalid choice: 'fp16'" in capsys.readouterr().err


def test_build_an_fp8_cache_format_the_arch_does_not_convert(capsys):
    """Forced to one backend, a cache format its arch has no kernel for is an error that names it; with every
    backend it is left out (the call falls back when it comes)."""
    fnuz = ["build", "--head-dim", "128", "--dtype", "bf16", "--features", "kvcache+fp8_fnuz", "--list"]
    assert main([*fnuz, "--target", "sm90", "--backend", "triton_fa2"]) == 2
    assert "an fp8 (e4m3fnuz) KV cache has no kernel here" in capsys.readouterr().err
    assert main([*fnuz, "--target", "gfx942", "--backend", "triton_rocm"]) == 0
    assert "fp8_kv" in capsys.readouterr().out
    assert main([*fnuz, "--target", "gfx950", "--backend", "triton_rocm"]) == 2
    assert "(converted in hardware on gfx942)" in capsys.readouterr().err

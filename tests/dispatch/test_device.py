import pytest
import torch

import attnforge
from attnforge import UnknownNameError
from attnforge.dispatch import PROFILES, detect, profile, resolve
from attnforge.dispatch.device import amd_features, nvidia_features


@pytest.mark.parametrize(("name", "arch", "features"), [
    ("A100", "sm80", set()),
    ("L40S", "sm89", {"fp8"}),
    ("RTX4090", "sm89", {"fp8"}),
    ("H100", "sm90", {"tma", "wgmma", "fp8"}),
    ("H200", "sm90", {"tma", "wgmma", "fp8"}),
    ("B200", "sm100", {"tma", "tcgen05", "fp8"}),
    ("RTX5090", "sm120", {"tma", "fp8"}),
    ("MI250X", "gfx90a", {"mfma"}),
    ("MI300X", "gfx942", {"mfma", "fp8"}),
    ("MI355X", "gfx950", {"mfma", "fp8"}),
    ("RX7900XTX", "gfx1100", set()),
    ("cpu", "cpu", set()),
])
def test_profiles(name, arch, features):
    spec = profile(name)
    assert spec.arch == arch
    assert set(spec.features) == features
    assert not spec.present
    if spec.vendor != "cpu":
        assert spec.multiprocessors > 0 and spec.smem_per_block >= 64 * 1024


def test_profile_names_are_case_insensitive_and_unknown_names_list_the_known():
    assert profile("h100") is PROFILES["H100"]
    assert resolve("mi300x") is PROFILES["MI300X"]
    with pytest.raises(UnknownNameError, match="unknown device profile 'V100'.*H100"):
        profile("V100")
    with pytest.raises(UnknownNameError, match="known profiles"):
        resolve("not-a-gpu")


def test_feature_flags_follow_capability():
    assert nvidia_features(7, 5) == frozenset()
    assert nvidia_features(9, 0) >= {"wgmma", "tma"}
    assert "wgmma" not in nvidia_features(10, 0) and "tcgen05" in nvidia_features(10, 3)
    assert "tcgen05" not in nvidia_features(12, 0)
    assert amd_features("gfx90a") == {"mfma"} and amd_features("gfx1100") == frozenset()


def test_detect_local_cpu():
    spec = detect(torch.device("cpu"))
    assert spec.vendor == "cpu" and spec.arch == "cpu" and spec.present
    assert resolve(None) == detect() and resolve("cpu") == spec


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where torch sees no GPU")
def test_a_local_cuda_device_without_a_gpu_is_an_error_naming_the_profiles():
    with pytest.raises(UnknownNameError, match="no GPU torch can use.*H100"):
        attnforge.explain(device="cuda", dtype="bf16", head_dim=64, seqlen_q=16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_local_cuda_index_past_the_gpus_is_an_error():
    with pytest.raises(UnknownNameError, match="sees"):
        attnforge.explain(device=f"cuda:{torch.cuda.device_count()}", dtype="bf16", head_dim=64, seqlen_q=16)

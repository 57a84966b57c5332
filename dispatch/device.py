"""The device model: what the dispatcher knows about a GPU (or the CPU), read from torch or
taken from a named profile, so decisions can be explained for hardware that is not present."""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..errors import UnknownNameError

FEATURES = ("tma", "wgmma", "tcgen05", "fp8", "mfma")

# The vendor of a device attnforge has no kernels for (mps, xpu, meta, ...): torch's SDPA serves it, and
# the spec's arch is the torch device type.
TORCH_ONLY = "torch"


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One device as the dispatcher sees it.

    ``arch`` is ``sm80``-style for NVIDIA, ``gfx942``-style for AMD and ``cpu``;
    ``smem_per_block`` is the opt-in maximum shared memory (LDS on AMD) one block may use, in bytes.
    ``present`` says whether the spec was read from a device of this process (True) or is a profile.
    """

    vendor: str  # "nvidia", "amd", "cpu" or TORCH_ONLY
    arch: str
    name: str
    capability: tuple[int, int] | None = None
    multiprocessors: int = 0
    smem_per_block: int = 0
    features: frozenset[str] = frozenset()
    present: bool = False
    index: int | None = None  # torch device index when present

    @property
    def torch_device(self) -> torch.device:
        if self.vendor == "cpu":
            return torch.device("cpu")
        if self.vendor == TORCH_ONLY:
            return torch.device(self.arch, self.index)
        return torch.device("cuda", self.index or 0)  # ROCm builds of torch call HIP devices "cuda"

    def has(self, feature: str) -> bool:
        return feature in self.features


def nvidia_features(major: int, minor: int) -> frozenset[str]:
    """Feature flags implied by an NVIDIA compute capability."""
    cap = (major, minor)
    feats = set()
    if cap >= (9, 0):
        feats.add("tma")  # sm90 and later have the Tensor Memory Accelerator, sm120 included
    if cap == (9, 0):
        feats.add("wgmma")  # warpgroup MMA exists on sm90a only
    if major == 10:
        feats.add("tcgen05")  # datacenter Blackwell (sm100/sm103); not sm120
    if cap >= (8, 9):
        feats.add("fp8")  # Ada, Hopper and Blackwell tensor cores take e4m3/e5m2
    return frozenset(feats)


# CDNA archs with matrix cores; fp8 (fnuz on gfx942, OCP on gfx950) from CDNA3 on.
_AMD_MFMA = {"gfx908", "gfx90a", "gfx940", "gfx941", "gfx942", "gfx950"}
_AMD_FP8 = {"gfx940", "gfx941", "gfx942", "gfx950"}


def amd_features(arch: str) -> frozenset[str]:
    """Feature flags implied by an AMD gfx arch."""
    feats = set()
    if arch in _AMD_MFMA:
        feats.add("mfma")
    if arch in _AMD_FP8:
        feats.add("fp8")
    return frozenset(feats)


def _nv(name, major, minor, sms, smem_kib):
    return DeviceSpec("nvidia", f"sm{major}{minor}", name, (major, minor), sms, smem_kib * 1024,
                      nvidia_features(major, minor))


def _amd(name, arch, cus, lds_kib):
    return DeviceSpec("amd", arch, name, None, cus, lds_kib * 1024, amd_features(arch))


CPU = DeviceSpec("cpu", "cpu", "cpu")
_LOCAL_CPU = dataclasses.replace(CPU, present=True)

# Numbers from the vendors' datasheets and CUDA programming guide tables (opt-in shared memory per
# block: 163 KiB on sm80, 99 KiB on sm86/89/120, 227 KiB on sm90/sm100); AMD: CUs per device
# as torch sees it (MI250X shows each of its two GCDs as one device) and LDS per workgroup.
PROFILES: dict[str, DeviceSpec] = {
    "A100": _nv("NVIDIA A100-SXM4-80GB", 8, 0, 108, 163),
    "A10": _nv("NVIDIA A10", 8, 6, 72, 99),
    "L40S": _nv("NVIDIA L40S", 8, 9, 142, 99),
    "RTX4090": _nv("NVIDIA GeForce RTX 4090", 8, 9, 128, 99),
    "H100": _nv("NVIDIA H100 80GB HBM3", 9, 0, 132, 227),
    "H200": _nv("NVIDIA H200", 9, 0, 132, 227),
    "B200": _nv("NVIDIA B200", 10, 0, 148, 227),
    "RTX5090": _nv("NVIDIA GeForce RTX 5090", 12, 0, 170, 99),
    "MI250X": _amd("AMD Instinct MI250X", "gfx90a", 110, 64),
    "MI300X": _amd("AMD Instinct MI300X", "gfx942", 304, 64),
    "MI355X": _amd("AMD Instinct MI355X", "gfx950", 256, 160),
    "RX7900XTX": _amd("AMD Radeon RX 7900 XTX", "gfx1100", 96, 64),
    "cpu": CPU,
}


def profile(name: str) -> DeviceSpec:
    """The named device profile (case-insensitive), e.g. ``profile("H100")``."""
    for key, spec in PROFILES.items():
        if key.lower() == name.lower():
            return spec
    raise UnknownNameError(f"unknown device profile {name!r}; known profiles: {', '.join(PROFILES)}")


@functools.lru_cache(maxsize=None)
def _detect_gpu(index: int) -> DeviceSpec:
    props = torch.cuda.get_device_properties(index)
    sms = props.multi_processor_count
    smem = getattr(props, "shared_memory_per_block_optin", 0) or getattr(props, "shared_memory_per_block", 0)
    if torch.version.hip is not None:
        arch = props.gcnArchName.split(":")[0]  # "gfx942:sramecc+:xnack-" -> "gfx942"
        return DeviceSpec("amd", arch, props.name, None, sms, smem, amd_features(arch), True, index)
    major, minor = props.major, props.minor
    return DeviceSpec("nvidia", f"sm{major}{minor}", props.name, (major, minor), sms, smem,
                      nvidia_features(major, minor), True, index)


def detect(device: torch.device | str | int | None = None) -> DeviceSpec:
    """The spec of a device of this process: the given one, else the current GPU, else the CPU."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    if isinstance(device, int):
        device = torch.device("cuda", device)
    device = torch.device(device)
    if device.type == "cpu":
        return _LOCAL_CPU
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UnknownNameError(f"{device} asked for, but this process has no GPU torch can use; name a profile "
                                   f"({', '.join(PROFILES)}) to ask about a GPU that is not here")
        count = torch.cuda.device_count()
        if device.index is not None and not 0 <= device.index < count:
            raise UnknownNameError(f"{device} asked for, but this process sees {count} GPU(s)")
        return _detect_gpu(device.index if device.index is not None else torch.cuda.current_device())
    # meta tensors hold no data: nothing there to self-check or to ask torch about, so not "present"
    return DeviceSpec(TORCH_ONLY, device.type, device.type, present=device.type != "meta", index=device.index)


def resolve(device: DeviceSpec | torch.device | str | int | None) -> DeviceSpec:
    """A DeviceSpec from a spec, a profile name, a torch device (or its string) or None (local)."""
    if isinstance(device, DeviceSpec):
        return device
    if isinstance(device, str):
        if any(k.lower() == device.lower() for k in PROFILES) and device.lower() != "cpu":
            return profile(device)
        try:
            torch_device = torch.device(device)
        except RuntimeError:
            return profile(device)  # raises with the list of profiles
        return detect(torch_device)
    return detect(device)

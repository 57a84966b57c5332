"""Which backends to try, in order, on each arch. The first entry is the backend the arch is
meant to get; choosing any later one is a fallback and is reported as such."""

from __future__ import annotations

from .device import DeviceSpec

_SM8X = ("triton_fa2", "sdpa", "reference")
_CDNA = ("triton_rocm", "sdpa", "reference")
_ANY = ("sdpa", "reference")

PRIORITY: dict[str, tuple[str, ...]] = {
    "sm80": _SM8X,
    "sm86": _SM8X,
    "sm89": _SM8X,
    "sm90": ("cute_sm90", "triton_fa2", "sdpa", "reference"),
    "sm100": ("cute_sm100", "triton_fa2", "sdpa", "reference"),
    "sm120": _SM8X,  # consumer Blackwell: no tcgen05, no wgmma; Triton's mma.sync path
    "gfx90a": _CDNA,
    "gfx942": _CDNA,
    "gfx950": _CDNA,
    "cpu": _ANY,
}

# Archs not in the table: NVIDIA tries Triton first (it refuses below sm80 with a reason).
_BY_VENDOR = {"nvidia": _SM8X, "amd": _CDNA}

PLANNED_BACKENDS: tuple[str, ...] = tuple(dict.fromkeys(n for order in PRIORITY.values() for n in order))


def priority(device: DeviceSpec) -> tuple[str, ...]:
    """Backends to try on ``device``, best first."""
    return PRIORITY.get(device.arch) or _BY_VENDOR.get(device.vendor, _ANY)

"""triton_rocm's variant table: AMD CDNA tiles and launch options, checked by triton_fa2's one
validity check (LDS budget per arch, 64-lane wavefronts, 512 registers per lane).

Where the numbers come from (docs/kernel-notes.md, section 4, AMD part):
- forward: 128x64, 4 waves, 1 stage, waves_per_eu 2 on gfx942/gfx950 (aiter's MI300X/MI350X MHA
  defaults, Dao-AILab flash_attn_triton_amd); 64x64 on gfx90a (flash_attn's AMD fallback); 1 stage
  because CDNA has no TMA/async copy worth pipelining for this kernel (the tutorials use 1);
  matrix_instr_nonkdim 16 (16x16 MFMA) as aiter's forward configs use on gfx942;
- backward: 1 wave per EU (waves_per_eu 1), 4 waves, 1 stage, dQ 128 queries x 32-64 keys and dK/dV
  128 keys x 32 queries as ROCm's bwd configs, nonkdim 16 on gfx942.
Then trimmed where Triton 3.9's AMDGCN showed scratch spills for our kernels (compile sweep, 2026-11-29).
Not run on AMD hardware: compiled and interpreter-tested only.
"""

from __future__ import annotations

import dataclasses

from ..triton_fa2.variants import HEAD_DIMS, BwdTile, FwdTile, KVTile, tiles_of

__all__ = ["BWD", "FWD", "HEAD_DIMS", "KVCACHE", "KVCACHE_PAGED", "RocmBwdTile", "RocmFwdTile"]


@dataclasses.dataclass(frozen=True)
class RocmFwdTile(FwdTile):
    waves_per_eu: int = 2  # LLVM amdgpu-waves-per-eu: the register budget per wave (0 = unset)
    matrix_instr_nonkdim: int = 16  # 16 -> v_mfma_*16x16*, 32 -> 32x32

    @property
    def module(self) -> str:
        return (f"fwd_m{self.block_m}_n{self.block_n}_w{self.num_warps}_s{self.num_stages}"
                f"_wpe{self.waves_per_eu}_k{self.matrix_instr_nonkdim}")

    def params(self) -> dict:
        return {"block_m": self.block_m, "block_n": self.block_n, "num_warps": self.num_warps,
                "num_stages": self.num_stages, "loads": self.loads,
                "launch_options": {"matrix_instr_nonkdim": self.matrix_instr_nonkdim, "waves_per_eu": self.waves_per_eu}}

    def describe(self) -> str:
        return f"{super().describe()} waves_per_eu={self.waves_per_eu} mfma={self.matrix_instr_nonkdim}"


@dataclasses.dataclass(frozen=True)
class RocmBwdTile(BwdTile):
    waves_per_eu: int = 1
    matrix_instr_nonkdim: int = 16

    @property
    def module(self) -> str:
        return f"{super().module}_wpe{self.waves_per_eu}_k{self.matrix_instr_nonkdim}"

    def params(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(BwdTile)}
        out["launch_options"] = {"matrix_instr_nonkdim": self.matrix_instr_nonkdim, "waves_per_eu": self.waves_per_eu}
        return out

    def describe(self) -> str:
        return f"{super().describe()} waves_per_eu={self.waves_per_eu} mfma={self.matrix_instr_nonkdim}"


def _f(m, n, w=4, s=1, wpe=2, k=16):
    return RocmFwdTile(m, n, w, s, "pointer", wpe, k)


def _b(m1, n1, m2, n2, w=4, s=1, wpe=1, k=16):
    return RocmBwdTile(m1, n1, m2, n2, w, s, wpe, k)


# Trimmed by the compile sweep (Triton 3.9, 2026-11-29): 128x64 spills at d=128 on every CDNA arch
# (60-232 B of scratch), so d96/d128 take 64x64; at d192/d256 the 64-row tiles spill with
# waves_per_eu 2 and not with 1 on gfx942/gfx950; gfx90a takes 32x32 there.
_CDNA3_FWD = {32: [_f(128, 64)], 64: [_f(128, 64)], 96: [_f(64, 64)], 128: [_f(64, 64)],
              192: [_f(64, 64, wpe=1)], 256: [_f(64, 64, wpe=1)]}
FWD: dict[str, dict[int, list[RocmFwdTile]]] = {
    "gfx90a": {32: [_f(128, 64)], 64: [_f(128, 64)], 96: [_f(64, 64)], 128: [_f(64, 64)],
               192: [_f(32, 32)], 256: [_f(32, 32)]},
    "gfx942": _CDNA3_FWD,
    "gfx950": _CDNA3_FWD,
}
# dK/dV 128 keys x 32 queries and dQ 128 x 32 to d=128; 64x32 at d=256, where 128 spills 0.8 KiB. At d=192 the 64x32
# dQ kernel spills a VGPR once compiled as Triton's JIT compiles a call (row strides multiples of 16,
# runtime.triton_aot), so d=192 takes 64 keys x 16 queries (compile sweep, Triton 3.9, gfx942, 2026-12-07: no spill,
# 354/258 VGPRs for dK/dV and dQ).
_CDNA_BWD = {32: [_b(32, 128, 128, 32)], 64: [_b(32, 128, 128, 32)], 96: [_b(32, 128, 128, 32)],
             128: [_b(32, 128, 128, 32)], 192: [_b(16, 64, 64, 16)], 256: [_b(32, 64, 64, 32)]}
BWD: dict[str, dict[int, list[RocmBwdTile]]] = {"gfx90a": _CDNA_BWD, "gfx942": _CDNA_BWD, "gfx950": _CDNA_BWD}

# The KV-cache kernel: one pipelining stage (an LDS buffer per stage, as the forward), 64-key steps to d=128.
# Compiled for gfx942 by the ahead-of-time path (Triton 3.9, no scratch at d=128); not timed on AMD hardware.
_CDNA_KV = {d: [KVTile(64, 64, 4, 1)] for d in HEAD_DIMS if d <= 128} | {192: [KVTile(32, 32, 4, 1)],
                                                                          256: [KVTile(32, 32, 4, 1)]}
KVCACHE = {arch: _CDNA_KV for arch in FWD}
KVCACHE_PAGED = KVCACHE


def all_tiles():
    return tiles_of(FWD), tiles_of(BWD)

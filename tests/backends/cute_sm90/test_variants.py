"""The sm90 variant table and its one validity check."""

import dataclasses
import math
import re
from importlib import resources

import pytest
import torch

from attnforge import explain
from attnforge.backends.cute_sm90 import compile as cc
from attnforge.backends.cute_sm90 import variants
from attnforge.backends.cute_sm90.variants import Sm90FwdTile, check
from attnforge.dispatch.problem import SMALL_SOFTCAP

# a bf16 softcap problem on an H100 (its cap at most SMALL_SOFTCAP)
PROBLEM = explain(device="H100", dtype="bf16", head_dim=128, seqlen_q=4096, softcap=30.0).problem


@pytest.mark.parametrize("kind", variants.KINDS)
def test_every_head_dim_has_a_valid_pick(kind):
    for head_dim in variants.HEAD_DIMS_OF[kind]:
        tile, reasons = variants.pick(kind, head_dim)
        assert tile is not None and not reasons and not check(tile, head_dim, kind)
    assert [(k, d) for k, d, _ in variants.picks()] == [(k, d) for k in variants.KINDS for d in variants.HEAD_DIMS_OF[k]]


def test_16bit_serves_every_multiple_of_8_up_to_256_as_flash_attention_does():
    assert variants.HEAD_DIMS_OF["16bit"] == tuple(range(8, 257, 8))
    for head_dim in (4, 12, 100, 264, 512):
        tile, reasons = variants.pick("16bit", head_dim)
        assert tile is None and any(f"head_dim {head_dim} has no cute_sm90 kernel" in r for r in reasons), reasons


@pytest.mark.parametrize(("head_dim", "kind", "padded"), [(8, "16bit", 16), (40, "16bit", 48), (64, "16bit", 64),
                                                          (72, "16bit", 80), (248, "16bit", 256), (64, "fp8", 64),
                                                          (96, "fp8", 96), (80, "fp8", 96)])
def test_head_dims_pad_to_the_wgmma_k_step(head_dim, kind, padded):
    assert variants.padded_head_dim(head_dim, kind) == padded


def test_a_padded_head_dim_needs_the_tma_store_epilogue_and_no_tail_split():
    reasons = check(Sm90FwdTile(128, 128), 40)
    assert any("padded to 48" in r and "TMA-store epilogue" in r for r in reasons), reasons
    assert any("tail_split" in r for r in check(Sm90FwdTile(128, 128, tma_store=True, tail_split=True), 40))
    assert not check(Sm90FwdTile(128, 128, tma_store=True), 40)
    assert not check(Sm90FwdTile(128, 128), 48)  # a multiple of 16 needs no padding


def test_fp8_keeps_the_head_dims_it_was_tuned_at():
    assert variants.HEAD_DIMS_OF["fp8"] == (64, 128, 256)
    assert any("head_dim 96 has no cute_sm90 kernel for fp8" in r for r in check(Sm90FwdTile(128, 128), 96, "fp8"))


def test_shared_memory_and_registers_count_the_padded_head_dim():
    tile = Sm90FwdTile(128, 128, tma_store=True)
    assert tile.smem_bytes(72) == tile.smem_bytes(80) and tile.registers_needed(72) == tile.registers_needed(80)


def test_fp8_needs_32_key_blocks():
    assert any("FP8 needs tile_n a multiple of 32" in r for r in check(Sm90FwdTile(128, 80), 128, "fp8"))
    assert not check(Sm90FwdTile(128, 80), 128, "16bit")


@pytest.mark.parametrize(("tile", "head_dim", "needle"), [
    (Sm90FwdTile(128, 128, 4), 256, "KiB of shared memory, sm90 has 227 KiB"),
    (Sm90FwdTile(192, 128), 128, "tile_m must be 64 x consumer warpgroups"),
    (Sm90FwdTile(128, 72), 128, "tile_n must be a multiple of 16"),
    (Sm90FwdTile(64, 128, consumer_warpgroups=1), 128, "pingpong needs two or more"),
    (Sm90FwdTile(192, 128, consumer_warpgroups=3, consumer_registers=240), 64, "registers per CTA > 65536"),
    (Sm90FwdTile(128, 256, consumer_registers=160), 128, "registers per consumer thread, has 160"),
    (Sm90FwdTile(128, 128, cluster=(2, 1)), 128, "clusters are not implemented"),
    (Sm90FwdTile(128, 128), 100, "head_dim 100 has no cute_sm90 kernel"),
])
def test_check_names_what_is_wrong(tile, head_dim, needle):
    assert any(needle in r for r in check(tile, head_dim)), check(tile, head_dim)


def test_module_names_are_distinct_and_describe_the_tile():
    names = {t.module(d, k) for k, d, t in variants.picks()}
    assert len(names) == len(variants.picks())
    assert "fwd_16bit_d256_m128_n64_s2_wg2_pp_to" in names


def test_tma_store_shows_in_the_names_and_its_buffer_in_shared_memory():
    tile = Sm90FwdTile(192, 128, consumer_warpgroups=3, producer_registers=32, consumer_registers=160)
    staged = dataclasses.replace(tile, tma_store=True)
    assert staged.module(64).endswith("_to") and staged.describe().endswith(" TMA store")
    assert staged.smem_bytes(64) == tile.smem_bytes(64) + 2 * 192 * 64 + 1024  # O's bf16/fp16 rows, 1024-aligned
    assert not staged.o_in_q(64)


def test_tma_store_stages_o_in_q_only_where_its_own_buffer_does_not_fit():
    """16-bit d=256 at 128x64: Q, K and V stages take 192 KiB, O's own buffer 64 more: O goes into Q's buffer
    (same size: 16-bit in, 16-bit out). Never for FP8 (Q is half O's size) or persistent tiles."""
    tile = Sm90FwdTile(128, 64, tma_store=True)
    assert tile.o_in_q(256) and tile.smem_bytes(256) == dataclasses.replace(tile, tma_store=False).smem_bytes(256)
    assert variants.check(tile, 256) == [] and tile.params(256)["o_in_q"] is True
    assert not tile.o_in_q(256, "fp8") and not tile.o_in_q(128)
    persistent = dataclasses.replace(tile, persistent=True)
    assert not persistent.o_in_q(256)
    assert any("shared memory" in r for r in variants.check(persistent, 256))


def test_persistent_shows_in_the_names():
    tile = Sm90FwdTile(128, 128, persistent=True)
    assert tile.module(128).endswith("_pp_ps") and tile.describe().endswith(" persistent")


def test_fixed_max_needs_a_softcap_without_alibi_in_16_bits():
    tile, _ = variants.pick("16bit", 128)
    assert tile.params(128, softcap=True, fixed_max=True)["fixed_max"]
    for kw in (dict(), dict(softcap=True, alibi=True), dict(kind="fp8", softcap=True)):
        with pytest.raises(ValueError, match="fixed_max needs softcap without alibi"):
            tile.params(128, **kw, fixed_max=True)


def test_the_small_softcap_keeps_the_fixed_max_in_fp32s_range():
    """With a = SMALL_SOFTCAP * log2(e) and the template's offset max(0, a - FIXED_P_LOG2): P is at most
    2^FIXED_P_LOG2, and a row whose every score sits at -SMALL_SOFTCAP keeps a normal P (exp2 flushes below 2^-126)."""
    text = (resources.files("attnforge") / "templates" / cc.TEMPLATE).read_text()
    fixed_p_log2 = float(re.search(r"^FIXED_P_LOG2 = ([0-9.]+)$", text, re.M).group(1))
    a = SMALL_SOFTCAP * math.log2(math.e)
    offset = max(a - fixed_p_log2, 0.0)
    assert a - offset <= fixed_p_log2
    assert -a - offset >= -126 + 1  # a bit to spare
    assert not variants.fixed_max_serves(dataclasses.replace(PROBLEM, softcap_large=True))
    assert variants.fixed_max_serves(PROBLEM)


def fixed_offset_attention(capped: torch.Tensor, v: torch.Tensor, cap: float, fixed_p_log2: float) -> torch.Tensor:
    """The FIXED_MAX softmax's arithmetic in torch: P = exp2(x - f) in fp32 with x = capped score * log2(e) and
    f = max(0, cap * log2(e) - fixed_p_log2), flushed to 0 below 2^-126 as MUFU.EX2 does, rounded to bf16 for P @ V,
    summed in fp32; rows whose every P flushed give 0 (the kernel's "saw no key")."""
    a = cap * math.log2(math.e)
    p = torch.exp2(capped.float() * math.log2(math.e) - max(a - fixed_p_log2, 0.0))
    p = torch.where(p < 2.0 ** -126, 0.0, p)
    total = p.sum(-1, keepdim=True)
    return (p.bfloat16().float() @ v.float()) / torch.where(total == 0, 1.0, total)


@pytest.mark.parametrize("cap", [1.0, 30.0, SMALL_SOFTCAP, 60.0])
def test_the_fixed_offset_softmax_is_exact_to_bf16_up_to_the_small_softcap_and_not_beyond(cap):
    """The template's FIXED_MAX arithmetic on the rows that strain it most (every score at -cap, at +cap, mixed)
    against fp64 softmax: within bf16's rounding up to SMALL_SOFTCAP; at a cap of 60 the rows at -cap flush to 0,
    which is why larger caps keep the running max."""
    text = (resources.files("attnforge") / "templates" / cc.TEMPLATE).read_text()
    fixed_p_log2 = float(re.search(r"^FIXED_P_LOG2 = ([0-9.]+)$", text, re.M).group(1))
    gen = torch.Generator().manual_seed(0)
    keys = 1023
    capped = torch.stack([torch.full((keys,), -cap), torch.full((keys,), cap),  # every score at one end
                          cap * torch.tanh(4 * torch.randn(keys, generator=gen)),  # scores all over [-cap, cap]
                          -cap + torch.rand(keys, generator=gen) * 1e-3 * cap]).double()  # a hair above -cap
    v = torch.randn(keys, 64, generator=gen, dtype=torch.float64).bfloat16().double()
    want = torch.softmax(capped, -1) @ v
    got = fixed_offset_attention(capped, v, cap, fixed_p_log2).double()
    err = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    if cap <= SMALL_SOFTCAP:
        assert err < 2 ** -7, err  # bf16 P's rounding (2^-9 relative per P), averaged over the keys
    else:
        assert not err < 2 ** -7, err

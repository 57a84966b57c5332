"""The host side of FP8 on sm90, on CPU: V's key permutation and padding, and the descale arguments."""

import pytest
import torch

import attnforge
from attnforge import InvalidInputError
from attnforge.backends.cute_sm90 import v_layout


KEY_ORDER = [v_layout.key_of_slot(slot) for slot in range(32)]


def test_key_order_is_a_permutation_of_each_32_key_block():
    assert sorted(KEY_ORDER) == list(range(32))
    assert KEY_ORDER[:8] == [0, 1, 8, 9, 2, 3, 10, 11]


@pytest.mark.parametrize("seqlen", (1, 31, 32, 77))
def test_prepare_v_transposes_permutes_and_pads_with_zero_keys(seqlen, gen):
    v = torch.randn(2, 3, seqlen, 16, generator=gen).to(torch.float8_e4m3fn)
    vt = v_layout.prepare_v_fp8(v)
    padded = -(-seqlen // 32) * 32
    assert vt.shape == (2, 3, 16, padded) and vt.dtype == torch.float8_e4m3fn and vt.is_contiguous()
    raw, vt_raw = v.view(torch.uint8), vt.view(torch.uint8)
    for slot in range(padded):
        key = slot // 32 * 32 + KEY_ORDER[slot % 32]
        want = raw[:, :, key, :] if key < seqlen else torch.zeros_like(raw[:, :, 0, :])
        assert torch.equal(vt_raw[..., slot], want), slot


def test_descales_are_checked():
    q = torch.randn(1, 2, 8, 64)
    with pytest.raises(InvalidInputError, match="apply to float8_e4m3fn inputs"):
        attnforge.attention(q, q, q, q_descale=torch.ones(1, 2))
    q8 = q.to(torch.float8_e4m3fn)
    with pytest.raises(InvalidInputError, match=r"k_descale must be a float tensor of shape \(batch, heads_kv\) = \(1, 2\)"):
        attnforge.attention(q8, q8, q8, k_descale=torch.ones(2))


def test_fp8_on_a_cpu_is_refused_with_the_reason():
    q8 = torch.randn(1, 2, 8, 64).to(torch.float8_e4m3fn)
    with pytest.raises(attnforge.BackendUnavailableError, match="dtype fp8 is not supported"):
        attnforge.attention(q8, q8, q8)

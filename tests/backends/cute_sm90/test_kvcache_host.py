"""The host side of cute_sm90's KV-cache forward, on CPU (the compiled kernel replaced by a recorder): the tensors
and values a KV_CACHE / PAGED kernel is called with, in its __call__'s order (templates/cute_sm90_fwd.py.jinja: after
max_ctas the key counts, the block table, then the score features' values)."""

import math

import torch

from attnforge.api import _causal_mask
from attnforge.backends.cute_sm90 import backend as sm90
from attnforge.backends.shared.cute_host import LOG2_E
from attnforge.dispatch.call import Call, KVCache
from attnforge.dispatch.registry import get
from attnforge import explain


def test_a_paged_call_passes_the_pages_key_counts_and_a_unit_stride_block_table(monkeypatch, gen):
    monkeypatch.setattr(sm90, "max_ctas", lambda device: 132)
    batch, nq, hq, hkv, d, page, per_seq = 3, 37, 8, 2, 128, 64, 5
    window, cap = (100, 0), 30.0
    decision = explain(device="H200", dtype="bf16", head_dim=d, seqlen_q=nq, seqlen_k=page * per_seq, batch=batch,
                       heads=hq, kv_heads=hkv, causal=True, window_size=window, softcap=cap, kv_cache="paged",
                       page_size=page, backend="cute_sm90")
    variant = decision.forward.variant
    assert (variant.kv_cache, variant.page_rows, variant.window, variant.softcap) == ("paged", 64, True, True)
    calls = []
    monkeypatch.setitem(variant.__dict__, "kernel", lambda *args: calls.append(args))  # (the cached kernel, replaced)
    q = torch.randn(batch, nq, hq, d, generator=gen).to(torch.bfloat16)
    pages = [torch.randn(batch * per_seq + 1, page, hkv, d, generator=gen).to(torch.bfloat16) for _ in range(2)]
    wide = torch.arange(batch * 2 * per_seq, dtype=torch.int32).view(batch, 2 * per_seq)
    table = wide[:, ::2]  # a strided view: the kernel takes unit inner stride
    seqlens = torch.tensor([0, 17, 300], dtype=torch.int32)
    cache = KVCache(seqlens, None, table, 300)
    call = Call(q.transpose(1, 2), pages[0].transpose(1, 2), pages[1].transpose(1, 2), d ** -0.5,
                _causal_mask(True, window), softcap=cap, cache=cache)
    out, lse = get("cute_sm90").forward(variant, call)
    (args,) = calls
    q_arg, k_arg, v_arg, out_arg, lse_arg, scale_log2, ctas, seqlens_arg, table_arg, left, right, cap_scale = args
    assert k_arg.shape == (batch * per_seq + 1, hkv, page, d) and k_arg.data_ptr() == pages[0].data_ptr()
    assert v_arg.data_ptr() == pages[1].data_ptr()  # (the cache read in place, never copied)
    assert out_arg is out and lse_arg is lse and out.shape == (batch, hq, nq, d) and lse.shape == (batch, hq, nq)
    assert ctas == 132 and torch.equal(seqlens_arg, seqlens)
    assert table_arg.stride(-1) == 1 and torch.equal(table_arg, table)
    # the window's bounds with causal folded in (right 0); the cap's scale and log2 units
    assert (left, right) == (100, 0)
    assert math.isclose(cap_scale, d ** -0.5 / cap) and math.isclose(scale_log2, cap * LOG2_E)


def test_an_unbounded_window_side_is_past_the_longest_sequence_not_the_page(monkeypatch, gen):
    """A window's unbounded side is passed as seqlen_q + seqlen_k; with a paged cache k's length is a page's, so the
    longest sequence (the host's cache.longest) stands for seqlen_k."""
    monkeypatch.setattr(sm90, "max_ctas", lambda device: 132)
    decision = explain(device="H200", dtype="bf16", head_dim=64, seqlen_q=5, seqlen_k=4096, window_size=(-1, 3),
                       kv_cache="paged", page_size=16, backend="cute_sm90")
    variant = decision.forward.variant
    calls = []
    monkeypatch.setitem(variant.__dict__, "kernel", lambda *args: calls.append(args))
    q = torch.randn(1, 5, 1, 64, generator=gen).to(torch.bfloat16)
    pages = torch.randn(256, 16, 1, 64, generator=gen).to(torch.bfloat16)
    cache = KVCache(torch.tensor([4000], dtype=torch.int32), None, torch.arange(256, dtype=torch.int32)[None], 4000)
    call = Call(q.transpose(1, 2), pages.transpose(1, 2), pages.transpose(1, 2), 0.125, _causal_mask(False, (-1, 3)),
                cache=cache)
    get("cute_sm90").forward(variant, call)
    (args,) = calls
    assert args[-2:] == (5 + 4000, 3)

"""cute_sm90's KV-cache forward (KV_CACHE and PAGED in templates/cute_sm90_fwd.py.jinja) on an sm90 GPU, forced
through attention_with_kvcache in bf16 and fp16, against fp64 math per sequence: contiguous caches and pages of 16, 64
and 256 positions (shuffled, a random block table), lengths 0, 1, 17, 1023 and 4099, appends, chunked prefill and a
few queries, GQA, causal and not, a window with softcap and sinks, and head dims whose tiles load pages in pieces of
16 rows (d=96's 176-key tile). Cache positions no sequence owns are NaN (a cache's unwritten memory may be; the kernel
zeroes V's rows there) and outputs NaN-filled before the run (poisoned_empty)."""

import math

import pytest
import torch

import attnforge
from attnforge.api import _causal_mask
from attnforge.backends.cute_sm90 import variants
from attnforge.testing import assert_close

from ..triton_fa2.test_kvcache_gpu import LENGTHS, check_sequences, run_case

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                 reason="needs an sm90 GPU")]

# (heads_q, heads_kv, seqlen_q, seqlen_new, causal, window, softcap, sinks)
CASES = [(8, 8, 113, 113, True, (-1, -1), 0.0, False), (16, 2, 300, 0, False, (-1, -1), 0.0, False),
         (16, 4, 7, 7, True, (-1, -1), 0.0, False), (16, 2, 129, 64, True, (256, -1), 30.0, True)]
# every tile family contiguous and with pages of 64; pages of 16 and 256 at d=128 (the page lookup does not depend on
# d) and pages of 16 at d=96 (eleven 16-row loads per 176-key block)
LAYOUTS = [(d, p) for d in (64, 80, 96, 128, 256) for p in
           ((0, 16, 64, 256) if d == 128 else (0, 16, 64) if d == 96 else (0, 64))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim,page_size", LAYOUTS, ids=lambda x: str(x))
@pytest.mark.parametrize("case", CASES, ids=str)
def test_cute_sm90_kvcache_on_the_gpu(case, head_dim, page_size, dtype, gen, poisoned_empty):
    hq, hkv, nq, new, causal, window, cap, with_sinks = case
    out, lse, q, dense, sinks = run_case(gen, (hq, hkv), nq, new, head_dim, page_size, dtype, causal=causal,
                                         window_size=window, softcap=cap, sinks=with_sinks, backend="cute_sm90")
    variant = attnforge.last_decision().forward.variant
    tile = variants.pick("16bit", head_dim)[0]
    assert variant.kv_cache == ("paged" if page_size else "contiguous")
    assert variant.page_rows == (math.gcd(tile.tile_n, page_size) if page_size else 0)
    check_sequences(out, lse, q, dense, new, _causal_mask(causal, window), cap, sinks)
    for b, n in enumerate(LENGTHS):
        if n + new == 0:  # no keys: the LSE -inf (or, with sinks, the sink's logit)
            no_key = torch.full_like(lse[b], -math.inf) if sinks is None else sinks[:, None].expand_as(lse[b])
            assert_close(f"lse[{b}]", lse[b], no_key.double(), no_key, ulps=4)  # (the sink through log2 units)


def test_the_self_check_passes_the_paged_kernel_on_a_nan_filled_cache():
    """The self-check's tiny paged problem (NaN past the keys) judges the kernel attention_with_kvcache would run."""
    from attnforge.dispatch import selfcheck
    from attnforge.dispatch.registry import get

    decision = attnforge.explain(device=torch.device("cuda"), dtype="bf16", head_dim=128, seqlen_q=200,
                                 seqlen_k=4096, heads=8, kv_cache="paged", page_size=64, backend="cute_sm90")
    backend = get("cute_sm90")
    assert selfcheck._run(backend, decision.forward.variant, decision.problem) == ()

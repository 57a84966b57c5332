"""The CuTe backends' packed (varlen) kernels on the host (backends/shared/cute_varlen.py): the tile table a forward
runs (every (sequence, m block) once, heaviest first, none for a sequence without queries), the key-block table of
cute_sm90's packed backward (every (sequence, n block) once, heaviest first, none for a sequence without keys), and
their caches."""

import math

import pytest
import torch

from attnforge.backends.shared import cute_varlen as varlen

LENGTHS_Q = [17, 0, 1, 1023, 113, 4099, 128, 64]
LENGTHS_K = [17, 9, 0, 1023, 4099, 113, 128, 200]


def bounds(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return tuple(out)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tile_m,tile_n", [(128, 128), (192, 128), (128, 176), (128, 64)])
def test_every_tile_once_heaviest_first(causal, tile_m, tile_n):
    table = varlen.tile_table(bounds(LENGTHS_Q), bounds(LENGTHS_K), tile_m, tile_n, causal, "cpu")
    assert table.dtype == torch.int32 and table.shape[1] == 2
    entries = [tuple(e) for e in table.tolist()]
    want = {(b, m) for b, n in enumerate(LENGTHS_Q) for m in range(-(-n // tile_m))}
    assert sorted(entries) == sorted(want)  # each once; the empty sequence (1) has none, the keyless one (2) has one
    work = [varlen.key_blocks(torch.tensor(LENGTHS_Q[b]), torch.tensor(LENGTHS_K[b]), torch.tensor(m), tile_m, tile_n,
                              causal).item() for b, m in entries]
    assert work == sorted(work, reverse=True)
    for (b, m), w in zip(entries, work):  # the blocks the kernel's key loop runs, counted one by one: with causal
        sq, sk = LENGTHS_Q[b], LENGTHS_K[b]  # those whose first key the tile's last row sees (bottom-right)
        last_key = (m + 1) * tile_m - 1 + sk - sq
        expect = sum(1 for n in range(-(-sk // tile_n)) if not causal or n * tile_n <= last_key)
        assert w == expect


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tile_m,tile_n", [(64, 128), (128, 128)])
def test_every_key_block_once_heaviest_first(causal, tile_m, tile_n):
    table = varlen.key_tile_table(bounds(LENGTHS_Q), bounds(LENGTHS_K), tile_m, tile_n, causal, "cpu")
    assert table.dtype == torch.int32 and table.shape[1] == 2
    entries = [tuple(e) for e in table.tolist()]
    want = {(b, n) for b, length in enumerate(LENGTHS_K) for n in range(-(-length // tile_n))}
    assert sorted(entries) == sorted(want)  # each once; the keyless sequence (2) has none, the queryless one (1) has one
    work = [varlen.query_blocks(torch.tensor(LENGTHS_Q[b]), torch.tensor(LENGTHS_K[b]), torch.tensor(n), tile_m,
                                tile_n, causal).item() for b, n in entries]
    assert work == sorted(work, reverse=True)
    for (b, n), w in zip(entries, work):  # the query blocks the backward's loop runs, counted one by one: with causal
        sq, sk = LENGTHS_Q[b], LENGTHS_K[b]  # those whose last row sees the key block's first key (bottom-right)
        expect = sum(1 for m in range(-(-sq // tile_m)) if not causal or n * tile_n <= min((m + 1) * tile_m, sq) - 1 + sk - sq)
        assert w == expect


@pytest.mark.parametrize("tile_m", [64, 128])
def test_the_backward_rows_start_aligned_and_never_overlap(tile_m):
    """The packed backward's LSE and delta rows (padded_rows): each sequence starts at a multiple of tile_m (a TMA
    load's innermost start must be 16-byte aligned) and its whole blocks end before the next sequence starts; and
    spread_rows puts each packed row's statistics there, +inf and 0 between."""
    from attnforge.backends.cute_sm90.backward import spread_rows

    offsets = bounds(LENGTHS_Q)
    index, rows = varlen.padded_rows(offsets, tile_m, "cpu")
    assert index.dtype == torch.int64 and index.numel() == offsets[-1] and len(set(index.tolist())) == index.numel()
    ends = []
    for b, n in enumerate(LENGTHS_Q):
        start = (offsets[b] + b * tile_m) // tile_m * tile_m
        assert start % tile_m == 0
        assert index[offsets[b]:offsets[b + 1]].tolist() == list(range(start, start + n))
        ends.append(start + -(-n // tile_m) * tile_m)  # the rows its whole blocks load
        if b:
            assert start >= ends[b - 1]
    assert rows % tile_m == 0 and rows >= max(ends)
    lse = torch.randn(1, 3, offsets[-1] + 5)
    delta = torch.randn(1, 3, offsets[-1] + 5)
    spread_lse, spread_delta = spread_rows(lse, delta, index, rows)
    assert spread_lse.shape == (1, 3, rows) and torch.equal(spread_lse[..., index], lse[..., :offsets[-1]])
    assert torch.equal(spread_delta[..., index], delta[..., :offsets[-1]])
    between = torch.ones(rows, dtype=torch.bool)
    between[index] = False
    assert (spread_lse[..., between] == math.inf).all() and (spread_delta[..., between] == 0).all()


def test_no_queries_no_tiles():
    table = varlen.tile_table((0, 0, 0), (0, 5, 9), 128, 128, True, "cpu")
    assert table.shape == (0, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the cache keys on the CUDA stream")
def test_the_table_is_built_once_per_offsets():
    a = varlen.tables(bounds(LENGTHS_Q), bounds(LENGTHS_K), 128, 128, True, torch.device("cuda"))
    assert varlen.tables(bounds(LENGTHS_Q), bounds(LENGTHS_K), 128, 128, True, torch.device("cuda")) is a
    assert varlen.tables(bounds(LENGTHS_Q), bounds(LENGTHS_K), 128, 128, False, torch.device("cuda")) is not a
    keys = varlen.key_tables(bounds(LENGTHS_Q), bounds(LENGTHS_K), 128, 128, True, torch.device("cuda"))
    assert keys is not a and not torch.equal(keys.cpu(), a.cpu())  # the two tables are cached apart
    assert varlen.key_tables(bounds(LENGTHS_Q), bounds(LENGTHS_K), 128, 128, True, torch.device("cuda")) is keys

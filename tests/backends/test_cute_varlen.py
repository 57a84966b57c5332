"""The CuTe backends' packed (varlen) forwards on the host (backends/shared/cute_varlen.py): the tile table a kernel runs (every (sequence, m block) once,
heaviest first, none for a sequence without queries) and its cache."""

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


def test_no_queries_no_tiles():
    table = varlen.tile_table((0, 0, 0), (0, 5, 9), 128, 128, True, "cpu")
    assert table.shape == (0, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the cache keys on the CUDA stream")
def test_the_table_is_built_once_per_offsets():
    a = varlen.tables(bounds(LENGTHS_Q), bounds(LENGTHS_K), 128, 128, True, torch.device("cuda"))
    assert varlen.tables(bounds(LENGTHS_Q), bounds(LENGTHS_K), 128, 128, True, torch.device("cuda")) is a
    assert varlen.tables(bounds(LENGTHS_Q), bounds(LENGTHS_K), 128, 128, False, torch.device("cuda")) is not a

"""The tile table of the CuTe backends' packed (varlen) forwards (VARLEN in templates/cute_sm90_fwd.py.jinja and
cute_sm100_fwd.py.jinja), and the arguments such a kernel takes after the others.

The kernel runs one CTA per (table entry, head); an entry names a sequence and one of its m blocks, so no CTA
starts past its sequence's end and no padding is computed. Entries go heaviest first, by the key blocks the tile
visits (its causal diagonal included), as the dense kernel orders its causal tiles: the long tiles start in the
first wave and the short ones fill the last. The host knows the offsets already (attention_varlen reads them once,
varlen.py), so the table costs a few CPU tensor ops and one small copy to the device: about 0.1-0.2 ms of host
time for a batch of 16 sequences, paid once per offsets, since a model's layers all take the same ones (tables()
keeps the last few, per device and stream).
"""

from __future__ import annotations

import functools

import torch

CACHED_TABLES = 16  # offsets of the last few packed batches (a model's layers share one; a few models, or streams)


def key_blocks(seqlen_q: torch.Tensor, seqlen_k: torch.Tensor, m_block: torch.Tensor, tile_m: int, tile_n: int,
               causal: bool) -> torch.Tensor:
    """The key blocks the tile ``m_block`` of each sequence visits: all of them, or with ``causal`` those up to the
    bottom-right diagonal of its last row (a window visits fewer; the order stays a good one, its tiles being about
    equally long)."""
    blocks = (seqlen_k + tile_n - 1) // tile_n
    if causal:
        last_key = ((m_block + 1) * tile_m + seqlen_k - seqlen_q).clamp(min=0)
        blocks = torch.minimum(blocks, (last_key + tile_n - 1) // tile_n)
    return blocks


def tile_table(bounds_q, bounds_k, tile_m: int, tile_n: int, causal: bool, device) -> torch.Tensor:
    """(tiles, 2) int32 on ``device``: (sequence, m block) per entry, heaviest first; ``bounds_*`` are the host
    offsets (batch + 1 ints). Sequences without queries have no entry; one with queries but no keys has its
    entries (the kernel writes their zeros and LSE -inf)."""
    offsets_q = torch.tensor(bounds_q, dtype=torch.int64)
    offsets_k = torch.tensor(bounds_k, dtype=torch.int64)
    seqlen_q, seqlen_k = offsets_q.diff(), offsets_k.diff()
    m_blocks = (seqlen_q + tile_m - 1) // tile_m
    sequence = torch.repeat_interleave(torch.arange(len(m_blocks)), m_blocks)
    first_entry = torch.repeat_interleave(m_blocks.cumsum(0) - m_blocks, m_blocks)
    m_block = torch.arange(len(sequence)) - first_entry
    work = key_blocks(seqlen_q[sequence], seqlen_k[sequence], m_block, tile_m, tile_n, causal)
    order = torch.argsort(work, descending=True, stable=True)
    table = torch.stack((sequence[order], m_block[order]), dim=1).to(torch.int32)
    return table.to(device)


def packed_arguments(variant, packed) -> tuple:
    """A VARLEN kernel's offsets and tile table for a call's Varlen (its host offsets, read once) and a variant with
    ``tile.tile_m``, ``tile.tile_n`` and ``causal``; the table is cached per offsets (tables)."""
    bounds_q, bounds_k = packed.bounds()
    table = tables(bounds_q, bounds_k, variant.tile.tile_m, variant.tile.tile_n, variant.causal,
                   packed.cu_seqlens_q.device)
    return packed.cu_seqlens_q, packed.cu_seqlens_k, table


def tables(bounds_q: tuple[int, ...], bounds_k: tuple[int, ...], tile_m: int, tile_n: int, causal: bool,
           device: torch.device) -> torch.Tensor:
    """tile_table's table, built once per (offsets, tile, causality, device, stream) and then reused: the copy to the
    device runs in the current stream, so another stream gets its own."""
    return _cached(bounds_q, bounds_k, tile_m, tile_n, causal, device, torch.cuda.current_stream(device))


@functools.lru_cache(maxsize=CACHED_TABLES)
def _cached(bounds_q, bounds_k, tile_m, tile_n, causal, device, stream) -> torch.Tensor:
    return tile_table(bounds_q, bounds_k, tile_m, tile_n, causal, device)

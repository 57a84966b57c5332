"""The tile table of the CuTe backends' packed (varlen) forwards (VARLEN in templates/cute_sm90_fwd.py.jinja and
cute_sm100_fwd.py.jinja), and the arguments such a kernel takes after the others; and the key-block table of
cute_sm90's packed backward (VARLEN in templates/cute_sm90_bwd.py.jinja: key_tile_table, one entry per key block,
heaviest first by the query blocks that see it).

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


def query_blocks(seqlen_q: torch.Tensor, seqlen_k: torch.Tensor, n_block: torch.Tensor, tile_m: int, tile_n: int,
                 causal: bool) -> torch.Tensor:
    """The query blocks that see key block ``n_block`` of each sequence (a backward CTA's work): all of them, or with
    ``causal`` those from the first row on the bottom-right diagonal of its first key."""
    blocks = (seqlen_q + tile_m - 1) // tile_m
    if causal:
        first_row = (n_block * tile_n - (seqlen_k - seqlen_q)).clamp(min=0)
        blocks = torch.where(first_row < seqlen_q, blocks - first_row // tile_m, 0)
    return blocks


def key_tile_table(bounds_q, bounds_k, tile_m: int, tile_n: int, causal: bool, device) -> torch.Tensor:
    """The packed backward's table: (tiles, 2) int32 on ``device``, (sequence, n block) per key block, heaviest
    first by the query blocks that see it. Sequences without keys have no entry; one with keys but no queries has
    its entries (the kernel writes their zero dK and dV)."""
    offsets_q = torch.tensor(bounds_q, dtype=torch.int64)
    offsets_k = torch.tensor(bounds_k, dtype=torch.int64)
    seqlen_q, seqlen_k = offsets_q.diff(), offsets_k.diff()
    n_blocks = (seqlen_k + tile_n - 1) // tile_n
    sequence = torch.repeat_interleave(torch.arange(len(n_blocks)), n_blocks)
    first_entry = torch.repeat_interleave(n_blocks.cumsum(0) - n_blocks, n_blocks)
    n_block = torch.arange(len(sequence)) - first_entry
    work = query_blocks(seqlen_q[sequence], seqlen_k[sequence], n_block, tile_m, tile_n, causal)
    order = torch.argsort(work, descending=True, stable=True)
    return torch.stack((sequence[order], n_block[order]), dim=1).to(torch.int32).to(device)


def key_tables(bounds_q: tuple[int, ...], bounds_k: tuple[int, ...], tile_m: int, tile_n: int, causal: bool,
               device: torch.device) -> torch.Tensor:
    """key_tile_table's table, cached as tables() caches the forward's."""
    return _cached_keys(bounds_q, bounds_k, tile_m, tile_n, causal, device, torch.cuda.current_stream(device))


def padded_rows(bounds_q: tuple[int, ...], tile_m: int, device) -> tuple[torch.Tensor, int]:
    """Where each packed query row goes in the packed backward's LSE and delta rows (VARLEN in
    templates/cute_sm90_bwd.py.jinja): sequence b's rows from (offset + b * tile_m) rounded down to a multiple of
    tile_m, so that every sequence starts 16-byte aligned (as a TMA load needs) and its whole blocks end before the
    next sequence starts. Returns the (total_q,) int64 row index on ``device`` and the padded row count."""
    offsets = torch.tensor(bounds_q, dtype=torch.int64)
    sequences = len(bounds_q) - 1
    starts = (offsets + torch.arange(sequences + 1) * tile_m) // tile_m * tile_m
    lengths = offsets.diff()
    sequence = torch.repeat_interleave(torch.arange(sequences), lengths)
    index = torch.arange(int(offsets[-1])) - offsets[sequence] + starts[sequence]
    return index.to(device), int(starts[-1])


def packed_rows(bounds_q: tuple[int, ...], tile_m: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """padded_rows, cached as tables() caches the forward's table."""
    return _cached_rows(bounds_q, tile_m, device, torch.cuda.current_stream(device))


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


@functools.lru_cache(maxsize=CACHED_TABLES)
def _cached_keys(bounds_q, bounds_k, tile_m, tile_n, causal, device, stream) -> torch.Tensor:
    return key_tile_table(bounds_q, bounds_k, tile_m, tile_n, causal, device)


@functools.lru_cache(maxsize=CACHED_TABLES)
def _cached_rows(bounds_q, tile_m, device, stream) -> tuple[torch.Tensor, int]:
    return padded_rows(bounds_q, tile_m, device)

"""Zeroed int32 counters for kernels whose CTAs count their arrivals (a split-KV kernel's last split of a tile merges
the others): the kernel leaves each counter it used back at zero, so one buffer serves every call on a stream
without a memset. One buffer per (device, stream): calls on one stream run in order, calls on two streams may
overlap and must not share counters. A buffer first made while a CUDA graph is being captured is zeroed by a
memset node of that graph (and at every replay), which the kernel's own reset makes redundant but harmless."""

from __future__ import annotations

import torch

_BUFFERS: dict[tuple, torch.Tensor] = {}
MIN_COUNTERS = 4096


def zeroed_counters(device: torch.device, count: int) -> torch.Tensor:
    """At least ``count`` int32 counters on ``device``, all zero, for the current stream."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    buffer = _BUFFERS.get(key)
    if buffer is None or buffer.numel() < count:
        buffer = torch.zeros(max(count, MIN_COUNTERS), dtype=torch.int32, device=device)
        _BUFFERS[key] = buffer
    return buffer

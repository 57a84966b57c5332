"""Run by test_context_parallel.py as a script: torch's context parallelism on two CPU processes (gloo), the ring
steps served by attnforge. Rank 0 prints one JSON line per rank and configuration: the errors the test asserts on,
PyTorch's own error in fp32 beside them, and how many calls of attnforge's forward and backward the ring made.

Each worker registers attnforge's functions for ``aten::_scaled_dot_product_flash_attention`` and its backward under
the CPU dispatch key (torch's flash-attention registry installs them for CUDA only; on a GPU,
``torch.nn.attention.activate_flash_attention_impl("attnforge")`` does this), counting the calls. Inside
``context_parallel`` the sequence is sharded over the ranks (head-tail load-balanced when causal, as torch does), and
the flash op called on DTensors goes to torch's ring: each step one call of attnforge's forward, the steps merged by
LSE in torch, then each step's backward from the merged output and LSE. The output and gradients, unsharded, are
compared with fp64 full attention, beside PyTorch's own error in the inputs' dtype (fp32).

    python tests/integrations/cp_worker.py PORT [cpu|cuda]

With ``cuda`` (two GPUs, NCCL) attnforge is activated as torch's flash implementation instead, the inputs are bf16
and the model calls ``F.scaled_dot_product_attention``, which ``context_parallel`` patches, on FLASH: the user's path.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = int(os.environ.get("ATTNFORGE_CP_WORLD", "2"))  # (1: the same path on one GPU, without the ring's exchanges)
CONFIGS = [(causal, rotate) for causal in (False, True) for rotate in ("allgather", "alltoall")]
BATCH, HEADS, SEQLEN, DIM = 2, 4, 96, 16  # SEQLEN: 2 ranks x 2 load-balancing chunks x 24


def attention_math(q, k, v, causal: bool, scale: float):
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def full(q, k, v, dout, causal: bool, scale: float, dtype):
    """Full attention in ``dtype``: (out, dq, dk, dv)."""
    q, k, v = (t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v))
    out = attention_math(q, k, v, causal, scale)
    out.backward(dout.to(dtype))
    return [t.detach().double() for t in (out, q.grad, k.grad, v.grad)]


def worker(rank: int, port: int, device: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options, context_parallel_unshard, set_rotate_method
    from torch.nn.attention import SDPBackend, activate_flash_attention_impl, sdpa_kernel

    import attnforge
    from attnforge.integrations import torch_flash

    calls = {"forward": 0, "backward": 0}

    def counted(fn, kind):
        def run(*args, **kwargs):
            calls[kind] += 1
            return fn(*args, **kwargs)
        return run

    forward = counted(torch_flash.sdpa_flash_forward, "forward")
    backward = counted(torch_flash.sdpa_flash_backward, "backward")
    if cuda:  # the user's path: attnforge activated as torch's flash implementation (it installs these two)
        torch_flash.sdpa_flash_forward, torch_flash.sdpa_flash_backward = forward, backward
        activate_flash_attention_impl("attnforge")
    else:
        library = torch.library.Library("aten", "IMPL")
        library.impl("_scaled_dot_product_flash_attention", forward, "CPU")
        library.impl("_scaled_dot_product_flash_attention_backward", backward, "CPU")
    mesh = init_device_mesh(device, (WORLD,))
    dtype = torch.bfloat16 if cuda else torch.float32
    scale = DIM ** -0.5
    rows = []
    for i, (causal, rotate) in enumerate(CONFIGS):
        gen = torch.Generator().manual_seed(i)
        q, k, v, dout = (torch.randn(BATCH, HEADS, SEQLEN, DIM, generator=gen).to(dtype) for _ in range(4))
        want = full(q, k, v, dout, causal, scale, torch.float64)
        peer = full(q, k, v, dout, causal, scale, dtype)
        before = dict(calls)
        set_rotate_method(rotate)
        _cp_options.enable_load_balance = causal  # (torch's head-tail balancing is for causal attention only)
        shards = [t.to(device) for t in (q, k, v, dout)]
        with context_parallel(mesh, buffers=shards, buffer_seq_dims=[2] * 4):
            local = [t.detach().clone().requires_grad_() for t in shards[:3]]
            if cuda:  # F.scaled_dot_product_attention, which context_parallel has patched, on FLASH
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    out = torch.nn.functional.scaled_dot_product_attention(*local, is_causal=causal, scale=scale)
                out.backward(shards[3])
            else:  # the flash op itself on DTensors (the CPU's SDPA takes another op, which CP does not ring)
                q_d, k_d, v_d = (DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in local)
                out = torch.ops.aten._scaled_dot_product_flash_attention(q_d, k_d, v_d, 0.0, causal, False,
                                                                         scale=scale)[0].to_local()
                out.backward(shards[3])
            decision = attnforge.last_decision()
        got = context_parallel_unshard(mesh, [out.detach(), *(t.grad for t in local)], [2] * 4)
        names = ("out", "dq", "dk", "dv")
        rows.append({"rank": rank, "causal": causal, "rotate": rotate, "dtype": str(dtype).split(".")[-1],
                     "errors": {n: (g.double().cpu() - w).abs().max().item() for n, g, w in zip(names, got, want)},
                     "peer_errors": {n: (p - w).abs().max().item() for n, p, w in zip(names, peer, want)},
                     "scales": {n: w.abs().max().item() for n, w in zip(names, want)},
                     "forward_calls": calls["forward"] - before["forward"],
                     "backward_calls": calls["backward"] - before["backward"],
                     "backend": decision.forward.backend if decision else None})
    every = [None] * WORLD if rank == 0 else None
    dist.gather_object(rows, every, dst=0)  # (one printer: the ranks' lines would interleave)
    if rank == 0:
        for row in (row for rank_rows in every for row in rank_rows):
            print(json.dumps(row), flush=True)
    dist.barrier()  # (no rank tears the group down while the other's last collective is in flight)
    dist.destroy_process_group()
    # Leave without the interpreter's exit-time C++ destructors: with torch 2.13's gloo, about one exit in fifteen
    # aborts there ("terminate called without an active exception", a joinable std::thread destroyed) after the group
    # was destroyed and every result printed. Everything this worker checks is done by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    mp.spawn(worker, args=(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "cpu"), nprocs=WORLD)

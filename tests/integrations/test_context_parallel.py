"""torch's context parallelism (``torch.distributed.tensor.experimental.context_parallel``) running its ring steps on
attnforge, on the CPU: two gloo processes (cp_worker.py), the sequence sharded over them, non-causal and causal
(head-tail load-balanced, torch's top-left ``is_causal``), with both of torch's rotate methods (all-gather and
all-to-all). Every ring step's forward and backward must be one call of attnforge's flash-op function (the backward
from the merged output and LSE, as torch's ring runs it), and the output and gradients, unsharded, must match fp64
full attention as closely as PyTorch's own math in the inputs' dtype does. The same on two GPUs (NCCL, bf16, attnforge
activated as torch's flash implementation) runs where there are two."""

import json
import math
import pathlib
import socket
import subprocess
import sys

import pytest
import torch

from .cp_worker import CONFIGS, SEQLEN, WORLD

WORKER = pathlib.Path(__file__).with_name("cp_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(device: str) -> list[dict]:
    run = subprocess.run([sys.executable, str(WORKER), str(free_port()), device], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def ring_results():
    if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
        pytest.skip("this torch has no gloo backend for the two CPU processes")
    return run_worker("cpu")


def check(rows: list[dict], causal: bool, rotate: str) -> None:
    rows = [r for r in rows if (r["causal"], r["rotate"]) == (causal, rotate)]
    assert sorted(r["rank"] for r in rows) == list(range(WORLD))
    for row in rows:
        # one ring step per rank's key chunk, forward and backward, each a call of attnforge's function
        assert (row["forward_calls"], row["backward_calls"]) == (WORLD, WORLD), row
        assert row["backend"] is not None
        eps = torch.finfo(getattr(torch, row["dtype"])).eps
        for name, err in row["errors"].items():
            bound = 2 * row["peer_errors"][name] + 4 * math.sqrt(SEQLEN) * eps * max(row["scales"][name], 1.0)
            assert err <= bound, f"rank {row['rank']} {name}: max error {err:.3e} > {bound:.3e}"


IDS = [f"{'causal' if c else 'full'}-{r}" for c, r in CONFIGS]


@pytest.mark.parametrize("causal, rotate", CONFIGS, ids=IDS)
def test_torch_context_parallel_ring_steps_run_on_attnforge_and_match_full_attention(ring_results, causal, rotate):
    check(ring_results, causal, rotate)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL, one process per GPU)")
def test_torch_context_parallel_on_two_gpus_with_attnforge_as_torchs_flash_implementation():
    """The user's path on two GPUs: attnforge activated, F.scaled_dot_product_attention under context_parallel."""
    rows = run_worker("cuda")
    for causal, rotate in CONFIGS:
        check(rows, causal, rotate)

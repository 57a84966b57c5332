"""A Hugging Face Llama training step through attnforge, eager and torch.compile(fullgraph=True), on a GPU:
the Decisions the compiled step took (forward and backward backends), its gradients against the eager step's
(the bound is what the same step through torch's SDPA shows, compiled against eager, in the same run), and the
step time of each (model speed: the whole step, embeddings to loss; CUDA events, median over steps).

Also the same model through ``attn_implementation="sdpa"`` restricted to torch's FLASH backend, with attnforge
active as torch's flash-attention implementation and without: step times, gradients against stock flash's,
and the Decisions that served it.

    python benchmarks/compiled_step.py [--json out.json] [--layers 4 --seqlen 2048 --batch 4]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics

import torch

import attnforge
from attnforge.dispatch import clear_caches, decisions
from attnforge.integrations import transformers as integration


def model(attn: str, args):
    import transformers

    integration.register()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=args.heads * args.head_dim,
                                   intermediate_size=4 * args.heads * args.head_dim, num_hidden_layers=args.layers,
                                   num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                   head_dim=args.head_dim, max_position_embeddings=args.seqlen)
    m = transformers.LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).train()
    m.set_attn_implementation(attn)
    return m


def step(m, ids):
    m.zero_grad(set_to_none=True)
    loss = m(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach()


def grads(m):
    return {n: p.grad.float().clone() for n, p in m.named_parameters()}


def step_ms(m, ids, steps: int) -> float:
    """Median milliseconds per step over ``steps`` timed steps (CUDA events), after 3 warm-up steps."""
    for _ in range(3):
        step(m, ids)
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(m, ids)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def max_diff(a: dict, b: dict) -> dict:
    return {n: (a[n] - b[n]).abs().max().item() for n in a}


def compiled_vs_eager(attn: str, ids, args, context=contextlib.nullcontext):
    """(loss and grads eager, the same compiled, eager ms, compiled ms) of one model through ``attn``."""
    with context():
        eager = model(attn, args)
        compiled = copy.deepcopy(eager)
        compiled.forward = torch.compile(compiled.forward, fullgraph=True)
        loss_c = step(compiled, ids)
        grads_c = grads(compiled)
        loss_e = step(eager, ids)
        grads_e = grads(eager)
        return (loss_e, grads_e), (loss_c, grads_c), step_ms(eager, ids, args.steps), step_ms(compiled, ids, args.steps)


@contextlib.contextmanager
def torch_flash(attnforge_active: bool):
    """SDPA restricted to its FLASH backend, with attnforge active as torch's flash implementation or not."""
    from torch.nn.attention import (SDPBackend, activate_flash_attention_impl, restore_flash_attention_impl,
                                    sdpa_kernel)

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        if not attnforge_active:
            yield
            return
        activate_flash_attention_impl("attnforge")
        try:
            yield
        finally:
            restore_flash_attention_impl()


def summary(ds) -> list[dict]:
    return [{"problem": d.problem.describe(), "forward": d.forward.backend,
             "backward": d.backward.backend if d.backward else None} for d in ds]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, 32000, (args.batch, args.seqlen), device="cuda", generator=gen)
    result = {"config": vars(args), "timing": "whole training step (model speed), CUDA events, median"}

    clear_caches()
    (loss_e, g_e), (loss_c, g_c), eager_ms, compiled_ms = compiled_vs_eager("attnforge", ids, args)
    result["attnforge"] = {"decisions": summary(decisions()), "eager_ms": eager_ms, "compiled_ms": compiled_ms,
                           "loss_eager": loss_e.item(), "loss_compiled": loss_c.item()}
    (ploss_e, pg_e), (ploss_c, pg_c), peager_ms, pcompiled_ms = compiled_vs_eager("sdpa", ids, args)
    result["sdpa"] = {"eager_ms": peager_ms, "compiled_ms": pcompiled_ms, "loss_eager": ploss_e.item(),
                      "loss_compiled": ploss_c.item()}
    ours, theirs = max_diff(g_c, g_e), max_diff(pg_c, pg_e)
    scale = {n: g.abs().max().item() for n, g in g_e.items()}
    worst = max(g_c, key=lambda n: (ours[n] - 2 * theirs[n]) / max(scale[n], 1e-30))
    result["compiled_vs_eager_grads"] = {
        "rule": "max|compiled - eager| <= 2 * (the same for stock SDPA) + 2^-8 * max|eager|, per parameter",
        "ok": all(ours[n] <= 2 * theirs[n] + 2 ** -8 * scale[n] for n in g_c),
        "nonfinite": [n for n, g in g_c.items() if not g.isfinite().all()],
        "worst": {"param": worst, "attnforge": ours[worst], "sdpa": theirs[worst], "scale": scale[worst]}}

    (sloss_e, sg_e), (sloss_c, sg_c), seager_ms, scompiled_ms = compiled_vs_eager(
        "sdpa", ids, args, lambda: torch_flash(False))
    result["sdpa_flash_stock"] = {"eager_ms": seager_ms, "compiled_ms": scompiled_ms, "loss_eager": sloss_e.item(),
                                  "loss_compiled": sloss_c.item()}
    clear_caches()
    (floss_e, fg_e), (floss_c, fg_c), feager_ms, fcompiled_ms = compiled_vs_eager(
        "sdpa", ids, args, lambda: torch_flash(True))
    flash, stock = max_diff(fg_e, sg_e), max_diff(sg_c, sg_e)
    result["sdpa_flash_with_attnforge"] = {
        "decisions": summary(decisions()), "eager_ms": feager_ms, "compiled_ms": fcompiled_ms,
        "loss_eager": floss_e.item(), "loss_compiled": floss_c.item(),
        "eager_grads_vs_stock_flash_eager_max_abs": max(flash.values()),
        "stock_flash_compiled_vs_eager_max_abs": max(stock.values()),
        "nonfinite": [n for n, g in fg_e.items() if not g.isfinite().all()]}
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()

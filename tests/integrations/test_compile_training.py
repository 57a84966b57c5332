"""A compiled (torch.compile fullgraph, inductor) training step of a tiny Hugging Face Llama and Qwen3 through
attn_implementation="attnforge" on the CPU, with and without autocast: its gradients match eager's. Hugging
Face passes attention ``view(...).transpose(1, 2)`` views, whose strides the custom op's fakes must get right
(the backward's fake used to copy q's strides, and inductor's stride assertion failed the step); Qwen3's
QK-norm leaves q and k in fp32 while v is bf16 under autocast."""

import contextlib
import copy
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the transformers extra is not installed")

import attnforge.dispatch  # noqa: E402
import attnforge.op  # noqa: E402
from attnforge.integrations import transformers as integration  # noqa: E402


def tiny(kind: str, attn: str):
    integration.register()
    torch.manual_seed(0)
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=8, **shape))
    model.train().set_attn_implementation(attn)
    return model


def gradients(model, ids, autocast):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def compiled_and_eager(kind, attn, ids, autocast):
    model = tiny(kind, attn)
    compiled_model = copy.deepcopy(model)
    compiled_model.forward = torch.compile(compiled_model.forward, fullgraph=True)
    return gradients(compiled_model, ids, autocast), gradients(model, ids, autocast)


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_compiled_training_step_matches_eager(kind, autocast, gen, monkeypatch):
    ids = torch.randint(1, 64, (2, 17), generator=gen)
    runs = []
    decide = attnforge.op._decide
    needs_grad = lambda *a: inspect.signature(decide).bind(*a).arguments["needs_grad"]  # noqa: E731
    monkeypatch.setattr(attnforge.op, "_decide", lambda *a: runs.append(needs_grad(*a)) or decide(*a))
    attnforge.dispatch.clear_caches()
    (loss, grads), (eager_loss, eager_grads) = compiled_and_eager(kind, "attnforge", ids, autocast)
    assert runs == [True, True]  # one causal attention layer: its forward op and its backward op, deciding with grad
    compiled = [d for d in attnforge.dispatch.decisions() if d.problem.needs_grad]
    assert len(compiled) == 1 and compiled[0].problem.mask.causal  # eager's steps took the compiled step's Decision
    assert compiled[0].problem.dtype == ("bf16" if autocast else "fp32")
    assert grads.keys() == eager_grads.keys()
    if not autocast:
        torch.testing.assert_close(loss, eager_loss, atol=1e-5, rtol=1e-5)
        for name, g in grads.items():
            assert g.abs().sum() > 0, name
            # fp32 on the CPU: inductor's fused kernels reorder sums, a few ulps at the gradients' scale
            torch.testing.assert_close(g, eager_grads[name], atol=1e-5, rtol=1e-4, msg=name)
        return
    # bf16: inductor fuses (and rounds) differently from eager; the bound is what the same step shows through
    # torch's SDPA (attn_implementation="sdpa"), compiled against eager, in the same run
    (peer_loss, peer), (peer_eager_loss, peer_eager) = compiled_and_eager(kind, "sdpa", ids, autocast)
    assert (loss - eager_loss).abs() <= 2 * (peer_loss - peer_eager_loss).abs() + 1e-3 * eager_loss.abs()
    for name, g in grads.items():
        assert g.abs().sum() > 0 and g.isfinite().all(), name
        ours = (g - eager_grads[name]).abs().max()
        theirs = (peer[name] - peer_eager[name]).abs().max()
        scale = eager_grads[name].abs().max()
        assert ours <= 2 * theirs + 2 ** -8 * scale, (name, ours.item(), theirs.item(), scale.item())

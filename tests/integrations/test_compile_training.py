"""A compiled (torch.compile fullgraph, inductor) training step of a tiny Hugging Face Llama through
attn_implementation="attnforge" on the CPU: its gradients match eager's. Hugging Face passes attention
``view(...).transpose(1, 2)`` views, whose strides the custom op's fakes must get right (the backward's fake
used to copy q's strides, and inductor's stride assertion failed the step)."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the transformers extra is not installed")

import attnforge.op  # noqa: E402
from attnforge.integrations import transformers as integration  # noqa: E402


def tiny_llama():
    integration.register()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg).train()
    model.set_attn_implementation("attnforge")
    return model


def gradients(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_compiled_training_step_matches_eager(gen, monkeypatch):
    model = tiny_llama()
    compiled_model = copy.deepcopy(model)
    ids = torch.randint(1, 64, (2, 17), generator=gen)
    runs = []
    plan = attnforge.op._plan
    monkeypatch.setattr(attnforge.op, "_plan", lambda *a: runs.append(a[3]) or plan(*a))  # the op ran: fwd and bwd
    compiled_model.forward = torch.compile(compiled_model.forward, fullgraph=True)
    loss, grads = gradients(compiled_model, ids)
    assert runs == [True, True]  # one causal attention layer: its forward op and its backward op
    eager_loss, eager_grads = gradients(model, ids)
    torch.testing.assert_close(loss, eager_loss, atol=1e-5, rtol=1e-5)
    assert grads.keys() == eager_grads.keys()
    for name, g in grads.items():
        assert g.abs().sum() > 0, name
        # fp32 on the CPU: inductor's fused kernels reorder sums, a few ulps at the gradients' scale
        torch.testing.assert_close(g, eager_grads[name], atol=1e-5, rtol=1e-4, msg=name)

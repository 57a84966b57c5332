"""attn_implementation="attnforge" in Hugging Face transformers, on a small Llama-style model built
from a config with random weights (nothing downloaded)."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the transformers extra is not installed")

import attnforge  # noqa: E402
from attnforge.dispatch.mask import Mask  # noqa: E402
from attnforge.integrations import transformers as integration  # noqa: E402


TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)


def pair(model_class, cfg, reference="sdpa", prepare=None):
    """The same random model twice: through attn_implementation=``reference`` and through "attnforge"
    (``prepare(ref)`` may set weights on the reference first)."""
    integration.register()
    torch.manual_seed(0)
    ref = model_class(copy.deepcopy(cfg)).eval()
    ref.set_attn_implementation(reference)
    if prepare is not None:
        prepare(ref)
    ours = model_class(copy.deepcopy(cfg)).eval()
    ours.load_state_dict(ref.state_dict())
    ours.set_attn_implementation("attnforge")
    assert (ref.config._attn_implementation, ours.config._attn_implementation) == (reference, "attnforge")
    return ref, ours


@pytest.fixture(scope="module")
def models():
    return pair(transformers.LlamaForCausalLM, transformers.LlamaConfig(pad_token_id=0, **TINY))


def test_logits_match_sdpa_and_calls_go_through_attnforge(models, gen):
    ref, ours = models
    ids = torch.randint(1, 128, (2, 23), generator=gen)
    with torch.no_grad():
        expected = ref(ids).logits
        got = ours(ids).logits
        with attnforge.use_backend("reference"):  # another implementation entirely: the same model output
            by_reference = ours(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(by_reference, expected, atol=1e-5, rtol=1e-5)
    assert not torch.equal(by_reference, expected)  # it really ran other code
    ran = attnforge.decisions()
    assert any(d.problem.causal and d.problem.heads_kv == 2 and d.problem.seqlen_q == 23 for d in ran)


def test_padded_batch_goes_through_the_mask_path(models, gen):
    ref, ours = models
    ids = torch.randint(1, 128, (2, 23), generator=gen)
    mask = torch.ones(2, 23, dtype=torch.long)
    mask[0, :5] = 0
    with torch.no_grad():
        expected = ref(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[1], expected[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[0, 5:], expected[0, 5:], atol=1e-5, rtol=1e-5)
    assert attnforge.last_decision().problem.mask == Mask(tensor=True)


def test_generate_gives_the_same_tokens(models, gen):
    ref, ours = models
    prompt = torch.randint(1, 128, (2, 7), generator=gen)
    mask = torch.ones_like(prompt)
    # min_new_tokens: a random model may pick the end-of-sequence token in both rows and stop early,
    # which some prompts do; six decode steps each must run for the comparison to mean anything
    steps = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    expected = ref.generate(prompt, **steps)
    got = ours.generate(prompt, **steps)
    assert got.tolist() == expected.tolist() and got.shape == (2, 13)


def test_plain_causal_mask_is_none_even_while_tracing():
    """With no padding mask, a square causal mask is None (is_causal: the fast kernels) without reading any
    tensor, so also under torch.compile, where transformers' own sdpa_mask materialises it."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    plain = dict(batch_size=2, q_length=17, kv_length=17, mask_function=causal_mask_function, attention_mask=None)
    try:
        sdpa_mask(**plain)
    except TypeError:
        pytest.skip("this transformers' sdpa_mask has other arguments (the mask is then transformers' own)")
    assert integration.causal_mask(**plain) is None
    assert integration.causal_mask(**{**plain, "q_length": 1}) is None
    padding = torch.ones(2, 17, dtype=torch.bool)
    padding[0, :3] = False
    others = [dict(plain, attention_mask=padding), dict(plain, q_length=5), dict(plain, local_size=4),
              dict(plain, allow_is_causal_skip=False), dict(plain, kv_offset=3)]
    for kwargs in others:
        ours, theirs = integration.causal_mask(**kwargs), sdpa_mask(**kwargs)
        assert (ours is None and theirs is None) or torch.equal(ours, theirs), kwargs


def test_compiled_model_runs_the_causal_kernels(models, gen):
    """Under torch.compile the no-padding forward takes attention()'s causal path, as eager does."""
    _, ours = models
    ids = torch.randint(1, 128, (2, 23), generator=gen)
    compiled = torch.compile(ours.forward, fullgraph=True)
    attnforge.dispatch.clear_caches()
    with torch.no_grad():
        logits = compiled(input_ids=ids).logits
        eager = ours(input_ids=ids).logits
    assert {d.problem.mask for d in attnforge.decisions()} == {Mask(causal=True)}
    torch.testing.assert_close(logits, eager, atol=1e-5, rtol=1e-5)


def test_a_sliding_window_model_matches_sdpa(gen):
    """A tiny Mistral-style model with a sliding window shorter than the sequence: with no padding the window
    reaches attention() as window_size (the windowed kernels, no mask tensor); with padding, transformers' mask
    goes through attnforge.sdpa. Logits equal attn_implementation="sdpa" either way."""
    ref, ours = pair(transformers.MistralForCausalLM, transformers.MistralConfig(sliding_window=8, **TINY))
    plain, _ = pair(transformers.MistralForCausalLM, transformers.MistralConfig(sliding_window=None, **TINY))
    plain.load_state_dict(ref.state_dict())
    ids = torch.randint(1, 128, (2, 23), generator=gen)
    with torch.no_grad():
        expected, got, unwindowed = ref(ids).logits, ours(ids).logits, plain(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(unwindowed, expected, atol=1e-3)  # the window really changes the answer
    mask = attnforge.last_decision().problem.mask
    assert mask.causal and not mask.tensor and mask.window[0] == 7
    padding = torch.ones_like(ids)
    padding[0, :4] = 0
    with torch.no_grad():
        expected, got = ref(ids, attention_mask=padding).logits, ours(ids, attention_mask=padding).logits
    torch.testing.assert_close(got[1], expected[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[0, 4:], expected[0, 4:], atol=1e-5, rtol=1e-5)  # (padded rows: no answer)
    assert attnforge.last_decision().problem.mask == Mask(tensor=True)


def test_a_sliding_window_model_generates_the_same_tokens(gen):
    """Decoding past the window: each new token's single query takes the window (window_size, bottom-right) over
    the keys transformers keeps for a sliding layer (its cache holds at most the window's): the same tokens and the
    same logits at every step as transformers' sdpa path."""
    ref, ours = pair(transformers.MistralForCausalLM, transformers.MistralConfig(sliding_window=8, **TINY))
    prompt = torch.randint(1, 128, (2, 11), generator=gen)
    # min_new_tokens: every decode step runs (a random model may pick its end-of-sequence token in both rows)
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=9, min_new_tokens=9, do_sample=False,
              output_logits=True, return_dict_in_generate=True)
    expected = ref.generate(prompt, **kw)
    attnforge.dispatch.clear_caches()
    got = ours.generate(prompt, **kw)
    assert got.sequences.tolist() == expected.sequences.tolist() and got.sequences.shape == (2, 20)
    for mine, theirs in zip(got.logits, expected.logits):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    decode = [d.problem for d in attnforge.decisions() if d.problem.seqlen_q == 1]
    assert decode and all(p.mask.window[0] == 7 and not p.mask.tensor for p in decode)


def test_a_gemma2_longer_than_its_window_matches_eager(gen):
    """Gemma 2 alternates sliding and full layers and caps its scores: a sequence longer than the window takes
    window_size and softcap together on the sliding layers (it was refused while the window came as a mask)."""
    cfg = transformers.Gemma2Config(pad_token_id=0, head_dim=16, sliding_window=8, attn_logit_softcapping=0.02,
                                    final_logit_softcapping=None, **TINY)
    ref, ours = pair(transformers.Gemma2ForCausalLM, cfg, reference="eager")
    ids = torch.randint(1, 128, (2, 29), generator=gen)
    attnforge.dispatch.clear_caches()
    with torch.no_grad():
        want, got = ref(ids).logits, ours(ids).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    masks = {d.problem.mask for d in attnforge.decisions()}
    assert Mask(causal=True) in masks and {m.window[0] for m in masks} == {-1, 7} and not any(m.tensor for m in masks)
    assert all(d.problem.softcap for d in attnforge.decisions())


def test_a_softcapped_gemma2_matches_eager(gen):
    """Gemma 2's attn_logit_softcapping reaches attention() as softcap (the mask-free causal path; a sequence
    shorter than the sliding window gives no mask): logits equal to transformers' eager attention, which applies
    the cap itself. A padded batch (a mask tensor) with softcap is refused with the reason. (The random tiny
    model's scores are about 0.01, so a cap of 0.02 bends them; Gemma 2 itself caps at 50.)"""
    cfg = transformers.Gemma2Config(pad_token_id=0, head_dim=16, sliding_window=64, attn_logit_softcapping=0.02,
                                    final_logit_softcapping=None, **TINY)
    ref, ours = pair(transformers.Gemma2ForCausalLM, cfg, reference="eager")
    ids = torch.randint(1, 128, (2, 37), generator=gen)
    with torch.no_grad():
        want, got = ref(ids).logits, ours(ids).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert attnforge.last_decision().problem.softcap
    uncapped = copy.deepcopy(cfg)
    uncapped.attn_logit_softcapping = None
    plain = transformers.Gemma2ForCausalLM(uncapped).eval()
    plain.load_state_dict(ref.state_dict())
    with torch.no_grad():
        assert (plain(ids).logits - want).abs().max() > 100 * (got - want).abs().max()  # the cap mattered
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    with pytest.raises(ValueError, match="softcap and sinks only without an attention mask tensor"), torch.no_grad():
        ours(ids, attention_mask=mask)


def test_gpt_oss_sinks_match_eager(gen):
    """gpt-oss's attention sinks (s_aux) reach attention() as sinks: logits equal to transformers' eager
    attention, and different from the same model with the sinks at -inf (where they have no share)."""
    cfg = transformers.GptOssConfig(pad_token_id=0, head_dim=16, sliding_window=64, num_local_experts=2,
                                    num_experts_per_tok=1, layer_types=["full_attention", "full_attention"],
                                    **dict(TINY, intermediate_size=64))
    def give_sinks_values(model):  # initialised to zeros
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0, generator=gen)

    ref, ours = pair(transformers.GptOssForCausalLM, cfg, reference="eager", prepare=give_sinks_values)
    ids = torch.randint(1, 128, (2, 37), generator=gen)
    with torch.no_grad():
        want, got = ref(ids).logits, ours(ids).logits
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        assert attnforge.last_decision().problem.sinks
        for layer in ours.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))
        assert (ours(ids).logits - want).abs().max() > 100 * (got - want).abs().max()  # the sinks mattered


def test_a_packed_batch_goes_to_attention_varlen(models, gen):
    """A padding-free packed row (sequences of 7, 1, 13 and 2 tokens concatenated, position ids restarting, and
    FlashAttention's varlen kwargs as DataCollatorWithFlattening(return_flash_attn_kwargs=True) makes them) runs
    one attention_varlen call per layer, and gives each sequence the logits it gets alone."""
    ref, ours = models
    lengths = [7, 1, 13, 2]
    ids = torch.randint(1, 128, (1, sum(lengths)), generator=gen)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    packed = dict(position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths),
                  max_length_k=max(lengths))
    with torch.no_grad():
        got = ours(ids, **packed).logits
        decision = attnforge.last_decision()
        alone = [ref(ids[:, a:b]).logits for a, b in zip(cu.tolist(), cu.tolist()[1:])]
    assert decision.problem.varlen and decision.problem.batch == len(lengths) and decision.problem.causal
    torch.testing.assert_close(got, torch.cat(alone, 1), atol=1e-5, rtol=1e-5)

"""Issue #23: models served exactly or refused when the generator is built, never served wrong (tiny models
built from configs, each case the issue's repro)."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from transformers import (BloomConfig, BloomForCausalLM, FalconConfig, FalconForCausalLM, GenerationConfig, GPTNeoConfig,
                          GPTNeoForCausalLM, LlamaConfig, LlamaForCausalLM, MptConfig, MptForCausalLM, ReformerConfig,
                          ReformerModelWithLMHead, RwkvConfig, RwkvForCausalLM, WhisperConfig, WhisperForCausalLM, xLSTMConfig,
                          xLSTMForCausalLM)

from conftest import assert_greedy_equal, hf_greedy, tiny_llama
from lookahead import LookaheadConfig, LookaheadGenerator, capability
from lookahead.cli import main
from lookahead.model_forward import forward, prefill
from lookahead.probing import probe

NO_SPECIAL = dict(eos_token_id=None, bos_token_id=None, pad_token_id=None)
LLAMA = dict(vocab_size=48, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, **NO_SPECIAL)


def sharpened(model, *suffixes: str):
    """``model`` in eval mode with the weights ending in ``suffixes`` (and lm_head) scaled by 4: drafts get accepted."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
        for name, weight in model.named_parameters():
            if name.endswith(suffixes):
                weight.mul_(4.0)
    return model.eval()


def test_longrope_steps_stay_on_one_side_of_the_factor_switch():
    # LongRoPE switches to its long factors for a whole forward once its largest position reaches 32
    torch.manual_seed(0)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [50.0] * 8,
            "original_max_position_embeddings": 32}
    model = sharpened(LlamaForCausalLM(LlamaConfig(**LLAMA, rope_parameters=rope)), "q_proj.weight", "k_proj.weight")
    prompt = list(range(10, 38))
    ref = hf_greedy(model, prompt, 20)
    out = LookaheadGenerator(model, config=LookaheadConfig(tree_budget=8, auto=False, window=0)).generate(prompt, max_new_tokens=20)
    assert_greedy_equal(model, prompt, out.tokens, ref)
    assert out.stats.steps < 20  # drafts were accepted around the switch


def test_dynamic_rope_never_runs_past_where_it_would_rescale():
    # dynamic NTK rescales every forward whose largest position reaches max_position_embeddings, by that
    # position: one-token-at-a-time generate() cannot be matched there, and the context ends there
    torch.manual_seed(0)
    rope = {"rope_type": "dynamic", "factor": 8.0, "rope_theta": 10000.0}
    model = sharpened(LlamaForCausalLM(LlamaConfig(**LLAMA, rope_parameters=rope)))
    gen = LookaheadGenerator(model, config=LookaheadConfig(tree_budget=64, auto=False))
    with pytest.raises(ValueError, match="exceeds the model's context of 64 tokens"):
        gen.generate([1, 2, 3], max_new_tokens=62)
    prompt = [5, 9, 5, 9]
    assert_greedy_equal(model, prompt, gen.generate(prompt, max_new_tokens=60).tokens, hf_greedy(model, prompt, 60))


@pytest.mark.parametrize("name", ["rwkv", "xlstm", "reformer"])
def test_models_without_a_rollback_kv_cache_are_refused(name):
    torch.manual_seed(0)
    if name == "rwkv":
        model = RwkvForCausalLM(RwkvConfig(vocab_size=48, hidden_size=32, num_hidden_layers=2, context_length=64,
                                           attention_hidden_size=32, intermediate_size=64))
    elif name == "xlstm":
        model = xLSTMForCausalLM(xLSTMConfig(vocab_size=48, hidden_size=64, num_heads=4, num_blocks=2))
    else:
        model = ReformerModelWithLMHead(ReformerConfig(vocab_size=48, hidden_size=32, is_decoder=True, axial_pos_embds=False,
                                                       max_position_embeddings=64))
    with pytest.raises(ValueError, match="recurrent state|cannot run a lookahead step"):
        LookaheadGenerator(model.eval())


def test_the_cli_refuses_a_recurrent_model(tmp_path):
    torch.manual_seed(0)
    RwkvForCausalLM(RwkvConfig(vocab_size=48, hidden_size=32, num_hidden_layers=2, context_length=64, attention_hidden_size=32,
                               intermediate_size=64)).save_pretrained(tmp_path / "rwkv")
    result = CliRunner().invoke(main, ["generate", "--model", str(tmp_path / "rwkv"), "--ids", "1,2,3", "--max-new-tokens", "5",
                                       "--dtype", "float32", "--no-lookahead"])
    assert result.exit_code == 1 and "recurrent state" in result.output, result.output


def test_generation_config_and_max_length_set_the_length_as_in_generate():
    model = tiny_llama()
    gen = LookaheadGenerator(model, config=LookaheadConfig(auto=False))
    prompt = torch.tensor([[5, 17, 99, 3]])
    cases = [dict(generation_config=GenerationConfig(max_new_tokens=5)), dict(max_length=7), dict(max_new_tokens=6, max_length=7),
             dict(generation_config=GenerationConfig(max_length=9)), {}]
    for kwargs in cases:
        ref = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, pad_token_id=0, **kwargs)[0, 4:].tolist()
        assert gen.generate(prompt, **kwargs).tokens == ref, kwargs
    assert len(gen.generate(prompt, 3, generation_config=GenerationConfig(max_new_tokens=5)).tokens) == 3  # the argument wins
    with pytest.raises(ValueError, match="max_length 4 - prompt 4"):
        gen.generate(prompt, max_length=4)


def test_gpt_neo_steps_stay_within_its_causal_buffer():
    # GPT-Neo's causal-mask buffer holds max_position_embeddings keys: a tree step near the end must fit in it
    torch.manual_seed(0)
    model = sharpened(GPTNeoForCausalLM(GPTNeoConfig(vocab_size=48, hidden_size=64, num_heads=4, num_layers=2, max_position_embeddings=64,
                                                     attention_types=[[["global", "local"], 1]], window_size=8, **NO_SPECIAL)))
    prompt = list(range(1, 41))
    out = LookaheadGenerator(model, config=LookaheadConfig(tree_budget=8, auto=False)).generate(prompt, max_new_tokens=24)
    assert_greedy_equal(model, prompt, out.tokens, hf_greedy(model, prompt, 24))


def tiny_mpt() -> MptForCausalLM:
    torch.manual_seed(0)
    return sharpened(MptForCausalLM(MptConfig(vocab_size=48, d_model=64, n_heads=4, n_layers=2, max_seq_len=64, **NO_SPECIAL)))


def test_the_cost_probe_fits_a_small_context():
    curve = probe(tiny_mpt(), rounds=1)  # MPT's context is max_seq_len (64), not the probe's 256-token cache
    assert curve.sizes[-1] <= 32 and curve.ratios[0] == 1.0


@pytest.mark.parametrize("name", ["mpt", "bloom", "falcon-alibi"])
def test_alibi_models_that_cannot_take_a_lookahead_step_are_refused(name):
    # Bloom's and Falcon's ALiBi builders cannot take a 4D mask; MPT's biases go by cache slot, not by
    # position, so two sibling drafts at one position would see different distances
    torch.manual_seed(0)
    if name == "mpt":
        model = tiny_mpt()
    elif name == "bloom":
        model = BloomForCausalLM(BloomConfig(vocab_size=48, hidden_size=64, n_head=4, n_layer=2, **NO_SPECIAL))
    else:
        model = FalconForCausalLM(FalconConfig(vocab_size=48, hidden_size=64, num_attention_heads=4, num_hidden_layers=2, alibi=True,
                                               max_position_embeddings=64, **NO_SPECIAL))
    with pytest.raises(ValueError, match="cannot run a lookahead step|differ from its plain forwards"):
        LookaheadGenerator(model.eval())


def test_a_model_that_ignores_logits_to_keep_is_served_exactly():
    # WhisperForCausalLM returns logits for every row of a step, whatever logits_to_keep asks for
    torch.manual_seed(0)
    config = WhisperConfig(vocab_size=48, d_model=64, decoder_layers=2, encoder_layers=2, decoder_attention_heads=4,
                           encoder_attention_heads=4, decoder_ffn_dim=64, encoder_ffn_dim=64, max_target_positions=64,
                           decoder_start_token_id=0, **NO_SPECIAL)
    model = sharpened(WhisperForCausalLM(config))
    prompt = [5, 17, 2, 5, 17, 2]
    gen = LookaheadGenerator(model, config=LookaheadConfig(tree_budget=8, auto=False))
    assert_greedy_equal(model, prompt, gen.generate(prompt, max_new_tokens=40).tokens, hf_greedy(model, prompt, 40))
    with pytest.raises(ValueError, match="context of 64 tokens"):  # its context is max_target_positions
        gen.generate(prompt, max_new_tokens=59)


def test_the_batch_probe_catches_rows_that_leak_between_sequences():
    model = tiny_llama(seed=2)
    gen = LookaheadGenerator(model, config=LookaheadConfig(auto=False))
    probes = (lambda prompt: prefill(model, prompt), lambda *step: forward(model, gen.windows, *step))
    assert gen.batchable and capability.check_batch(model, *probes)
    leaky = lambda *step: probes[1](*step).mean(0, keepdim=True).expand(2, -1, -1)  # noqa: E731 -- rows mixed across the batch
    assert not capability.check_batch(model, probes[0], leaky)
    gen.batchable = False  # as for such a model: a batch's sequences decode in turn, each still exact
    prompts = [[5, 6, 5, 6, 5], [9, 10, 11] * 4]
    for prompt, out in zip(prompts, gen.decode([gen.new_lane(p, 12, state=gen.new_state()) for p in prompts])):
        assert out.tokens == hf_greedy(model, prompt, 12)

"""Exactness on every architecture the engine accepts (tiny random-weight models, fast): sliding windows
with and without ``layer_types`` and smaller than the step, learned absolute positions and dynamic RoPE up
to the last position of the context, and a fuzz over architectures x step shapes x prompt lengths."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import (GPT2Config, GPT2LMHeadModel, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM)

from conftest import assert_greedy_equal, hf_greedy
from lookahead import LookaheadConfig, LookaheadGenerator

CONTEXT = 64
COMMON = dict(vocab_size=40, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=CONTEXT, eos_token_id=None, bos_token_id=None, pad_token_id=None)


def build(name: str, seed: int = 0, window: int = 6):
    """A tiny model of architecture ``name``, its lm_head sharpened so greedy paths repeat and drafts get accepted."""
    torch.manual_seed(seed)
    if name == "llama":
        model = LlamaForCausalLM(LlamaConfig(**COMMON))
    elif name == "llama-dynamic-rope":  # dynamic NTK: positions past the context would change every rotation
        model = LlamaForCausalLM(LlamaConfig(**COMMON, rope_parameters={"rope_type": "dynamic", "factor": 64.0, "rope_theta": 10000.0}))
    elif name == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**COMMON))
    elif name == "mistral":  # sliding_window without layer_types: every layer windowed
        model = MistralForCausalLM(MistralConfig(**COMMON, sliding_window=window))
    elif name == "phi3":
        model = Phi3ForCausalLM(Phi3Config(**COMMON, sliding_window=window))
    elif name == "gemma3":
        model = Gemma3ForCausalLM(Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=window,
                                                   layer_types=["sliding_attention", "full_attention"]))
    elif name == "gpt2":  # learned absolute positions: an index past n_positions fails
        model = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=CONTEXT, n_embd=64, n_layer=2, n_head=4,
                                           eos_token_id=None, bos_token_id=None, pad_token_id=None))
    else:
        raise ValueError(name)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    return model.eval()


ARCHITECTURES = ["llama", "llama-dynamic-rope", "qwen2", "mistral", "phi3", "gemma3", "gpt2"]


def run_and_compare(model, config: LookaheadConfig, prompt: list[int], max_new_tokens: int):
    ref = hf_greedy(model, prompt, max_new_tokens)
    out = LookaheadGenerator(model, config=config).generate(prompt, max_new_tokens=max_new_tokens)
    assert_greedy_equal(model, prompt, out.tokens, ref)
    return out


@pytest.mark.parametrize("name", ["mistral", "phi3"])
def test_sliding_window_without_layer_types_matches_generate(name):
    out = run_and_compare(build(name, window=6), LookaheadConfig(), [8, 36, 4], 40)
    assert out.stats.steps < 40  # drafts were accepted, so windowed steps really ran


@pytest.mark.parametrize("ngram", [4, 6, 7])
def test_sliding_window_smaller_than_the_step(ngram):
    # a window of 5 with Jacobi columns of N-1 levels and trees of depth up to 8: rows see only the window
    model = build("gemma3", seed=1, window=5)
    config = LookaheadConfig(auto=False, window=1, ngram=ngram, guess=16, suffix_length=8)
    for prompt in ([3, 7, 3, 7, 3, 7, 9], [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4]):
        run_and_compare(model, config, prompt, 40)


@pytest.mark.parametrize("name", ["gpt2", "llama-dynamic-rope"])
def test_generating_up_to_the_last_position_of_the_context(name):
    model = build(name)
    for prompt in ([1, 2, 3, 4], [5, 9, 5, 9, 5, 9]):
        run_and_compare(model, LookaheadConfig(auto=False, window=3, ngram=4, guess=4), prompt, CONTEXT - len(prompt))


def test_fuzz_architectures_shapes_and_prompt_lengths():
    """Random architecture, step shape, prompt and length reaching the end of the context: no difference but ties."""
    rng = np.random.default_rng(13)
    models = {}
    for trial in range(24):
        name = ARCHITECTURES[trial % len(ARCHITECTURES)]
        model = models.setdefault(name, build(name, window=int(rng.integers(3, 9))))
        config = LookaheadConfig(auto=bool(rng.integers(0, 2)), window=int(rng.integers(0, 5)), ngram=int(rng.integers(2, 6)), guess=int(rng.integers(0, 6)),
                                 tree_budget=int(rng.integers(0, 24)), suffix_drafts=int(rng.integers(0, 4)),
                                 suffix_length=int(rng.integers(1, 10)), recycle_k=int(rng.integers(0, 6)))
        motif = rng.integers(0, 40, size=int(rng.integers(1, 6))).tolist()
        prompt = (motif * 20)[: int(rng.integers(1, 40))]
        max_new = CONTEXT - len(prompt) - int(rng.integers(0, 3))
        run_and_compare(model, config, prompt, max_new)

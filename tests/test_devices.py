"""The engine on every device at hand: the same checks on CPU (always) and on CUDA (when a GPU is present;
skipped otherwise, so CI on CPU collects and skips them). fp32 greedy equals ``generate()`` on that device
(ties aside) for tiny models of the tested architectures, trees of 1 to 64 nodes, batches, and a real-shaped
model (SmolLM2-135M's configuration, random weights; CUDA only: on CPU the real checkpoint is tested elsewhere);
a seeded sample is the same whatever was drafted."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import assert_greedy_equal, hf_greedy
from lookahead import LookaheadConfig, LookaheadGenerator
from test_architectures import build

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
PROMPT = [8, 36, 4, 8, 36, 5, 8]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "phi3", "gemma3", "gpt2"])
def test_greedy_equals_generate_on_the_device(device, name):
    model = build(name).to(device)
    ref = hf_greedy(model, PROMPT, 48)
    for budget in (1, 8, 64):
        out = LookaheadGenerator(model, config=LookaheadConfig(auto=False, tree_budget=budget)).generate(PROMPT, max_new_tokens=48)
        assert_greedy_equal(model, PROMPT, out.tokens, ref)
    assert out.stats.steps < 47  # drafts were accepted on this device


@pytest.mark.parametrize("device", DEVICES)
def test_a_steps_attention_leaves_out_cudnn_on_cuda(device):
    """cuDNN's SDPA plans anew for each key length it meets, and a decode step meets a new one every time: our prefill
    and steps leave it out on CUDA (``model_forward.attention_backends``: bf16 steps ~3x faster on an H200); elsewhere
    SDPA keeps every backend, and after a request the flags are as they were."""
    model = build("llama").to(device)
    gen = LookaheadGenerator(model, config=LookaheadConfig(auto=False))  # its support checks ran the stock forward too
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    gen.generate(PROMPT, max_new_tokens=8)
    assert len(seen) > 1 and set(seen) == {device != "cuda"}
    assert torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.parametrize("device", DEVICES)
def test_a_batch_equals_each_prompt_alone_on_the_device(device):
    model = build("gemma3").to(device)
    prompts = [PROMPT, [3, 9, 3, 9, 3], list(range(5, 25))]
    outs = LookaheadGenerator(model, config=LookaheadConfig(auto=False, tree_budget=8)).generate_batch(prompts, 30)
    for prompt, out in zip(prompts, outs):
        assert_greedy_equal(model, prompt, out.tokens, hf_greedy(model, prompt, 30))


@pytest.mark.parametrize("device", DEVICES)
def test_a_seeded_sample_does_not_depend_on_drafting_on_the_device(device):
    gen = LookaheadGenerator(build("llama").to(device), config=LookaheadConfig(auto=False, tree_budget=16))
    options = dict(max_new_tokens=40, do_sample=True, temperature=0.8, top_k=8, seed=1234)
    drafted = gen.generate(PROMPT, **options)
    assert drafted.tokens == gen.generate(PROMPT, lookahead=False, **options).tokens
    assert drafted.stats.steps < 39


@CUDA
def test_a_real_shaped_model_equals_generate_on_cuda():
    """SmolLM2-135M's shape (random weights, lm_head sharpened so drafts get accepted), trees of 1 to 64 nodes."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
                         eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config).eval().to("cuda")
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    prompt = [int(t) for t in torch.randint(0, 49152, (40,))] * 2  # repeated: suffix drafts find matches
    ref = hf_greedy(model, prompt, 64)
    for budget in (1, 8, 32, 64):
        out = LookaheadGenerator(model, config=LookaheadConfig(auto=False, tree_budget=budget)).generate(prompt, max_new_tokens=64)
        assert_greedy_equal(model, prompt, out.tokens, ref)

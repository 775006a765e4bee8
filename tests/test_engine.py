"""The decode loop on tiny random-weight models (fast): exactness vs ``generate``, KV compaction vs
recomputation, sliding-window layers beyond their window, stops, statistics and input errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import assert_greedy_equal, hf_greedy, tiny_gemma3, tiny_llama
from lookahead import LookaheadConfig, LookaheadGenerator, kv
from lookahead.layout import build_layout
from lookahead.window import JacobiWindow

CONFIGS = [
    LookaheadConfig(),
    LookaheadConfig(window=1, ngram=2, guess=0),  # smallest window, no verification
    LookaheadConfig(window=4, ngram=2, guess=4),  # N=2: bigrams
    LookaheadConfig(window=3, ngram=5, guess=64),  # G beyond what the pool holds
    LookaheadConfig(window=6, ngram=3, guess=2, seed_pool_from_prompt=False, pool_from_output=False),
]


def repetitive_prompt(length: int = 24, seed: int = 1) -> list[int]:
    rng = np.random.default_rng(seed)
    motif = rng.integers(3, 120, size=6).tolist()
    return (motif * (length // 6 + 1))[:length]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"W{c.window}N{c.ngram}G{c.guess}")
@pytest.mark.parametrize("make_model", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3-window8"])
def test_tiny_models_match_generate(make_model, config):
    model = make_model()
    gen = LookaheadGenerator(model, config=config)
    for prompt in (repetitive_prompt(), [5, 17, 99, 3], list(range(40, 70))):
        ref = hf_greedy(model, prompt, 48)
        out = gen.generate(prompt, max_new_tokens=48)
        assert_greedy_equal(model, prompt, out.tokens, ref)
        assert out.stats.new_tokens == 48 and out.finish_reason == "length"


def test_statistics_add_up():
    model = tiny_llama(seed=3)
    gen = LookaheadGenerator(model, config=LookaheadConfig(window=4, ngram=4, guess=8))
    s = gen.generate(repetitive_prompt(60), max_new_tokens=64).stats
    assert sum(s.accepted_hist.values()) == s.steps
    assert sum(k * v for k, v in s.accepted_hist.items()) + 1 >= s.new_tokens  # the last step may be cut
    assert s.compression == pytest.approx(s.new_tokens / (s.steps + 1))
    assert s.as_dict()["new_tokens"] == 64


def test_plain_greedy_path_matches_generate():
    model = tiny_gemma3()
    prompt = repetitive_prompt(30)
    out = LookaheadGenerator(model).generate(prompt, max_new_tokens=32, lookahead=False)
    assert_greedy_equal(model, prompt, out.tokens, hf_greedy(model, prompt, 32))
    assert out.stats.steps == 31 and set(out.stats.accepted_hist) == {1}


def test_stops_at_eos_and_never_emits_past_it():
    model = tiny_llama()
    prompt = repetitive_prompt()
    ref = hf_greedy(model, prompt, 40)
    eos = ref[10]
    first = ref.index(eos)
    model.generation_config.eos_token_id = [eos, 127]
    out = LookaheadGenerator(model, config=LookaheadConfig(window=3, ngram=3, guess=3)).generate(prompt, max_new_tokens=40)
    assert out.tokens == ref[: first + 1] and out.finish_reason == "stop"
    assert out.tokens == hf_greedy(model, prompt, 40)


def test_streamer_receives_prompt_then_every_token_in_order():
    class Recorder:
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, ids):
            self.puts.append(ids.tolist())

        def end(self):
            self.ended = True

    model, rec = tiny_llama(), Recorder()
    prompt = repetitive_prompt()
    out = LookaheadGenerator(model).generate(prompt, max_new_tokens=20, streamer=rec)
    assert rec.puts[0] == prompt and sum(rec.puts[1:], []) == out.tokens and rec.ended


@pytest.mark.parametrize("make_model", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3-window8"])
def test_kv_compaction_equals_recomputing_the_accepted_prefix(make_model):
    model = make_model()
    gen = LookaheadGenerator(model, config=LookaheadConfig(window=2, ngram=3, guess=2))
    prefix = repetitive_prompt(20)  # longer than the gemma window of 8
    with torch.inference_mode():
        cache = kv.new_cache(model)
        model(input_ids=torch.tensor([prefix]), past_key_values=cache, use_cache=True)
        layout = build_layout(2, 3, levels=2, n_cands=2)
        current, levels, cands = 7, np.array([[1, 2], [3, 4]]), np.array([[8, 9], [10, 11]])
        gen._forward(layout, cache, current, levels, cands, position=len(prefix))
        # keep the current token and the second candidate's two tokens (rows 5 and 6 of the layout)
        kv.compact(cache, layout.size, torch.tensor([0, 7, 8]))
        fresh = kv.new_cache(model)
        model(input_ids=torch.tensor([prefix + [current, 10, 11]]), past_key_values=fresh, use_cache=True)
        fresh.crop(0)  # sliding layers keep only their window, as after a compaction
    for got, want in zip(cache.layers, fresh.layers):
        assert got.keys.shape == want.keys.shape
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-4)
    assert cache.get_seq_length() == len(prefix) + 3


def test_window_is_deterministic_for_a_seed_and_warms_up():
    prompt = np.arange(100)
    a, b, c = (JacobiWindow(4, 4, prompt, seed) for seed in (0, 0, 1))
    assert np.array_equal(a.active, b.active) and not np.array_equal(a.active, c.active)
    assert a.advance(np.array([1, 2, 3, 4])).shape == (0, 4)  # warming up: 2 of 3 levels
    assert a.advance(np.array([5, 6, 7, 8])).shape == (0, 4)  # 3 of 3
    ngrams = a.advance(np.array([9, 9, 9, 9]))
    assert ngrams.tolist()[0] == [b.active[0, 0], 1, 5, 9] and a.active[-1].tolist() == [9, 9, 9, 9]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(window=0), r"window \(W\) must be in \[1, 128\], got 0"),
        (dict(window=129), r"window \(W\) must be in \[1, 128\]"),
        (dict(ngram=1), r"ngram \(N\) must be in \[2, 16\], got 1"),
        (dict(guess=-1), r"guess \(G\) must be in \[0, 128\]"),
        (dict(window=2.5), r"window \(W\) must be an integer"),
        (dict(pool_slots=0), "pool_slots must be >= 1"),
        (dict(seed_pool_from_prompt="yes"), "seed_pool_from_prompt must be True or False"),
    ],
)
def test_config_rejects_out_of_range_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LookaheadConfig(**kwargs)


def test_bad_generate_inputs_raise_value_errors():
    gen = LookaheadGenerator(tiny_llama())
    with pytest.raises(ValueError, match="the prompt is empty"):
        gen.generate([], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"token id 128 is outside the vocabulary \[0, 128\)"):
        gen.generate([1, 128], max_new_tokens=4)
    with pytest.raises(ValueError, match="token id -1 is outside"):
        gen.generate(torch.tensor([[1, -1]]), max_new_tokens=4)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        gen.generate("hello", max_new_tokens=4)
    with pytest.raises(ValueError, match="exceeds the model's context of 512"):
        gen.generate([1] * 500, max_new_tokens=13)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        gen.generate([1, 2], max_new_tokens=0)
    with pytest.raises(ValueError, match="integer tensor"):
        gen.generate(torch.tensor([1.0, 2.0]), max_new_tokens=4)
    with pytest.raises(ValueError, match="list of ints"):
        gen.generate([1, "2"], max_new_tokens=4)


def test_unsupported_models_are_refused():
    model = tiny_llama()
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="cannot take a custom 4D mask"):
        LookaheadGenerator(model)

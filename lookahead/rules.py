"""A request's decoding rules: its ``GenerationConfig`` turned into the very logits processors, stop rules and
sampling that ``model.generate()`` would use, plus the acceptance rule that matches them."""

from __future__ import annotations

import copy
import math
import time
from functools import lru_cache
from typing import NamedTuple

import numpy as np
import torch
from transformers import GenerationConfig, LogitsProcessor, PreTrainedModel, StopStringCriteria

from lookahead.host_kernels import argmax
from lookahead.prompt import check_text
from lookahead.tree import TokenTree
from lookahead.verify import Verdict, accept, gumbel

# generate() options with no lossless single-sequence meaning here: (field, value that means "off")
UNSUPPORTED = {
    "num_beams": 1, "num_beam_groups": 1, "num_return_sequences": 1, "penalty_alpha": None, "guidance_scale": None,
    "prompt_lookup_num_tokens": None, "assistant_confidence_threshold": 0.4, "constraints": None, "force_words_ids": None,
    "cache_implementation": None, "watermarking_config": None, "output_scores": False, "output_logits": False,
    "return_dict_in_generate": False, "diversity_penalty": 0.0, "low_memory": None,
    "encoder_repetition_penalty": 1.0, "encoder_no_repeat_ngram_size": 0,  # encoder-decoder options in generate()
}
# What one request may ask in stop strings. Those in use are few and short ("\n\n", "</s>", "Observation:", a closing
# tag; OpenAI takes 4): 16 of 256 characters is far past them, and keeps a check (per emitted token) to the
# strings of at most the last 1024 tokens (256 characters of 4 UTF-8 bytes) and 16 searches of them.
MAX_STOP_STRINGS, MAX_STOP_LENGTH = 16, 256
PREFIX = "abcdef"  # the static prefix ``StopStringCriteria.clean_tokenizer_vocab`` reads each token after
PENALTIES = ("presence_penalty", "frequency_penalty")  # ours, not generate()'s: OpenAI's additive penalties (``Penalties``)
PENALTY_BOUND = 2.0  # OpenAI's and vLLM's range, [-2, 2]
MAX_LOGPROBS = 20  # likeliest alternatives an emitted token's log-probability may come with (OpenAI's top_logprobs)


class TokenLogprob(NamedTuple):
    """An emitted token's log-probability under the model (its raw logits' log-softmax, before any processor or
    temperature, as vLLM's default), and the likeliest tokens' (id, log-probability), likeliest first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """Each of ``tokens``' log-probability under its row of raw ``logits`` (len(tokens) or more, V), with the ``k``
    likeliest tokens'."""
    if not tokens:
        return []
    logp = torch.log_softmax(logits[: len(tokens)].float(), -1)  # (n, V)
    chosen = logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    values, ids = logp.topk(k, -1)  # (n, k); k = 0: empty
    return [TokenLogprob(t, c, list(zip(i, v))) for t, c, i, v in zip(tokens, chosen, ids.tolist(), values.tolist())]


class Penalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties, as vLLM applies them: each token's score less ``frequency`` times
    how often it came in the tokens generated so far (those after the prompt's ``prompt_len``), less ``presence`` once
    it has come; before every other processor. generate() has no such option: it takes this as a
    ``logits_processor``. A function of the prefix alone, so verification scores every branch as plain decoding
    would."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """input_ids (B, L), scores (B, V) -> the penalised scores (B, V)."""
        generated = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)

    @classmethod
    def taken_from(cls, options: dict, prompt_len: int) -> tuple["Penalties | None", dict]:
        """The penalties ``options`` ask for (None: none, or both 0), and the options without them; a ValueError for a
        value that is not a number in [-2, 2]."""
        values = {name: options.get(name, 0.0) for name in PENALTIES}
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -PENALTY_BOUND <= value <= PENALTY_BOUND:
                raise ValueError(f"{name} must be a number in [{-PENALTY_BOUND:g}, {PENALTY_BOUND:g}], got {value!r}")
        rest = {k: v for k, v in options.items() if k not in PENALTIES}
        return (cls(prompt_len, float(values[PENALTIES[0]]), float(values[PENALTIES[1]])) if any(values.values()) else None), rest


class Rules:
    """The generation options of one request, resolved once: processors, acceptance rule, stops, RNG.

    ``seed=None`` samples from torch's global RNG, as ``generate()`` does (``torch.manual_seed`` before the
    call reproduces it); an int seeds a private generator, reproducible whatever the global state.
    """

    def __init__(self, model: PreTrainedModel, tokenizer, prompt_len: int, max_new_tokens: int | None,
                 generation_config: GenerationConfig | None, seed: int | None, options: dict) -> None:
        # the same helpers generate() uses, so defaults, validation and processor order match it exactly
        penalties, options = Penalties.taken_from(options, prompt_len)
        # likeliest alternatives with each new token's log-probability, and with each prompt token's (None: none)
        self.logprobs, self.prompt_logprobs = options.pop("logprobs", None), options.pop("prompt_logprobs", None)
        for name, k in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {k!r}")
        if max_new_tokens is not None:  # an explicit argument outranks every config, as generate()'s keyword does
            if generation_config is not None:  # set there: beside a config, transformers 5.24 warns of a keyword
                generation_config = copy.copy(generation_config)
                generation_config.max_new_tokens = max_new_tokens
            else:
                options = options | {"max_new_tokens": max_new_tokens}
        config, unused = model._prepare_generation_config(generation_config, **options)
        if unused:
            raise ValueError(f"unknown generation option(s): {', '.join(sorted(unused))}")
        for name, off in UNSUPPORTED.items():
            value = getattr(config, name, off)
            if value is not None and value != off:
                raise ValueError(f"generation option {name}={value!r} is not supported by lookahead decoding")
        for name, value in vars(config).items():  # generate() itself takes temperature=inf, top_p=nan, ...
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
        if config.do_sample and config.temperature is not None and config.temperature <= 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {config.temperature}")
        for name in ("top_p", "typical_p", "min_p"):  # generate() skips a top_p or typical_p of 1 or more without a word
            value = getattr(config, name, None)
            if config.do_sample and value is not None and not 0 <= value <= 1:
                raise ValueError(f"{name} is a probability mass, in [0, 1], got {value}")
        self.max_new_tokens = self._length(model, config, prompt_len, generation_config, options)
        config.max_length = prompt_len + self.max_new_tokens
        config.max_new_tokens = self.max_new_tokens
        host = torch.device("cpu")  # the loop verifies on the host: a step's logits come back once, whatever the model's device
        model._prepare_special_tokens(config, device=host)
        self.processors = model._get_logits_processor(config, input_ids_seq_length=prompt_len, device=host)
        if penalties is not None:
            self.processors.insert(0, penalties)
        self.do_sample = bool(config.do_sample)
        eos = config._eos_token_tensor
        self.eos_ids = frozenset(eos.flatten().tolist()) if eos is not None else frozenset()
        stops = [config.stop_strings] if isinstance(config.stop_strings, str) else config.stop_strings or []
        if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):  # (5: a TypeError below)
            raise ValueError(f"stop_strings must be a string or a list of strings, got {config.stop_strings!r:.80}")
        stops = [s for s in stops if s]  # "" would end generation at once; ignored, as OpenAI ignores it
        if stops and tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none")
        self.stop_strings = StopStrings(tokenizer, stops) if stops else None
        self.rng = torch.Generator().manual_seed(seed) if seed is not None else None
        self.deadline = time.monotonic() + config.max_time if config.max_time is not None else None

    @staticmethod
    def _length(model: PreTrainedModel, config: GenerationConfig, prompt_len: int,
                generation_config: GenerationConfig | None, options: dict) -> int:
        """New tokens to generate, by generate()'s precedence: ``max_new_tokens`` (argument, options, the given
        or the model's generation config), else a ``max_length`` set anywhere, minus the prompt, else 20 new
        tokens capped at the model's ``max_position_embeddings``."""
        new = config.max_new_tokens
        if new is None:
            max_length_set = options.get("max_length") is not None or model.generation_config.max_length is not None \
                or (generation_config is not None and generation_config.max_length is not None)
            total = config.max_length + (0 if max_length_set else prompt_len)
            context = getattr(model.config, "max_position_embeddings", None)
            new = (total if max_length_set or context is None else min(total, context)) - prompt_len
        if isinstance(new, bool) or not isinstance(new, int) or new < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {new!r}"
                             + ("" if config.max_new_tokens is not None else f" (max_length {config.max_length} - prompt {prompt_len})"))
        return new

    def scores(self, logits: torch.Tensor, prefix: list[int]) -> torch.Tensor:
        """Processed next-token scores (V,), fp32 as generate()'s, from raw logits (V,) after the token sequence ``prefix``;
        without processors the logits as they are (a bf16 row ranks as its fp32 copy does: ``argmax`` reads it whole)."""
        if not self.processors:
            return logits
        return self.processors(torch.tensor([prefix], device=logits.device), logits.float()[None].clone())[0]

    def verify(self, history: list[int], first: torch.Tensor, tree_logits: torch.Tensor | None, tree: TokenTree,
               best: np.ndarray | None = None) -> Verdict:
        """The accepted branch and the next token: the argmax walk over the processed scores, Gumbel-perturbed
        when sampling (the only difference between the two).

        history: the tokens so far, the current one last; first (V,): logits after it; tree_logits
        (K, V): logits after each tree node; tree: the K nodes; best (1 + K,): each of those rows' argmax where the
        step has it (its top-k's first), which a greedy walk of raw logits reads instead of the rows (cold after a
        forward: ~20 us each on SmolLM2's 49152 columns).
        """
        if best is not None and not self.do_sample and not self.processors:
            return accept(lambda node: int(best[node + 1]), tree)

        def next_token(node: int) -> int:  # after tree node ``node`` (-1: the current token)
            if node < 0:
                scores = self.scores(first, history)
            else:  # the prefix only where a processor reads it
                scores = self.scores(tree_logits[node], history + tree.tokens[tree.path(node)].tolist() if self.processors else history)
            return argmax(scores.double() + gumbel(scores.numel(), self.rng) if self.do_sample else scores)

        return accept(next_token, tree)

    def logprobs_of(self, logits: torch.Tensor, tokens: list[int]) -> list[TokenLogprob]:
        """``token_logprobs`` with the ``logprobs`` likeliest tokens'; [] where the request asked for none. A row's
        log-softmax depends on that row alone, so a token verified in a wide step has the log-probability plain decoding
        gives it (up to the forward's own rounding across widths, none on our kernels)."""
        return [] if self.logprobs is None else token_logprobs(logits, tokens, self.logprobs)

    def out_of_time(self) -> bool:
        """``max_time`` has passed since the request began (checked between steps, as generate() checks between tokens)."""
        return self.deadline is not None and time.monotonic() > self.deadline

    def stops(self, sequence: list[int]) -> bool:
        """Whether generation ends with the last token of ``sequence`` (EOS or a stop string)."""
        if sequence[-1] in self.eos_ids:
            return True
        return self.stop_strings is not None and self.stop_strings(sequence)


class StopStrings:
    """Stop strings matched where transformers' ``StopStringCriteria`` matches them: one ends generation at the token
    that completes it (overhanging either end of that token; the prompt's last tokens count), each token read as
    the string that criteria reads for it (bytes where the tokenizer's tokens are bytes). The criteria builds,
    per request, tables of vocabulary x stop length (gigabytes for one long stop string, kept in a module cache);
    here a check reads the strings of the last few tokens (``token_string``, cached per token)."""

    def __init__(self, tokenizer, stops: list[str]) -> None:
        """``stops``: non-empty strings, checked against the bounds (``MAX_STOP_STRINGS``, ``MAX_STOP_LENGTH``)."""
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"{len(stops)} stop strings: at most {MAX_STOP_STRINGS} are taken")
        longest = max(stops, key=len)
        if len(longest) > MAX_STOP_LENGTH:
            raise ValueError(f"a stop string of {len(longest)} characters: at most {MAX_STOP_LENGTH} are taken")
        for stop in stops:
            check_text("a stop string", stop)
        mode = _token_form(tokenizer)[0]
        self.tokenizer, self.empty = tokenizer, "" if mode is None else b""
        self.stops = StopStringCriteria._get_stop_strings_for_matching(tuple(stops), mode)
        self.window = max(map(len, self.stops))  # tokens read back at most, as the criteria reads them

    def __call__(self, sequence: list[int]) -> bool:
        """Whether a stop string ends inside the string of ``sequence``'s last token."""
        pieces, length = [], 0  # the last tokens' strings, last first; their length
        for token in reversed(sequence[-self.window :]):
            piece = token_string(self.tokenizer, token)
            if piece is None:  # outside the tokenizer's vocabulary: no stop string runs across it
                break
            pieces.append(piece)
            length += len(piece)
            if length - len(pieces[0]) >= self.window - 1:  # enough before the last token for the longest stop string
                break
        if not pieces:
            return False
        text = self.empty.join(reversed(pieces))
        last = len(text) - len(pieces[0])  # where the last token's string starts: a stop string must end past it
        return any(text.find(stop, max(last - len(stop) + 1, 0)) >= 0 for stop in self.stops)


@lru_cache(maxsize=8)
def _token_form(tokenizer) -> tuple[str | None, dict | None, list[str]]:
    """What ``StopStringCriteria.clean_tokenizer_vocab`` reads a tokenizer's tokens with: its matching mode (None:
    text; "byte_level", "byte_fallback": bytes), the byte-level decoder, the tokens of its static prefix."""
    mode = StopStringCriteria._get_stop_string_matching_mode(tokenizer)
    decoder = StopStringCriteria._byte_level_decoder() if mode == "byte_level" else None
    prefix = [tokenizer._convert_id_to_token(t) for t in tokenizer(PREFIX, add_special_tokens=False)["input_ids"]]
    return mode, decoder, prefix


@lru_cache(maxsize=1 << 16)
def token_string(tokenizer, token: int) -> str | bytes | None:
    """The string ``StopStringCriteria`` reads for one token (its ``clean_tokenizer_vocab``, for this token alone);
    None for an id outside the tokenizer's vocabulary. Cached: tokens recur, a vocabulary is bounded."""
    name = tokenizer.convert_ids_to_tokens(token)
    if name is None:
        return None
    mode, decoder, prefix = _token_form(tokenizer)
    piece = StopStringCriteria._token_to_bytes(name, mode, decoder)
    if piece is None:
        text = tokenizer.convert_tokens_to_string(prefix + [name])
        piece = text[text.index(PREFIX) + len(PREFIX) :]
        piece = piece.encode("utf-8") if mode is not None else piece
    return piece

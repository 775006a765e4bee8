"""Lookahead as a transformers custom generation method, one argument away inside ``model.generate()``::

    model.generate(**inputs, custom_generate=lookahead.custom_generate, max_new_tokens=64)

generate() prepares the inputs, the generation config, the processors and the stopping criteria, then hands
them to ``custom_generate``, which runs each row through the ``LookaheadGenerator`` cached for that model and
returns what generate() would: the sequences tensor, or a ``GenerateDecoderOnlyOutput``.

transformers 5.x hands a callable neither the ``streamer`` nor the ``tokenizer`` given to generate(), and
refuses ``stop_strings`` without that tokenizer; bind them instead (``stop_strings`` then reaches us directly)::

    model.generate(**inputs, custom_generate=functools.partial(lookahead.custom_generate, streamer=s, tokenizer=tok),
                   stop_strings=["."])

A streamer given to generate() unbound still works: generate() has put the prompt into it before calling us, so
we take it from that call (its frame's ``streamer``: read, never changed) and go on from the prompt. Without
that, its consumer would wait forever for an ``end()``.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation import EosTokenCriteria, GenerateDecoderOnlyOutput, MaxLengthCriteria, MaxTimeCriteria

from lookahead.config import LookaheadConfig
from lookahead.drafting import DraftState
from lookahead.generator import LookaheadGenerator

# a directory with custom_generate/generate.py: model.generate(custom_generate=HUB_DIR, trust_remote_code=True)
HUB_DIR = str(Path(__file__).parent)

# what generate() puts in model_kwargs on its own; anything else (inputs_embeds, pixel_values, ...) is refused
CACHE_KWARGS = ("cache", "past_key_values")  # the cache's name since transformers 5.24, and before
PREPARED_KWARGS = {"attention_mask", "position_ids", "logits_to_keep", "use_cache", "cache_position", *CACHE_KWARGS}
# outputs the loop does not compute as generate() does: refused by name
UNRETURNED = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
# criteria generate() builds from the generation config, which the loop applies itself
BUILT_CRITERIA = (MaxLengthCriteria, MaxTimeCriteria, EosTokenCriteria)

GENERATORS = "_lookahead_generators"  # the attribute of a model that holds its generators, one per config


def generator_for(model: PreTrainedModel, config: LookaheadConfig | None = None) -> LookaheadGenerator:
    """The model's generator, built once per (model, config), so its cost model and compiled kernels carry over
    from call to call. They are kept on the model itself, so they go with it: a weak map from the model would
    never let go, since each generator holds its model."""
    config = config or LookaheadConfig()
    per_model = model.__dict__.setdefault(GENERATORS, {})
    if config not in per_model:
        per_model[config] = LookaheadGenerator(model, None, config)
    return per_model[config]


def custom_generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,  # generate() keeps it from a callable (single process only)
    streamer=None,
    *,
    tokenizer=None,
    stop_strings: str | list[str] | None = None,
    lookahead_config: LookaheadConfig | None = None,
    lookahead_state: DraftState | None = None,
    **model_kwargs,
) -> torch.LongTensor | GenerateDecoderOnlyOutput:
    """generate()'s decoding loop replaced by lookahead's: greedy token for token, sampling with its distribution.

    The rows are decoded together (``LookaheadGenerator.decode``), each without its padding (on the left: a row
    padded on the right is refused), then padded back as generate() pads: rows ending before the longest get
    ``pad_token_id``. generate() keywords of our own:
    ``lookahead_config`` picks the step shape; ``lookahead_state`` (``generator_for(model, config).new_state()``) is
    the drafting state to draft from and teach, as ``LookaheadGenerator.generate(state=...)`` takes it
    (default, as there: the generator's own, learning across calls). Options the loop cannot honour are refused by name with ValueError.
    """
    unbound = _streamer_of_generate(model) if streamer is None else None
    if unbound is None:
        return _decode(model, input_ids, logits_processor, stopping_criteria, generation_config, streamer, tokenizer,
                       stop_strings, lookahead_config, lookahead_state, model_kwargs)
    try:
        return _decode(model, input_ids, logits_processor, stopping_criteria, generation_config, _AfterPrompt(unbound),
                       tokenizer, stop_strings, lookahead_config, lookahead_state, model_kwargs)
    except BaseException:
        unbound.end()  # its consumer is waiting: an error must end the stream too
        raise


def _streamer_of_generate(model: PreTrainedModel):
    """The streamer of the generate() call on ``model`` that called ``custom_generate``, or None."""
    frame = sys._getframe(2)  # custom_generate's caller (functools.partial adds no Python frame)
    for _ in range(3):  # generate() itself, under at most a decorator or two
        if frame is None:
            return None
        if frame.f_code.co_name == "generate" and frame.f_locals.get("self") is model:
            return frame.f_locals.get("streamer")
        frame = frame.f_back
    return None


class _AfterPrompt:
    """A streamer that already holds the prompt (generate() put it): the loop's own put of the prompt is skipped."""

    def __init__(self, streamer) -> None:
        self.streamer, self.prompt_seen = streamer, False

    def put(self, ids) -> None:
        if self.prompt_seen:
            self.streamer.put(ids)
        self.prompt_seen = True

    def end(self) -> None:
        self.streamer.end()


def _decode(model: PreTrainedModel, input_ids: torch.LongTensor, logits_processor: LogitsProcessorList,
            stopping_criteria: StoppingCriteriaList, generation_config: GenerationConfig, streamer, tokenizer,
            stop_strings: str | list[str] | None, lookahead_config: LookaheadConfig | None, lookahead_state: DraftState | None,
            model_kwargs: dict) -> torch.LongTensor | GenerateDecoderOnlyOutput:
    config = copy.deepcopy(generation_config)
    _refuse_unhonoured(model, input_ids, logits_processor, stopping_criteria, config, model_kwargs)
    if stop_strings is not None and tokenizer is None:
        raise ValueError("stop_strings need the tokenizer: bind it, functools.partial(lookahead.custom_generate, tokenizer=tok)")
    if streamer is not None and input_ids.shape[0] > 1:
        raise ValueError("a streamer takes one sequence; stream with a batch of one")
    gen = generator_for(model, lookahead_config)
    gen.tokenizer = tokenizer  # only stop strings read it (ids in, ids out)
    return_dict = config.return_dict_in_generate
    config.return_dict_in_generate, config.stop_strings = False, stop_strings
    width = input_ids.shape[1]
    max_new_tokens = config.max_length - width
    mask = model_kwargs.get("attention_mask")
    lanes = []
    with gen.drafting_state(lookahead_state) as state:
        for i, row in enumerate(input_ids):
            keep = mask[i].bool() if mask is not None else torch.ones_like(row, dtype=torch.bool)
            pads = int((~keep).sum())
            row_config = copy.copy(config)  # generate()'s lengths count the padding; the row's own do not
            row_config.max_length, row_config.min_length = config.max_length - pads, max(config.min_length - pads, 0)
            lanes.append(gen.new_lane(row[keep].cpu(), max_new_tokens, state=state, streamer=streamer, generation_config=row_config))
        rows = [out.tokens for out in gen.decode(lanes)]
    sequences = torch.cat([input_ids, _padded(rows, config, input_ids)], dim=1)
    return GenerateDecoderOnlyOutput(sequences=sequences) if return_dict else sequences


def _padded(rows: list[list[int]], config: GenerationConfig, like: torch.Tensor) -> torch.LongTensor:
    """The new tokens of every row, as long as the longest, the shorter ones ended with ``pad_token_id``."""
    longest = max(len(r) for r in rows)
    if any(len(r) < longest for r in rows) and config._pad_token_tensor is None:
        raise ValueError("rows ended at different lengths and there is no pad_token_id to fill them with; pass pad_token_id")
    pad = int(config._pad_token_tensor) if config._pad_token_tensor is not None else 0
    return torch.tensor([r + [pad] * (longest - len(r)) for r in rows], dtype=like.dtype, device=like.device).view(len(rows), longest)


def _refuse_unhonoured(model: PreTrainedModel, input_ids: torch.Tensor, logits_processor: LogitsProcessorList,
                       stopping_criteria: StoppingCriteriaList, config: GenerationConfig, model_kwargs: dict) -> None:
    """ValueError naming what generate() was given that the loop cannot honour (the generation config's own
    options are checked per row by ``Rules``, as for ``LookaheadGenerator.generate``)."""
    for name in UNRETURNED:
        if getattr(config, name, False):
            raise ValueError(f"generation option {name}=True is not supported by lookahead decoding "
                             "(the loop verifies drafts from batched forwards, not generate()'s per-token ones)")
    extra = sorted(set(k for k, v in model_kwargs.items() if v is not None) - PREPARED_KWARGS)
    if extra:
        raise ValueError(f"model input(s) {', '.join(extra)} are not supported by lookahead decoding")
    for name in CACHE_KWARGS:
        cache = model_kwargs.get(name)
        if cache is not None and cache.get_seq_length() > 0:
            raise ValueError(f"{name} with content are not supported by lookahead decoding; pass the whole prompt")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not mask[:, -1:].bool().all():
        raise ValueError(f"row {int(mask[:, -1].eq(0).nonzero()[0])} of the batch is padded on the right: generate() would decode "
                         "after its pads, lookahead decoding from its last token; pad on the left (tokenizer.padding_side='left')")
    # as generate() builds them (its encoder_input_ids are the prompt), so the processors differ only where the caller gave its own
    built = model._get_logits_processor(config, input_ids_seq_length=input_ids.shape[1], encoder_input_ids=input_ids,
                                        device=input_ids.device)
    if [type(p) for p in logits_processor] != [type(p) for p in built]:
        raise ValueError("logits_processor / prefix_allowed_tokens_fn are not supported by lookahead decoding; "
                         "use the generation options that build processors (repetition_penalty, bad_words_ids, ...)")
    if not all(isinstance(c, BUILT_CRITERIA) for c in stopping_criteria):
        raise ValueError("stopping_criteria are not supported by lookahead decoding; pass stop_strings or eos_token_id")

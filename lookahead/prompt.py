"""A prompt (text, through the chat template or not, a list of ids or a tensor) -> checked token ids."""

from __future__ import annotations

import numpy as np
import torch
from jinja2 import TemplateError


def prompt_ids(prompt: str | list[int] | torch.Tensor, tokenizer, vocab_size: int, chat: bool, system: str | None) -> list[int]:
    """The prompt's token ids, or a ValueError naming what is wrong with it."""
    if system is not None and not (chat and isinstance(prompt, str)):  # it would be silently dropped
        raise ValueError("a system message needs chat mode and a text prompt (it goes through the chat template)")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; this model has none, so pass token ids")
        if not prompt.strip():
            raise ValueError("the prompt is empty")
        check_text("the prompt", prompt)
        if system is not None:
            check_text("the system message", system)
        if chat:
            ids = chat_ids(tokenizer, ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}])
        else:
            ids = tokenizer(prompt)["input_ids"]
    else:
        ids = _ids_from(prompt)
    if len(ids) == 0:
        raise ValueError("the prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return list(ids)


def chat_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """``messages`` (role and content) through the tokenizer's chat template, up to where the assistant's answer
    starts; a ValueError if there is no template, or it rejects them or fails on them (the template's fault, said in
    one line, as every caller says a bad request: the CLI's commands, the chat's turns, the server's 400)."""
    if not tokenizer.chat_template:
        raise ValueError("this model's tokenizer has no chat template; generate without chat")
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    except TemplateError as e:  # raised from inside the template (e.g. "no system role")
        raise ValueError(f"the chat template rejected the messages: {e}") from None
    except Exception as e:  # the template's own bug: {{ 1 // 0 }}, {{ 'a' + 1 }}, a macro that calls itself
        raise ValueError(f"the chat template failed on the messages: {type(e).__name__}: {e}") from None


def check_text(what: str, text: str) -> None:
    """ValueError unless ``text`` is text (encodes as UTF-8): a lone surrogate ("\\ud800" is valid JSON; a command
    line's undecodable byte becomes one) would reach the tokenizer as a TypeError, or be a stop string never met."""
    if not isinstance(text, str):  # (an int system message: an AttributeError from the chat template's path)
        raise ValueError(f"{what} must be text, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} holds a lone surrogate ({text[e.start]!r} at character {e.start}), which is not text") from None


def _ids_from(prompt: list[int] | torch.Tensor | np.ndarray) -> list[int]:
    """The ids of a prompt given as ids: a list (or tuple) of ints, or a 1-D or (1, L) integer tensor or array (what a
    tokenizer returns with ``return_tensors="pt"`` or ``"np"``)."""
    if isinstance(prompt, (torch.Tensor, np.ndarray)):
        shape = tuple(prompt.shape)
        if len(shape) == 2 and shape[0] == 1:
            prompt = prompt[0]
        integer = prompt.dtype.kind in "iu" if isinstance(prompt, np.ndarray) else \
            not (prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool)
        if prompt.ndim != 1 or not integer:
            raise ValueError(f"input_ids must be a 1-D or (1, L) integer tensor or array, got {shape} {prompt.dtype}")
        return prompt.tolist()
    if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
        raise ValueError("input_ids must be a list of ints, an integer tensor or array, or a text prompt")
    return [int(t) for t in prompt]

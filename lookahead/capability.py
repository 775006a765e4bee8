"""Which models lookahead can serve exactly, decided when the generator is built, by what the model does
rather than by its name: a model it cannot serve exactly is refused with a ValueError saying why.

A lookahead step feeds many rows in one forward: it needs an attention KV cache it can append to and roll
back, a forward that takes a custom 4D mask and position ids over that cache, rotary embeddings that do not
depend on the step's largest position, and buffers (causal masks, ALiBi biases) that hold its rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.cache_utils import get_layer_types_and_kwargs

from lookahead import kernels, kv, models
from lookahead.layout import BatchLayout, build_layout, stack
from lookahead.native import INTEGER
from lookahead.tree import TokenTree

SUPPORTED_ATTENTION = ("sdpa", "eager", kernels.GROUPED_SDPA)
CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx", "max_sequence_length",
                  "max_target_positions")
PROBE_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}  # of the largest logit; half precision: 5e-2


def probe_tolerance(model: PreTrainedModel) -> float:
    """How far a probe's rows may be from plain forwards, of the largest logit: by dtype, and as half precision on
    the integer kernel (``--dtype int8``: every linear's input rounded to 8 bits, whatever the dtype between)."""
    return 5e-2 if kernels.dtype_of(model) == INTEGER else PROBE_TOLERANCE.get(model.dtype, 5e-2)


def check_config(model: PreTrainedModel) -> None:
    """Refusals readable from the config alone."""
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"{type(model).__name__} is an encoder-decoder model; lookahead needs a decoder-only LM")
    if model.config._attn_implementation not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"attention implementation {model.config._attn_implementation!r} cannot take a custom 4D mask; "
            f"load the model with attn_implementation='sdpa' or 'eager'"
        )


def context_length(config: PreTrainedConfig) -> int | None:
    """The model's context: the smallest length field its config sets (``max_seq_len`` for MPT, ...), or None.

    Causal-mask and position buffers are sized by it, so no step may hold more keys than this."""
    lengths = [_field(config, f) for f in CONTEXT_FIELDS]
    lengths = [n for n in lengths if isinstance(n, int) and not isinstance(n, bool) and n > 0]
    return min(lengths) if lengths else None


def _field(config: PreTrainedConfig, name: str):
    try:
        return getattr(config, name, None)
    except NotImplementedError:  # XLNetConfig.max_position_embeddings: "no sequence length limit"
        return None


def mask_windows(config: PreTrainedConfig) -> dict[str, int | None]:
    """Layer type -> its sliding window or None: what the step's masks are built for (``kv.BatchCache.masks``)."""
    return {kind: window for kind, (_, window) in mask_layers(config).items()}


def mask_layers(config: PreTrainedConfig) -> dict[str, tuple[int, int | None]]:
    """Layer type -> (its first layer, its sliding window or None): one 4D mask per type.

    The types and windows are read exactly as ``DynamicCache`` reads them, so the masks window the same
    layers the cache windows (also for configs with ``sliding_window`` but no ``layer_types``).
    """
    layer_types, kwargs = get_layer_types_and_kwargs(config)
    if not set(layer_types) <= {"full_attention", "sliding_attention"}:
        raise ValueError(f"unsupported layer types {sorted(set(layer_types))}: only (sliding) attention layers can be rolled back")
    layers = {}
    for i, (kind, kw) in enumerate(zip(layer_types, kwargs)):
        window = kw.get("sliding_window")
        if layers.setdefault(kind, (i, window))[1] != window:
            raise ValueError(f"layers of type {kind} have different sliding windows; lookahead needs one mask per layer type")
    if len(layers) > 1 and getattr(config, "layer_types", None) is None:
        raise ValueError("the model mixes sliding and full attention without declaring layer_types; its masks cannot be given per layer")
    return layers


def rotary_switches(config: PreTrainedConfig) -> tuple[int, ...]:
    """Positions P where the rotary embedding changes for a whole forward once its largest position reaches P.

    transformers picks LongRoPE's long or short factors per forward from ``max(position_ids) + 1 >
    original_max_position_embeddings``; ``generate()`` decides it per token, so no step may have rows on both
    sides of P. Dynamic NTK rescales every forward whose largest position reaches ``max_position_embeddings``
    (each by that position): the context ends there (``context_length``), so no row ever gets so far.
    """
    params = getattr(config, "rope_parameters", None) or {}
    per_layer = params.values() if params and all(isinstance(p, dict) for p in params.values()) else [params]
    switches = {int(p["original_max_position_embeddings"]) for p in per_layer
                if p.get("rope_type") == "longrope" and p.get("original_max_position_embeddings")}
    return tuple(sorted(switches))


def rows_before_switch(position: int, switches: tuple[int, ...]) -> int:
    """How far past ``position`` a row may sit and stay on the same side of every switch."""
    return min((s - 1 - position for s in switches if s > position), default=1 << 30)


@dataclass(frozen=True)
class Reach:
    """How far a model's steps may reach: its context (``context_length``; None: unbounded) and its rotary
    switches (``rotary_switches``)."""

    context: int | None
    switches: tuple[int, ...] = ()

    @classmethod
    def of(cls, config: PreTrainedConfig) -> Reach:
        return cls(context_length(config), rotary_switches(config))

    def limits(self, position: int, last_position: int) -> tuple[int, int]:
        """How far past the current token (at ``position``) a step's rows may sit, and how many rows it may add.

        No row goes past the last position generate() feeds nor across a rotary switch, and no key past the
        context: causal-mask and ALiBi buffers (MPT, GPT-Neo) end there."""
        room = min(last_position - position, rows_before_switch(position, self.switches))
        space = self.context - position - 1 if self.context is not None else 1 << 30
        return room, space


Prefill = Callable[..., tuple[kv.BatchCache, torch.Tensor]]  # model_forward.prefill: (prompt, cache holding its first tokens or None)
Forward = Callable[[BatchLayout, kv.BatchCache, torch.Tensor, torch.Tensor], torch.Tensor]  # model_forward.forward


def check_step(model: PreTrainedModel, prefill: Prefill, forward: Forward) -> None:
    """Run one tiny lookahead step and compare it with plain forwards; refuse the model if it differs.

    Prefill [a, b]; step c with two sibling drafts x and y (each sees c only, both one position after it);
    keep c and y, then feed z. Each row must give the logits of the plain forward over its own sequence: a
    recurrent state (RWKV, xLSTM, Mamba ...), a model that cannot take a 4D mask (ALiBi in Bloom and Falcon)
    or ignores it, or a cache that cannot be rolled back all fail here.
    """
    vocab = models.vocab_size(model)
    a, b, c, x, y, z = (np.arange(1, 7) % vocab).tolist()
    name = type(model).__name__
    try:
        with torch.inference_mode():
            plain = [model(input_ids=torch.tensor([seq], device=model.device)).logits[0, -2:].float().cpu()
                     for seq in ([a, b, c, x], [a, b, c, y, z])]
            cache, _ = prefill([a, b])
            recurrent = cache.cache.get_seq_length() != 2
            if not recurrent:
                tree = TokenTree.merge(np.array([x, y]), np.array([-1, -1]), np.array([0.5, 0.4]), np.ones(2, np.int64), 2)
                layout = stack([build_layout(0, 0, tree)])
                step = forward(layout, cache, torch.tensor([[c, x, y]]), torch.tensor([2]))[0]
                cache.compact(layout.size, [torch.tensor([0, 2])], [torch.tensor([2, 3])])
                after = forward(stack([build_layout(0, 0, TokenTree.empty())]), cache, torch.tensor([[z]]), torch.tensor([4]))[0]
    except Exception as e:  # the model's own code failing on a 4D mask, a foreign cache or its arguments
        raise ValueError(f"{name} cannot run a lookahead step ({type(e).__name__}: {e})") from None
    if recurrent:
        raise ValueError(f"{name} does not fill an attention KV cache that lookahead can roll back "
                         "(it keeps a recurrent state, or no cache)")
    got = torch.stack([step[0], step[1], step[2], after[0]]).float()
    want = torch.stack([plain[0][0], plain[0][1], plain[1][0], plain[1][1]])
    tolerance = probe_tolerance(model) * float(want.abs().max().clamp_min(1.0))
    if not torch.allclose(got, want, rtol=0, atol=tolerance):
        raise ValueError(f"{name}'s rows in a lookahead step differ from its plain forwards (max difference "
                         f"{float((got - want).abs().max()):.3g}): its forward ignores the 4D mask or the position ids "
                         "(ALiBi by cache slot as in MPT, or positions counted from the cache), or its cache cannot be rolled back")


def check_reuse(model: PreTrainedModel, prefill: Prefill, forward: Forward) -> bool:
    """Whether a prompt can start from an earlier sequence's keys exactly: [a, b] prefilled, then c fed alone, then d
    with a two-node chain e, f accepted (as a chat's answer is decoded), and the rest of [a .. h] prefilled after those
    six keys (``BatchCache.sequence``) must give the last logits of [a .. h] prefilled at once, bit for bit. It does
    where every product and the attention sum a row's terms alike whatever the step's rows (our kernels); where a
    kernel's order depends on them, a low bit moves and the prompt is prefilled whole, as before."""
    vocab = models.vocab_size(model)
    t = (np.arange(1, 9) % vocab).tolist()
    try:
        with torch.inference_mode():
            _, whole = prefill(t)
            cache, _ = prefill(t[:2])
            lone = stack([build_layout(0, 0, TokenTree.empty())])
            forward(lone, cache, torch.tensor([[t[2]]]), torch.tensor([2]))
            cache.compact(1, [np.array([0])], [np.array([2])])
            tree = TokenTree.merge(np.array(t[4:6]), np.array([-1, 0]), np.array([0.5, 0.4]), np.ones(2, np.int64), 2)
            chain = stack([build_layout(0, 0, tree)])
            forward(chain, cache, torch.tensor([t[3:6]]), torch.tensor([3]))
            cache.compact(3, [np.array([0, 1, 2])], [np.array([3, 4, 5])])
            held = cache.sequence(0, 6)
            _, reused = prefill(t, held) if held is not None else (None, None)
    except Exception:  # noqa: BLE001 -- a model this does not fit prefills every prompt whole
        return False
    return reused is not None and torch.equal(reused, whole)


def reuse_windows(windows: dict[str, int | None]) -> list[dict[str, int | None]]:
    """The mask windows ``check_reuse`` runs under: the model's, within which its 8 tokens stay, and, where the model has
    sliding windows, those narrowed to 3 tokens, which its prompt passes as a long chat's passes the model's (a prompt
    past Gemma 3's window, prefilled whole under the model's own sliding mask, had parted from the same prompt after
    held keys: ``model_forward.prefill``). The layers attend under the masks drawn for the windows given."""
    narrowed = {kind: None if window is None else min(window, 3) for kind, window in windows.items()}
    return [windows] if narrowed == windows else [windows, narrowed]


def check_batch(model: PreTrainedModel, prefill: Prefill, forward: Forward) -> bool:
    """Whether sequences can share a step exactly: two of different lengths (so one is left-padded), one step
    with a two-node chain beside a lone token (a padding row), then a step after which the shorter sequence
    keeps fewer rows (holes in its cache). Every row must give its plain forward's logits; where they do not,
    the generator decodes a batch's sequences in turn."""
    vocab = models.vocab_size(model)
    t = (np.arange(1, 14) % vocab).tolist()
    seqs = ([t[0], t[1], t[6], t[7], t[8], t[10]], [t[2], t[3], t[4], t[5], t[9], t[11], t[12]])  # full sequences
    try:
        with torch.inference_mode():
            plain = [model(input_ids=torch.tensor([seq], device=model.device)).logits[0].float().cpu() for seq in seqs]
            cache, _ = prefill(seqs[0][:2])
            other, _ = prefill(seqs[1][:4])
            cache.join(other)
            chain = TokenTree.merge(np.array(seqs[0][3:5]), np.array([-1, 0]), np.array([0.5, 0.4]), np.ones(2, np.int64), 2)
            first = stack([build_layout(0, 0, chain), build_layout(0, 0, TokenTree.empty())])
            one = forward(first, cache, torch.tensor([seqs[0][2:5], [seqs[1][4], 0, 0]]), torch.tensor([2, 4]))
            cache.compact(first.size, [torch.tensor([0, 1, 2]), torch.tensor([0])], [torch.tensor([2, 3, 4]), torch.tensor([4])])
            node = TokenTree.merge(np.array(seqs[1][6:7]), np.array([-1]), np.array([0.5]), np.ones(1, np.int64), 1)
            second = stack([build_layout(0, 0, TokenTree.empty()), build_layout(0, 0, node)])
            two = forward(second, cache, torch.tensor([[seqs[0][5], 0], seqs[1][5:7]]), torch.tensor([5, 5]))
    except Exception:  # noqa: BLE001 -- a model that cannot take a batched step decodes one sequence at a time
        return False
    got = torch.cat([first.logits_of(one, 0), second.logits_of(two, 0),
                     first.logits_of(one, 1), second.logits_of(two, 1)]).float()
    want = torch.cat([plain[0][2:5], plain[0][5:6], plain[1][4:5], plain[1][5:7]])
    tolerance = probe_tolerance(model) * float(want.abs().max().clamp_min(1.0))
    return bool(torch.allclose(got, want, rtol=0, atol=tolerance))

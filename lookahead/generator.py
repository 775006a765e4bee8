"""``LookaheadGenerator``: prefill, then one forward per step over the current token, the Jacobi window
and the pool's candidates; accept what the model agrees with; keep only the accepted KV entries."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import Cache, GenerationConfig, PreTrainedModel

from lookahead import kv, models, support
from lookahead.config import LookaheadConfig
from lookahead.decoding import Decoding
from lookahead.drafting import TRAJECTORY, DraftState
from lookahead.layout import StepLayout, build_layout
from lookahead.prompt import prompt_ids
from lookahead.stats import Clock, GenerationStats
from lookahead.tree import TokenTree
from lookahead.tuner import CostCurve, JacobiWorth, LiveCurve, cached_curve, choose, fastest_dtype
from lookahead.window import JacobiWindow

SPARSE_POOL_VOCAB = 65536


@dataclass
class GenerationResult:
    tokens: list[int]  # the new tokens only
    text: str | None  # None without a tokenizer
    stats: GenerationStats
    finish_reason: str  # "stop" (EOS or a stop string) or "length"


class LookaheadGenerator:
    """Lossless lookahead decoding over any loaded Hugging Face causal LM (token ids in, token ids out)."""

    def __init__(self, model: PreTrainedModel, tokenizer=None, config: LookaheadConfig | None = None, *,
                 cost: CostCurve | None = None, cache_dir: Path | None = None, progress: models.Progress = models._quiet) -> None:
        """``cost``: this machine's forward-cost curve for ``config.auto`` (default: measured at first use and
        cached under ``cache_dir``, see ``tuner.py``)."""
        self.model, self.tokenizer = model, tokenizer
        self.config = config or LookaheadConfig()
        self._cost, self._cache_dir, self._progress = cost, cache_dir, progress
        self._live: LiveCurve | None = None
        mc = model.config.get_text_config(decoder=True)
        support.check_config(model)
        self.vocab_size = models.vocab_size(model)
        self.max_context = support.context_length(mc)
        self.mask_layers = support.mask_layers(mc)
        self.rotary_switches = support.rotary_switches(mc)
        TokenTree.warm_up()
        DraftState.warm_up()
        support.check_step(model, self._prefill, self._forward)

    @classmethod
    def from_pretrained(
        cls,
        spec: str = models.DEFAULT_MODEL,
        config: LookaheadConfig | None = None,
        dtype: str = "auto",
        device: str = "cpu",
        cache_dir: Path | None = None,
        progress: models.Progress = models._quiet,
        kernels: str = "packed",
    ) -> "LookaheadGenerator":
        """Load a hub id, model directory, GGUF file or embedded model name (see ``lookahead.models``).

        ``dtype="auto"``: float32 or bfloat16, whichever lookahead is expected to run fastest in on this
        machine (its measured cost curve, cached); bfloat16 output equals bfloat16 ``generate()`` up to its
        rounding ties. ``kernels="packed"``: on CPU the linears run on weights packed once (``lookahead.kernels``;
        stock kernels with a notice where unavailable); ``"stock"``: as loaded."""
        cache_dir = cache_dir or models.default_cache_dir()
        loaded = None
        if dtype == "auto":
            dtype, loaded = fastest_dtype(spec, device, cache_dir, progress, kernels)
        model, tokenizer = loaded or models.load(spec, dtype=dtype, device=device, cache_dir=cache_dir, progress=progress, kernels=kernels)
        return cls(model, tokenizer, config, cache_dir=cache_dir, progress=progress)

    @property
    def cost(self) -> CostCurve:
        """This machine's forward-cost curve for the model (probed once and cached on disk)."""
        if self._cost is None:
            self._cost = cached_curve(self.model, self._cache_dir or models.default_cache_dir(), self._progress)
        return self._cost

    @property
    def live_cost(self) -> LiveCurve:
        """``cost`` corrected by this generator's own forward timings (kept across requests)."""
        if self._live is None:
            self._live = LiveCurve(self.cost)
        return self._live

    # -- public entry point ---------------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[int] | torch.Tensor,
        max_new_tokens: int | None = None,
        *,
        chat: bool = False,
        system: str | None = None,
        streamer=None,
        lookahead: bool = True,
        generation_config: GenerationConfig | None = None,
        state: DraftState | None = None,
        seed: int | None = None,
        **options,
    ) -> GenerationResult:
        """What ``model.generate()`` gives: greedy token for token, or sampling with exactly its distribution.

        ``options`` (or ``generation_config``) are ``generate()``'s: ``do_sample``, ``temperature``, ``top_k``,
        ``top_p``, ``min_p``, ``repetition_penalty``, ``no_repeat_ngram_size``, ``bad_words_ids``,
        ``min_new_tokens``, ``forced_eos_token_id``, ``eos_token_id``, ``stop_strings``, ... (the model's own
        generation config fills the rest). The length follows generate()'s precedence: ``max_new_tokens``, then
        the options' or generation config's ``max_new_tokens``, then its ``max_length`` minus the prompt, then the
        model's generation config (20 new tokens by default). ``lookahead=False`` decodes one token per forward
        through the same loop. ``streamer`` gets ``put(ids)`` with the prompt, then every accepted token in order, then ``end()``.
        ``state`` (from ``new_state()`` or ``DraftState.load``) keeps the drafting sources and their
        acceptance statistics across requests, so later requests draft better. Sampling draws from torch's
        global RNG like ``generate()`` (``torch.manual_seed`` reproduces it), or, with ``seed=<int>``, from a
        private generator: the same seed gives the same sample whatever the global state.
        """
        if state is not None:
            state.check_fits(self.vocab_size, self.config)
        ids, decoding = self.prepare(prompt, max_new_tokens, chat=chat, system=system, generation_config=generation_config,
                                     seed=seed, **options)
        with torch.inference_mode():
            tokens, stats, reason = self._decode(ids, decoding.max_new_tokens, streamer, lookahead, decoding, state or self.new_state())
        text = self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer is not None else None
        return GenerationResult(tokens, text, stats, reason)

    def prepare(self, prompt: str | list[int] | torch.Tensor, max_new_tokens: int | None = None, *, chat: bool = False,
                system: str | None = None, generation_config: GenerationConfig | None = None, seed: int | None = None,
                **options) -> tuple[list[int], Decoding]:
        """The prompt's token ids and the resolved options: every check ``generate()`` makes before decoding
        (a ValueError), so a server can refuse bad input before it starts a stream."""
        ids = prompt_ids(prompt, self.tokenizer, self.vocab_size, chat, system)
        if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1):
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
            raise ValueError(f"seed must be None or an integer in [0, 2**63), got {seed!r}")
        decoding = Decoding(self.model, self.tokenizer, len(ids), max_new_tokens, generation_config, seed, options)
        if self.max_context is not None and len(ids) + decoding.max_new_tokens > self.max_context:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({decoding.max_new_tokens}) exceeds the model's "
                             f"context of {self.max_context} tokens")
        return ids, decoding

    def new_state(self) -> DraftState:
        """An empty drafting state for this generator; pass it to ``generate(state=...)`` to keep it learning."""
        cfg = self.config
        sparse = cfg.pool_sparse if cfg.pool_sparse is not None else self.vocab_size > SPARSE_POOL_VOCAB
        return DraftState.for_config(self.vocab_size, cfg, sparse)

    # -- the decode loop ------------------------------------------------------------------------

    def _decode(self, prompt: list[int], max_new_tokens: int, streamer, lookahead: bool, decoding: Decoding, state: DraftState):
        cfg, stats = self.config, GenerationStats()
        budget = cfg.tree_budget if lookahead else 0
        curve, worth = (self.live_cost, JacobiWorth()) if cfg.auto and lookahead else (None, None)
        clock = Clock()
        last_position = len(prompt) + max_new_tokens - 2  # the last position generate() feeds; no row goes beyond
        if streamer is not None:
            streamer.put(torch.tensor(prompt))
        # 0. prefill: one forward over the prompt fills the cache and gives the first token
        cache, logits = self._prefill(prompt)
        out, done = self._until_stop(decoding, prompt, decoding.verify(prompt, logits, None, TokenTree.empty()).tokens)
        state.start(prompt + out, cfg)
        window = JacobiWindow(cfg.window, cfg.ngram, np.asarray(prompt), cfg.seed) if lookahead and cfg.window else None
        stats.prefill_s = clock.lap()
        self._emit(streamer, out)
        while not done and len(out) < max_new_tokens and not decoding.out_of_time():
            position = len(prompt) + len(out) - 1  # of the current token, out[-1]
            room, space = self._limits(position, last_position)
            # 1. draft: every source proposes continuations of the current token, merged into one tree
            tree = state.propose(out[-1], cfg, min(budget, space), room)
            levels = window.levels_within(room) if window else 0
            levels = levels if levels * cfg.window <= space else 0
            if curve is not None:  # the cost model keeps only what is expected to pay (possibly nothing: a plain step)
                choice = choose(curve, tree, levels * cfg.window, worth.value)
                tree, levels = tree.best(choice.nodes), levels if worth.runs(choice.window) else 0
            tree = tree.best(space - levels * cfg.window)
            stats.phase_s["draft"] += clock.lap()
            # 2. layout and one forward: logits only for the current token, the window's last level and the tree
            layout = build_layout(cfg.window, levels, tree)
            ids = torch.cat([torch.tensor([out[-1]]), torch.from_numpy(window.active[:levels].ravel() if levels else np.empty(0, np.int64)),
                             torch.from_numpy(tree.tokens)])
            logits = self._forward(layout, cache, ids, position)
            first, last_level, tree_logits = layout.split_logits(logits)
            forward_s = clock.lap()
            stats.phase_s["forward"] += forward_s
            if curve is not None:
                curve.observe(layout.size, forward_s)
            # 3. verify: the deepest branch the model agrees with (greedy or sampling), plus its own next token
            history = prompt + out
            verdict = decoding.verify(history, first, tree_logits, tree)
            new, done = self._until_stop(decoding, history, verdict.tokens[: max_new_tokens - len(out)])
            stats.phase_s["verify"] += clock.lap()
            # 4. keep the KV of the current token and the accepted branch only
            accepted_rows = [0] + [layout.first_tree_row + n for n in verdict.path]
            kv.compact(cache, layout.size, torch.tensor(accepted_rows))
            # 5. learn (not in plain decoding): the window advances; the sources take the trajectories, the new
            #    tokens and every row's top-k
            if lookahead:
                trajectories = window.advance(last_level.argmax(-1).numpy()) if levels else np.empty((0, cfg.ngram), np.int64)
                row_tokens, row_topk = self._ranked_rows(layout, ids, logits, verdict.path, cfg.recycle_k)
                state.learn(cfg, tree, verdict.path, new, trajectories, row_tokens, row_topk, history[-(cfg.ngram - 1):])
            if worth is not None and levels:
                worth.update(int((tree.sources[verdict.path] == 1 << TRAJECTORY).sum()))
            out += new
            stats.record(tree, levels, verdict.path, len(new))
            stats.phase_s["learn"] += clock.lap()
            # 6. stream what was accepted
            self._emit(streamer, new)
        stats.decode_s = clock.total() - stats.prefill_s
        stats.new_tokens = len(out)
        if streamer is not None:
            streamer.end()
        return out, stats, "stop" if done else "length"

    def _limits(self, position: int, last_position: int) -> tuple[int, int]:
        """How far past the current token (at ``position``) a step's rows may sit, and how many rows it may add.

        No row goes past the last position generate() feeds nor across a rotary switch, and no key past the
        context: causal-mask and ALiBi buffers (MPT, GPT-Neo) end there."""
        room = min(last_position - position, support.rows_before_switch(position, self.rotary_switches))
        space = self.max_context - position - 1 if self.max_context is not None else 1 << 30
        return room, space

    def _prefill(self, prompt: list[int]) -> tuple[Cache, torch.Tensor]:
        """A fresh cache holding the prompt, and the logits (V,) after its last token."""
        cache = kv.new_cache(self.model)
        ids = torch.tensor([prompt], device=self.model.device)
        logits = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        return cache, logits[0, -1].float().cpu()

    @staticmethod
    def _until_stop(decoding: Decoding, history: list[int], new: list[int]) -> tuple[list[int], bool]:
        """``new`` up to and including the first token that ends generation, and whether one did."""
        for i in range(len(new)):
            if decoding.stops(history + new[: i + 1]):
                return new[: i + 1], True
        return new, False

    def _forward(self, layout: StepLayout, cache: Cache, ids: torch.Tensor, position: int) -> torch.Tensor:
        """Logits (rows, V) for ``layout.logit_rows`` of the step's tokens ``ids`` (T,), the first at ``position``."""
        device, dtype = self.model.device, self.model.dtype
        masks = {kind: layout.additive_mask(*cache.get_mask_sizes(layout.size, layer), position, window, dtype).to(device)
                 for kind, (layer, window) in self.mask_layers.items()}
        out = self.model(
            input_ids=ids.unsqueeze(0).to(device),
            position_ids=(position + layout.offsets).unsqueeze(0).to(device),
            attention_mask=masks if len(masks) > 1 else next(iter(masks.values())),  # (1, 1, T, kv) each
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=layout.logit_rows.to(device),
        )
        logits = out.logits[0]
        if logits.shape[0] != layout.logit_rows.numel():  # the model ignored logits_to_keep (WhisperForCausalLM)
            logits = logits[layout.logit_rows.to(device)]
        return logits.float().cpu()

    @staticmethod
    def _ranked_rows(layout: StepLayout, ids: torch.Tensor, logits: torch.Tensor, path: list[int], k: int) -> tuple[np.ndarray, np.ndarray]:
        """Input token (R,) and top-k next tokens (R, k) of every row with logits, the accepted rows last (they win)."""
        if not k:
            return np.empty(0, np.int64), np.empty((0, 0), np.int64)
        first_tree = layout.logit_rows.numel() - (layout.size - layout.first_tree_row)
        trusted = torch.zeros(layout.logit_rows.numel(), dtype=torch.bool)
        trusted[[0] + [first_tree + n for n in path]] = True
        order = torch.cat([torch.nonzero(~trusted).flatten(), torch.nonzero(trusted).flatten()])
        return ids[layout.logit_rows[order]].numpy(), torch.topk(logits[order], min(k, logits.shape[-1])).indices.numpy()

    @staticmethod
    def _emit(streamer, tokens: list[int]) -> None:
        if streamer is not None and tokens:
            streamer.put(torch.tensor(tokens))

"""``LookaheadGenerator``: prefill, then one forward per step over the current token, the Jacobi window
and the pool's candidates; accept what the model agrees with; keep only the accepted KV entries."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import GenerationConfig, PreTrainedModel

from lookahead import capability, models, planner, prior
from lookahead.cache_entries import quiet
from lookahead.config import LookaheadConfig
from lookahead.curve import CostCurve
from lookahead.rules import Rules, TokenLogprob
from lookahead.drafting import DraftState
from lookahead.kv import HeldKeys, RecentKeys
from lookahead.lane import Lane, shared_state
from lookahead.loop import Batch
from lookahead.model_forward import forward, prefill
from lookahead.planner import Calibration, LiveCurve, Planner
from lookahead.prompt import prompt_ids
from lookahead.stats import GenerationStats
from lookahead.tree import TokenTree
from lookahead.probing import cached_curve, fastest

SPARSE_POOL_VOCAB = 65536


@dataclass
class GenerationResult:
    tokens: list[int]  # the new tokens only
    text: str | None  # None without a tokenizer
    stats: GenerationStats
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    logprobs: list[TokenLogprob] | None = None  # one a new token, where ``generate(logprobs=k)`` asked (``rules.TokenLogprob``)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one a prompt token, the first None, where ``prompt_logprobs=k`` asked


class LookaheadGenerator:
    """Lossless lookahead decoding over any loaded Hugging Face causal LM (token ids in, token ids out)."""

    def __init__(self, model: PreTrainedModel, tokenizer=None, config: LookaheadConfig | None = None, *,
                 cost: CostCurve | None = None, cache_dir: Path | None = None, progress: models.Progress = quiet) -> None:
        """``cost``: this machine's forward-cost curve for ``config.auto`` (default: measured at first use and
        cached under ``cache_dir``, see ``probing.py``)."""
        if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
            raise ValueError(f"model must be a loaded transformers causal LM (lookahead.models.load, or "
                             f"AutoModelForCausalLM.from_pretrained), got {type(model).__name__}")
        if tokenizer is not None and not (callable(tokenizer) and hasattr(tokenizer, "decode")):
            raise ValueError(f"tokenizer must be None or a transformers tokenizer, got {type(tokenizer).__name__}")
        if config is not None and not isinstance(config, LookaheadConfig):
            raise ValueError(f"config must be None or a LookaheadConfig, got {type(config).__name__}")
        self.model, self.tokenizer = model, tokenizer
        self.config = config or LookaheadConfig()
        self._cost, self._cache_dir, self._progress = cost, cache_dir, progress
        self._live: LiveCurve | None = None
        self._calibration = Calibration()  # the drafts' promise against what came, over every sequence (kept across requests)
        self._state: DraftState | None = None  # the drafting state requests without one of their own share (``own_state``)
        self.state_lock = threading.Lock()  # held by whoever decodes with that state: a call, or a server's batch
        self._prior: np.ndarray | None = None  # the recycling table's prior (``prior.py``), computed at the first new state
        self._prior_lock = threading.Lock()
        mc = model.config.get_text_config(decoder=True)
        capability.check_config(model)
        self.vocab_size = models.vocab_size(model)
        self.reach = capability.Reach.of(mc)
        self.windows = capability.mask_windows(mc)
        TokenTree.warm_up()
        DraftState.warm_up()
        planner.warm_up()
        capability.check_step(model, *self._probes())

    def _probes(self, windows: dict[str, int | None] | None = None) -> tuple[capability.Prefill, capability.Forward]:
        """The probes' prefill and forward, their masks drawn for ``windows`` (default: the model's)."""
        windows = self.windows if windows is None else windows
        return (lambda prompt, cache=None: prefill(self.model, prompt, cache, windows),
                lambda *step: forward(self.model, windows, *step))

    @functools.cached_property
    def batchable(self) -> bool:
        """Whether sequences share a step exactly (LongRoPE switches a whole forward by its largest position): probed
        when a batch first needs it, not at load (a quarter of a second a one-request start does not need)."""
        return not self.reach.switches and capability.check_batch(self.model, *self._probes())

    @functools.cached_property
    def reuses_keys(self) -> bool:
        """Whether a prompt's first keys, taken from an earlier sequence's cache (a chat's last turn: its prompt's and
        its answer's, made by steps), give what the whole prompt's prefill gives, bit for bit (``check_reuse``): on
        kernels whose rows are summed alike whatever the step, within the model's sliding windows and past them
        (``capability.reuse_windows``). Probed when first asked."""
        return all(capability.check_reuse(self.model, *self._probes(windows)) for windows in capability.reuse_windows(self.windows))

    @classmethod
    def from_pretrained(
        cls,
        spec: str = models.DEFAULT_MODEL,
        config: LookaheadConfig | None = None,
        dtype: str = "auto",
        device: str = "cpu",
        cache_dir: Path | None = None,
        progress: models.Progress = quiet,
        kernels: str = "packed",
        weights: str = "auto",
    ) -> "LookaheadGenerator":
        """Load a hub id, model directory, GGUF file or embedded model name (see ``lookahead.models``).

        ``dtype="auto"``: float32 or bfloat16, whichever lookahead is expected to run fastest in on this
        machine (its measured cost curve, cached); bfloat16 output equals bfloat16 ``generate()`` up to its
        rounding ties. ``kernels="packed"``: on CPU the linears run on weights packed once (``lookahead.kernels``;
        stock kernels with a notice where unavailable); ``"stock"``: as loaded. ``weights`` (``models.WEIGHTS``):
        "gguf" runs a GGUF model on its own quantized blocks (with packed kernels; ``dtype`` is then the
        activations'), "q8" quantizes any model's linears to Q8_0 once, "dense" runs the dequantized weights,
        "auto" is "gguf" for a GGUF model where our quantized kernel runs, else "dense"."""
        cache_dir, device = cache_dir or models.default_cache_dir(), models.device_of(device)
        loaded = None
        if dtype == "auto":
            dtype, weights, loaded = fastest(spec, device, cache_dir, progress, kernels, weights, dtype)
        model, tokenizer = loaded or models.load(spec, dtype=dtype, device=device, cache_dir=cache_dir, progress=progress,
                                                 kernels=kernels, weights=weights)
        return cls(model, tokenizer, config, cache_dir=cache_dir, progress=progress)

    @property
    def cost(self) -> CostCurve:
        """This machine's forward-cost curve for the model (probed once and cached on disk)."""
        if self._cost is None:
            self._cost = cached_curve(self.model, self._cache_dir or models.default_cache_dir(), self._progress, lambda: self.batchable)
        return self._cost

    @property
    def live_cost(self) -> LiveCurve:
        """``cost`` corrected by this generator's own forward timings (kept across requests)."""
        if self._live is None:
            self._live = LiveCurve(self.cost, self.config.live_cost)
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
        generation config fills the rest); and OpenAI's ``presence_penalty`` and ``frequency_penalty``
        (``rules.Penalties``: generate() takes them as a ``logits_processor``); ``logprobs=k`` (0-20): each new token's
        log-probability under the model (raw logits, as vLLM's default) with its k likeliest alternatives', in
        ``GenerationResult.logprobs``; ``prompt_logprobs=k``: each prompt token's after those before it (the first has
        none), in ``GenerationResult.prompt_logprobs``, as vLLM's (what ``echo`` with ``logprobs`` serves). The length
        follows generate()'s precedence: ``max_new_tokens``, then the options' or generation config's
        ``max_new_tokens``, then its ``max_length`` minus the prompt, then the model's generation config (20 new tokens
        by default). ``lookahead=False`` decodes one token per forward
        through the same loop. ``streamer`` gets ``put(ids)`` with the prompt, then every accepted token in order, then ``end()``.
        ``state`` (from ``new_state()`` or ``DraftState.load``): the drafting sources and their acceptance
        statistics to draft from and teach; by default this generator's own, which keeps learning across
        requests, so later requests draft better (``drafting_state``; ``state=gen.new_state()`` starts cold). Sampling draws from torch's
        global RNG like ``generate()`` (``torch.manual_seed`` reproduces it), or, with ``seed=<int>``, from a
        private generator: the same seed gives the same sample whatever the global state.
        """
        return self.generate_batch([prompt], max_new_tokens, chat=chat, system=system, streamers=[streamer], lookahead=lookahead,
                                   generation_config=generation_config, state=state, seeds=[seed], **options)[0]

    def generate_batch(
        self,
        prompts: list[str | list[int] | torch.Tensor],
        max_new_tokens: int | None = None,
        *,
        chat: bool = False,
        system: str | None = None,
        streamers: list | None = None,
        lookahead: bool = True,
        generation_config: GenerationConfig | None = None,
        state: DraftState | None = None,
        seeds: list[int | None] | None = None,
        **options,
    ) -> list[GenerationResult]:
        """``generate`` for many prompts at once, decoded together: every step is one forward for all of them,
        each with its own tree, stops, streamer (``streamers[i]``) and seed (``seeds[i]``); a sequence that
        finishes leaves the batch at once. Each result equals that prompt's ``generate()`` alone (greedy; sampling
        with a seed gives that seed's sample, without one the rows draw from the global RNG in turn; one ``seed`` for
        all is every row's, as each prompt's ``generate(seed=...)`` would take it). The rows share one drafting ``state``."""
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list")
        if "seed" in options:  # (passed on beside each row's seed, it was a TypeError)
            if seeds is not None:
                raise ValueError("give seeds (one a prompt) or seed (every prompt's), not both")
            seeds = [options.pop("seed")] * len(prompts)
        for name, values in (("streamers", streamers), ("seeds", seeds)):
            if values is not None and len(values) != len(prompts):
                raise ValueError(f"{name} has {len(values)} entries for {len(prompts)} prompts")
        with self.drafting_state(state) as state:
            lanes = [self.new_lane(prompt, max_new_tokens, state=state, chat=chat, system=system, streamer=streamers[i] if streamers else None,
                                   lookahead=lookahead, generation_config=generation_config, seed=seeds[i] if seeds else None, **options)
                     for i, prompt in enumerate(prompts)]
            return self.decode(lanes)

    def decode(self, lanes: list[Lane]) -> list[GenerationResult]:
        """Decode ``new_lane``s together (each joins in turn) until every one has finished; one after another
        where sequences cannot share a step exactly (``batchable``)."""
        groups = [lanes] if len(lanes) == 1 or self.batchable else [[lane] for lane in lanes]
        for group in groups:  # before anything joins
            shared_state(group)
        for group in groups:
            batch = self.new_batch(any(lane.lookahead for lane in group))
            with torch.inference_mode():
                for lane in group:
                    batch.join(lane)
                while batch:
                    batch.step()
        return [self.result(lane) for lane in lanes]

    def new_lane(self, prompt: str | list[int] | torch.Tensor, max_new_tokens: int | None = None, *, state: DraftState,
                 streamer=None, lookahead: bool = True, keys: HeldKeys | RecentKeys | None = None, keeps_keys: bool = False,
                 **options) -> Lane:
        """One request, checked and ready to join a batch (``new_batch``); ``options`` as ``prepare`` takes them.
        ``keys``: an earlier sequence's (``Lane.keys``) or a server's (``RecentKeys``), whose prefix in common with the prompt is not prefilled again
        where that gives the same bits (``reuses_keys``); ``keeps_keys``: the lane's own kept when it finishes."""
        self._check_state(state)
        ids, rules = self.prepare(prompt, max_new_tokens, **options)
        prefix = keys.prefix_for(ids) if keys is not None and self.reuses_keys and rules.prompt_logprobs is None else None  # scored: every row
        return Lane(ids, rules, state, streamer, lookahead, prefix=prefix, keeps_keys=keeps_keys)

    def new_batch(self, lookahead: bool = True, prefill_chunk: int | None = None) -> Batch:
        """An empty running batch over this generator's model (the cost model on where ``config.auto`` and lookahead);
        ``prefill_chunk``: see ``Batch``."""
        auto = self.config.auto and lookahead
        return Batch(self.model, self.config, self.windows, self.reach, Planner(self.live_cost if auto else None, self._calibration), prefill_chunk)

    def result(self, lane: Lane) -> GenerationResult:
        """What a finished lane gives back."""
        text = self.tokenizer.decode(lane.out, skip_special_tokens=True) if self.tokenizer is not None else None
        return GenerationResult(lane.out, text, lane.stats, lane.finish_reason, lane.logprobs if lane.rules.logprobs is not None else None,
                                lane.prompt_logprobs if lane.rules.prompt_logprobs is not None else None)

    def prepare(self, prompt: str | list[int] | torch.Tensor, max_new_tokens: int | None = None, *, chat: bool = False,
                system: str | None = None, generation_config: GenerationConfig | None = None, seed: int | None = None,
                **options) -> tuple[list[int], Rules]:
        """The prompt's token ids and the resolved options: every check ``generate()`` makes before decoding
        (a ValueError), so a server can refuse bad input before it starts a stream."""
        ids = prompt_ids(prompt, self.tokenizer, self.vocab_size, chat, system)
        if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1):
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
            raise ValueError(f"seed must be None or an integer in [0, 2**63), got {seed!r}")
        rules = Rules(self.model, self.tokenizer, len(ids), max_new_tokens, generation_config, seed, options)
        if self.reach.context is not None and len(ids) + rules.max_new_tokens > self.reach.context:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({rules.max_new_tokens}) exceeds the model's "
                             f"context of {self.reach.context} tokens")
        return ids, rules

    def new_state(self) -> DraftState:
        """A drafting state for this generator, empty but for the recycling table's prior (``prior.py``); pass it
        to ``generate(state=...)`` to keep it learning."""
        cfg = self.config
        sparse = cfg.pool_sparse if cfg.pool_sparse is not None else self.vocab_size > SPARSE_POOL_VOCAB
        return self._with_prior(DraftState.for_config(self.vocab_size, cfg, sparse))

    def load_state(self, directory: Path | None) -> DraftState:
        """The drafting state saved in ``directory`` (``DraftState.save``), the rows of its recycling table that
        nothing taught yet filled from the prior; a new state where there is none. ValueError if it does not fit."""
        if directory is None or not Path(directory).exists():
            return self.new_state()
        state = DraftState.load(directory, self.vocab_size)  # the vocabulary before allocating; the rest against the config
        state.check_fits(self.vocab_size, self.config)
        return self._with_prior(state)

    def _prior_from(self, source: Callable[..., np.ndarray | None]) -> np.ndarray | None:
        """``prior.cached`` or ``prior.grow`` for this generator's model and config; None where the config wants no
        prior."""
        cfg = self.config
        if not (cfg.recycle_prior and cfg.recycle_k):
            return None
        return source(self.model, self.tokenizer, cfg.recycle_prior, cfg.recycle_k, self._cache_dir or models.default_cache_dir(),
                      self._progress, cfg.recycle_prior_s)

    def _with_prior(self, state: DraftState) -> DraftState:
        cfg = self.config
        with self._prior_lock:  # computed once (seconds), whichever thread asks first
            if self._prior is None:
                self._prior = self._prior_from(prior.cached)
                if self._prior is None:
                    self._prior = np.empty((0, cfg.recycle_k), np.int32)  # none for this model or config: asked once
        if self._prior.size:
            state.recycle.fill_empty(self._prior)
        return state

    def grow_prior(self, state: DraftState | None = None) -> None:
        """Grow the cached prior (``prior.grow``: a tenth of a first run's seconds) for later states and runs, and
        fill ``state``'s empty rows from it: call it once the answers are out (the CLI after its requests, a chat when
        it ends, a server before it listens), never before a first token. Nothing where the prior is whole or off."""
        with self._prior_lock:
            grown = self._prior_from(prior.grow)
            if grown is not None:
                self._prior = grown
        if grown is not None and state is not None:
            state.recycle.fill_empty(grown)

    def _check_state(self, state: DraftState) -> None:
        """ValueError unless ``state`` is a drafting state this generator can draft from."""
        if not isinstance(state, DraftState):
            raise ValueError(f"state must be a DraftState (new_state() or DraftState.load), got {type(state).__name__}")
        state.check_fits(self.vocab_size, self.config)

    def own_state(self, state: DraftState | None = None) -> DraftState:
        """This generator's own drafting state, which calls without ``state=`` share and a server's batch decodes
        with (made on first use); ``state`` (checked to fit) becomes it from now on: a server's saved one, loaded.
        Whoever decodes with it holds ``state_lock``."""
        if state is not None:
            self._check_state(state)
            self._state = state
        elif self._state is None:
            self._state = self.new_state()
        return self._state

    @contextmanager
    def drafting_state(self, state: DraftState | None = None) -> Iterator[DraftState]:
        """The drafting state a call decodes with: ``state`` when given; else this generator's own, which keeps
        learning across requests (SmolLM2, bf16, Zen 5, 16 unseen prompts one after another: 1.57 -> 1.82 tokens
        a forward, 1.30x -> 1.41x our plain loop); else, while another thread decodes with that one, a fresh
        one (the sources are not thread-safe). To keep or save a state, pass one of your own."""
        if state is not None:
            yield state
            return
        if not self.state_lock.acquire(blocking=False):
            yield self.new_state()
            return
        try:
            yield self.own_state()
        finally:
            self.state_lock.release()

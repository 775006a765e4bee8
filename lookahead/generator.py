"""``LookaheadGenerator``: prefill, then one forward per step over the current token, the Jacobi window
and the pool's candidates; accept what the model agrees with; keep only the accepted KV entries."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import Cache, GenerationConfig, PreTrainedModel

from lookahead import kv, models
from lookahead.config import LookaheadConfig
from lookahead.decoding import Decoding
from lookahead.layout import StepLayout, build_layout
from lookahead.verify import Verdict
from lookahead.window import JacobiWindow
from ngram_pool import NGramPool, Source

SPARSE_POOL_VOCAB = 65536
NO_CANDIDATES = np.empty((0, 0), dtype=np.int32)
SUPPORTED_ATTENTION = ("sdpa", "eager")


@dataclass
class GenerationStats:
    new_tokens: int = 0
    steps: int = 0  # decode forwards (the prefill not counted)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    accepted_hist: Counter = field(default_factory=Counter)  # tokens emitted in a step -> number of steps
    accepted_by_source: Counter = field(default_factory=Counter)  # candidate tokens accepted, by pool source

    def record(self, verdict: Verdict, sources: np.ndarray) -> None:
        self.steps += 1
        self.accepted_hist[len(verdict.tokens)] += 1
        if verdict.branch >= 0:
            self.accepted_by_source[Source(int(sources[verdict.branch])).name.lower()] += len(verdict.tokens) - 1

    @property
    def compression(self) -> float:
        """New tokens per forward pass, the prefill's first token included (plain greedy: 1.0)."""
        return self.new_tokens / max(self.steps + 1, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / max(self.prefill_s + self.decode_s, 1e-9)

    def as_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens, "steps": self.steps, "compression": round(self.compression, 4),
            "tokens_per_s": round(self.tokens_per_s, 3), "prefill_s": round(self.prefill_s, 4),
            "decode_s": round(self.decode_s, 4), "time_to_first_token_s": round(self.prefill_s, 4),
            "accepted_hist": {str(k): v for k, v in sorted(self.accepted_hist.items())},
            "accepted_by_source": dict(self.accepted_by_source),
        }


@dataclass
class GenerationResult:
    tokens: list[int]  # the new tokens only
    text: str | None  # None without a tokenizer
    stats: GenerationStats
    finish_reason: str  # "stop" (EOS or a stop string) or "length"


class LookaheadGenerator:
    """Lossless lookahead decoding over any loaded Hugging Face causal LM (token ids in, token ids out)."""

    def __init__(self, model: PreTrainedModel, tokenizer=None, config: LookaheadConfig | None = None) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.config = config or LookaheadConfig()
        mc = model.config.get_text_config(decoder=True)
        if getattr(model.config, "is_encoder_decoder", False):
            raise ValueError(f"{type(model).__name__} is an encoder-decoder model; lookahead needs a decoder-only LM")
        if model.config._attn_implementation not in SUPPORTED_ATTENTION:
            raise ValueError(
                f"attention implementation {model.config._attn_implementation!r} cannot take a custom 4D mask; "
                f"load the model with attn_implementation='sdpa' or 'eager'"
            )
        layer_types = list(getattr(mc, "layer_types", None) or ["full_attention"])
        if not set(layer_types) <= {"full_attention", "sliding_attention"}:
            raise ValueError(f"unsupported layer types {sorted(set(layer_types))}: only (sliding) attention layers can be rolled back")
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_context = int(getattr(mc, "max_position_embeddings", 0) or 0) or None
        # one mask per layer type: (a layer of that type, to ask the cache for its mask sizes; its window)
        windows = {"full_attention": None, "sliding_attention": getattr(mc, "sliding_window", None)}
        self.mask_layers = {kind: (layer_types.index(kind), windows[kind]) for kind in dict.fromkeys(layer_types)}

    @classmethod
    def from_pretrained(
        cls,
        spec: str = models.DEFAULT_MODEL,
        config: LookaheadConfig | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        cache_dir: Path | None = None,
        progress: models.Progress = models._quiet,
    ) -> "LookaheadGenerator":
        """Load a hub id, model directory, GGUF file or embedded model name (see ``lookahead.models``)."""
        model, tokenizer = models.load(spec, dtype=dtype, device=device, cache_dir=cache_dir, progress=progress)
        return cls(model, tokenizer, config)

    # -- public entry point ---------------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[int] | torch.Tensor,
        max_new_tokens: int = 128,
        *,
        chat: bool = False,
        system: str | None = None,
        streamer=None,
        lookahead: bool = True,
        generation_config: GenerationConfig | None = None,
        pool: NGramPool | None = None,
        seed: int | None = None,
        **options,
    ) -> GenerationResult:
        """What ``model.generate()`` gives: greedy token for token, or sampling with exactly its distribution.

        ``options`` (or ``generation_config``) are ``generate()``'s: ``do_sample``, ``temperature``, ``top_k``,
        ``top_p``, ``min_p``, ``repetition_penalty``, ``no_repeat_ngram_size``, ``bad_words_ids``,
        ``min_new_tokens``, ``forced_eos_token_id``, ``eos_token_id``, ``stop_strings``, ... (the model's own
        generation config fills the rest). ``lookahead=False`` decodes one token per forward through the same
        loop. ``streamer`` gets ``put(ids)`` with the prompt, then every accepted token in order, then ``end()``.
        ``pool`` reuses an n-gram pool across requests (it keeps learning). ``seed`` (default: the config's)
        makes sampling reproducible.
        """
        ids = self._prompt_ids(prompt, chat, system)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if self.max_context is not None and len(ids) + max_new_tokens > self.max_context:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context of {self.max_context} tokens"
            )
        if pool is not None and (pool.vocab_size != self.vocab_size or pool.n != self.config.ngram):
            raise ValueError(f"pool holds {pool.n}-grams over {pool.vocab_size} ids; this generator needs "
                             f"{self.config.ngram}-grams over {self.vocab_size}")
        seed = self.config.seed if seed is None else seed
        decoding = Decoding(self.model, self.tokenizer, len(ids), max_new_tokens, generation_config, seed, options)
        with torch.inference_mode():
            tokens, stats, reason = self._decode(ids, max_new_tokens, streamer, lookahead, decoding, pool or self._new_pool(ids))
        text = self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer is not None else None
        return GenerationResult(tokens, text, stats, reason)

    def _prompt_ids(self, prompt: str | list[int] | torch.Tensor, chat: bool, system: str | None) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; this model has none, so pass token ids")
            if not prompt.strip():
                raise ValueError("the prompt is empty")
            if chat:
                if not self.tokenizer.chat_template:
                    raise ValueError("this model's tokenizer has no chat template; generate without chat")
                messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
                ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            else:
                ids = self.tokenizer(prompt)["input_ids"]
        else:
            ids = self._ids_from(prompt)
        if len(ids) == 0:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return list(ids)

    @staticmethod
    def _ids_from(prompt: list[int] | torch.Tensor) -> list[int]:
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() == 2 and prompt.shape[0] == 1:
                prompt = prompt[0]
            if prompt.dim() != 1 or prompt.is_floating_point() or prompt.dtype == torch.bool:
                raise ValueError(f"input_ids must be a 1-D or (1, L) integer tensor, got {tuple(prompt.shape)} {prompt.dtype}")
            return prompt.tolist()
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("input_ids must be a list of ints, a LongTensor, or a text prompt")
        return list(prompt)

    # -- the decode loop ------------------------------------------------------------------------

    def _decode(self, prompt: list[int], max_new_tokens: int, streamer, lookahead: bool, decoding: Decoding, pool: NGramPool):
        cfg, stats = self.config, GenerationStats()
        levels, guess = (cfg.ngram - 1, cfg.guess) if lookahead else (0, 0)
        if streamer is not None:
            streamer.put(torch.tensor(prompt))
        # 0. prefill: one forward over the prompt fills the cache and gives the first token
        t0 = time.perf_counter()
        cache, logits = self._prefill(prompt)
        out, done = self._until_stop(decoding, prompt, decoding.verify(prompt, logits, None, NO_CANDIDATES).tokens)
        window = JacobiWindow(cfg.window, cfg.ngram, np.asarray(prompt), cfg.seed)
        cands, sources = pool.lookup_with_sources(out[-1], guess)
        stats.prefill_s = time.perf_counter() - t0
        self._emit(streamer, out)
        while not done and len(out) < max_new_tokens:
            # 1. layout: current token + window levels + candidates (built once per shape)
            layout = build_layout(cfg.window, cfg.ngram, min(window.filled, levels), len(cands))
            # 2. one forward, logits only for the rows the step reads
            first, last_level, cand_logits = layout.split_logits(
                self._forward(layout, cache, out[-1], window.active[: layout.levels], cands, len(prompt) + len(out) - 1))
            # 3. verify: the candidate prefix the model accepts (greedy or sampling), plus its own next token
            history = prompt + out
            verdict = decoding.verify(history, first, cand_logits, cands)
            # 4. keep the KV of the current token and the accepted candidate tokens only
            kv.compact(cache, layout.size, self._kept_rows(layout, verdict))
            # 5. window and pool: the last level's outputs become a level; finished columns become n-grams
            trajectories = window.advance(last_level.argmax(-1).numpy()) if layout.levels else np.empty((0, cfg.ngram), np.int64)
            new, done = self._until_stop(decoding, history, verdict.tokens[: max_new_tokens - len(out)])
            out += new
            if cfg.pool_from_output:
                pool.insert_sequence(history[-(cfg.ngram - 1) :] + new, Source.OUTPUT)  # n-grams ending in a new token
            stats.record(verdict, sources)
            cands, sources = pool.insert_and_lookup(trajectories, out[-1], guess)
            # 6. stream what was accepted
            self._emit(streamer, new)
        stats.decode_s = time.perf_counter() - t0 - stats.prefill_s
        stats.new_tokens = len(out)
        if streamer is not None:
            streamer.end()
        return out, stats, "stop" if done else "length"

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

    def _new_pool(self, prompt: list[int]) -> NGramPool:
        cfg = self.config
        sparse = cfg.pool_sparse if cfg.pool_sparse is not None else self.vocab_size > SPARSE_POOL_VOCAB
        pool = NGramPool(self.vocab_size, cfg.ngram, cfg.pool_slots, sparse=sparse)
        if cfg.seed_pool_from_prompt:
            pool.insert_sequence(np.asarray(prompt), Source.PROMPT)
        return pool

    def _forward(self, layout: StepLayout, cache: Cache, current: int, levels: np.ndarray, cands: np.ndarray, position: int) -> torch.Tensor:
        """Logits (rows, V) for ``layout.logit_rows``: the current token, the last level, the candidates."""
        device, dtype = self.model.device, self.model.dtype
        ids = layout.input_ids(current, torch.from_numpy(levels), torch.from_numpy(cands).long())
        masks = {kind: layout.additive_mask(*cache.get_mask_sizes(layout.size, layer), position, window, dtype).to(device)
                 for kind, (layer, window) in self.mask_layers.items()}
        out = self.model(
            input_ids=ids.to(device),
            position_ids=(position + layout.offsets).unsqueeze(0).to(device),
            attention_mask=masks if "sliding_attention" in masks else masks["full_attention"],  # (1, 1, T, kv) each
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=layout.logit_rows.to(device),
        )
        return out.logits[0].float().cpu()

    @staticmethod
    def _kept_rows(layout: StepLayout, verdict: Verdict) -> torch.Tensor:
        """Row 0 (the current token) and the accepted candidate's first len(tokens)-1 rows."""
        accepted = len(verdict.tokens) - 1
        start = layout.first_candidate_row + max(verdict.branch, 0) * (layout.ngram - 1)
        return torch.cat([torch.tensor([0]), torch.arange(start, start + accepted)])

    @staticmethod
    def _emit(streamer, tokens: list[int]) -> None:
        if streamer is not None and tokens:
            streamer.put(torch.tensor(tokens))

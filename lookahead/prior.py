"""The recycling table's prior: each common token's likeliest successors, predicted once by the model itself.

The recycling table learns a token's successors from the rows that fed it; a token no row has fed yet (a
fresh state meets many) has none, and where pool and suffix have nothing either the step drafts nothing.
Measured (SmolLM2 bf16, Zen 5, the benchmark's 8 prompts x 64 tokens, a fresh state): 102 of 297 steps
proposed nothing. So before a state's first request the model predicts, for each of the ``recycle_prior``
lowest ids (BPE vocabularies number the commonest first: 89% of those tokens were below 16384 of 49152), its
top-k next tokens after a newline and that token alone (with no token before it, a small model's prediction
is noise). Batched passes, cached on disk per model and dtype (SmolLM2: ~20 s in bf16 once). Side by side,
the same prompts: 1.64 -> 1.83 tokens a forward from a fresh state, 1.73 -> 1.90 from one kept across
prompts, +5.5-5.8% tokens/s. Drafts only: the output is what it was.

A first run spends at most ``recycle_prior_s`` seconds on it and caches what it got, commonest ids first (``cached``);
later runs use what is cached and grow it by a tenth of that once their answers are out (``grow``: the CLI after its
requests, a chat when it ends, a server before it listens). A row costs a forward of its own, so the whole prior of a
7B-class model would take ~20 minutes on 2 cores, and the 1.5B's rows came at ~77 a second on a Zen 3: the commonest
arrive first, the rest over many runs, at a small price to each and never before a first token (a warm run of the
1.5B had spent ~2 s growing it before its first).
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from lookahead import host_kernels, kv, models
from lookahead.cache_entries import quiet
from lookahead.probing import model_name
from ngram_pool.files import written_whole

FORMAT = 1
BATCH = 512  # one-token sequences a forward
GROWTH = 0.1  # of a first run's seconds, what a later one spends growing the prior
FIRST_ROWS = 64  # a bounded run's first forward, which measures the rate for the next


def successors(model: PreTrainedModel, prefix: list[int], tokens: int, k: int, start: int = 0,
               seconds: float = float("inf")) -> np.ndarray:
    """(n, k) int32: the model's k likeliest next tokens after ``prefix`` + [t], for t = start .. start + n - 1: the
    prefix's keys computed once, then up to ``BATCH`` one-token sequences a forward over copies of them, up to t =
    ``tokens`` - 1 or until ``seconds`` have passed (at least one forward). Within a budget the first forward takes
    ``FIRST_ROWS`` and each next as many as the rate so far fits in what is left (a 1.5B's 512 rows took 7 s)."""
    bounded = seconds < float("inf")
    out, began, first, size = [], time.perf_counter(), start, min(BATCH, FIRST_ROWS) if bounded else BATCH
    with torch.inference_mode():
        held = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([prefix], device=model.device), **kv.cache_kwarg(model, held), use_cache=True)
        while first < tokens and size >= 1:
            ids = torch.arange(first, min(tokens, first + size), device=model.device)[:, None]  # (B, 1)
            cache = copy.deepcopy(held)
            cache.batch_repeat_interleave(ids.shape[0])
            logits = model(input_ids=ids, **kv.cache_kwarg(model, cache), use_cache=True, logits_to_keep=1).logits[:, -1].cpu()
            out.append(host_kernels.top_k(logits, k).astype(np.int32))
            first += ids.shape[0]
            spent = time.perf_counter() - began
            if bounded:
                size = 0 if spent >= seconds else min(BATCH, int((first - start) / spent * (seconds - spent)))
    return np.concatenate(out) if out else np.empty((0, k), np.int32)


def cached(model: PreTrainedModel, tokenizer, tokens: int, k: int, cache_dir: Path,
           progress: models.Progress = quiet, seconds: float = float("inf")) -> np.ndarray | None:
    """``successors`` of the ``tokens`` lowest ids after a newline, as cached in ``cache_dir`` (the first n ids:
    fewer than ``tokens`` while it grows); where none are, what ``seconds`` of forwards give, cached. None without a
    tokenizer (no newline to put first), where there is nothing to predict, or where the model's forward does not
    take this pass (a prior is only ever a help: its absence costs drafts, never a request)."""
    found = _found(model, tokenizer, tokens, k, cache_dir)
    if found is None:
        return None
    path, prefix, tokens, table = found
    if len(table):
        return table[:tokens]
    budget = f"up to {seconds:.0f} s; the rest grows after later runs" if seconds < float("inf") else "once for this model and dtype"
    progress(f"predicting the successors of common tokens ({budget})")
    return _extended(model, path, prefix, table, tokens, k, progress, seconds)


def grow(model: PreTrainedModel, tokenizer, tokens: int, k: int, cache_dir: Path, progress: models.Progress = quiet,
         seconds: float = float("inf")) -> np.ndarray | None:
    """The cached table grown by ``GROWTH`` x ``seconds`` of forwards, cached: for later
    states and runs. None where there is no table to grow (``cached`` makes the first), it is whole, or the pass fails."""
    found = _found(model, tokenizer, tokens, k, cache_dir)
    if found is None:
        return None
    path, prefix, tokens, table = found
    if not len(table) or len(table) >= tokens:
        return None
    progress(f"growing the successors of common tokens, {len(table)} of {tokens} so far (up to {seconds * GROWTH:.0f} s)")
    return _extended(model, path, prefix, table, tokens, k, progress, seconds * GROWTH)


def _found(model: PreTrainedModel, tokenizer, tokens: int, k: int, cache_dir: Path) -> tuple[Path, list[int], int, np.ndarray] | None:
    """(the cache file, the prefix, the ids to predict: at most the vocabulary, the table cached there: ``_held``), or
    None where there is nothing to do."""
    vocab = models.vocab_size(model)
    tokens = min(tokens, vocab)
    if tokenizer is None or tokens < 1 or k < 1:
        return None
    prefix = tokenizer.encode("\n", add_special_tokens=False)[-1:]
    if not prefix:
        return None
    name = model_name(model)
    key = json.dumps([name, str(model.dtype), vocab, k, prefix, FORMAT])
    path = cache_dir / "priors" / f"{Path(name).name or 'model'}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.npy"
    return path, prefix, tokens, _held(path, k, vocab)


def _held(path: Path, k: int, vocab: int) -> np.ndarray:
    """The table cached at ``path``; an empty one where there is none, or it is unreadable or not a table of this
    model's ids (computed again, never trusted)."""
    try:
        held = np.load(path, allow_pickle=False)
        if held.dtype == np.int32 and held.ndim == 2 and held.shape[1] == k and (held >= -1).all() and (held < vocab).all():
            return held
    except (OSError, ValueError):
        pass
    return np.empty((0, k), np.int32)


def _extended(model: PreTrainedModel, path: Path, prefix: list[int], table: np.ndarray, tokens: int, k: int,
              progress: models.Progress, seconds: float) -> np.ndarray | None:
    """``table`` and the next rows ``seconds`` of forwards give, written to ``path`` (None where the pass fails)."""
    try:
        table = np.concatenate([table, successors(model, prefix, tokens, k, len(table), seconds)])
    except (RuntimeError, TypeError, ValueError, IndexError, AttributeError) as e:  # a model this pass does not fit
        progress(f"no prior for the recycling table ({type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''})")
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with written_whole(path) as out:
            np.save(out, table)
    except OSError:
        pass  # an unwritable cache: used this once
    return table

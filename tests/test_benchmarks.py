"""The benchmark runners in their smallest modes, so they cannot rot."""

import json
import subprocess
import sys

import pytest

from benchmarks import arithmetic_floor, datasets, drafting_counts, kernel_ab, peers, pool_bench, results_log, run, step_cost, window
from lookahead import cpu, models, native


def test_config_specs_parse_presets_and_fields():
    assert run.parse_config("suffix-only")[1].window == 0
    assert run.parse_config("tree_budget=32,recycle_k=4")[1].tree_budget == 32
    assert run.parse_config("tree_budget=8,auto=0")[1].auto is False
    with pytest.raises(SystemExit, match="preset"):
        run.parse_config("tree_budget=lots")


def test_pool_microbenchmark_runs_and_reports_ratios():
    result = pool_bench.run(window=15, guess=15, ngram=5, steps=200)
    assert result["fused_us"] > 0 and result["python_us"] > 0
    assert result["speedup_fused"] == pytest.approx(result["python_us"] / result["fused_us"])


@pytest.mark.slow
def test_runner_smallest_mode_writes_json_markdown_and_plot(tmp_path):
    run.main(["--sets", "mt_bench,humaneval", "--limit", "1", "--max-new-tokens", "6", "--dtypes", "float32", "--config", "window=2,ngram=2,guess=2",
              "--config", "suffix-only", "--cost-sizes", "1,2", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    sets = {r["set"] for r in results["summary"]}
    assert sets == {"mt_bench", "humaneval", "all"}
    overall = {r["method"]: r for r in results["summary"] if r["set"] == "all"}
    name = "lookahead window=2,ngram=2,guess=2"
    cold = f"{name} {run.COLD}"  # the first config again, from a fresh drafting state per prompt
    assert set(overall) == {"hf_greedy", "hf_prompt_lookup", "plain loop (--no-lookahead)", name, cold, "lookahead suffix-only", run.HF_ENTRY}
    assert overall[cold]["equal_or_tie_rate"] == 1.0
    assert overall["plain loop (--no-lookahead)"]["compression"] == 1.0
    assert overall["hf_greedy"]["speedup_same_dtype"] == 1.0
    assert overall[name]["equal_or_tie_rate"] == 1.0 and overall["lookahead suffix-only"]["equal_or_tie_rate"] == 1.0
    assert overall[run.HF_ENTRY]["equal_or_tie_rate"] == 1.0  # the first config, through generate(custom_generate=)
    assert overall["lookahead suffix-only"]["drafted_by_source"].keys() <= {"suffix"}
    assert set(overall[name]["phase_ms_per_step"]) == {"draft", "forward", "verify", "learn"}
    assert results["hardware"]["cores"] >= 1 and results["cost_curve"]["float32 stock"]["1"] == 1.0
    assert f"float32 {results['kernels']['float32']}" in results["cost_curve"]  # the curve of the kernels our loop ran on
    assert f"| all | float32 | {name} |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "speedup.png").stat().st_size > 1000


FAKE_LLAMA_SERVER = '''#!{python}
"""Stands for llama-server: dies as its weight repacking does unless --no-repack; answers /health and
/completion with the prompt's tokens reversed."""
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
if "--no-repack" not in sys.argv:
    sys.exit(139)
class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        out = {{"tokens": body["prompt"][::-1][: body["n_predict"]], "timings": {{"predicted_ms": 30.0, "predicted_n": 4}}}}
        self.send_response(200); self.end_headers(); self.wfile.write(json.dumps(out).encode())
    def log_message(self, *args):
        pass
HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Handler).serve_forever()
'''


def test_peers_server_retries_without_repacking_and_the_report_ranks_engines(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "llama-server").write_text(FAKE_LLAMA_SERVER.format(python=sys.executable))
    (bin_dir / "llama-server").chmod(0o755)
    with peers.llama_server(bin_dir, tmp_path / "model.gguf", 2) as (complete, flags):
        tokens, seconds, timings = complete([1, 2, 3, 4, 5], 4)
    assert flags == ("--no-repack",) and tokens == [5, 4, 3, 2] and timings["predicted_ms"] == 30.0 and seconds > 0

    def rows(tokens_per_s: float, sets=("a", "b")) -> list[dict]:
        return [{"set": s, "prompt": "0", "tokens": [1] * 100, "seconds": 100 / tokens_per_s, "step_ms": 10.0} for s in sets]
    results = {"hardware": run.hardware(), "model": "m", "isa": "avx2", "max_new_tokens": 100, "llama_cpp": peers.LLAMA_CPP,
               "weight_bytes": 2e8, "read_bytes_per_s": 2e10,
               "runs": {"our plain loop bfloat16": rows(40), "lookahead bfloat16": rows(80), "llama.cpp bf16 plain": rows(50),
                        "llama.cpp bf16 ngram-mod": rows(64)}}
    peers.write_report(results, tmp_path / "out")
    text = (tmp_path / "out" / "results.md").read_text()
    assert "| engine | tokens/s | vs llama.cpp bf16 ngram-mod |" in text and "| lookahead bfloat16 | 80.0 | 1.25x |" in text
    assert "takes 10.0 ms" in text and "| llama.cpp bf16 plain | 50.0 | 0.78x | 10.0 |" in text
    assert "The worst prompt set of lookahead bfloat16 against llama.cpp bf16 ngram-mod: a at 1.25x." in text
    written = json.loads((tmp_path / "out" / "results.json").read_text())
    assert written["runs"].keys() == results["runs"].keys()
    assert written["runs"]["lookahead bfloat16"][0]["tokens"] == results_log.digest([1] * 100)  # ids as a count and a digest
    assert results_log.headline(written) == results_log.headline(results) == "bf16: 80.0 tok/s, 1.25x llama.cpp bf16 ngram-mod"
    on_file = {"our plain loop gguf bfloat16": rows(45), "our plain loop gguf float32": rows(44), "our plain loop gguf int8": rows(60),
               "lookahead gguf int8": rows(120), "llama.cpp m.gguf plain": rows(55)}
    on_file["our plain loop gguf int8"][1]["tokens"] = [1] * 30 + [2] * 70  # int8 rounding changed one prompt's text at token 30
    peers.write_report({**results, "gguf": "m.gguf", "quantized_bytes": 1e8, "runs": {**results["runs"], **on_file}}, tmp_path / "out")
    text = (tmp_path / "out" / "results.md").read_text()
    assert "On m.gguf's own blocks: lookahead gguf int8 120.0 tokens/s, 2.18x llama.cpp m.gguf plain" in text
    assert "The worst prompt set of lookahead gguf int8 against llama.cpp bf16 ngram-mod: a at 1.88x." in text  # our fastest lookahead
    assert "10.0 ms (int8 activations) against llama.cpp's 10.0 ms" in text
    assert "int8 plain loop equal to our plain loop gguf float32's: 1 of 2 prompts (the same first 100 tokens, median)" in text


def test_token_ids_are_recorded_as_a_count_and_a_digest_and_nothing_else_changes():
    ids = [5, 17, 3]
    results = {"runs": {"a": [{"tokens": ids, "seconds": 1.0}]}, "summary": [{"tokens": 64}], "sizes": [1, 2],
               "methods": {"m": {"runs": {"one": {"outputs": [ids, [9]], "tokens": 4}}}}}
    out = results_log.compact(results)
    assert out["runs"]["a"][0] == {"tokens": results_log.digest(ids), "seconds": 1.0} and results["runs"]["a"][0]["tokens"] == ids
    assert out["methods"]["m"]["runs"]["one"] == {"outputs": [results_log.digest(ids), results_log.digest([9])], "tokens": 4}
    assert out["summary"] == [{"tokens": 64}] and out["sizes"] == [1, 2]  # counts, and lists under other keys, as they were
    assert results_log.compact(out) == out and results_log.digest(ids)["n"] == results_log.count(ids) == 3
    assert results_log.same(ids, out["runs"]["a"][0]["tokens"]) and not results_log.same([5, 17], ids)


def test_the_results_log_indexes_every_folder_and_keeps_its_history(tmp_path):
    results = tmp_path / "results"
    for name, data in {
        "run-a": {"hardware": {"commit": "abc1234", "cpu": "Some CPU (family 1; avx2)"}, "model": "m", "max_new_tokens": 64,
                  "dtypes": ["float32", "bfloat16"],
                  "summary": [{"set": "all", "dtype": "bfloat16", "method": results_log.OURS, "tokens_per_s": 90.0, "speedup_vs_fastest_greedy": 3.0},
                              {"set": "all", "dtype": "bfloat16", "method": results_log.PLAIN, "tokens_per_s": 60.0, "speedup_vs_fastest_greedy": 2.0}]},
        "peers-b": {"hardware": {"commit": "def5678", "cpu": "Other CPU"}, "model": "m", "max_new_tokens": 128,
                    "runs": {"lookahead bfloat16": [{"tokens": [1] * 80, "seconds": 1.0}],
                             "llama.cpp bf16 plain": [{"tokens": [1] * 50, "seconds": 1.0}]}},
    }.items():
        (results / name).mkdir(parents=True)
        (results / name / "results.json").write_text(json.dumps(data))
    (results / "batch-c").mkdir()
    (results / "batch-c" / "batch.md").write_text("# batch\n")
    log = tmp_path / "RESULTS.md"
    log.write_text("# Results log\n\nIntro.\n\n**An old run** (commit 0000000): text.\n")
    for _ in range(2):  # the second rewrite replaces the index, it does not add one
        results_log.rewrite(log, results)
    text = log.read_text()
    assert text.count(results_log.BEGIN) == 1 and text.endswith("**An old run** (commit 0000000): text.\n")
    assert "| `run-a` | – | abc1234 | Some CPU (family 1) | m, 64 | bfloat16: 90.0 tok/s, 3.00x fastest HF greedy, 1.50x our plain loop |" in text
    assert "| `peers-b` | – | def5678 | Other CPU | m, 128 | bf16: 80.0 tok/s, 1.60x llama.cpp bf16 plain |" in text
    assert "| `batch-c` | – | | | | see batch.md |" in text
    assert "Dropped folders" not in text
    results_log.compact_folder(results / "peers-b")  # the same row from the digests
    assert json.loads((results / "peers-b" / "results.json").read_text())["runs"]["lookahead bfloat16"][0]["tokens"]["n"] == 80
    (results / results_log.DROPPED).write_text(json.dumps({"old-run": {"recorded": "2026-11-22", "commit": "0000000", "machine": "A CPU",
                                                                      "model": "m, 64", "headline": "no default lookahead row", "files_at": "1111111"}}))
    results_log.rewrite(log, results)
    text = log.read_text()
    assert "| `peers-b` | – | def5678 | Other CPU | m, 128 | bf16: 80.0 tok/s, 1.60x llama.cpp bf16 plain |" in text
    assert "| old-run | 2026-11-22 | 0000000 | A CPU | m, 64 | no default lookahead row | 1111111 |" in text


def test_the_window_report_says_what_the_window_ran_and_earned_and_the_slowest_prompt(tmp_path):
    def rows(speeds: list[float], window_steps: int, tokens: list[int]) -> list[dict]:
        return [{"set": "a", "prompt": str(i), "tokens": tokens, "seconds": len(tokens) / speed, "steps": 40, "rested_steps": 2,
                 "window_steps": window_steps, "trajectory_tokens": 3 * window_steps} for i, speed in enumerate(speeds)]
    runs = {"lookahead": rows([30, 18], 5, [1, 2, 3] * 20), "lookahead without the window": rows([25, 25], 0, [1, 2, 3] * 20),
            "our plain loop": rows([20, 20], 0, [1, 2, 3] * 20)}
    results = {"hardware": run.hardware(), "model": "m", "dtype": "int8", "weights": "gguf", "max_new_tokens": 60, "runs": runs}
    window.write_report(results, tmp_path)
    text = (tmp_path / "results.md").read_text()
    assert "| lookahead | 22.5 | 1.12x | 0.90x | 80 | 4 | 10 | 30 | 100% |" in text  # 120 tokens in 2 + 10/3 s
    assert "| lookahead without the window | 25.0 | 1.25x | 1.25x | 80 | 4 | 0 | 0 | 100% |" in text
    written = json.loads((tmp_path / "results.json").read_text())
    assert written["runs"]["lookahead"][0]["tokens"] == results_log.digest([1, 2, 3] * 20)
    assert results_log.headline(written) == "int8: the window ran on 10 of 80 steps; lookahead 22.5 tok/s, 0.90x without it"


def test_the_drafting_counts_report_gives_tokens_a_forward_by_rows_source_and_set(tmp_path):
    def cell(name: str, rows: int, per_set: dict[str, tuple[int, int]], same: bool = True) -> dict:
        return {"sources": name, "rows": rows, "window_rows": 6 * (name == "all + window"),
                "prompts": [{"set": s, "prompt": "0", "tokens": t, "forwards": f, "same": same} for s, (t, f) in per_set.items()]}
    counts = {"all @ 5": cell("all", 5, {"own": (64, 40), "gsm8k": (64, 56)}), "all @ 9": cell("all", 9, {"own": (64, 32), "gsm8k": (64, 48)}),
              "all + window @ 5": cell("all + window", 5, {"own": (64, 32), "gsm8k": (64, 32)}, same=False),
              "all + window @ 9": cell("all + window", 9, {"own": (64, 32), "gsm8k": (64, 32)})}
    assert set(drafting_counts.configs([5, 9])) >= {("all", 5), ("recycling", 9)}
    assert drafting_counts.configs([9])["suffix", 9].tree_budget == 8 and drafting_counts.configs([9])["all, no prior", 9].recycle_prior == 0
    assert set(drafting_counts.configs([9, 17], ["all", "pool"])) == {("all", 9), ("all", 17), ("pool", 9), ("pool", 17)}
    results = {"hardware": run.hardware(), "isa": "avx2", "model": "m", "dtype": "int8", "weights": "gguf", "max_new_tokens": 64, "counts": counts}
    drafting_counts.write_report(results, tmp_path)
    text = (tmp_path / "results.md").read_text()
    assert "| all | 1.33 | 1.60 | 100% |" in text and "| all + window (+6 window rows) | 2.00 | 2.00 | 50% |" in text
    assert "| own | 1.60 | 2.00 |" in text and "| gsm8k | 1.14 | 1.33 |" in text
    assert results_log.headline(results) == "int8, all sources: 5 rows 1.33, 9 rows 1.60 tokens a forward"


def test_the_copy_edit_and_multi_turn_sets_are_conversations_the_answer_can_copy_from():
    cache_dir = models.default_cache_dir()
    edits, turns = datasets.load(["copy_edit"], None, cache_dir), datasets.load(["multi_turn"], None, cache_dir)
    assert len(edits) == 20 and len(turns) == 30 and all(p.chat for p in edits + turns)
    assert datasets.misspelt("one two three seven eight nine ten eleven twelve thirteen") == "one two three sveen eight nine ten eleven twelve tihrteen"
    passage = datasets.summarisation(cache_dir)[0].text.split("\n\n", 1)[1]
    wrong = edits[0].text.split("\n\n", 1)[1]
    assert wrong != passage and len(wrong.split()) == len(passage.split()) and sorted(wrong) == sorted(passage)

    class Template:  # a tokenizer with a chat template: what it is given
        chat_template = "..."

        def apply_chat_template(self, messages, **options):
            self.messages = messages
            return [1, 2]

    tok = Template()
    assert turns[0].ids(tok) == [1, 2] and [m["role"] for m in tok.messages] == ["user", "assistant", "user"]
    assert [m["content"] for m in tok.messages] == [*turns[0].earlier, turns[0].text]


def test_the_step_cost_report_prices_each_shape_against_the_plain_forward(tmp_path):
    def rows(steps: int, nodes: int, forward_ms: float, host_ms: float, tokens: list[int]) -> list[dict]:
        return [{"set": "a", "prompt": str(i), "tokens": tokens, "seconds": steps * forward_ms / 1e3 * 1.25, "steps": steps,
                 "tree_nodes": steps * nodes, "forward_s": steps * forward_ms / 1e3, "host_s": steps * host_ms / 1e3} for i in range(2)]
    runs = {step_cost.PLAIN: rows(59, 0, 20.0, 0.2, [1, 2, 3] * 20), "up to 8 nodes": rows(29, 8, 30.0, 0.5, [1, 2, 3] * 20),
            step_cost.PLANNER: rows(39, 3, 24.0, 0.3, [1, 2, 3] * 19 + [4, 4, 4])}
    results = {"hardware": run.hardware(), "isa": "avx2", "model": "m", "dtype": "int8", "weights": "gguf", "max_new_tokens": 60,
               "runs": runs, "curve": {"sizes": [1, 4, 16], "ratios": [1.0, 1.2, 2.4]},
               "peak": {"what": "vpdpbusd", "macs_a_s": 1e12, "macs_a_row": 1.5e9, "one_row_ms": 20.0}}
    step_cost.write_report(results, tmp_path)
    text = (tmp_path / "results.md").read_text()
    assert "| our plain loop | 1.00 | 20.0 | 1.00 | 1.00 | 1.00 | 0.200 | 0.0% | 1.00 | 1.00x | 100% |" in text
    # 9 rows: r(9) on the curve 1.2 + 5 x 0.1; 13.5 ms of multiply-adds over 20; 0.3 ms of host work more than plain over
    # a 30.5 ms step; 60 tokens in 30 forwards; 2.95 s against 2.175
    assert "| up to 8 nodes | 9.00 | 30.0 | 1.50 | 1.70 | 1.00 | 0.500 | 1.0% | 2.00 | 1.36x | 100% |" in text
    assert "| the planner | 4.00 | 24.0 | 1.20 | 1.20 | 1.00 | 0.300 | 0.4% | 1.50 | 1.26x | 0% |" in text
    assert results_log.headline(results) == "int8 on avx2: a step's forward over the plain one, 8 nodes 1.50; the planner 1.26x our plain loop"


@pytest.mark.slow
def test_kernel_ab_builds_a_revisions_kernels_beside_the_working_trees(capsys):
    kernel_ab.main(["--before", "HEAD", "--model", "smollm2-135m", "--dtype", "float32", "--weights", "dense", "--rounds", "1"])
    out = capsys.readouterr().out
    assert "| before (HEAD) |" in out and "| after (working tree) |" in out
    unchanged = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", kernel_ab.CSRC]).returncode == 0
    assert ("equal bit for bit" in out) if unchanged else ("are equal bit for bit" in out or "NOT equal" in out)


@pytest.mark.slow
@pytest.mark.skipif(native.best_tier() in (None, "avx2"), reason="no tier below this CPU's best to compare with")
def test_kernel_ab_compares_a_lower_tiers_integer_kernels_in_one_process(capsys):
    best = native.best_tier()
    with pytest.raises(SystemExit, match="best tier"):
        kernel_ab.main(["--tier", best, "--model", "smollm2-135m"])
    with pytest.raises(SystemExit, match="integer kernels"):
        kernel_ab.main(["--tier", "avx2", "--model", "smollm2-135m", "--dtype", "float32"])
    kernel_ab.main(["--tier", "avx2", "--model", "smollm2-135m", "--rounds", "1"])
    out = capsys.readouterr().out
    assert "| avx2 (working tree) |" in out and f"| {best} (working tree) |" in out
    assert "equal bit for bit" in out  # SmolLM2's Q4_1 blocks: a legacy type, the same bits on every tier (DESIGN)


@pytest.mark.slow
@pytest.mark.skipif(not any(flag in cpu.flags() for flag in arithmetic_floor.VARIANTS), reason="no AVX2 on this CPU")
def test_the_arithmetic_floor_measures_the_dot_product_peak_and_bounds_the_steps_by_it(capsys):
    what, peak = arithmetic_floor.dot_peak(threads=1, seconds=0.1)
    assert ("vpdpbusd" in what or "vpmaddubsw" in what) and 8e9 <= peak <= 6e9 * 128  # 8 to 128 multiply-adds a cycle, at up to 6 GHz
    assert "vpmaddubsw" in arithmetic_floor.dot_peak(threads=1, seconds=0.01, tier="avx2")[0]  # a tier held: its own instruction
    arithmetic_floor.main(["--model", "smollm2-135m", "--weights", "q8", "--sizes", "2,64", "--reps", "1"])
    out = capsys.readouterr().out
    assert "G multiply-adds a row" in out and "peak" in out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [int(r[0]) for r in rows] == [1, 2, 64]
    for size, forward, ratio, at_peak, floor in ([float(c) for c in r] for r in rows):
        # no step is faster than its multiply-adds at the peak (a bound with ~10x to spare); the floor's ratio is the
        # arithmetic's, at least 1. The measured r(T) is a timing: one rep of it moved below 1 on a quiet 2-core VM.
        assert forward >= at_peak and floor >= 0.99 and ratio > 0


def test_the_plot_takes_each_engine_s_best_run_on_the_file_and_draws_them(tmp_path):
    from benchmarks import plot

    def rows(tokens_per_s: float) -> list[dict]:
        return [{"set": "a", "prompt": "0", "tokens": {"n": 100, "sha256": "x"}, "seconds": 100 / tokens_per_s}]
    runs = {"HF greedy float32": rows(10), "HF greedy bfloat16": rows(12), "HF prompt lookup bfloat16": rows(15),
            "llama.cpp m.gguf plain": rows(40), "llama.cpp m.gguf ngram-simple": rows(44), "llama.cpp bf16 ngram-mod": rows(90),
            "our plain loop gguf float32": rows(50), "our plain loop gguf int8": rows(60), "lookahead gguf int8": rows(80),
            "lookahead bfloat16": rows(99)}
    results = {"hardware": run.hardware(), "model": "m", "gguf": "m.gguf", "max_new_tokens": 100, "runs": runs}
    assert plot.rates(results) == pytest.approx({"HF greedy": 12, "HF prompt lookup": 15, "llama.cpp plain": 40,
                                                 "llama.cpp best n-gram mode": 44, "our plain loop": 60, "lookahead": 80})
    plot.draw([results, results], tmp_path / "peers.png")
    assert (tmp_path / "peers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_load_times_a_cli_run_on_an_empty_cache_sharing_only_the_downloads(tmp_path):
    from benchmarks.load import cache_gb, cli_run, empty_cache

    user = tmp_path / "user" / "lookahead"
    cache = empty_cache(tmp_path / "base", user)
    assert sorted(p.name for p in cache.iterdir()) == ["gguf", "kernels", "wheels"] and all(p.is_symlink() for p in cache.iterdir())
    run = cli_run(cache, "models")  # the embedded models, none fetched into this cache
    assert run["exit"] == 0 and 0 < run["first_byte_s"] <= run["seconds"] and run["peak_rss_gb"] > 0.05
    (cache / "blocks").mkdir()
    (cache / "blocks" / "x.bin").write_bytes(b"\0" * 10**6)
    assert cache_gb(cache) == {"blocks": 0.001}

"""The benchmark runners in their smallest modes, so they cannot rot."""

import json

import pytest

from benchmarks import pool_bench, run


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
    run.main(["--limit", "1", "--max-new-tokens", "6", "--dtypes", "float32", "--config", "window=2,ngram=2,guess=2", "--config", "suffix-only",
              "--cost-sizes", "1,2", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    sets = {r["set"] for r in results["summary"]}
    assert sets == {"mt_bench", "humaneval", "gsm8k", "summarisation", "all"}
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

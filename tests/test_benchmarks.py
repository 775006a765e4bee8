"""The benchmark runners in their smallest modes, so they cannot rot."""

import json

import pytest

from benchmarks import pool_bench, run


def test_pool_microbenchmark_runs_and_reports_ratios():
    result = pool_bench.run(window=15, guess=15, ngram=5, steps=200)
    assert result["fused_us"] > 0 and result["python_us"] > 0
    assert result["speedup_fused"] == pytest.approx(result["python_us"] / result["fused_us"])


@pytest.mark.slow
def test_runner_smallest_mode_writes_json_markdown_and_plot(tmp_path):
    run.main(["--limit", "1", "--max-new-tokens", "6", "--dtypes", "float32", "--config", "2,2,2",
              "--cost-sizes", "1,2", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    sets = {r["set"] for r in results["summary"]}
    assert sets == {"mt_bench", "humaneval", "gsm8k", "summarisation", "all"}
    overall = {r["method"]: r for r in results["summary"] if r["set"] == "all"}
    assert set(overall) == {"hf_greedy", "hf_prompt_lookup", "plain loop (--no-lookahead)", "lookahead W2 N2 G2"}
    assert overall["plain loop (--no-lookahead)"]["compression"] == 1.0
    assert overall["hf_greedy"]["speedup_same_dtype"] == 1.0
    assert overall["lookahead W2 N2 G2"]["equal_or_tie_rate"] == 1.0  # lossless, as everywhere
    assert results["hardware"]["cores"] >= 1 and results["cost_curve"]["float32"]["1"] == 1.0
    assert "| all | float32 | lookahead W2 N2 G2 |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "speedup.png").stat().st_size > 1000

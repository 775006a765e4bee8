"""Runs inside vLLM's own virtual environment (``vllm_cpu.run``): one engine, the job read as JSON from standard
input, the results written as JSON to the job's ``out`` file (vLLM logs to standard output).

    {"model": dir, "dtype": "float32", "spec": {...} | null, "max_num_seqs": 8, "eager": true, "out": path,
     "runs": [{"name": ..., "prompts": [[ids], ...], "max_tokens": [n, ...], "together": bool}, ...]}
    -> {"runs": {name: {"outputs": [[ids], ...], "seconds": s, "tokens": n}}, "drafts": n, "draft_tokens": n,
        "accepted": n}

``together``: every prompt at once (vLLM batches them, at most ``max_num_seqs`` running: the rest join as others
finish); otherwise one request at a time. The counters are vLLM's own speculative decoding metrics over the job.
"""

from __future__ import annotations

import json
import sys
import time


def counters(llm) -> dict[str, int]:
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    out = dict.fromkeys(names.values(), 0)
    for metric in llm.get_metrics():
        if metric.name in names:
            out[names[metric.name]] += int(metric.value)
    return out


def main() -> None:
    from vllm import LLM, SamplingParams

    job = json.load(sys.stdin)
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=job.get("max_model_len", 2048),
              max_num_seqs=job.get("max_num_seqs", 8), speculative_config=job.get("spec"), seed=0,
              enforce_eager=job.get("eager", True), kv_cache_memory_bytes=job.get("kv_bytes", 1 << 29),
              disable_log_stats=False)
    runs = {}
    for run in job["runs"]:
        requests = [{"prompt_token_ids": p} for p in run["prompts"]]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=run.get("ignore_eos", False)) for n in run["max_tokens"]]
        start = time.perf_counter()
        if run["together"]:
            outs = llm.generate(requests, params, use_tqdm=False)
        else:
            outs = [llm.generate([r], p, use_tqdm=False)[0] for r, p in zip(requests, params)]
        seconds = time.perf_counter() - start
        outputs = [list(o.outputs[0].token_ids) for o in outs]
        runs[run["name"]] = {"outputs": outputs, "seconds": seconds, "tokens": sum(map(len, outputs))}
    with open(job["out"], "w") as f:
        json.dump({"runs": runs, **counters(llm)}, f)


if __name__ == "__main__":
    main()

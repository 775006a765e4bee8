"""Load test of ``lookahead serve``: concurrent clients, a few hundred requests (malformed ones and clients
that hang up mid-stream among them), against the real server started in-process on a loopback port.

    python -m benchmarks.serve_load [--clients 8 --requests 300 --max-tokens 16 --max-batch 1,8 --model smollm2-135m]

Checked as it runs: every well-formed request gets a 200 whose tokens equal what the same request got when
sent alone (greedy, so the answer is fixed: nothing lost or mixed up between clients), every malformed one a
4xx with an OpenAI-style body, and the process's peak memory stays bounded. Reported: requests/s, p50/p95
latency, generated tokens/s, for each ``--max-batch`` in turn on the same generator (1: one request at a time,
the server before continuous batching), so the two are compared in one run. Then the warm-state pass: the summarisation prompts twice through one server,
tokens per forward in each pass.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import resource
import time

import httpx

from benchmarks import datasets
from benchmarks.run import hardware
from lookahead import LookaheadGenerator, models
from lookahead.config import PREFILL_CHUNK
from lookahead.server import Server, background

MALFORMED = [
    {"prompt": "hello", "n": 2},
    {"prompt": [1, 2, 10**9]},
    {"prompt": "hello", "max_tokens": -1},
    {"model": "no-such-model", "prompt": "hello"},
    {"prompt": "hello", "best_of": 4},
]


async def client_loop(url: str, jobs: list, expected: dict, results: list, max_tokens: int) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        for kind, payload in jobs:
            start = time.perf_counter()
            if kind == "ok":
                reply = await http.post("/v1/completions", json={"prompt": payload, "max_tokens": max_tokens, "temperature": 0,
                                                                 "return_token_ids": True})
                ok = reply.status_code == 200 and reply.json()["choices"][0]["token_ids"] == expected[payload]
                tokens = len(reply.json()["choices"][0]["token_ids"]) if reply.status_code == 200 else 0
            elif kind == "bad":
                reply = await http.post("/v1/completions", json=payload)
                ok, tokens = 400 <= reply.status_code < 500 and "message" in reply.json().get("error", {}), 0
            else:  # a client that hangs up after the first streamed chunk
                async with http.stream("POST", "/v1/completions", json={"prompt": payload, "max_tokens": 200, "temperature": 0,
                                                                        "stream": True}) as reply:
                    async for line in reply.aiter_lines():
                        if line.startswith("data:"):
                            break
                ok, tokens = reply.status_code == 200, 0
            results.append((kind, ok, time.perf_counter() - start, tokens))


def load_test(server: Server, prompts: list[str], clients: int, requests: int, max_tokens: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    with background(server) as url:
        expected = {}
        for p in prompts:  # each prompt alone first: the answer every concurrent request must get back
            reply = httpx.post(url + "/v1/completions", json={"prompt": p, "max_tokens": max_tokens, "temperature": 0,
                                                              "return_token_ids": True}, timeout=600).json()
            expected[p] = reply["choices"][0]["token_ids"]
        kinds = rng.choices(["ok", "bad", "hangup"], weights=[0.8, 0.1, 0.1], k=requests)
        jobs = [(k, rng.choice(MALFORMED) if k == "bad" else rng.choice(prompts)) for k in kinds]
        results: list = []
        start = time.perf_counter()

        async def main() -> None:
            await asyncio.gather(*(client_loop(url, jobs[i::clients], expected, results, max_tokens) for i in range(clients)))

        asyncio.run(main())
        wall = time.perf_counter() - start
        health = httpx.get(url + "/health").json()
    lat = sorted(t for k, _, t, _ in results if k == "ok")
    return {
        "requests": len(results), "clients": clients, "wall_s": wall, "requests_per_s": len(results) / wall,
        "failures": [(k, t) for k, ok, t, _ in results if not ok], "ok": sum(k == "ok" for k, *_ in results),
        "malformed": sum(k == "bad" for k, *_ in results), "hangups": sum(k == "hangup" for k, *_ in results),
        "p50_s": lat[len(lat) // 2], "p95_s": lat[int(len(lat) * 0.95)],
        "tokens_per_s": sum(n for *_, n in results) / wall, "queue_after": health["queue"],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def warm_passes(gen: LookaheadGenerator, prompts: list[list[int]], max_tokens: int) -> list[float]:
    """Tokens per forward over the prompts, twice through one server (one shared, warming drafting state)."""
    server, passes = Server(gen, "bench"), []
    with background(server) as url:
        for _ in range(2):
            tokens = forwards = 0
            for ids in prompts:
                reply = httpx.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": max_tokens, "temperature": 0},
                                   timeout=600).json()
                tokens += reply["lookahead"]["new_tokens"]
                forwards += reply["lookahead"]["steps"] + 1
            passes.append(tokens / forwards)
    return passes


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    # float32: every answer must equal the same request sent alone, token for token; in bfloat16 the step's shape
    # (batch mates, the warm drafting state) changes rounding, so near-ties can go either way
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--warm-tokens", type=int, default=64)
    parser.add_argument("--max-batch", default="1,8", type=lambda v: [int(b) for b in v.split(",")],
                        help="requests decoded together (1: one at a time); several: one load test each, same run")
    parser.add_argument("--prefill-chunk", default=str(PREFILL_CHUNK), type=lambda v: [int(c) for c in v.split(",")],
                        help="the server's --prefill-chunk; several: one load test each (with every --max-batch above 1)")
    args = parser.parse_args(argv)
    gen = LookaheadGenerator.from_pretrained(args.model, dtype=args.dtype)
    prompts = [p.text for p in datasets.load(["mt_bench", "gsm8k"], 3, models.default_cache_dir())]
    hw = hardware()
    print(f"{args.model} ({str(gen.model.dtype).split('.')[-1]}), {hw['cpu']}, {hw['cores']} cores, commit {hw['commit']}")
    failures = []
    for max_batch, chunk in [(b, c) for b in args.max_batch for c in (args.prefill_chunk if b > 1 else args.prefill_chunk[:1])]:
        r = load_test(Server(gen, args.model, queue_limit=args.clients + 1, max_batch=max_batch, prefill_chunk=chunk), prompts,
                      args.clients, args.requests, args.max_tokens)
        print(f"--max-batch {max_batch} --prefill-chunk {chunk}: {r['requests']} requests ({r['ok']} completions, {r['malformed']} malformed, {r['hangups']} "
              f"hang-ups) from {r['clients']} clients in {r['wall_s']:.1f} s: {r['requests_per_s']:.2f} requests/s, p50 {r['p50_s']:.2f} s, "
              f"p95 {r['p95_s']:.2f} s, {r['tokens_per_s']:.1f} generated tokens/s; failures: {len(r['failures'])}; "
              f"queue after: {r['queue_after']}; peak RSS {r['peak_rss_mb']:.0f} MB", flush=True)
        failures += r["failures"]
    summaries = [p.ids(gen.tokenizer) for p in datasets.load(["summarisation"], None, models.default_cache_dir())]
    if args.warm_tokens:
        first, second = warm_passes(gen, summaries, args.warm_tokens)
        print(f"warm state, summarisation set ({len(summaries)} prompts) twice: {first:.2f} then {second:.2f} tokens per forward")
    if failures:
        raise SystemExit(f"failed requests: {failures[:5]}")


if __name__ == "__main__":
    main()

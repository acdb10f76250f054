"""Structured outputs and n > 1 against `deltamoe serve`: the cost of a JSON schema, the gain of one prefill.

    .venv/bin/python bench/bench_serve_structured.py [--quick] [--model tiny] [--input-len 256] [--output-len 64]

Starts `deltamoe serve MODEL` on a free local port (default: the `tiny` preset, random weights), then:

1. TPOT with and without a JSON schema (`response_format` json_schema, through token masking) at
   1 and 8 concurrent streaming /v1/completions clients. The schema (an object holding an array
   of strings) lets random weights run to max_tokens, so both arms decode the same number of
   tokens; TPOT = (e2e - TTFT) / (output tokens - 1) per request, tokens from the usage chunk.
2. n = 4 choices in one request (one prefill, engine/forks.py) vs 4 separate requests for the
   same prompt sent at once (seeds seed..seed+3), at `--n-clients` concurrent clients: output
   tokens per second and mean latency per group of 4.

Prints markdown tables and writes bench/results/serve_structured.json (serve_structured_quick.json with --quick).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_serve_online import MODEL_NAME, free_port, random_prompt, start_server, wait_healthy  # noqa: E402
from common import markdown_table, result_name, write_result  # noqa: E402

SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}},
          "required": ["items"], "additionalProperties": False}


async def stream_one(http: httpx.AsyncClient, prompt: str, output_len: int, schema: bool, seed: int) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": output_len, "temperature": 1.0, "seed": seed,
            "stream": True, "stream_options": {"include_usage": True}}
    if schema:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "bench", "schema": SCHEMA}}
    else:
        body["ignore_eos"] = True
    start, first, tokens = time.perf_counter(), None, 0
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"ok": False, "error": (await r.aread()).decode()[:200]}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk.get("choices") and chunk["choices"][0].get("text") and first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    ok = first is not None and tokens > 1
    return {"ok": ok, "tpot": (end - first) / (tokens - 1) if ok else 0.0, "tokens": tokens}


async def tpot_run(url: str, concurrency: int, prompts: list[str], output_len: int, schema: bool) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        queue = list(enumerate(prompts))

        async def client() -> list[dict]:
            out = []
            while queue:
                i, prompt = queue.pop()
                out.append(await stream_one(http, prompt, output_len, schema, seed=i))
            return out

        results = [r for rs in await asyncio.gather(*(client() for _ in range(concurrency))) for r in rs]
    ok = [r for r in results if r["ok"]]
    return {"concurrency": concurrency, "schema": schema, "requests": len(results), "errors": len(results) - len(ok),
            "mean_output_tokens": float(np.mean([r["tokens"] for r in ok])) if ok else 0.0,
            "tpot_ms_median": float(np.median([r["tpot"] for r in ok]) * 1e3) if ok else 0.0}


async def choices_run(url: str, clients: int, prompts: list[str], output_len: int, together: bool) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        queue = list(prompts)
        latencies: list[float] = []
        tokens = 0

        async def one(prompt: str, n: int, seed: int) -> int:
            r = await http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": output_len,
                                                         "temperature": 1.0, "seed": seed, "n": n, "ignore_eos": True})
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        async def client() -> None:
            nonlocal tokens
            while queue:
                prompt = queue.pop()
                start = time.perf_counter()
                if together:
                    tokens += await one(prompt, 4, 0)
                else:
                    tokens += sum(await asyncio.gather(*(one(prompt, 1, s) for s in range(4))))
                latencies.append(time.perf_counter() - start)

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        wall = time.perf_counter() - start
    return {"mode": "n=4 in one request" if together else "4 separate requests", "groups": len(prompts),
            "output_tok_per_s": tokens / wall, "mean_group_latency_s": float(np.mean(latencies))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--quick", action="store_true", help="few requests; writes serve_structured_quick.json")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prompts-per-client", type=int, default=4)
    parser.add_argument("--n-clients", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.quick:
        args.input_len, args.output_len, args.prompts_per_client = 64, 16, 1
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(args.model, port, max_model_len=args.input_len * 2 + args.output_len * 8, max_num_seqs=32,
                        threads=args.threads)
    rng = random.Random(0)
    try:
        wait_healthy(proc, url)
        tpot = []
        for concurrency in (1, 8):
            prompts = [random_prompt(rng, args.input_len) for _ in range(concurrency * args.prompts_per_client)]
            for schema in (False, True):
                tpot.append(asyncio.run(tpot_run(url, concurrency, prompts, args.output_len, schema)))
        groups = [random_prompt(rng, args.input_len) for _ in range(args.n_clients * args.prompts_per_client)]
        choices = [asyncio.run(choices_run(url, args.n_clients, list(groups), args.output_len, together))
                   for together in (False, True)]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(markdown_table(["streams", "schema", "requests", "errors", "mean out tokens", "TPOT ms (median)"],
                         [[r["concurrency"], r["schema"], r["requests"], r["errors"], f"{r['mean_output_tokens']:.1f}",
                           f"{r['tpot_ms_median']:.2f}"] for r in tpot]))
    print(markdown_table(["mode", "groups", "output tok/s", "mean latency per group (s)"],
                         [[r["mode"], r["groups"], f"{r['output_tok_per_s']:.1f}", f"{r['mean_group_latency_s']:.3f}"]
                          for r in choices]))
    path = write_result(result_name("serve_structured", args.quick), {
        "model": args.model, "input_len": args.input_len, "output_len": args.output_len, "tpot": tpot, "choices": choices})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

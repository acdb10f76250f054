"""Online serving: TTFT, TPOT and ITL at 1, 8 and 32 concurrent clients against `deltamoe serve`.

    .venv/bin/python bench/bench_serve_online.py [--quick] [--model tiny] [--input-len 64] [--output-len 32]
                                                 [--compile-decode]

Starts `deltamoe serve MODEL` as a subprocess on a free local port (default: the `tiny` preset,
random weights), then for each concurrency C keeps C streaming /v1/completions clients busy
until `--prompts-per-client * C` requests are done. Metrics follow vLLM's serving benchmark
(benchmarks/serve.py): request and output-token throughput over the wall time of the run;
TTFT = arrival of the first text event; TPOT = (e2e - TTFT) / (output tokens - 1) per request;
ITL = gaps between successive text events; E2EL. Output lengths are fixed (`ignore_eos`) and
counted from the server's usage chunk, so a lost or short request shows up as an error.
With the byte tokenizer and random weights, half of a UTF-8 character is held back and sent with
the next token, so one SSE event can carry two tokens: ITL is per event, TPOT per token.

`--compile-decode` starts the server with its decode steps compiled (`deltamoe serve
--compile-decode`; the compile runs at startup, before the health check passes, and is not timed)
and writes serve_online_compiled.json instead. `--async-scheduling` serves with one-step-ahead
scheduling (`deltamoe serve --async-scheduling`).

`--peer transformers` runs the same clients, prompts and concurrencies against `transformers serve`
too, one server after the other, both on one transformers-saved Kimi Linear checkpoint (the tiny
random-weight model of bench_serve_offline.py, with a byte-level tokenizer.json that both servers
read: one character, one token) and writes serve_online_vs_transformers.json with each side's
output tokens/s and TPOT and their ratio. transformers has no `ignore_eos`: the checkpoint's
generation config sets `min_new_tokens` to the output length instead, so both produce exactly
`--output-len` tokens. Both servers get the same torch threads (`--threads`, default all cores but
one). `--peer-args` passes options to `transformers serve` (e.g. "--continuous-batching").

Prints a markdown table and writes bench/results/serve_online.json atomically. Absolute times
are this machine's CPU, shared with other work; read them as a profile of the server, not a
hardware figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import exit_on_sigterm, markdown_table, result_name, write_result  # noqa: E402

# What `deltamoe serve` picks without --threads once OMP_NUM_THREADS is removed from its environment.
SERVER_DEFAULT_THREADS = max(1, (os.cpu_count() or 1) - 1)

ROOT = Path(__file__).resolve().parent.parent
MODEL_NAME = "bench"


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, port: int, max_model_len: int, max_num_seqs: int, threads: int | None,
                 compile_decode: bool = False, async_scheduling: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "deltamoe.cli", "serve", model, "--port", str(port), "--served-model-name",
           MODEL_NAME, "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
           "--log-level", "warning"]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    if compile_decode:
        cmd.append("--compile-decode")
    if async_scheduling:
        cmd.append("--async-scheduling")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the server's own default
    return subprocess.Popen(cmd, cwd=ROOT, env=env)


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"`deltamoe serve` exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"`deltamoe serve` was not healthy within {timeout:.0f} s")


def start_peer(folder: Path, port: int, threads: int, extra: list[str]) -> subprocess.Popen:
    """`transformers serve` on the same checkpoint, its torch threads set like deltamoe's."""
    cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(folder), "--port", str(port),
           "--device", "cpu", *extra]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    return subprocess.Popen(cmd, cwd=ROOT, env=env)


def save_shared_checkpoint(folder: Path, output_len: int) -> None:
    """The tiny Kimi Linear of bench_serve_offline.py, saved by transformers, with a tokenizer.json whose
    ids are the raw bytes (0..255; specials 256..258 as in the config) for deltamoe and transformers alike."""
    from bench_serve_offline import hf_model
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from deltamoe.tokenizers.hf import byte_decoder

    model = hf_model()
    model.generation_config.min_new_tokens = output_len  # transformers has no ignore_eos
    model.save_pretrained(folder)
    tok = Tokenizer(models.BPE(vocab=dict(byte_decoder()), merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|bos|>", "<|eos|>", "<|pad|>"])  # 256, 257, 258: the config's bos/eos/pad
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>",
        "pad_token": "<|pad|>"}))


async def one_request(http: httpx.AsyncClient, prompt: str, output_len: int, model: str = MODEL_NAME) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if model == MODEL_NAME:  # transformers rejects the field (its checkpoint's min_new_tokens does the same)
        body["ignore_eos"] = True
    start = time.perf_counter()
    last, ttft, itl, tokens = start, 0.0, [], 0
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return RequestResult(False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    if ttft == 0.0:
                        ttft = now - start
                    else:
                        itl.append(now - last)
                    last = now
        e2e = time.perf_counter() - start
    except httpx.HTTPError as e:
        return RequestResult(False, error=repr(e))
    if tokens != output_len:
        return RequestResult(False, error=f"{tokens} output tokens, expected {output_len}")
    return RequestResult(True, ttft=ttft, e2e=e2e, output_tokens=tokens, itl=itl)


async def run_concurrency(url: str, concurrency: int, prompts: list[str], output_len: int,
                          model: str = MODEL_NAME) -> tuple[list[RequestResult], float]:
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        async def client() -> None:
            while not queue.empty():
                results.append(await one_request(http, queue.get_nowait(), output_len, model))

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return results, time.perf_counter() - start


def summarize(concurrency: int, results: list[RequestResult], duration: float, input_len: int) -> dict:
    ok = [r for r in results if r.ok]

    def ms(values: list[float], q: float) -> float:
        return round(float(np.percentile(values, q)) * 1e3, 2) if values else float("nan")

    ttft = [r.ttft for r in ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    e2e = [r.e2e for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    row = {"concurrency": concurrency, "completed": len(ok), "failed": len(results) - len(ok),
           "duration_s": round(duration, 3), "request_throughput": round(len(ok) / duration, 3),
           "output_throughput": round(out_tokens / duration, 2),
           "total_token_throughput": round((out_tokens + input_len * len(ok)) / duration, 2)}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2e)):
        row[f"mean_{name}_ms"] = round(float(np.mean(values)) * 1e3, 2) if values else float("nan")
        row[f"p50_{name}_ms"] = ms(values, 50)
        row[f"p99_{name}_ms"] = ms(values, 99)
    row["errors"] = sorted({r.error for r in results if not r.ok})[:5]
    return row


def random_prompt(rng: random.Random, length: int) -> str:
    # Printable ASCII: with the byte tokenizer one character is exactly one prompt token.
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(length))


def measure(proc: subprocess.Popen, url: str, model: str, prompt_sets: list[list[str]], concurrency: list[int],
            args: argparse.Namespace, health_timeout: float) -> list[dict]:
    """Every concurrency against one started server (stopped at the end, whatever happens)."""
    rows = []
    try:
        wait_healthy(proc, url, timeout=health_timeout)
        asyncio.run(run_concurrency(url, 1, prompt_sets[0][:1], args.output_len, model))  # warm-up
        for c, prompts in zip(concurrency, prompt_sets):
            results, duration = asyncio.run(run_concurrency(url, c, prompts, args.output_len, model))
            rows.append(summarize(c, results, duration, args.input_len))
            print(f"{model} at concurrency {c}: {rows[-1]['completed']} done, {rows[-1]['failed']} failed in "
                  f"{duration:.1f} s", file=sys.stderr)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="Checkpoint folder or preset (presets get random weights); "
                    "ignored with --peer (both servers share a transformers-saved Kimi Linear).")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompts-per-client", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of the server (default: the server's own, all cores but one)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile-decode", action="store_true",
                    help="serve with compiled decode steps; writes serve_online_compiled.json")
    ap.add_argument("--async-scheduling", action="store_true", help="serve with one-step-ahead scheduling")
    ap.add_argument("--peer", choices=["none", "transformers"], default="none",
                    help="also run `transformers serve` on the same checkpoint; writes "
                         "serve_online_vs_transformers.json")
    ap.add_argument("--peer-args", default="", help="extra options for `transformers serve`")
    ap.add_argument("--quick", action="store_true", help="2 requests per client, 32 in / 16 out tokens, writes serve_online_quick.json")
    args = ap.parse_args()
    if args.quick:
        args.prompts_per_client, args.input_len, args.output_len = 2, 32, 16

    rng = random.Random(args.seed)
    prompt_sets = [[random_prompt(rng, args.input_len) for _ in range(c * args.prompts_per_client)]
                   for c in args.concurrency]
    max_len = args.input_len + args.output_len + 8
    health_timeout = 1200.0 if args.compile_decode else 300.0  # compiling takes minutes
    threads = args.threads or SERVER_DEFAULT_THREADS
    peer_rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if args.peer == "transformers":
            model = str(Path(tmp) / "kimi-linear-tiny")
            save_shared_checkpoint(Path(model), args.output_len)
        port = free_port()
        proc = start_server(model, port, max_len, max(args.concurrency), args.threads, args.compile_decode,
                            args.async_scheduling)
        rows = measure(proc, f"http://127.0.0.1:{port}", MODEL_NAME, prompt_sets, args.concurrency, args,
                       health_timeout)
        if args.peer == "transformers":
            port = free_port()
            peer = start_peer(Path(model), port, threads, args.peer_args.split())
            peer_rows = measure(peer, f"http://127.0.0.1:{port}", model, prompt_sets, args.concurrency, args, 300.0)

    config = {"model": "Kimi Linear tiny (transformers-saved)" if args.peer == "transformers" else args.model,
              "input_len": args.input_len, "output_len": args.output_len,
              "prompts_per_client": args.prompts_per_client, "server_threads": threads, "quick": args.quick,
              "compile_decode": args.compile_decode, "async_scheduling": args.async_scheduling,
              "command": " ".join(["bench/bench_serve_online.py", *sys.argv[1:]])}
    headers = ["clients", "done", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms",
               "ITL p50 ms", "ITL p99 ms", "E2EL p50 ms"]

    def table(runs: list[dict]) -> str:
        return markdown_table(headers, [[r["concurrency"], f"{r['completed']}/{r['completed'] + r['failed']}",
                                         r["request_throughput"], r["output_throughput"], r["p50_ttft_ms"],
                                         r["p99_ttft_ms"], r["p50_tpot_ms"], r["p99_tpot_ms"], r["p50_itl_ms"],
                                         r["p99_itl_ms"], r["p50_e2el_ms"]] for r in runs])

    flags = "".join(f" --{k.replace('_', '-')}" for k in ("compile_decode", "async_scheduling") if getattr(args, k))
    print(f"\n`deltamoe serve {config['model']}{flags}`, {args.input_len} in / {args.output_len} out tokens, "
          f"{args.prompts_per_client} requests per client\n")
    print(table(rows))
    if args.peer == "transformers":
        ratios = {str(a["concurrency"]): {"output_throughput": a["output_throughput"] / b["output_throughput"],
                                          "p50_tpot": b["p50_tpot_ms"] / a["p50_tpot_ms"]}
                  for a, b in zip(rows, peer_rows) if a["completed"] and b["completed"]}
        config["peer"] = {"name": "transformers serve", "args": args.peer_args,
                          "note": "KDA through transformers' reference PyTorch path (no flash-linear-attention on CPU)"}
        path = write_result(result_name("serve_online_vs_transformers", args.quick), {
            "config": config, "runs": rows, "peer_runs": peer_rows, "ratio_vs_peer": ratios,
            "target": {"output_throughput_ratio_at": 8, "ratio": 10.0}})
        print(f"\n`transformers serve` on the same checkpoint {args.peer_args}\n")
        print(table(peer_rows))
        print("\n" + markdown_table(["clients", "output tok/s vs transformers", "TPOT p50: transformers / deltamoe"],
                                    [[c, f"{r['output_throughput']:.2f}x", f"{r['p50_tpot']:.2f}x"]
                                     for c, r in ratios.items()]))
    else:
        name = "serve_online_compiled" if args.compile_decode else "serve_online"
        path = write_result(result_name(name, args.quick), {"config": config, "runs": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    exit_on_sigterm()
    main()

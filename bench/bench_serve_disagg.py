"""Prefill/decode disaggregation vs one colocated server, side by side in one run, same load.

    .venv/bin/python bench/bench_serve_disagg.py [--quick] [--model tiny] [--duration 40] [--baseline packed]

Load (the same for both setups): `--chats` clients each stream short completions back to back
(`--chat-len` prompt tokens, `--chat-output` tokens), while a long prompt (`--long-len` tokens,
`--long-output` tokens) arrives every `--long-every` seconds (default: 3x the colocated server's
time to prefill one alone, measured first, so that neither setup's prefill queue grows without
bound over the run: an overloaded server measures its queue, not its steps). Every server runs
the engine's default chunked-prefill budget (`--max-num-batched-tokens`) unless `--chunk` is
given. In one server the long prompts' prefill chunks share steps with the chats' decodes, so a
chat stalls for a whole chunk; with
`deltamoe router` + `--role prefill` + `--role decode` the decode server never computes a long
prompt: it waits on the hand-off (Mooncake, TCP) and keeps decoding. The chats' prompts are
below `--min-hand-off-tokens` (default 256): the decode server computes them itself.

Reported: the short chats' TPOT p50/p99 (per request: (end - first token) / (tokens - 1)) and
inter-token gaps p50/p99 (every gap between streamed tokens, where one stall shows whole), their
TTFT, the long prompts' TTFT; each setup gets one long prompt and one chat as warm-up first. Hand-off bytes and
throughput (under the load, and for `--idle-handoffs` prompts of each `--idle-lens` length sent
one at a time afterwards, on pools the load left scattered) next to the Mooncake transfer
engine's raw TCP write throughput measured in the same run on the same machine, from this
process into a receiver process, for one write of each idle size: back to back (the goal's
reference) and isolated (after `ISOLATED_IDLE_S` of idle transport, as a hand-off's write follows a
prefill); both over the engine's persistent connection lanes, as the servers write (the
transport's default), and back to back once more over a new connection per write (the engine's
own default: "no lanes"); and isolated once more with a completion notice, timed until the receiver
(polling for notices as a decode server does) has it ("raw + notice"): a bare write tells only its
sender that the bytes arrived, a hand-off must also tell its receiver, so this is the transfer
engine's floor for any hand-off (a row beside the goal's reference, not a new definition of it).

Hand-off throughput = bytes handed off / the time from the prefill's finish (the prefill server's
engine ends the request's N-1 tokens) to the decode side having the request's cache and state in
its pools (its scatter done): `kv_transfer_seconds_finish_to_cache` of the decode server, timed on
the host's one monotonic clock. It covers the wait for a hand-off thread, the gather, the write,
the completion notice (the transfer engine's notify after the last write, polled by the decode
server; the prefill server's HTTP answer when it comes first) and the scatter, and nothing of the
prefill's compute. Printed beside it: the copy path alone (gather + write on the prefill side,
`kv_transfer_seconds_sent`, plus the scatter, `kv_transfer_seconds_unpacking`: the definition
before the notice was timed), split into gather / write / scatter (the write goes out in chunks
while the gather runs: "write" is the part that does not overlap it), the wait for the hand-off
thread (queued), the notice (from the prefill thread's return from its last write to the scatter's
start: below zero when the notice overtakes that return) and how many hand-offs landed on the
notice rather than on the HTTP answer, and for a direct hand-off that the engine thread started,
its write by phase (`kv_transfer_seconds_{submitting,transferring,notifying}`: the engine thread's
submission, the batch on the wire until the hand-off thread saw it complete, the notice's own
write; zero for the others), and the share of hand-offs the engine thread wrote itself in one
synchronous call with their notice (`kv_transfer_written_inline`) with that call's time;
goal: >= 50 % of raw (back to back) at every size. Then, sustained: for each `--in-flight` count N
(default 4 and 8), N prompts of each `--idle-lens` length at once, `--idle-handoffs` rounds: bytes /
the decode server's `kv_transfer_seconds_busy` (the seconds during which at least one hand-off was on
its way, overlaps counted once), next to the same raw write, and next to N raw writes of one hand-off's
size each, back to back and timed together (the same total bytes: "N in flight vs raw back to back").
The idle table also shows the segments of a direct hand-off (`kv_transfer_segments_direct` / hand-offs).
`--baseline DIR|packed|no-lanes|no-inline|no-markers` starts a second
1P+1D stack (from another checkout of the code, or this one with every hand-off packed, or this one
over a new Mooncake TCP connection per write instead of the connection lanes, or this one with the
prefill engine thread's own synchronous write turned off, or this one with the transfer engine's
notice instead of completion markers) and sends it every
other one-at-a-time hand-off: this / baseline per size, under the same load.
`--handoff-only` runs the idle hand-offs and
the raw writes without the colocated server and the mixed load (a minute instead of several).
Also the bytes a hand-off moves for Kimi K3 (the planner's cost formulas) at a few prompt
lengths beside this run's tiny model (measured and predicted).

`--async-scheduling` runs every server (the colocated one, prefill and decode) with one-step-ahead
scheduling (step N+1 scheduled while step N runs) and writes `serve_disagg_async.json`, a row of
its own beside the one-step run's.

Resources: the colocated server gets `--colocated-threads` torch threads (default 2), each
P/D server 1, so both setups use the same number of cores. Absolute times are this shared
CPU's; read the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_serve_online import free_port, wait_healthy  # noqa: E402
from common import exit_on_sigterm, markdown_table, result_name, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL_NAME = "bench"
TARGETS = {"p99_chat_tpot_colocated_over_disagg": 2.0, "handoff_over_raw_tcp": 0.5}
ISOLATED_IDLE_S = 0.05  # the transport's idle time before each "isolated" raw write


def start(args: list[str], port: int, root: Path = ROOT, env_extra: dict[str, str] | None = None
          ) -> tuple[subprocess.Popen, str]:
    """`deltamoe ARGS` on `port`, from the code in `root` (this checkout, or `--baseline`'s), with
    `env_extra` in its environment."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | {"GLOG_minloglevel": "2"}
    env |= env_extra or {}
    if root != ROOT:
        env["PYTHONPATH"] = str(root)
    proc = subprocess.Popen([sys.executable, "-m", "deltamoe", *args, "--port", str(port), "--log-level", "warning"],
                            cwd=root, env=env, stdout=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


def metric(url: str, name: str) -> float:
    """A metric's value; a counter by its `_total` name (or the bare one older servers exported)."""
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "_total "):
            return float(line.split()[-1])
    raise KeyError(name)


async def stream_one(http: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, last, tokens, gaps = None, None, 0, []
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"ok": False, "error": f"HTTP {r.status_code}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"ok": False, "error": chunk["error"]["message"][:200]}
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"]:
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
    end = time.perf_counter()
    if tokens != max_tokens or first is None:
        return {"ok": False, "error": f"{tokens} tokens, expected {max_tokens}"}
    return {"ok": True, "ttft": first - start, "tpot": (end - first) / max(1, tokens - 1), "gaps": gaps}


async def mixed_load(url: str, args) -> dict:
    rng = random.Random(args.seed)
    chats, longs = [], []
    stop = time.perf_counter() + args.duration
    limits = httpx.Limits(max_connections=args.chats + 16)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        async def chat_client():
            while time.perf_counter() < stop:
                prompt = [rng.randrange(32, 127) for _ in range(args.chat_len)]
                chats.append(await stream_one(http, prompt, args.chat_output))

        async def long_arrivals():
            tasks = []
            await asyncio.sleep(args.long_every / 2)
            while time.perf_counter() < stop:
                prompt = [rng.randrange(32, 127) for _ in range(args.long_len)]
                tasks.append(asyncio.create_task(stream_one(http, prompt, args.long_output)))
                await asyncio.sleep(args.long_every)
            longs.extend(await asyncio.gather(*tasks))

        await asyncio.gather(long_arrivals(), *(chat_client() for _ in range(args.chats)))

    def pct(rows, key, q):
        values = [r[key] for r in rows if r["ok"]]
        return round(float(np.percentile(values, q)) * 1e3, 2) if values else float("nan")

    gaps = [g for r in chats if r["ok"] for g in r["gaps"]]
    gap = {f"chat_itl_p{q}_ms": round(float(np.percentile(gaps, q)) * 1e3, 2) if gaps else float("nan")
           for q in (50, 99)}
    return {"chats_ok": sum(r["ok"] for r in chats), "chats_failed": sum(not r["ok"] for r in chats), **gap,
            "longs_ok": sum(r["ok"] for r in longs), "longs_failed": sum(not r["ok"] for r in longs),
            "chat_tpot_p50_ms": pct(chats, "tpot", 50), "chat_tpot_p99_ms": pct(chats, "tpot", 99),
            "chat_ttft_p50_ms": pct(chats, "ttft", 50), "chat_ttft_p99_ms": pct(chats, "ttft", 99),
            "long_ttft_p50_ms": pct(longs, "ttft", 50), "long_ttft_p99_ms": pct(longs, "ttft", 99),
            "errors": sorted({r["error"] for r in chats + longs if not r["ok"]})[:5]}


async def idle_handoffs(url: str, args, length: int, count: int | None = None, in_flight: int = 1) -> None:
    """`count` (default `--idle-handoffs`) prompts of `length` tokens, `in_flight` at a time (1: one at a
    time on idle servers, the hand-off without CPU contention)."""
    rng = random.Random(args.seed + length)
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        for _ in range(count or args.idle_handoffs):
            prompts = [[rng.randrange(32, 127) for _ in range(length)] for _ in range(in_flight)]
            for result in await asyncio.gather(*(stream_one(http, p, 1) for p in prompts)):
                if not result["ok"]:
                    raise RuntimeError(f"an idle hand-off of {length} tokens failed: {result['error']}")


def metric_or_nan(url: str, name: str) -> float:
    """`metric`, NaN where that server's code does not count it (a `--baseline` checkout)."""
    try:
        return metric(url, name)
    except KeyError:
        return float("nan")


def handoff_totals(p_url: str, d_url: str) -> dict[str, float]:
    """The hand-off counters: bytes, and seconds = the prefill side's gather + write plus the
    decode side's scatter; and those three parts on their own. `busy`: seconds during which at least
    one hand-off was on its way (NaN from a baseline that does not count them)."""
    try:
        busy = metric(d_url, "deltamoe_engine_kv_transfer_seconds_busy")
    except KeyError:
        busy = float("nan")
    return {"busy": busy, "count": metric(p_url, "deltamoe_engine_kv_transfer_sent"),
            "segments": metric_or_nan(p_url, "deltamoe_engine_kv_transfer_segments_direct"),
            "bytes": metric(p_url, "deltamoe_engine_kv_transfer_bytes_sent"),
            "unpacked": metric(p_url, "deltamoe_engine_kv_transfer_unpacked"),
            "writes": metric(p_url, "deltamoe_engine_kv_transfer_writes"),
            "timed": metric(d_url, "deltamoe_engine_kv_transfer_timed"),
            "seconds": metric(d_url, "deltamoe_engine_kv_transfer_seconds_finish_to_cache"),
            "copy": metric(p_url, "deltamoe_engine_kv_transfer_seconds_sent")
            + metric(d_url, "deltamoe_engine_kv_transfer_seconds_unpacking"),
            "gather": metric(p_url, "deltamoe_engine_kv_transfer_seconds_packing"),
            "write": metric(p_url, "deltamoe_engine_kv_transfer_seconds_writing"),
            "queued": metric(p_url, "deltamoe_engine_kv_transfer_seconds_queued"),
            "notice": metric(d_url, "deltamoe_engine_kv_transfer_seconds_notice"),
            "on_notice": metric(d_url, "deltamoe_engine_kv_transfer_landed_on_notice"),
            "scatter": metric(d_url, "deltamoe_engine_kv_transfer_seconds_unpacking"),
            **{part: metric_or_nan(p_url, f"deltamoe_engine_kv_transfer_seconds_{part}")
               for part in ("submitting", "transferring", "notifying", "inline")},
            "written_inline": metric_or_nan(p_url, "deltamoe_engine_kv_transfer_written_inline")}


def serve_args(args, threads: int) -> list[str]:
    chunk = [] if args.chunk is None else ["--max-num-batched-tokens", str(args.chunk)]
    overlap = ["--async-scheduling"] if args.async_scheduling else []
    return ["serve", args.model, "--served-model-name", MODEL_NAME, "--threads", str(threads), "--cache-memory",
            args.cache_memory, *chunk, "--max-model-len", str(max(args.long_len, *args.idle_lens) + args.long_output + 8),
            *overlap, *(["--no-compile"] if args.no_compile else [])]


async def warm_up(url: str, args) -> float:
    """One long prompt alone, then one chat; the long prompt's time to first token (seconds)."""
    rng = random.Random(args.seed - 1)
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        long = await stream_one(http, [rng.randrange(32, 127) for _ in range(args.long_len)], 1)
        chat = await stream_one(http, [rng.randrange(32, 127) for _ in range(args.chat_len)], args.chat_output)
    if not (long["ok"] and chat["ok"]):
        raise RuntimeError(f"warm-up failed: {long.get('error') or chat.get('error')}")
    return long["ttft"]


def run_colocated(args) -> dict:
    proc, url = start(serve_args(args, args.colocated_threads), free_port())
    try:
        wait_healthy(proc, url)
        alone = asyncio.run(warm_up(url, args))
        if args.long_every is None:
            args.long_every = round(3 * alone, 2)
        return asyncio.run(mixed_load(url, args)) | {"long_prefill_alone_ms": round(alone * 1e3, 1)}
    finally:
        proc.terminate()
        proc.wait(30)


def start_stack(args, root: Path = ROOT, prefill_args: tuple[str, ...] = (), env_extra: dict[str, str] | None = None,
                decode_args: tuple[str, ...] = ()) -> tuple[list[subprocess.Popen], str, str, str]:
    """1 prefill + 1 decode server and a router, from the code in `root`, the prefill and decode servers
    with `prefill_args` and `decode_args` added, both with `env_extra`: (processes, prefill, decode and
    router URLs)."""
    role = ["--kv-transfer", "mooncake", "--kv-transfer-timeout", "600"]  # a long prompt queues behind others
    prefill, p_url = start(serve_args(args, 1) + ["--role", "prefill", *role, *prefill_args], free_port(), root,
                           env_extra)
    decode, d_url = start(serve_args(args, 1) + ["--role", "decode", *role, "--min-hand-off-tokens",
                                                  str(args.min_hand_off_tokens), *decode_args], free_port(), root,
                           env_extra)
    procs = [prefill, decode]
    try:
        wait_healthy(prefill, p_url)
        wait_healthy(decode, d_url)
        router, r_url = start(["router", "--prefill", p_url, "--decode", d_url, "--read-timeout", "600"], free_port(),
                              root)
        procs.append(router)
        wait_healthy(router, r_url, 60)
    except BaseException:
        stop(procs)
        raise
    return procs, p_url, d_url, r_url


def baseline_stack(args) -> tuple[list[subprocess.Popen], str, str, str]:
    """`--baseline`'s stack: this checkout with every hand-off packed (`packed`), or over a new Mooncake
    connection per write (`no-lanes`), or with every direct hand-off written from a hand-off thread
    rather than by the prefill engine thread itself (`no-inline`), or with the decode server told of each
    hand-off's end by the transfer engine's notice instead of a completion marker (`no-markers`), or the
    checkout in that directory."""
    if args.baseline == "packed":
        return start_stack(args, prefill_args=("--kv-transfer-direct-max-segments", "-1"))
    if args.baseline == "no-inline":
        return start_stack(args, prefill_args=("--kv-transfer-inline-write", "0"))
    if args.baseline == "no-markers":
        return start_stack(args, decode_args=("--no-kv-transfer-markers",))
    if args.baseline == "no-lanes":
        from deltamoe.serve.kv_transfer.mooncake_transport import CONNECTION_LANES

        return start_stack(args, env_extra={CONNECTION_LANES: "0"})
    return start_stack(args, Path(args.baseline))


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in reversed(procs):
        proc.terminate()
    for proc in procs:
        proc.wait(30)


def per_handoff(r: dict) -> dict:
    """One size's counters (deltas over its hand-offs) as per-hand-off figures."""
    return {"prompt_tokens": r["prompt_tokens"], "bytes_per_handoff": r["bytes"] / r["count"],
            "seconds_per_handoff": r["seconds"] / r["count"], "unpacked": r["unpacked"],
            "writes_per_handoff": r["writes"] / r["count"], "landed_on_notice": r["on_notice"] / r["count"],
            "segments_per_handoff": r["segments"] / r["unpacked"] if r["unpacked"] else float("nan"),
            "written_inline": r["written_inline"] / r["count"],
            **{f"{part}_seconds": r[part] / r["count"]
               for part in ("copy", "queued", "gather", "write", "notice", "scatter", "submitting", "transferring",
                            "notifying", "inline")},
            "gb_s": r["bytes"] / r["seconds"] / 1e9, "copy_gb_s": r["bytes"] / r["copy"] / 1e9}


def run_disaggregated(args) -> tuple[dict, dict]:
    procs, p_url, d_url, r_url = start_stack(args)
    stacks = {"this": (p_url, d_url, r_url)}
    try:
        if args.baseline is not None:  # started after this checkout's stack: it warms up meanwhile
            base_procs, *base_urls = baseline_stack(args)
            procs += base_procs
            stacks["baseline"] = tuple(base_urls)
        alone = asyncio.run(warm_up(r_url, args))
        for name, (_, _, url) in stacks.items():
            if name != "this":
                asyncio.run(warm_up(url, args))
        warm = handoff_totals(p_url, d_url)
        row = {"chats_ok": 0, "longs_ok": 0} if args.handoff_only else asyncio.run(mixed_load(r_url, args))
        row |= {"long_prefill_alone_ms": round(alone * 1e3, 1)}
        loaded = handoff_totals(p_url, d_url)
        if loaded["timed"] != loaded["count"]:
            raise RuntimeError(f"{loaded['count'] - loaded['timed']:.0f} hand-offs were not timed (the servers must "
                               "share this host's monotonic clock)")
        loaded = {k: loaded[k] - warm[k] for k in loaded}  # the load's hand-offs, not the warm-up's
        # One at a time; with a baseline, one hand-off on each stack in turn (the machine's load hits both alike).
        idle = {name: [] for name in stacks}
        for length in args.idle_lens:
            before = {name: handoff_totals(p, d) for name, (p, d, _) in stacks.items()}
            for _ in range(args.idle_handoffs):
                for name, (_, _, url) in stacks.items():
                    asyncio.run(idle_handoffs(url, args, length, count=1))
            for name, (p, d, _) in stacks.items():
                after = handoff_totals(p, d)
                delta = {k: after[k] - before[name][k] for k in after}
                idle[name].append(per_handoff({"prompt_tokens": length, **delta}))
        # Several in flight: `--in-flight` prompts at once, `--idle-handoffs` times; bytes over the seconds
        # during which at least one of them was on its way (this checkout's stack only).
        sustained = []
        for in_flight, length in ((n, length) for n in args.in_flight if n > 1 for length in args.idle_lens):
            before = handoff_totals(p_url, d_url)
            asyncio.run(idle_handoffs(r_url, args, length, in_flight=in_flight))
            after = handoff_totals(p_url, d_url)
            d = {k: after[k] - before[k] for k in after}
            sustained.append({"prompt_tokens": length, "in_flight": in_flight, "handoffs": d["count"],
                              "bytes": d["bytes"], "busy_seconds": d["busy"], "gb_s": d["bytes"] / d["busy"] / 1e9,
                              "one_at_a_time_gb_s": d["bytes"] / d["seconds"] / 1e9})
        sent = metric(p_url, "deltamoe_engine_kv_transfer_sent")
        hand_off = {"handoffs": sent, "failures": metric(p_url, "deltamoe_engine_kv_transfer_failures")
                    + metric(d_url, "deltamoe_engine_kv_transfer_failures"),
                    "bytes_total": metric(p_url, "deltamoe_engine_kv_transfer_bytes_sent"),
                    "write_seconds_total": metric(p_url, "deltamoe_engine_kv_transfer_seconds_sent"),
                    "handoff_seconds_total": metric(d_url, "deltamoe_engine_kv_transfer_seconds_received"),
                    "retries": metric(r_url, "deltamoe_router_retries_total"),
                    "loaded_gb_s": loaded["bytes"] / loaded["seconds"] / 1e9 if loaded["count"] else float("nan"),
                    "unpacked": metric(p_url, "deltamoe_engine_kv_transfer_unpacked"),
                    "idle": idle["this"], "sustained": sustained}
        if "baseline" in idle:
            hand_off["baseline_idle"] = idle["baseline"]
        return row, hand_off
    finally:
        stop(procs)


RECEIVER = """
import json, sys, threading, time, torch
from deltamoe.serve.kv_transfer.mooncake_transport import MooncakeTransport
from deltamoe.serve.kv_transfer.notices import POLL_S
t = MooncakeTransport(); dst = torch.zeros(int(sys.argv[1]) // 4 + 1); t.register(dst.data_ptr(), dst.nbytes)
board = torch.zeros(1, dtype=torch.int64); t.register(board.data_ptr(), board.nbytes)  # a completion marker's word
print(json.dumps([t.session, dst.data_ptr(), board.data_ptr()]), flush=True)
def watch():  # as a decode server's watcher polls: each notice's or marker's arrival on this host's clock
    last = 0
    while True:
        for msg in t.notices():
            print(msg, time.monotonic(), flush=True)
        if (value := int(board[0])) != last:
            last = value
            print(f"marker-{value}", time.monotonic(), flush=True)
        time.sleep(POLL_S)
threading.Thread(target=watch, daemon=True).start()
sys.stdin.read()
"""


def raw_tcp_throughput(sizes: list[tuple[int, int]], repeats: int = 9, idle_s: float = 0.0,
                       lanes: bool = True, notice: bool = False, writes: int = 1, marker: bool = False) -> list[float]:
    """Bytes per second of Mooncake TCP writes from this process into another's registered memory (a
    receiver process, as between two servers): for each (total bytes, segments), the total split
    into that many equal segments in one `MooncakeTransport.write` (the engine's own synchronous
    write, `transfer_sync_write` or `batch_transfer_sync_write`, plus a clock check), median of
    `repeats`. `idle_s` > 0: each write after that long with the transport idle, as a hand-off's
    write is (it follows a prefill), instead of back to back with warm threads and caches. `lanes`:
    over the engine's persistent connections, as the servers write (the transport's default), else
    a new connection per write (the engine's own default). `notice`: each write carries a completion
    notice (the engine sends it once the write completed, as a hand-off's last write does) and is timed
    until the receiver, polling for notices as a decode server does, has it: what a receiver needs to
    know that the bytes are there, which a bare write does not tell it. `marker`: the same, told by a
    completion marker instead (`markers.py`: an 8-byte write into the receiver's memory once the write
    completed, which it polls), as hand-offs are. `writes` > 1: each sample is that many such writes back
    to back, timed together (bytes: `writes` x the total)."""
    import torch

    from deltamoe.serve.kv_transfer.markers import MarkerSources
    from deltamoe.serve.kv_transfer.mooncake_transport import MooncakeTransport
    from deltamoe.serve.kv_transfer.pools import Segment

    largest = max(total for total, _ in sizes)
    env = dict(os.environ, GLOG_minloglevel="2", PYTHONPATH=str(ROOT))
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER, str(largest)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    rates = []
    try:
        session, address, board = json.loads(receiver.stdout.readline())
        sender = with_lanes(lanes, MooncakeTransport)
        src, sources, values = torch.rand(largest // 4 + 1), MarkerSources(1), itertools.count(1)
        sender.register(src.data_ptr(), src.nbytes)
        sender.register(sources.buffer.data_ptr(), sources.buffer.nbytes)
        sender.write(session, [Segment(src.data_ptr(), address, 64)], 30.0)  # the handshake, not timed
        for total, count in sizes:
            size = total // count
            segments = [Segment(src.data_ptr() + i * size, address + i * size, size) for i in range(count)]
            times = []
            for i in range(repeats):
                time.sleep(idle_s)
                t0, key = time.monotonic(), f"raw-{total}-{i}"
                for _ in range(writes - 1):
                    sender.write(session, segments, 30.0)
                if marker:
                    value = next(values)
                    key = f"marker-{value}"
                    with sources.segments([(board, value)], packed=False) as markers:
                        sender.write(session, segments, 30.0, markers=markers)
                else:
                    sender.write(session, segments, 30.0, notice=key if notice else None)
                if notice or marker:
                    seen, at = receiver.stdout.readline().split()
                    if seen != key:
                        raise RuntimeError(f"the receiver saw notice {seen!r}, expected {key!r}")
                    times.append(float(at) - t0)
                else:
                    times.append(time.monotonic() - t0)
            rates.append(writes * size * count / statistics.median(times))
        sender.close()
    finally:
        receiver.stdin.close()
        receiver.wait(10)
    return rates


def with_lanes(lanes: bool, make):
    """`make()` with the Mooncake engine's connection lanes on or off (read by its constructor)."""
    from deltamoe.serve.kv_transfer.mooncake_transport import CONNECTION_LANES

    before = os.environ.get(CONNECTION_LANES)
    os.environ[CONNECTION_LANES] = "1" if lanes else "0"
    try:
        return make()
    finally:
        if before is None:
            os.environ.pop(CONNECTION_LANES)
        else:
            os.environ[CONNECTION_LANES] = before


def bytes_per_handoff(args, disagg: dict, measured_total: float) -> list[dict]:
    """Hand-off bytes for N prompt tokens: (N-1) tokens of latent + indexer rows, plus one KDA state.
    For this run's model: the formula summed over the requests the run handed off, and the bytes
    the prefill server reported writing."""
    from deltamoe.config import load_preset
    from deltamoe.hf_config import load_config
    from deltamoe.plan.costs import model_costs
    from deltamoe.serve.engine.cache_layout import CacheLayout

    rows = []
    k3 = model_costs(load_preset("kimi-k3"))
    for n in (4096, 32768, 131072):
        rows.append({"model": "kimi-k3 (bf16 latent, fp32 KDA state; planner)", "prompt_tokens": n,
                     "bytes": (n - 1) * k3.kv_bytes_per_token + k3.kda_state_bytes_per_seq, "measured": None})
    layout = CacheLayout.from_config(load_config(args.model), 16)
    one = {n: (n - 1) * layout.bytes_per_token + layout.bytes_per_state_slot for n in (args.chat_len, args.long_len)}
    one |= {n: (n - 1) * layout.bytes_per_token + layout.bytes_per_state_slot for n in args.idle_lens}
    chats = disagg["chats_ok"] if disagg["chats_ok"] and args.chat_len >= args.min_hand_off_tokens else 0
    longs = disagg["longs_ok"] + 1  # and the warm-up's long prompt (its chat stays on the decode server)
    rows.append({"model": f"{args.model} (fp32; engine layout)", "prompt_tokens": args.long_len,
                 "bytes": one[args.long_len], "measured": None})
    each = args.idle_handoffs * (1 + sum(n for n in args.in_flight if n > 1))  # one at a time, then in flight
    idle = " + ".join(f"{each} x {n}" for n in args.idle_lens)
    rows.append({"model": f"{args.model}, this run: {chats} x {args.chat_len} + {longs} x {args.long_len} + {idle} "
                          "tokens",
                 "prompt_tokens": chats * args.chat_len + longs * args.long_len + each * sum(args.idle_lens),
                 "bytes": chats * one[args.chat_len] + longs * one[args.long_len]
                 + each * sum(one[n] for n in args.idle_lens), "measured": measured_total})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--duration", type=float, default=40.0)
    ap.add_argument("--chats", type=int, default=4)
    ap.add_argument("--chat-len", type=int, default=32)
    ap.add_argument("--chat-output", type=int, default=32)
    ap.add_argument("--long-len", type=int, default=1536)
    ap.add_argument("--long-output", type=int, default=2)
    ap.add_argument("--long-every", type=float, default=None,
                    help="seconds between long prompts (default: 3x the colocated server's prefill of one alone)")
    ap.add_argument("--chunk", type=int, default=None,
                    help="--max-num-batched-tokens of every server (default: the engine's default)")
    ap.add_argument("--cache-memory", default="256MiB")
    ap.add_argument("--colocated-threads", type=int, default=2)
    ap.add_argument("--min-hand-off-tokens", type=int, default=256,
                    help="the decode server computes shorter prompts itself (the chats); 2 hands off every prompt")
    ap.add_argument("--idle-handoffs", type=int, default=5, help="prompts of each --idle-lens length handed off one "
                    "at a time after the load")
    ap.add_argument("--idle-lens", type=lambda s: [int(x) for x in s.split(",")], default=[256, 1536, 6144, 8192],
                    help="prompt lengths of the idle hand-offs (tiny: 0.5 KiB a token)")
    ap.add_argument("--in-flight", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8],
                    help="then, for each of these counts and each --idle-lens length, --idle-handoffs rounds of "
                    "that many prompts at once: sustained throughput, also against as many raw writes back to "
                    "back (1: none)")
    ap.add_argument("--baseline", default=None, help="a checkout of the code to compare with (e.g. `git worktree "
                    "add /tmp/base 712a24e`), or `packed` (this checkout, every hand-off packed), or `no-lanes` "
                    "(this checkout, a new Mooncake TCP connection per write), or `no-inline` (this checkout, "
                    "--kv-transfer-inline-write 0 on the prefill server), or `no-markers` (this checkout, "
                    "--no-kv-transfer-markers on the decode server): a second 1P+1D stack from it takes "
                    "every other idle hand-off")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--async-scheduling", action="store_true", help="every server (colocated, prefill, decode) "
                    "schedules step N+1 while step N runs; writes serve_disagg_async.json")
    ap.add_argument("--quick", action="store_true", help="15 s per setup; writes serve_disagg_quick.json")
    ap.add_argument("--handoff-only", action="store_true", help="only the idle hand-offs against raw TCP (no "
                    "colocated server, no mixed load); writes serve_disagg_handoff_quick.json (no README row)")
    ap.add_argument("--no-compile", action="store_true", help="every server decodes eagerly (a loaded machine's "
                    "first start may compile past the health check's bound; hand-offs do not depend on it)")
    args = ap.parse_args()
    if args.quick:
        args.duration = 15.0

    colocated = None
    if not args.handoff_only:
        colocated = run_colocated(args)
        print("colocated:", colocated, flush=True)
    disagg, hand_off = run_disaggregated(args)
    print("disaggregated:", disagg, hand_off, flush=True)
    per_request = hand_off["bytes_total"] / max(1, hand_off["handoffs"])
    # One raw write of each idle hand-off's size, then 8 and 64 MiB in 1 and 16 writes (a K3
    # hand-off is hundreds of MiB: bandwidth, not the per-write cost, decides there).
    sweep = [(int(r["bytes_per_handoff"]), 1) for r in hand_off["idle"]]
    sweep += [(mib << 20, count) for mib in (8, 64) for count in (1, 16)]
    rates = raw_tcp_throughput(sweep)
    isolated = raw_tcp_throughput(sweep[:len(hand_off["idle"])], idle_s=ISOLATED_IDLE_S)
    no_lanes = raw_tcp_throughput(sweep[:len(hand_off["idle"])], lanes=False)
    noticed = raw_tcp_throughput(sweep[:len(hand_off["idle"])], idle_s=ISOLATED_IDLE_S, notice=True)
    marked = raw_tcp_throughput(sweep[:len(hand_off["idle"])], idle_s=ISOLATED_IDLE_S, marker=True)
    transport = [{"bytes": total, "segments": count, "gb_s": round(rate / 1e9, 3)}
                 for (total, count), rate in zip(sweep, rates)]
    for r, raw, alone in zip(hand_off["idle"], rates, isolated):
        r["raw_tcp_gb_s"], r["over_raw_tcp"] = raw / 1e9, r["gb_s"] * 1e9 / raw
        r["raw_tcp_isolated_gb_s"], r["over_raw_tcp_isolated"] = alone / 1e9, r["gb_s"] * 1e9 / alone
        r["copy_over_raw_tcp"] = r["copy_gb_s"] * 1e9 / raw
    for r, fresh in zip(hand_off["idle"], no_lanes):
        r["raw_tcp_no_lanes_gb_s"], r["over_raw_tcp_no_lanes"] = fresh / 1e9, r["gb_s"] * 1e9 / fresh
    for r, seen in zip(hand_off["idle"], noticed):
        r["raw_tcp_noticed_gb_s"], r["over_raw_tcp_noticed"] = seen / 1e9, r["gb_s"] * 1e9 / seen
    for r, seen in zip(hand_off["idle"], marked):
        r["raw_tcp_marked_gb_s"], r["over_raw_tcp_marked"] = seen / 1e9, r["gb_s"] * 1e9 / seen
    for i, r in enumerate(hand_off["sustained"]):  # the idle sizes again, for each in-flight count
        raw = rates[i % len(hand_off["idle"])]
        r["raw_tcp_gb_s"], r["over_raw_tcp"] = raw / 1e9, r["gb_s"] * 1e9 / raw
    for n in sorted({r["in_flight"] for r in hand_off["sustained"]}):  # N raw writes of a hand-off's size
        rows = [r for r in hand_off["sustained"] if r["in_flight"] == n]
        for r, raw in zip(rows, raw_tcp_throughput([(round(r["bytes"] / r["handoffs"]), 1) for r in rows], writes=n)):
            r["raw_tcp_same_bytes_gb_s"], r["over_raw_tcp_same_bytes"] = raw / 1e9, r["gb_s"] * 1e9 / raw
    for r, base in zip(hand_off["idle"], hand_off.get("baseline_idle", [])):
        r["baseline_gb_s"], r["over_baseline"] = base["gb_s"], r["gb_s"] / base["gb_s"]
    summary = {} if colocated is None else {
        "p99_chat_tpot_colocated_over_disagg": round(colocated["chat_tpot_p99_ms"] / disagg["chat_tpot_p99_ms"], 2),
        "p99_chat_itl_colocated_over_disagg": round(colocated["chat_itl_p99_ms"] / disagg["chat_itl_p99_ms"], 2),
        "handoff_under_load_gb_s": round(hand_off["loaded_gb_s"], 3)}
    summary |= {"handoff_over_raw_tcp": round(min(r["over_raw_tcp"] for r in hand_off["idle"]), 2),
                "copy_path_over_raw_tcp": round(min(r["copy_over_raw_tcp"] for r in hand_off["idle"]), 2),
                "handoff_over_raw_tcp_isolated": round(min(r["over_raw_tcp_isolated"] for r in hand_off["idle"]), 2),
                "handoff_over_raw_tcp_noticed": round(min(r["over_raw_tcp_noticed"] for r in hand_off["idle"]), 2),
                # The transport's own ceiling for a hand-off that tells its receiver, against the goal's reference.
                "raw_tcp_noticed_over_raw_tcp": round(min(r["raw_tcp_noticed_gb_s"] / r["raw_tcp_gb_s"]
                                                          for r in hand_off["idle"]), 2),
                # ... and for one told by a completion marker, as hand-offs are now.
                "handoff_over_raw_tcp_marked": round(min(r["over_raw_tcp_marked"] for r in hand_off["idle"]), 2),
                "raw_tcp_marked_over_raw_tcp": round(min(r["raw_tcp_marked_gb_s"] / r["raw_tcp_gb_s"]
                                                         for r in hand_off["idle"]), 2),
                "handoff_bytes_per_request": round(per_request),
                **({"sustained_handoff_over_raw_tcp": round(min(r["over_raw_tcp"] for r in hand_off["sustained"]), 2),
                    "in_flight_handoff_over_raw_tcp_same_bytes": round(min(r["over_raw_tcp_same_bytes"]
                                                                           for r in hand_off["sustained"]), 2)}
                   if hand_off["sustained"] else {}),
                **({"handoff_over_baseline": round(min(r["over_baseline"] for r in hand_off["idle"]), 2)}
                   if "baseline_idle" in hand_off else {}),
                "handoff_seconds_per_request": round(hand_off["handoff_seconds_total"] / max(1, hand_off["handoffs"]), 4)}
    sizes = bytes_per_handoff(args, disagg, hand_off["bytes_total"])
    print(markdown_table(["write (this process -> receiver process)", "GB/s"],
                         [[f"{t['bytes'] / 2**20:.2f} MiB in {t['segments']} segment(s)", t["gb_s"]] for t in transport]))
    print(markdown_table(["idle hand-off", "MiB", "writes", "segments (direct)", "finish -> in cache ms", "GB/s",
                          "raw TCP GB/s (back to back)", "hand-off / raw", "raw TCP GB/s (isolated)",
                          "hand-off / isolated raw", "copy path ms (gather / write / scatter)", "copy path / raw",
                          "queued / notice ms", "on notice", "direct write ms (submit / on wire / notice write)",
                          "raw TCP GB/s (no lanes)", "hand-off / raw (no lanes)",
                          "written inline (share, ms)", "raw TCP + notice GB/s (isolated, until the receiver has it)",
                          "hand-off / raw + notice", "raw TCP + marker GB/s (isolated, until the receiver has it)",
                          "hand-off / raw + marker"],
                         [[f"{r['prompt_tokens']} tokens", f"{r['bytes_per_handoff'] / 2**20:.2f}",
                           f"{r['writes_per_handoff']:.0f}", f"{r['segments_per_handoff']:.1f}",
                           f"{r['seconds_per_handoff'] * 1e3:.2f}",
                           f"{r['gb_s']:.3f}", f"{r['raw_tcp_gb_s']:.3f}", f"{r['over_raw_tcp']:.2f}",
                           f"{r['raw_tcp_isolated_gb_s']:.3f}", f"{r['over_raw_tcp_isolated']:.2f}",
                           f"{r['copy_seconds'] * 1e3:.2f} ("
                           + " / ".join(f"{r[f'{part}_seconds'] * 1e3:.2f}" for part in ("gather", "write", "scatter"))
                           + ")", f"{r['copy_over_raw_tcp']:.2f}",
                           f"{r['queued_seconds'] * 1e3:.2f} / {r['notice_seconds'] * 1e3:.2f}",
                           f"{r['landed_on_notice']:.0%}",
                           " / ".join(f"{r[f'{part}_seconds'] * 1e3:.2f}"
                                      for part in ("submitting", "transferring", "notifying")),
                           f"{r['raw_tcp_no_lanes_gb_s']:.3f}", f"{r['over_raw_tcp_no_lanes']:.2f}",
                           f"{r['written_inline']:.0%}, {r['inline_seconds'] * 1e3:.2f}",
                           f"{r['raw_tcp_noticed_gb_s']:.3f}", f"{r['over_raw_tcp_noticed']:.2f}",
                           f"{r['raw_tcp_marked_gb_s']:.3f}", f"{r['over_raw_tcp_marked']:.2f}"]
                          for r in hand_off["idle"]]))
    if hand_off["sustained"]:
        print(markdown_table(["hand-offs in flight", "MiB each", "busy ms", "GB/s (bytes / busy)",
                              "GB/s (one at a time's definition)", "raw TCP GB/s", "sustained / raw"],
                             [[f"{r['in_flight']} x {r['prompt_tokens']} tokens",
                               f"{r['bytes'] / r['handoffs'] / 2**20:.2f}",
                               f"{r['busy_seconds'] * 1e3:.1f}", f"{r['gb_s']:.3f}", f"{r['one_at_a_time_gb_s']:.3f}",
                               f"{r['raw_tcp_gb_s']:.3f}", f"{r['over_raw_tcp']:.2f}"] for r in hand_off["sustained"]]))
        print(markdown_table(["N hand-offs in flight at once vs N raw writes back to back (same total bytes)",
                              "MiB in all", "hand-offs GB/s (bytes / busy)", "raw TCP GB/s (N writes back to back)",
                              "in flight / raw"],
                             [[f"{r['in_flight']} x {r['prompt_tokens']} tokens",
                               f"{r['bytes'] / r['handoffs'] * r['in_flight'] / 2**20:.2f}", f"{r['gb_s']:.3f}",
                               f"{r['raw_tcp_same_bytes_gb_s']:.3f}",
                               f"{r['over_raw_tcp_same_bytes']:.2f}"] for r in hand_off["sustained"]]))
    if "baseline_idle" in hand_off:
        print(markdown_table(["idle hand-off", "this checkout GB/s", f"baseline ({args.baseline}) GB/s",
                              "this / baseline", "baseline finish -> in cache ms"],
                             [[f"{r['prompt_tokens']} tokens", f"{r['gb_s']:.3f}", f"{b['gb_s']:.3f}",
                               f"{r['over_baseline']:.2f}", f"{b['seconds_per_handoff'] * 1e3:.2f}"]
                              for r, b in zip(hand_off["idle"], hand_off["baseline_idle"])]))
    if colocated is not None:
        print(f"a long prompt every {args.long_every} s")
        print(markdown_table(["setup", "chat TPOT p50 ms", "chat TPOT p99 ms", "chat gap p50 ms", "chat gap p99 ms",
                              "chat TTFT p50 ms", "long TTFT p50 ms", "done (chats/longs)", "failed"],
                             [[name, r["chat_tpot_p50_ms"], r["chat_tpot_p99_ms"], r["chat_itl_p50_ms"],
                               r["chat_itl_p99_ms"], r["chat_ttft_p50_ms"],
                               r["long_ttft_p50_ms"], f"{r['chats_ok']}/{r['longs_ok']}",
                               r["chats_failed"] + r["longs_failed"]]
                              for name, r in (("colocated", colocated), ("1P+1D", disagg))]))
    print(markdown_table(list(summary), [list(summary.values())]))
    print(markdown_table(["model", "prompt tokens", "bytes per hand-off", "measured"],
                         [[s["model"], s["prompt_tokens"], f"{s['bytes'] / 2**20:.2f} MiB",
                           "" if s["measured"] is None else f"{s['measured'] / 2**20:.2f} MiB"] for s in sizes]))
    # A hand-off-only run lacks the TPOT comparison the README row shows: always a _quick (git-ignored) file.
    name = "serve_disagg_handoff_quick" if args.handoff_only else result_name(
        "serve_disagg_async" if args.async_scheduling else "serve_disagg", args.quick)
    path = write_result(name, {
        "config": vars(args), "targets": TARGETS, "colocated": colocated, "disaggregated": disagg,
        "hand_off": hand_off, "summary": summary, "bytes_per_handoff": sizes, "transport": transport})
    print(f"wrote {path}")


if __name__ == "__main__":
    exit_on_sigterm()
    main()

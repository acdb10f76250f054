"""Offline serving over worker processes: one process vs `--tp 2` vs `--ep 2`, async scheduling off and on.

    .venv/bin/python bench/bench_serve_workers.py [--quick] [--model small] [--threads 2] [--rounds 2]
        [--layouts 1-async,tp2,ep2,tp2-async,ep2-async] [--prompts 64] [--new-tokens 128]

64 prompts (16..64 tokens) x 128 new tokens, greedy, EOS ignored, on the `small` preset (K3.1-shaped
MoE, seeded random weights, the same on every rank). Each layout is `LLMEngine.from_pretrained(MODEL,
workers=WorkerConfig(tp, ep))`: `--tp 2` / `--ep 2` spawn one worker process beside this one, and
the ranks share `--threads` torch threads (each rank gets threads / ranks), so every layout uses the
same cores. Async scheduling (`EngineConfig.async_scheduling`, `--async-scheduling`) runs on each
layout too (rank 0 schedules step N+1 while the ranks run step N); its host thread takes one of the
layout's threads, as the CLI's default keeps a core for it (`serve.cli.host_thread_reserve`): one
process with async scheduling computes on `--threads` - 1 torch threads (at least 1). The requests go in at once and `step()` runs until all are done; per layout:
- output tokens/s over the whole run (best of `--rounds`);
- TPOT per request: (time of its last token - time of its first) / (tokens - 1), as the outputs
  reach the caller (with async scheduling, one step later than they are computed), mean and p50.
Every layout's greedy tokens are checked against the one-process engine's (they must be equal).
A warm-up run of 8 tokens per layout comes first. Each layout's wall time (start-up, warm-up and every
round) is printed as it ends and kept in the results, so a shorter run can be sized from a full one.
Writes bench/results/serve_workers.json (the issue's workload: every layout, 64 x 128, `small`).

Shorter runs that keep the workload's shape: `--rounds 1` (about half the time), `--layouts tp2,tp2-async`
(the one-process run always comes first: it is the reference and the ratios' base), or fewer prompts /
new tokens; any of these but `--rounds` writes serve_workers_quick.json, which the README table skips.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown_table, result_name, write_result  # noqa: E402

from deltamoe.serve.engine.config import EngineConfig  # noqa: E402
from deltamoe.serve.engine.llm_engine import LLMEngine  # noqa: E402
from deltamoe.serve.engine.sampling import SamplingParams  # noqa: E402
from deltamoe.serve.cli import host_thread_reserve  # noqa: E402
from deltamoe.serve.executor.config import WorkerConfig  # noqa: E402

# key (`--layouts`) -> (label, tp, ep, async scheduling, compiled decode); the first is the reference
# every run starts with
LAYOUTS = {"1": ("1 process", 1, 1, False, False), "1-async": ("1 process, async scheduling", 1, 1, True, False),
           "tp2": ("tp 2", 2, 1, False, False), "ep2": ("ep 2", 1, 2, False, False),
           "tp2-async": ("tp 2, async scheduling", 2, 1, True, False),
           "ep2-async": ("ep 2, async scheduling", 1, 2, True, False),
           "1-compiled": ("1 process, compiled", 1, 1, False, True), "tp2-compiled": ("tp 2, compiled", 2, 1, False, True),
           "ep2-compiled": ("ep 2, compiled", 1, 2, False, True)}
SPEC = (64, 128)  # the workload: prompts x new tokens


def chosen_layouts(keys: str | None) -> list[tuple[str, int, int, bool, bool]]:
    """The one-process reference, then the layouts `keys` names (comma-separated; None: all)."""
    names = list(LAYOUTS) if keys is None else ["1"] + [k.strip() for k in keys.split(",") if k.strip() != "1"]
    unknown = [k for k in names if k not in LAYOUTS]
    if unknown:
        raise SystemExit(f"--layouts: unknown {', '.join(unknown)} (choose from {', '.join(LAYOUTS)})")
    return [LAYOUTS[k] for k in dict.fromkeys(names)]


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 65, (n,), generator=g).tolist()
    return [torch.randint(0, 256, (k,), generator=g).tolist() for k in lengths]


def timed_run(engine: LLMEngine, prompts: list[list[int]], new: int) -> tuple[float, list[float], list[list[int]]]:
    """(seconds, TPOT per request, tokens per request): every request in at once, stepped to the end."""
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.delta_token_ids:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                tokens[out.request_id] += out.delta_token_ids
    seconds = time.perf_counter() - start
    tpot = [(last[i] - first[i]) / (len(tokens[i]) - 1) for i in ids if len(tokens[i]) > 1]
    return seconds, tpot, [tokens[i] for i in ids]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="`tiny`, 8 prompts x 16 tokens, 1 round; "
                        "writes serve_workers_quick.json")
    parser.add_argument("--model", default=None, help="preset or checkpoint (default: small; tiny with --quick)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in all, shared by a layout's ranks")
    parser.add_argument("--rounds", type=int, default=2, help="timed runs per layout; the best one counts")
    parser.add_argument("--layouts", default=None,
                        help=f"comma-separated, from {', '.join(LAYOUTS)} (default: all; 1 always runs first)")
    parser.add_argument("--prompts", type=int, default=None, help=f"requests (default {SPEC[0]}; 8 with --quick)")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help=f"tokens per request (default {SPEC[1]}; 16 with --quick)")
    args = parser.parse_args()
    model = args.model or ("tiny" if args.quick else "small")
    n = args.prompts or (8 if args.quick else SPEC[0])
    new = args.new_tokens or (16 if args.quick else SPEC[1])
    rounds = 1 if args.quick else args.rounds
    layouts = chosen_layouts(args.layouts)
    # Only the whole workload lands in the README table; anything smaller is a quick run.
    quick = args.quick or (n, new) != SPEC or len(layouts) < len(LAYOUTS)
    prompts = make_prompts(n)
    config = dict(cache_memory="2GiB", max_num_seqs=64, max_num_batched_tokens=2048)

    results: dict[str, dict] = {}
    reference: list[list[int]] | None = None
    for label, tp, ep, async_scheduling, compiled in layouts:
        # A replica divides them among its ranks; the async host thread takes one, as the CLI's default.
        torch_threads = max(1, args.threads - host_thread_reserve(async_scheduling))
        torch.set_num_threads(torch_threads)
        print(f"{label}: starting", file=sys.stderr)
        layout_start = time.perf_counter()
        engine = LLMEngine.from_pretrained(model, EngineConfig(**config, async_scheduling=async_scheduling,
                                                               compile_decode=compiled),
                                           workers=WorkerConfig(tp=tp, ep=ep))
        engine.warm_up()  # compiled decode: every graph the run meets, on every rank, as a server's start-up does
        startup = time.perf_counter() - layout_start
        try:
            timed_run(engine, prompts[:4], 8)  # warm-up
            best, best_tpot, outputs = float("inf"), [], []
            for _ in range(rounds):
                seconds, tpot, outputs = timed_run(engine, prompts, new)
                if seconds < best:
                    best, best_tpot = seconds, tpot
        finally:
            engine.shutdown()
        wall = time.perf_counter() - layout_start
        assert all(len(t) == new for t in outputs), f"{label}: a request ended early"
        reference = reference if reference is not None else outputs
        results[label] = {"tp": tp, "ep": ep, "async_scheduling": async_scheduling, "compile_decode": compiled,
                          "torch_threads": torch_threads,
                          "seconds": best,
                          "tokens_per_s": n * new / best, "mean_tpot_ms": statistics.mean(best_tpot) * 1e3,
                          "p50_tpot_ms": statistics.median(best_tpot) * 1e3,
                          "greedy_equal_to_one_process": sum(a == b for a, b in zip(outputs, reference)) / n,
                          "startup_seconds": startup, "wall_seconds": wall}
        print(f"{label}: {results[label]['tokens_per_s']:,.0f} tok/s; layout took {wall:.0f} s "
              f"(start-up {startup:.0f} s)", file=sys.stderr)

    base = results["1 process"]["tokens_per_s"]
    speedups = {f"{label} vs {base_label}": results[label]["tokens_per_s"] / results[base_label]["tokens_per_s"]
                for base_label, label in (("1 process", "1 process, async scheduling"),
                                          ("tp 2", "tp 2, async scheduling"), ("ep 2", "ep 2, async scheduling"),
                                          ("1 process", "1 process, compiled"), ("tp 2", "tp 2, compiled"),
                                          ("ep 2", "ep 2, compiled"))
                if label in results and base_label in results}
    path = write_result(result_name("serve_workers", quick), {
        "workload": {"model": model, "prompts": n, "new_tokens": new, "prompt_lengths": "16..64", "greedy": True},
        "threads": args.threads, "rounds": rounds, "layouts": results, "quick": quick,
        "speedups": speedups,
        "wall_seconds": sum(r["wall_seconds"] for r in results.values())})
    rows = [[label, f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_s'] / base:.2f}x", f"{r['mean_tpot_ms']:.1f}",
             f"{r['p50_tpot_ms']:.1f}", f"{r['greedy_equal_to_one_process']:.0%}", f"{r['wall_seconds']:.0f}"]
            for label, r in results.items()]
    print(f"\n`{model}`, {n} prompts x {new} new tokens, greedy; {args.threads} torch threads per layout\n")
    print(markdown_table(["layout", "output tokens/s", "vs 1 process", "TPOT mean ms", "TPOT p50 ms",
                          "greedy = 1 process", "layout wall s"], rows))
    for name, ratio in speedups.items():
        print(f"{name}: {ratio:.2f}x")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()

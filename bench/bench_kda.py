"""KDA prefill: deltamoe `chunk_kda` side by side with transformers' torch chunk KDA
(`chunk_kimi_delta_attention`, the fallback KimiLinear uses without FLA kernels) and the plain
token-by-token recurrence `recurrent_kda`, in one run. `chunk_kda` runs its fused C++ kernel
(`ops/kda_fused.py`: these calls record no gradient); its torch path (the kernel turned off, what
training runs) is timed beside it.

With `--compiled` also `compiled_chunk_kda` (ops/kda_compiled.py: each group of chunk steps, terms
and state pass, one torch.compile call); its first call, which compiles, is the warm-up, its CPU
seconds recorded as `compile_cpu_s`. `bench/kda_compiled_groups.py` compares its group sizes.

    .venv/bin/python bench/bench_kda.py [--quick] [--gate softplus|lower_bound] [--repeats 3] [--head-dim 128] [--threads 1] [--compiled] [--cpu-time] [--allocator steady|default]

fp32, B=1, H=8, K=V=32 (`--head-dim 128`: K=V=128, K3's head size, written to kda_k128.json), qk l2norm in kernel (as the model calls it); g comes from `kda_gate`
with transformers' KimiLinear init of A_log and dt_bias and f ~ N(0, 1). Every path is timed at
every T (no extrapolation). Prints a markdown table and writes bench/results/kda.json atomically.
Each path runs twice before the timed rounds (the first call compiles the compiled form; the
second is its first run on a warm graph and memory). Times are medians of interleaved rounds on
this machine's CPU (ms columns), with 2 threads unless `--threads N` (then written to
kda*_tN.json); the ratios are given for the medians and for the best round of each path, since
load from other processes on a shared machine only ever adds time. Every round records each
path's wall and CPU seconds and its minor page faults. `--cpu-time` reports the CPU seconds
instead of the wall clock: on a loaded machine with `--threads 1` that leaves out the time spent
waiting for a core. By default glibc malloc keeps freed memory in the process
(`process_memory.keep_freed_memory`): under its defaults the recurrence's time at K = 128
depends on what the process allocated before (transformers' temporaries, a compile), through
the pages it faults in afresh (`--allocator default` measures that; `kda_bench_agreement.py`
shows it). Read the ratios (DESIGN.md, "Performance").
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown_table, result_name, write_result  # noqa: E402
from process_memory import ALLOCATORS, keep_freed_memory, minor_faults  # noqa: E402

from deltamoe.ops import kda_fused  # noqa: E402
from deltamoe.ops.kda import chunk_kda, recurrent_kda  # noqa: E402
from deltamoe.ops.kda_compiled import compiled_chunk_kda  # noqa: E402
from deltamoe.ops.kda_gate import kda_gate  # noqa: E402

HEADS, HEAD_DIM = 8, 32
THREADS = 2  # the default: a 2-core machine's CPU
TARGET = {"speedup_vs_transformers": 1.5, "speedup_vs_recurrent": 20.0}  # at the longest T
KdaFn = Callable[[], tuple[torch.Tensor, torch.Tensor | None]]


def transformers_chunk_kda() -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    fn = hf.chunk_kimi_delta_attention
    return getattr(fn, "__wrapped__", fn)  # the raw torch function, not the kernel-hub wrapper


def make_inputs(seq_len: int, gate: str, seed: int = 0, head_dim: int = HEAD_DIM) -> dict[str, torch.Tensor]:
    """Random q, k, v, beta; g from the real gate formula with KimiLinear's parameter init."""
    gen = torch.Generator().manual_seed(seed)
    shape = (1, seq_len, HEADS, head_dim)
    a_log = torch.empty(HEADS).uniform_(1.0, 16.0, generator=gen).log()
    dt = torch.empty(HEADS * head_dim).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
    dt_bias = dt + torch.log(-torch.expm1(-dt))  # inverse softplus, as transformers' _init_weights
    f = torch.randn(1, seq_len, HEADS * head_dim, generator=gen)
    return {
        "q": torch.randn(shape, generator=gen),
        "k": torch.randn(shape, generator=gen),
        "v": torch.randn(shape, generator=gen),
        "g": kda_gate(f, a_log, dt_bias, HEADS, kind=gate),
        "beta": torch.randn(1, seq_len, HEADS, generator=gen).sigmoid(),
    }


class Run(NamedTuple):
    """One timed call of a path."""

    cpu_s: float  # process CPU seconds (all threads)
    wall_s: float
    faults: int  # minor page faults: fresh pages the call touched


def timed_run(fn: KdaFn) -> tuple[tuple[torch.Tensor, torch.Tensor | None], Run]:
    """(result, Run) of one call."""
    faults, cpu, wall = minor_faults(), time.process_time(), time.perf_counter()
    result = fn()
    return result, Run(time.process_time() - cpu, time.perf_counter() - wall, minor_faults() - faults)


def interleaved_runs(paths: dict[str, KdaFn], repeats: int) -> dict[str, list[Run]]:
    """Each path's timed calls, timing the paths in turn each round, so that load from other
    processes on a shared machine lands on all of them alike (the ratios are what we report)."""
    runs: dict[str, list[Run]] = {name: [] for name in paths}
    for _ in range(repeats):
        for name, fn in paths.items():
            runs[name].append(timed_run(fn)[1])
    return runs


def warm_up(paths: dict[str, KdaFn]) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor | None]], dict[str, Run]]:
    """Call every path twice, in turn: (the first results, the first calls' Runs: a compile's cost)."""
    first = {name: timed_run(fn) for name, fn in paths.items()}
    for fn in paths.values():
        fn()
    return {name: result for name, (result, _) in first.items()}, {name: run for name, (_, run) in first.items()}


def bench_one(seq_len: int, gate: str, repeats: int, head_dim: int = HEAD_DIM, compiled: bool = False,
              cpu_time: bool = False) -> dict:
    x = make_inputs(seq_len, gate, head_dim=head_dim)
    hf_chunk = transformers_chunk_kda()

    def torch_path():
        """`chunk_kda` with its fused kernel turned off: training's path (and any call with a gradient)."""
        with kda_fused.turned_off():
            return chunk_kda(**x, output_final_state=True, use_qk_l2norm=True)
    paths: dict[str, KdaFn] = {
        "chunk_kda": lambda: chunk_kda(**x, output_final_state=True, use_qk_l2norm=True),
        "transformers": lambda: hf_chunk(
            x["q"], x["k"], x["v"], x["g"], x["beta"], output_final_state=True, use_qk_l2norm_in_kernel=True
        ),
        "recurrent_kda": lambda: recurrent_kda(**x, output_final_state=True, use_qk_l2norm=True),
        "chunk_kda_torch_path": torch_path,
    }
    if compiled:
        paths["compiled_chunk_kda"] = lambda: compiled_chunk_kda(**x, output_final_state=True, use_qk_l2norm=True)
    with torch.no_grad():
        outputs, first = warm_up(paths)  # also the compile
        runs = interleaved_runs(paths, repeats)
    seconds = {name: [r.cpu_s if cpu_time else r.wall_s for r in rs] for name, rs in runs.items()}
    times = {name: statistics.median(ts) for name, ts in seconds.items()}
    best = {name: min(ts) for name, ts in seconds.items()}  # load from other processes only ever adds time
    o_ref, s_ref = outputs["recurrent_kda"]
    row: dict = {"T": seq_len, **{f"{name}_s": t for name, t in times.items()}}
    row["speedup_vs_transformers"] = times["transformers"] / times["chunk_kda"]
    row["speedup_vs_recurrent"] = times["recurrent_kda"] / times["chunk_kda"]
    row["best_speedup_vs_transformers"] = best["transformers"] / best["chunk_kda"]
    row["best_speedup_vs_recurrent"] = best["recurrent_kda"] / best["chunk_kda"]
    if compiled:
        for key, ref in (("vs_transformers", "transformers"), ("vs_recurrent", "recurrent_kda")):
            row[f"compiled_speedup_{key}"] = times[ref] / times["compiled_chunk_kda"]
            row[f"best_compiled_speedup_{key}"] = best[ref] / best["compiled_chunk_kda"]
        row["compiled_vs_eager"] = times["chunk_kda"] / times["compiled_chunk_kda"]
        row["compile_cpu_s"] = first["compiled_chunk_kda"].cpu_s  # the first call: compile + one run
    row["kernel_vs_torch_path"] = times["chunk_kda_torch_path"] / times["chunk_kda"]
    for name in ("chunk_kda", "chunk_kda_torch_path", "transformers",
                 *(["compiled_chunk_kda"] if compiled else [])):  # sanity: all agree
        o, s = outputs[name]
        row[f"{name}_max_rel_err"] = max(
            ((o - o_ref).abs().max() / o_ref.abs().max()).item(), ((s - s_ref).abs().max() / s_ref.abs().max()).item()
        )
    for name, rs in runs.items():  # both clocks and the page faults, whichever clock the ratios use
        row[f"{name}_cpu_s"] = statistics.median(r.cpu_s for r in rs)
        row[f"{name}_wall_s"] = statistics.median(r.wall_s for r in rs)
        row[f"{name}_faults"] = statistics.median(r.faults for r in rs)
    row["runs"] = {name: [r._asdict() for r in rs] for name, rs in runs.items()}
    return row


def table(rows: list[dict]) -> str:
    headers = ["T", "chunk_kda (ms)", "transformers chunk (ms)", "recurrent_kda (ms)",
               "vs transformers (median / best)", "vs recurrence (median / best)",
               "page faults per run (chunk / transformers / recurrence)"]
    cells = [
        [r["T"], f"{r['chunk_kda_s'] * 1e3:.1f}", f"{r['transformers_s'] * 1e3:.1f}", f"{r['recurrent_kda_s'] * 1e3:.1f}",
         f"{r['speedup_vs_transformers']:.1f}x / {r['best_speedup_vs_transformers']:.1f}x",
         f"{r['speedup_vs_recurrent']:.1f}x / {r['best_speedup_vs_recurrent']:.1f}x",
         " / ".join(f"{r[f'{name}_faults']:.0f}" for name in ("chunk_kda", "transformers", "recurrent_kda"))]
        for r in rows
    ]
    if "compiled_chunk_kda_s" in rows[0]:
        headers += ["compiled (ms)", "compiled vs transformers / recurrence (median)", "compiled vs eager", "compile (CPU s)"]
        for cell, r in zip(cells, rows):
            cell += [f"{r['compiled_chunk_kda_s'] * 1e3:.1f}",
                     f"{r['compiled_speedup_vs_transformers']:.1f}x / {r['compiled_speedup_vs_recurrent']:.1f}x",
                     f"{r['compiled_vs_eager']:.2f}x", f"{r['compile_cpu_s']:.1f}"]
    return markdown_table(headers, cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T in {512, 2048}, 3 repeats, writes kda_quick.json")
    parser.add_argument("--gate", choices=("softplus", "lower_bound"), default="softplus")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (median); default 5, quick 3")
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM, help="K = V per head (K3: 128)")
    parser.add_argument("--threads", type=int, default=THREADS, help=f"torch CPU threads (default {THREADS})")
    parser.add_argument("--compiled", action="store_true", help="also time compiled_chunk_kda (ops/kda_compiled.py)")
    parser.add_argument("--cpu-time", action="store_true", help="time runs by process CPU seconds, not wall time")
    parser.add_argument("--allocator", choices=ALLOCATORS, default="steady",
                        help="steady: glibc keeps freed memory (default); default: glibc's own thresholds")
    args = parser.parse_args()
    if args.threads < 1:
        parser.error(f"--threads: expected a positive integer, got {args.threads}")
    allocator = keep_freed_memory() if args.allocator == "steady" else "default"
    torch.set_num_threads(args.threads)
    seq_lens = [512, 2048] if args.quick else [512, 2048, 8192]
    repeats = args.repeats or (3 if args.quick else 5)

    rows = []
    for seq_len in seq_lens:
        rows.append(bench_one(seq_len, args.gate, repeats, args.head_dim, args.compiled, args.cpu_time))
        print(f"T={seq_len}: done", flush=True)
    print(table(rows))
    config = {"B": 1, "H": HEADS, "K": args.head_dim, "V": args.head_dim, "dtype": "float32", "gate": args.gate,
              "qk_l2norm": True, "repeats": repeats, "statistic": "median of interleaved rounds",
              "threads": args.threads, "clock": "process CPU time" if args.cpu_time else "wall",
              "warm_up_calls": 2, "allocator": allocator}
    name = "kda" if args.head_dim == HEAD_DIM else f"kda_k{args.head_dim}"
    name += "" if args.threads == THREADS else f"_t{args.threads}"
    name += "" if args.allocator == "steady" else "_default_malloc"
    path = write_result(result_name(name, args.quick), {"config": config, "rows": rows, "target": TARGET})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

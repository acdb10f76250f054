"""KDA prefill at one T: the plain recurrence, the eager `chunk_kda` and `compiled_chunk_kda`
(ops/kda_compiled.py) at several chunk steps per compiled call, in one run, as ratios vs the
recurrence by CPU time and by wall time.

    .venv/bin/python bench/kda_compiled_groups.py [--seq-len 8192] [--head-dim 128] [--group-chunks 4 8 16] [--threads 2] [--repeats 5] [--quick]

Inputs as `bench_kda.py` (B=1, H=8, fp32, qk l2norm in kernel, the softplus gate with KimiLinear's
init). Each compiled variant's first call compiles: its CPU and wall seconds are the compile
columns (inductor caches compiled graphs on disk: for a cold compile, run with
TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)). Then rounds time every path in turn (load from other processes lands on all alike);
medians. Each path's result is checked against the recurrence's. Prints a markdown table and
writes bench/results/kda_compiled_groups.json (`--quick`: T = 2048, 3 repeats, *_quick.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_kda import make_inputs  # noqa: E402
from common import markdown_table, result_name, write_result  # noqa: E402

from deltamoe.ops.kda import chunk_kda, recurrent_kda  # noqa: E402
from deltamoe.ops.kda_compiled import compiled_chunk_kda  # noqa: E402

KdaFn = Callable[[], tuple[torch.Tensor, torch.Tensor | None]]


def timed(fn: KdaFn) -> tuple[tuple[torch.Tensor, torch.Tensor | None], float, float]:
    """(result, CPU seconds, wall seconds) of one call."""
    cpu, wall = time.process_time(), time.perf_counter()
    result = fn()
    return result, time.process_time() - cpu, time.perf_counter() - wall


def max_rel_err(got: tuple[torch.Tensor, torch.Tensor | None], want: tuple[torch.Tensor, torch.Tensor | None]) -> float:
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want))


def run(seq_len: int, head_dim: int, group_chunks: list[int], repeats: int) -> dict:
    x = make_inputs(seq_len, "softplus", head_dim=head_dim)
    kwargs = {"output_final_state": True, "use_qk_l2norm": True}
    paths: dict[str, KdaFn] = {
        "recurrent_kda": lambda: recurrent_kda(**x, **kwargs),
        "chunk_kda": lambda: chunk_kda(**x, **kwargs),
        **{f"compiled G={n}": (lambda n=n: compiled_chunk_kda(**x, **kwargs, group_chunks=n)) for n in group_chunks},
    }
    with torch.no_grad():
        first = {name: timed(fn) for name, fn in paths.items()}  # warm-up, and the compiles
        cpu: dict[str, list[float]] = {name: [] for name in paths}
        wall: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(repeats):
            for name, fn in paths.items():
                _, c, w = timed(fn)
                cpu[name].append(c)
                wall[name].append(w)
    reference = first["recurrent_kda"][0]
    rows = []
    for name in paths:
        c, w = statistics.median(cpu[name]), statistics.median(wall[name])
        rows.append({
            "path": name, "cpu_s": c, "wall_s": w,
            "cpu_vs_recurrent": statistics.median(cpu["recurrent_kda"]) / c,
            "wall_vs_recurrent": statistics.median(wall["recurrent_kda"]) / w,
            "first_call_cpu_s": first[name][1], "first_call_wall_s": first[name][2],
            "max_rel_err_vs_recurrent": max_rel_err(first[name][0], reference),
            "runs_cpu_s": cpu[name], "runs_wall_s": wall[name],
        })
    return {"rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--head-dim", type=int, default=128, help="K = V per head (K3: 128)")
    parser.add_argument("--group-chunks", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (median); default 5, quick 3")
    parser.add_argument("--quick", action="store_true", help="T = 2048, 3 repeats, writes *_quick.json")
    args = parser.parse_args()
    for name in ("seq_len", "head_dim", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a positive integer, got {getattr(args, name)}")
    if min(args.group_chunks) < 1:
        parser.error(f"--group-chunks: expected positive integers, got {args.group_chunks}")
    torch.set_num_threads(args.threads)
    seq_len = 2048 if args.quick else args.seq_len
    repeats = args.repeats or (3 if args.quick else 5)
    result = run(seq_len, args.head_dim, args.group_chunks, repeats)
    print(f"T={seq_len}, B=1, H=8, K=V={args.head_dim}, fp32, {args.threads} threads, median of {repeats}")
    print(markdown_table(
        ["path", "CPU (ms)", "wall (ms)", "vs recurrence (CPU / wall)", "first call, compiles (CPU / wall s)",
         "max rel. err vs recurrence"],
        [[r["path"], f"{r['cpu_s'] * 1e3:.1f}", f"{r['wall_s'] * 1e3:.1f}",
          f"{r['cpu_vs_recurrent']:.1f}x / {r['wall_vs_recurrent']:.1f}x",
          f"{r['first_call_cpu_s']:.1f} / {r['first_call_wall_s']:.1f}", f"{r['max_rel_err_vs_recurrent']:.1e}"]
         for r in result["rows"]],
    ))
    config = {"B": 1, "H": 8, "K": args.head_dim, "V": args.head_dim, "T": seq_len, "dtype": "float32",
              "gate": "softplus", "qk_l2norm": True, "threads": args.threads, "repeats": repeats,
              "statistic": "median of interleaved rounds"}
    path = write_result(result_name("kda_compiled_groups", args.quick), {"config": config, **result})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

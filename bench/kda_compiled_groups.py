"""KDA prefill at one T: the plain recurrence, the eager `chunk_kda` and `compiled_chunk_kda`
(ops/kda_compiled.py) at several chunk steps per compiled call, in one run, as ratios vs the
recurrence by CPU time and by wall time. The eager `chunk_kda` runs its fused C++ kernel here (these
calls record no gradient; ops/kda_fused.py); `DELTAMOE_KDA_KERNEL=0` times its torch path instead,
the steps `compiled_chunk_kda` compiles.

    .venv/bin/python bench/kda_compiled_groups.py [--seq-len 8192] [--head-dim 128] [--group-chunks 8 16 32] [--threads 2] [--repeats 5] [--quick] [--allocator steady|default]

Inputs, warm-up, timing and allocator as `bench_kda.py` (B=1, H=8, fp32, qk l2norm in kernel, the
softplus gate with KimiLinear's init; two calls of every path before the timed rounds, which time
every path in turn; glibc malloc keeping freed memory unless `--allocator default`), so that its
figures and the README table's agree. Each compiled variant's first call compiles: its CPU and
wall seconds are the compile columns (inductor caches compiled graphs on disk: for a cold
compile, run with TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)). Medians, with each path's minor page
faults per run. Each path's result is checked against the recurrence's. Prints a markdown table and
writes bench/results/kda_compiled_groups.json (`--quick`: T = 2048, 3 repeats, *_quick.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_kda import KdaFn, interleaved_runs, make_inputs, warm_up  # noqa: E402
from common import markdown_table, result_name, write_result  # noqa: E402
from process_memory import ALLOCATORS, keep_freed_memory  # noqa: E402

from deltamoe.ops.kda import chunk_kda, recurrent_kda  # noqa: E402
from deltamoe.ops.kda_compiled import compiled_chunk_kda  # noqa: E402

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
        results, first = warm_up(paths)  # and the compiles
        runs = interleaved_runs(paths, repeats)
    cpu = {name: statistics.median(r.cpu_s for r in rs) for name, rs in runs.items()}
    wall = {name: statistics.median(r.wall_s for r in rs) for name, rs in runs.items()}
    rows = []
    for name in paths:
        rows.append({
            "path": name, "cpu_s": cpu[name], "wall_s": wall[name],
            "cpu_vs_recurrent": cpu["recurrent_kda"] / cpu[name], "wall_vs_recurrent": wall["recurrent_kda"] / wall[name],
            "faults": statistics.median(r.faults for r in runs[name]),
            "first_call_cpu_s": first[name].cpu_s, "first_call_wall_s": first[name].wall_s,
            "max_rel_err_vs_recurrent": max_rel_err(results[name], results["recurrent_kda"]),
            "runs": [r._asdict() for r in runs[name]],
        })
    return {"rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--head-dim", type=int, default=128, help="K = V per head (K3: 128)")
    parser.add_argument("--group-chunks", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (median); default 5, quick 3")
    parser.add_argument("--quick", action="store_true", help="T = 2048, 3 repeats, writes *_quick.json")
    parser.add_argument("--allocator", choices=ALLOCATORS, default="steady",
                        help="steady: glibc keeps freed memory (default); default: glibc's own thresholds")
    args = parser.parse_args()
    for name in ("seq_len", "head_dim", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a positive integer, got {getattr(args, name)}")
    if min(args.group_chunks) < 1:
        parser.error(f"--group-chunks: expected positive integers, got {args.group_chunks}")
    allocator = keep_freed_memory() if args.allocator == "steady" else "default"
    torch.set_num_threads(args.threads)
    seq_len = 2048 if args.quick else args.seq_len
    repeats = args.repeats or (3 if args.quick else 5)
    result = run(seq_len, args.head_dim, args.group_chunks, repeats)
    print(f"T={seq_len}, B=1, H=8, K=V={args.head_dim}, fp32, {args.threads} threads, median of {repeats}, "
          f"allocator {allocator}")
    print(markdown_table(
        ["path", "CPU (ms)", "wall (ms)", "vs recurrence (CPU / wall)", "page faults per run",
         "first call, compiles (CPU / wall s)", "max rel. err vs recurrence"],
        [[r["path"], f"{r['cpu_s'] * 1e3:.1f}", f"{r['wall_s'] * 1e3:.1f}",
          f"{r['cpu_vs_recurrent']:.1f}x / {r['wall_vs_recurrent']:.1f}x", f"{r['faults']:.0f}",
          f"{r['first_call_cpu_s']:.1f} / {r['first_call_wall_s']:.1f}", f"{r['max_rel_err_vs_recurrent']:.1e}"]
         for r in result["rows"]],
    ))
    config = {"B": 1, "H": 8, "K": args.head_dim, "V": args.head_dim, "T": seq_len, "dtype": "float32",
              "gate": "softplus", "qk_l2norm": True, "threads": args.threads, "repeats": repeats,
              "statistic": "median of interleaved rounds", "warm_up_calls": 2, "allocator": allocator}
    name = "kda_compiled_groups" + ("" if args.allocator == "steady" else "_default_malloc")
    path = write_result(result_name(name, args.quick), {"config": config, **result})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

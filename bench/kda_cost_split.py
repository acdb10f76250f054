"""Where `chunk_kda`'s torch path spends its time: the state-independent part (layout, decay
factors, M and L, the triangular solve, U and W; batched over all chunks of a group) against the
sequential state pass (one chunk after another), each split further into matmuls, the triangular
solve and the rest (elementwise products, exp, layout copies, tril), and the copies of o into token
order. (The fused kernel, `ops/kda_fused.py`, which inference calls take by default, is turned off
here: it has no stages to split.)

    .venv/bin/python bench/kda_cost_split.py [--seq-len 8192] [--head-dim 128] [--chunk-size 64 32] [--threads 2] [--decay-scale 0.25] [--allocator steady|default]

Inputs and allocator as `bench_kda.py` (B=1, H=8, fp32, qk l2norm in kernel, the softplus gate with
KimiLinear's init; glibc malloc keeps freed memory unless `--allocator default`, where the
intermediates' fresh pages land in the ops that first write them). A chunk size is the longest chunk: `chunk_kda` halves it where a chunk's decay span would
exceed MAX_CHUNK_SPAN (the table gives the length it used). `--decay-scale 0.25` multiplies the
log-decays so that chunks of 64 keep their length at K = 128: the plain 64-token form's time, a
lower bound for any form that reaches 64 with the softplus gate by splitting a chunk into
sub-chunks with their own decay anchors (those only add work to it). Times are medians of `--repeats`
runs; per-op times come from one profiled run after them. A second table gives each matmul shape's
achieved GFLOP/s in that run against the same matmul alone (hot operands, an out= buffer): the
state pass's products are the [B*H, ...] shapes, the state-independent part's the [chunks*B*H, ...]
ones. (Allocation counts the allocator calls only; first touches of fresh pages land in the op
that writes them.) Prints a markdown table; figures on a
loaded machine are indicative only.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_kda import make_inputs  # noqa: E402
from common import markdown_table  # noqa: E402
from process_memory import ALLOCATORS, keep_freed_memory  # noqa: E402

from deltamoe.ops import kda, kda_fused  # noqa: E402

MATMULS = {"aten::bmm", "aten::baddbmm", "aten::baddbmm_", "aten::mm", "aten::addmm"}
SOLVE = "aten::linalg_solve_triangular"
ALLOCATIONS = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::zeros"}
STAGES = ("state-independent", "state pass", "o into token order, rest")


class StageTimer:
    """Wraps `kda._chunk_terms` and `kda._state_pass` to add up their wall time, and remembers the
    chunk length `_chunk_terms` picked."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.chunks: set[int] = set()

    def wrap(self, stage: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            self.seconds[stage] += time.perf_counter() - start
            if stage == "state-independent":
                self.chunks.add(result.u.shape[2])
            return result

        return timed


def op_split(run: Callable[[], object]) -> tuple[dict[str, float], list[dict]]:
    """CPU seconds of one run by kind of op (matmul, triangular solve with the ops it calls,
    allocation calls, everything else: elementwise, exp, layout copies, tril), and each matmul shape's calls, time and achieved GFLOP/s."""
    from torch.profiler import ProfilerActivity, profile  # slow to import: only where used

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        run()
    events = prof.key_averages(group_by_input_shape=True)
    everything = sum(e.self_cpu_time_total for e in events) / 1e6
    matmul = sum(e.self_cpu_time_total for e in events if e.key in MATMULS) / 1e6
    solve = sum(e.cpu_time_total for e in events if e.key == SOLVE) / 1e6
    allocation = sum(e.self_cpu_time_total for e in events if e.key in ALLOCATIONS) / 1e6
    shapes = [
        {"op": e.key, "shapes": e.input_shapes, "calls": e.count, "seconds": e.self_cpu_time_total / 1e6,
         "gflop": e.count * matmul_flops(e.key, e.input_shapes) / 1e9}
        for e in events if e.key in MATMULS
    ]
    return {"matmul": matmul, "solve": solve, "allocation": allocation,
            "rest": everything - matmul - solve - allocation}, shapes


def _operands(op: str, shapes: list[list[int]]) -> tuple[list[int], list[int]]:
    """The two multiplied operands' shapes: bmm/mm (a, b), baddbmm/addmm (input, a, b)."""
    return (shapes[0], shapes[1]) if op in ("aten::bmm", "aten::mm") else (shapes[1], shapes[2])


def matmul_flops(op: str, shapes: list[list[int]]) -> int:
    a, b = _operands(op, shapes)
    return 2 * math.prod(a) * b[-1]  # [..., m, k] @ [..., k, n]: 2 m k n per batch entry


def isolated_seconds(op: str, shapes: list[list[int]], repeats: int = 50) -> float:
    """Seconds per call of the same matmul alone (hot operands, an out= buffer): what MKL gives
    for that shape on this machine."""
    a_shape, b_shape = _operands(op, shapes)
    a, b = torch.randn(a_shape), torch.randn(b_shape)
    out = torch.empty(*a_shape[:-1], b_shape[-1])
    batched = len(a_shape) == 3
    fn = (lambda: torch.bmm(a, b, out=out)) if batched else (lambda: torch.mm(a, b, out=out))
    if op in ("aten::baddbmm", "aten::baddbmm_", "aten::addmm"):
        fn = (lambda: out.baddbmm_(a, b)) if batched else (lambda: out.addmm_(a, b))
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def measure(x: dict[str, torch.Tensor], chunk_size: int, repeats: int, split_ops: bool = True) -> dict:
    """Stage times (medians) of `chunk_kda` on x, and with split_ops the op kinds of one more run."""
    timer = StageTimer()
    terms, state_pass = kda._chunk_terms, kda._state_pass
    kda._chunk_terms, kda._state_pass = timer.wrap("state-independent", terms), timer.wrap("state pass", state_pass)
    try:
        def run() -> object:
            return kda.chunk_kda(**x, output_final_state=True, use_qk_l2norm=True, chunk_size=chunk_size)

        with torch.no_grad(), kda_fused.turned_off():
            run()  # warm-up
            totals, stages = [], defaultdict(list)
            for _ in range(repeats):
                timer.seconds.clear()
                start = time.perf_counter()
                run()
                totals.append(time.perf_counter() - start)
                for stage, seconds in timer.seconds.items():
                    stages[stage].append(seconds)
            ops, matmuls = op_split(run) if split_ops else ({}, [])
    finally:
        kda._chunk_terms, kda._state_pass = terms, state_pass
    total = statistics.median(totals)
    parts = {stage: statistics.median(s) for stage, s in stages.items()}
    parts["o into token order, rest"] = total - sum(parts.values())
    return {"chunk_size": chunk_size, "chunks_used": sorted(timer.chunks), "total_s": total, "stages_s": parts,
            "ops_s": ops, "matmuls": matmuls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--head-dim", type=int, default=128, help="K = V per head (K3: 128)")
    parser.add_argument("--chunk-size", type=int, nargs="+", default=[64, 32])
    parser.add_argument("--gate", choices=("softplus", "lower_bound"), default="softplus")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decay-scale", type=float, default=1.0, help="multiply the log-decays g (0.25: chunks of 64 fit)")
    parser.add_argument("--allocator", choices=ALLOCATORS, default="steady",
                        help="steady: glibc keeps freed memory (default); default: glibc's own thresholds")
    args = parser.parse_args()
    for name in ("seq_len", "head_dim", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a positive integer, got {getattr(args, name)}")
    if not args.decay_scale > 0:
        parser.error(f"--decay-scale: expected a positive number, got {args.decay_scale}")
    if min(args.chunk_size) < 1:
        parser.error(f"--chunk-size: expected positive integers, got {args.chunk_size}")
    if args.allocator == "steady":
        keep_freed_memory()
    torch.set_num_threads(args.threads)
    x = make_inputs(args.seq_len, args.gate, head_dim=args.head_dim)
    x["g"] = x["g"] * args.decay_scale

    rows = []
    for chunk_size in args.chunk_size:
        r = measure(x, chunk_size, args.repeats)
        ops = r["ops_s"]
        op_total = sum(ops.values())
        rows.append([
            chunk_size, "/".join(str(c) for c in r["chunks_used"]), f"{r['total_s'] * 1e3:.1f}",
            *(f"{r['stages_s'].get(s, 0.0) * 1e3:.1f}" for s in STAGES),
            " / ".join(f"{ops.get(k, 0.0) / op_total:.0%}" for k in ("matmul", "solve", "allocation", "rest")),
        ])
    print(f"T={args.seq_len}, B=1, H=8, K=V={args.head_dim}, fp32, {args.threads} threads, median of {args.repeats}, "
          f"log-decays x {args.decay_scale:g}")
    print(markdown_table(
        ["chunk_size", "chunks used", "total (ms)", *(f"{s} (ms)" for s in STAGES),
         "matmul / solve / allocation / rest (share of op time)"],
        rows,
    ))
    print("\nMatmuls of the last chunk size's profiled run, against the same shape alone (out= buffer):")
    print(markdown_table(
        ["op", "operand shapes", "calls", "time (ms)", "GFLOP/s in the run", "GFLOP/s alone", "run / alone"],
        [[m["op"], " x ".join(str(list(x)) for x in _operands(m["op"], m["shapes"])), m["calls"],
          f"{m['seconds'] * 1e3:.1f}", f"{m['gflop'] / m['seconds']:.0f}",
          f"{matmul_flops(m['op'], m['shapes']) / 1e9 / alone:.0f}", f"{m['gflop'] / m['seconds'] * alone / (matmul_flops(m['op'], m['shapes']) / 1e9):.2f}"]
         for m in sorted(r["matmuls"], key=lambda m: -m["seconds"])
         for alone in [isolated_seconds(m["op"], m["shapes"])]],
    ))


if __name__ == "__main__":
    main()

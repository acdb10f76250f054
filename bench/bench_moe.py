"""Routed-expert compute: deltamoe `experts_forward` side by side with a naive per-token
loop and transformers' KimiLinear experts (eager loop and grouped_mm), in one run.

    .venv/bin/python bench/bench_moe.py [--quick] [--tokens 256] [--experts 32] [--top-k 4]

Prints a markdown table and writes bench/results/moe.json atomically. Times are medians on
this machine's CPU; read the ratios, not the milliseconds (DESIGN.md, "Performance").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, result_name  # noqa: E402

from deltamoe.ops.moe import experts_forward, route_tokens  # noqa: E402


def naive_per_token(x, weights, indices, w1, w3, w2) -> torch.Tensor:
    """What a first draft does: one tiny matmul chain per (token, slot)."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for slot in range(indices.shape[1]):
            e = int(indices[t, slot])
            h = F.silu(w1[e] @ x[t]) * (w3[e] @ x[t])
            out[t] += weights[t, slot] * (w2[e] @ h).float()
    return out


def transformers_experts(impl: str, w1, w3, w2):
    """transformers' KimiLinearExperts holding the same weights, with a given backend."""
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearExperts

    e, i, d = w1.shape
    cfg = KimiLinearConfig(hidden_size=d, moe_intermediate_size=i, num_local_experts=e, hidden_act="silu")
    cfg._experts_implementation = impl
    module = KimiLinearExperts(cfg).eval()
    with torch.no_grad():
        module.gate_up_proj.copy_(torch.cat([w1, w3], dim=1))
        module.down_proj.copy_(w2)
    return module


def median_ms(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    fn()  # warm-up (allocator, lazy imports)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def write_atomically(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 tokens, 3 repeats, writes moe_quick.json")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--inter", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the CI box is shared)")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.repeats = 64, 3
    torch.set_num_threads(args.threads)

    g = torch.Generator().manual_seed(0)
    n, e, k, d, i = args.tokens, args.experts, args.top_k, args.hidden, args.inter
    x = torch.randn(n, d, generator=g)
    weights, indices = route_tokens(torch.randn(n, e, generator=g), None, k)
    w1 = torch.randn(e, i, d, generator=g) * d**-0.5
    w3 = torch.randn(e, i, d, generator=g) * d**-0.5
    w2 = torch.randn(e, d, i, generator=g) * i**-0.5

    candidates: dict[str, Callable[[], torch.Tensor]] = {
        "deltamoe experts_forward": lambda: experts_forward(x, weights, indices, w1, w3, w2),
        "naive per-token loop": lambda: naive_per_token(x, weights, indices, w1, w3, w2),
    }
    for impl in ("eager", "grouped_mm"):
        module = transformers_experts(impl, w1, w3, w2)
        candidates[f"transformers KimiLinearExperts ({impl})"] = (
            lambda module=module: module(x, indices, weights)
        )

    reference = candidates["deltamoe experts_forward"]()
    rows = []
    with torch.no_grad():
        for name, fn in candidates.items():
            diff = (fn().float() - reference).abs().max().item()
            rows.append({"name": name, "median_ms": median_ms(fn, args.repeats), "max_abs_diff": diff})
    base = rows[0]["median_ms"]
    for row in rows:
        row["time_vs_experts_forward"] = row["median_ms"] / base

    payload = {
        "benchmark": "moe_experts",
        "shape": {"tokens": n, "experts": e, "top_k": k, "hidden": d, "intermediate": i},
        "dtype": "float32",
        "threads": args.threads,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "results": rows,
    }
    path = RESULTS / f"{result_name('moe', args.quick)}.json"
    write_atomically(path, payload)

    print(f"MoE experts, N={n} E={e} k={k} D={d} I={i}, fp32, {args.threads} thread(s)\n")
    print("| implementation | median ms | time / experts_forward | max abs diff |")
    print("|---|---:|---:|---:|")
    for row in rows:
        print(f"| {row['name']} | {row['median_ms']:.2f} | {row['time_vs_experts_forward']:.2f}x "
              f"| {row['max_abs_diff']:.1e} |")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()

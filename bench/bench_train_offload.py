"""Activation memory vs step time: none / checkpointing / offload / both, one training step (forward +
backward) of the `small` preset on one process, for the same batch.

offload = `--offload-activations attn,mlp` (every trunk layer's attention and MLP/MoE saved tensors to
host memory); both = `--ac --offload-activations layer` (checkpointed layers, their inputs to host).
Goal: >= 40 % lower peak activation memory than none for <= 25 % more step time.

Memory: on a GPU, the peak allocated during the step above what was allocated before it
(torch.cuda.max_memory_allocated), so it includes temporaries and checkpointing's recomputation.
On a CPU the host is the device, so the figure is what the hooks account: the bytes of saved
activations (parameters excluded) left on the device at the end of the forward, counted by a
saved-tensor hook around the step; offloaded bytes are reported apart. That count leaves out
temporaries and the one layer that checkpointing recomputes at a time in backward.
Run: python bench/bench_train_offload.py [--quick] [--batch B] [--seq T]
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

GOAL_MEMORY_CUT, GOAL_SLOWDOWN = 0.40, 0.25
MODES = {
    "none": {},
    "checkpointing": {"activation_checkpointing": True},
    "offload": {"offload_activations": "attn,mlp"},
    "both": {"activation_checkpointing": True, "offload_activations": "layer"},
}


def measure(preset: str, mode: dict, batch: int, seq: int, repeats: int, device: torch.device) -> dict:
    from deltamoe.config import load_preset
    from deltamoe.model.load import build_model
    from deltamoe.parallel import ParallelDims, parallelize
    from deltamoe.parallel.offload import SavedBytesCounter

    config = load_preset(preset)
    model = build_model(config, seed=0).to(device).train()
    params = list(model.parameters())
    pm = parallelize(model, ParallelDims(**mode), None)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (batch, seq), generator=gen).to(device)
    times, resident, moved, peak = [], 0, 0, None
    for i in range(repeats + 1):  # the first step warms up
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        with SavedBytesCounter(params) as counter:
            pm.forward_backward(ids, ids)
        if device.type == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - before
        dt = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        step_moved = pm.offload_stats.take() if pm.offload_stats is not None else 0
        if i:
            times.append(dt)
            resident, moved = counter.bytes, step_moved
    return {"step_s": statistics.median(times), "resident_saved_bytes": resident, "offloaded_bytes": moved,
            "cuda_peak_bytes": peak}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="the tiny preset, 2 x 64 tokens, one timed step")
    args = ap.parse_args()
    if args.quick:
        args.preset, args.batch, args.seq, args.repeats = "tiny", 2, 64, 1
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(2)
    results = {name: measure(args.preset, mode, args.batch, args.seq, args.repeats, device)
               for name, mode in MODES.items()}
    key = "cuda_peak_bytes" if device.type == "cuda" else "resident_saved_bytes"
    base = results["none"]
    for r in results.values():
        r["memory_cut"] = 1 - r[key] / base[key]
        r["slowdown"] = r["step_s"] / base["step_s"] - 1
    data = {"preset": args.preset, "batch": args.batch, "seq": args.seq, "device": device.type, "memory": key,
            "goal_memory_cut": GOAL_MEMORY_CUT, "goal_slowdown": GOAL_SLOWDOWN, "modes": MODES, "results": results}
    path = write_result(result_name("train_offload", args.quick), data)
    rows = [[name, f"{r[key] / 2**20:.1f} MiB", f"{r['memory_cut']:+.0%}", f"{r['offloaded_bytes'] / 2**20:.1f} MiB",
             f"{r['step_s']:.2f} s", f"{r['slowdown']:+.0%}",
             "yes" if r["memory_cut"] >= GOAL_MEMORY_CUT and r["slowdown"] <= GOAL_SLOWDOWN else "no"]
            for name, r in results.items()]
    label = "peak activation memory" if device.type == "cuda" else "saved activations resident"
    print(markdown_table(["mode", label, "vs none", "to host", "step", "vs none", "goal"], rows))
    print(f"results: {path}")


if __name__ == "__main__":
    main()

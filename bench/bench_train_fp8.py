"""Blockwise FP8 training quality: the `tiny` preset trained twice on associative recall with the same
seed and data, without and with `--fp8 blockwise` (linears and experts in e4m3 with DeepSeek-V3
tiling, forward and backward); reports both loss curves, the final smoothed loss (mean of the last
tenth of the steps), its relative gap (goal: within 1 %) and the held-out accuracy.

The rest of the model runs at `--precision`: bf16 autocast on a GPU; fp32 on a CPU, where bf16
autocast stops in KDA's chunked triangular solve (no bf16 CPU kernel). On a CPU the fp8 products are
the exact quantise -> dequantise emulation, so the wall times measure the emulation, not fp8 speed.
Run: python bench/bench_train_fp8.py [--quick] [--steps N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown_table, result_name, write_result  # noqa: E402

GOAL = 0.01  # relative gap of the final smoothed loss
SETTINGS = {
    "data": {"task": "recall", "num_pairs": 8, "num_queries": 8, "seq_len": 40, "batch_size": 32, "eval_rows": 128},
    "optim": {"lr": 3e-3, "warmup_steps": 20, "min_lr_ratio": 0.1},
    "run": {"eval_every": 0, "threads": 2, "progress": True},
}


def run(fp8: bool, steps: int, settings: dict, out: str) -> dict:
    from deltamoe.train.config import TrainConfig
    from deltamoe.train.trainer import train

    s = {k: dict(v) for k, v in settings.items()}
    s["run"].update(steps=steps, out=out, fp8="blockwise" if fp8 else None)
    cfg = TrainConfig.from_dict({"model": {"preset": "tiny"}, **s}).validate()
    t0 = time.perf_counter()
    result = train(cfg)
    wall = time.perf_counter() - t0
    losses = [m["loss"] for m in result.metrics]
    tail = max(1, len(losses) // 10)
    record = {"losses": losses, "final_loss": sum(losses[-tail:]) / tail, "wall_s": wall,
              "eval_loss": result.final_eval["loss"], "accuracy": result.final_eval.get("accuracy")}
    if fp8:
        last = result.metrics[-1]["fp8_error"]
        record["fp8_error_last_step"] = {k: max(e[k] for e in last.values() if k in e) for k in ("x", "w", "dy")}
    return record


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--quick", action="store_true", help="6 steps of 8 rows on a 4-pair task (a smoke run)")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="bf16" if torch.cuda.is_available() else "fp32")
    args = ap.parse_args()
    settings = {k: dict(v) for k, v in SETTINGS.items()}
    settings["run"]["precision"] = args.precision
    steps = args.steps
    if args.quick:
        settings["data"].update(num_pairs=4, num_queries=4, seq_len=24, batch_size=8, eval_rows=16)
        settings["optim"]["warmup_steps"] = 2
        steps = 6
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        base = run(False, steps, settings, str(Path(tmp) / "base"))
        fp8 = run(True, steps, settings, str(Path(tmp) / "fp8"))
    gap = fp8["final_loss"] / base["final_loss"] - 1
    data = {"settings": settings, "steps": steps, "goal_rel_gap": GOAL, "rel_gap": gap, "within_goal": abs(gap) <= GOAL,
            args.precision: base, "fp8_blockwise": fp8}
    path = write_result(result_name("train_fp8", args.quick), data)
    rows = [[name, f"{r['final_loss']:.4f}", f"{r['eval_loss']:.4f}",
             "-" if r["accuracy"] is None else f"{r['accuracy']:.1%}", f"{r['wall_s']:.0f} s"]
            for name, r in ((args.precision, base), (f"{args.precision} + fp8 blockwise", fp8))]
    print(markdown_table(["run", f"train loss (last {max(1, steps // 10)} steps)", "eval loss", "accuracy", "wall"],
                         rows))
    print(f"fp8 vs {args.precision} final loss: {gap:+.2%} (goal within {GOAL:.0%}); max operand error at the last step "
          f"{fp8['fp8_error_last_step']}")
    print(f"results: {path}")


if __name__ == "__main__":
    main()

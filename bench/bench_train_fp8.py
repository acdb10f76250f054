"""Blockwise FP8 training quality: the `tiny` preset trained twice on associative recall with the same
seed, initial weights and data order, without and with `--fp8 blockwise` (linears and experts in e4m3
with DeepSeek-V3 tiling, forward and backward); reports both loss curves (bench/results/train_fp8.png),
the smoothed final training loss (mean of the last 20 steps: one batch's loss is noisy), the held-out
eval loss every 50 steps and at the end, their relative gaps (goal: within 1 %) and the accuracy.
A third run, full precision with another seed (other initial weights and data), gives the gap that
seed-to-seed noise alone makes at the same step: a gap of fp8 well inside it is noise, not fp8
(`--no-seed-spread` skips it).

The rest of the model runs at `--precision`: bf16 autocast on a GPU; fp32 on a CPU, where bf16
autocast stops in KDA's chunked triangular solve (no bf16 CPU kernel). On a CPU the fp8 products are
the exact quantise -> dequantise emulation, so the wall times measure the emulation, not fp8 speed.
The runs train side by side in processes of one thread each (`--sequential`: one after the
other on `threads` threads); `--out DIR` keeps their run folders (metrics.jsonl, eval.jsonl).
Run: python bench/bench_train_fp8.py [--quick] [--steps N]
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, markdown_table, result_name, write_result  # noqa: E402

GOAL = 0.01  # relative gap of the smoothed final training loss and of the final eval loss
TAIL = 20  # steps averaged into the smoothed final training loss
SETTINGS = {
    "data": {"task": "recall", "num_pairs": 8, "num_queries": 8, "seq_len": 40, "batch_size": 32, "eval_rows": 128},
    "optim": {"lr": 3e-3, "warmup_steps": 20, "min_lr_ratio": 0.1},
    "run": {"eval_every": 50, "threads": 2, "progress": True},
}


def run(fp8: bool, steps: int, settings: dict, out: str, seed: int = 0) -> dict:
    from deltamoe.train.config import TrainConfig
    from deltamoe.train.metrics import read_jsonl
    from deltamoe.train.trainer import train

    s = {k: dict(v) for k, v in settings.items()}
    s["run"].update(steps=steps, out=out, fp8="blockwise" if fp8 else None, seed=seed)
    cfg = TrainConfig.from_dict({"model": {"preset": "tiny"}, **s}).validate()
    t0 = time.perf_counter()
    result = train(cfg)
    wall = time.perf_counter() - t0
    losses = [m["loss"] for m in result.metrics]
    tail = losses[-TAIL:]
    evals = [{"step": e["step"], "loss": e["loss"], "accuracy": e.get("accuracy")}
             for e in read_jsonl(Path(out) / "eval.jsonl")]
    record = {"losses": losses, "final_loss": sum(tail) / len(tail), "evals": evals, "wall_s": wall,
              "eval_loss": result.final_eval["loss"], "accuracy": result.final_eval.get("accuracy")}
    if fp8:
        last = result.metrics[-1]["fp8_error"]
        record["fp8_error_last_step"] = {k: max(e[k] for e in last.values() if k in e) for k in ("x", "w", "dy")}
    return record


def plot(runs: list[tuple[str, dict]], path: Path) -> Path:
    """Training loss (raw, faint; and its 20-step running mean) and held-out eval loss of each run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from deltamoe.train.plots import save_figure

    fig, ax = plt.subplots(figsize=(7, 4))
    for color, (name, r) in zip(("C0", "C3", "C7", "C2"), runs):
        losses = r["losses"]
        steps = range(1, len(losses) + 1)
        smooth = [sum(losses[max(0, i - TAIL + 1):i + 1]) / len(losses[max(0, i - TAIL + 1):i + 1])
                  for i in range(len(losses))]
        ax.plot(steps, losses, color=color, alpha=0.25, lw=0.8)
        ax.plot(steps, smooth, color=color, lw=1.5, label=f"{name}: train loss ({TAIL}-step mean)")
        ax.plot([e["step"] for e in r["evals"]], [e["loss"] for e in r["evals"]], "o--", color=color, ms=4,
                label=f"{name}: held-out eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("tiny preset, associative recall: blockwise FP8 vs full precision")
    return save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--quick", action="store_true", help="6 steps of 8 rows on a 4-pair task (a smoke run)")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="bf16" if torch.cuda.is_available() else "fp32")
    ap.add_argument("--sequential", action="store_true", help="one run after the other instead of side by side")
    ap.add_argument("--out", help="keep the run folders here (default: a temporary folder)")
    ap.add_argument("--no-seed-spread", action="store_true", help="skip the full-precision run with seed 1")
    args = ap.parse_args()
    settings = {k: dict(v) for k, v in SETTINGS.items()}
    settings["run"]["precision"] = args.precision
    steps = args.steps
    if args.quick:
        settings["data"].update(num_pairs=4, num_queries=4, seq_len=24, batch_size=8, eval_rows=16)
        settings["optim"]["warmup_steps"] = 2
        settings["run"]["eval_every"] = 3
        steps = 6
    if not args.sequential:
        settings["run"].update(threads=1, progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        jobs = [(False, steps, settings, str(root / "base")), (True, steps, settings, str(root / "fp8"))]
        if not args.no_seed_spread:
            jobs.append((False, steps, settings, str(root / "base_seed1"), 1))
        if args.sequential:
            base, fp8, *other = (run(*job) for job in jobs)
        else:
            with multiprocessing.get_context("spawn").Pool(len(jobs)) as pool:
                base, fp8, *other = pool.starmap(run, jobs)
    gap = fp8["final_loss"] / base["final_loss"] - 1
    eval_gap = fp8["eval_loss"] / base["eval_loss"] - 1
    data = {"settings": settings, "steps": steps, "tail_steps": TAIL, "goal_rel_gap": GOAL, "rel_gap": gap,
            "eval_rel_gap": eval_gap, "within_goal": abs(gap) <= GOAL and abs(eval_gap) <= GOAL,
            args.precision: base, "fp8_blockwise": fp8}
    if other:
        data.update({f"{args.precision}_seed1": other[0], "seed_rel_gap": other[0]["final_loss"] / base["final_loss"] - 1,
                     "seed_eval_rel_gap": other[0]["eval_loss"] / base["eval_loss"] - 1})
    path = write_result(result_name("train_fp8", args.quick), data)
    runs = [(args.precision, base), (f"{args.precision} + fp8 blockwise", fp8)]
    runs += [(f"{args.precision}, seed 1", r) for r in other]
    png = plot(runs, RESULTS / f"{result_name('train_fp8', args.quick)}.png")
    rows = [[name, f"{r['final_loss']:.4f}", f"{r['eval_loss']:.4f}",
             "-" if r["accuracy"] is None else f"{r['accuracy']:.1%}", f"{r['wall_s']:.0f} s"]
            for name, r in ((args.precision, base), (f"{args.precision} + fp8 blockwise", fp8))]
    print(markdown_table(["run", f"train loss (last {TAIL} steps)", "eval loss", "accuracy", "wall"], rows))
    if other:
        print(f"{args.precision} seed 1 vs seed 0 (noise): train loss {data['seed_rel_gap']:+.2%}, "
              f"eval loss {data['seed_eval_rel_gap']:+.2%}")
    print(f"fp8 vs {args.precision}: train loss {gap:+.2%}, eval loss {eval_gap:+.2%} (goal within {GOAL:.0%}); "
          f"max operand error at the last step {fp8['fp8_error_last_step']}")
    print(f"results: {path}, curve: {png}")


if __name__ == "__main__":
    main()

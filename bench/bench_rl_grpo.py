"""GRPO from a briefly supervised checkpoint: `deltamoe train` gives `tiny` a short supervised run
on associative recall (40 steps at a constant lr: the middle of its rise, held-out greedy ~21 %),
then `deltamoe rl` raises its held-out greedy accuracy, starting AdamW from the supervised run's step
count and second moments (`--init-optimizer`); reports both accuracies, the RL wall and CPU time per
step and the curve (bench/results/rl_grpo.png).

Recall's answer is one byte, so the trainer forwards each prompt once and scores all its sampled
answers there (`train/rl/batch.py`). Both phases run through the CLI, as a user would. Held-out
accuracy is exact match of the engine's greedy answers on prompts from the task's eval split (never
trained on by either phase), each with its 95 % Wilson interval; the rise counts as outside noise
when the final interval's low end is above the start's high end. Accuracy figures do not depend on
the machine's load; times do (`cpu_s` per step is the process's CPU time, which the load changes
far less).
Run: python bench/bench_rl_grpo.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, result_name, write_result  # noqa: E402

SFT = """
[model]
preset = "tiny"
[data]
task = "recall"
num_pairs = 8
num_queries = 8
seq_len = 40
batch_size = 32
eval_rows = 128
[optim]
lr = 3e-3
warmup_steps = 20
min_lr_ratio = 1.0         # constant after the warmup: the start sits in the middle of the rise
[run]
steps = {steps}
eval_every = 10
save_every = 0
progress = false
threads = {threads}
"""
RL = {"task": "recall", "num-pairs": 8, "prompts-per-step": 512, "group-size": 8, "updates-per-batch": 1,
      "advantage-norm": "mean", "lr": 3e-3, "warmup-steps": 0, "eval-every": 3, "eval-prompts": 1024,
      "save-every": 0, "temperature": 1.0}


def deltamoe(*args: str) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    subprocess.run([sys.executable, "-m", "deltamoe", *args], check=True, env=env)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a smoke run: 30 supervised steps, 2 RL steps")
    ap.add_argument("--sft-steps", type=int, default=40)
    ap.add_argument("--rl-steps", type=int, default=12)
    # One thread: float sums in one order, so a rerun starts from the same weights (the seeds fix the data
    # and the samples; another thread count changes the weights' last bits, and from there the samples).
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="keep both run folders here (default: a temp folder)")
    args = ap.parse_args()
    sft_steps, rl_steps = (30, 2) if args.quick else (args.sft_steps, args.rl_steps)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        root.mkdir(parents=True, exist_ok=True)
        (root / "sft.toml").write_text(SFT.format(steps=sft_steps, threads=args.threads))
        t0 = time.perf_counter()
        deltamoe("train", "-c", str(root / "sft.toml"), "--out", str(root / "sft"))
        sft_s = time.perf_counter() - t0
        flags = [f"--{k}={v}" for k, v in RL.items()]
        flags.append(f"--init-optimizer={root / 'sft' / 'checkpoints' / f'step-{sft_steps:08d}'}")
        t0 = time.perf_counter()
        deltamoe("rl", "--init", str(root / "sft" / "model"), "--steps", str(rl_steps), "--out", str(root / "rl"),
                 "--threads", str(args.threads), "--no-progress", *flags)
        rl_s = time.perf_counter() - t0
        records = [json.loads(line) for line in (root / "rl" / "metrics.jsonl").read_text().splitlines()]
        evals = [(r["step"], r["eval_accuracy"], *r["eval_ci95"]) for r in records if r.get("eval_accuracy") is not None]
        RESULTS.mkdir(parents=True, exist_ok=True)
        curve = RESULTS / f"{result_name('rl_grpo', args.quick)}.png"
        shutil.copyfile(root / "rl" / "curves.png", curve)
    start, end = evals[0], evals[-1]
    print(f"held-out greedy accuracy ({RL['eval-prompts']} prompts): {start[1]:.1%} [{start[2]:.1%}, {start[3]:.1%}] "
          f"after {sft_steps} supervised steps -> {end[1]:.1%} [{end[2]:.1%}, {end[3]:.1%}] after {rl_steps} GRPO "
          f"steps ({rl_s / 60:.1f} min); curve -> {curve}")
    steps = [r for r in records if r["step"] > 0]
    path = write_result(result_name("rl_grpo", args.quick), {
        "quick": args.quick, "sft_steps": sft_steps, "rl_steps": rl_steps, "rl_settings": RL,
        "threads": args.threads, "sft_s": sft_s, "rl_s": rl_s, "eval_prompts": RL["eval-prompts"],
        "eval_accuracy": [{"step": e[0], "accuracy": e[1], "ci95": [e[2], e[3]]} for e in evals],
        "start_accuracy": start[1], "start_ci95": [start[2], start[3]],
        "final_accuracy": end[1], "final_ci95": [end[2], end[3]], "rise_outside_noise": end[2] > start[3],
        "reward_mean": [r.get("reward_mean") for r in steps],
        "advantage_nonzero": [r.get("advantage_nonzero") for r in steps],
        "logprob_mismatch_max": max((r.get("logprob_mismatch_max") or 0.0) for r in steps),
        "seconds_per_step": {k: sum(r[k] for r in steps) / len(steps) for k in ("rollout_s", "train_s", "sync_s", "cpu_s")},
        "curve": curve.name})
    print(f"-> {path}")


if __name__ == "__main__":
    main()

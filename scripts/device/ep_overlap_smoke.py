"""GPU check of overlapped expert all-to-all (`--ep-chunks`) on NCCL, shown with deltamoe's trace analyzer.

Two ranks (one GPU each, NCCL) train the `tiny` preset with `--ep 2` and bf16 autocast, once with one
exchange per MoE call and once with `--ep-chunks CHUNKS`, profiling steps 2..STEPS-1; the analyzer reads
each run's Kineto traces and reports, per step, the all-to-all kernel time not under any compute kernel
(`exposed_by_kind`), all exposed communication and the step time. Checks: both runs' losses agree
(bf16 matmuls over fewer rows may round differently: 1e-2 relative) and print the before/after figures;
exit status 0 when the runs complete and the losses agree. Needs two CUDA devices (NCCL runs one rank
per device); prints why and exits 1 otherwise. A few minutes.
    python scripts/device/ep_overlap_smoke.py [--chunks 4] [--steps 6] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _rank(rank: int, port: int, out: str, chunks: int, steps: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from deltamoe.train.config import TrainConfig
    from deltamoe.train.trainer import train

    train(TrainConfig.from_dict({
        "model": {"preset": "tiny"}, "data": {"task": "recall", "batch_size": 64, "seq_len": 128, "eval_rows": 8},
        "parallel": {"ep": 2, "ep_chunks": chunks},
        "run": {"out": out, "steps": steps, "profile_steps": f"2:{steps}", "eval_every": 0, "progress": False,
                "precision": "bf16"}}))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", help="keep the runs and their traces here")
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        print(f"{torch.cuda.device_count()} CUDA device(s): NCCL expert parallelism needs two; nothing to check")
        return 1
    from deltamoe.trace.analyze import analyze
    from deltamoe.train.metrics import read_jsonl

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        runs = {}
        for chunks in (1, args.chunks):
            out = root / f"chunks{chunks}"
            mp.spawn(_rank, args=(_port(), str(out), chunks, args.steps), nprocs=2, join=True)
            ex = analyze(str(out / "traces")).report["exposed_by_kind"]
            runs[chunks] = (ex, [m["loss"] for m in read_jsonl(out / "metrics.jsonl")])
            print(f"--ep-chunks {chunks}: exposed all-to-all {ex['by_kind_s_per_step'].get('all_to_all', 0) * 1e3:.2f} "
                  f"ms/step, exposed comm {ex['exposed_s_per_step'] * 1e3:.2f} ms/step, step {ex['step_s'] * 1e3:.1f} ms")
    (_, base), (_, over) = runs[1], runs[args.chunks]
    diff = max(abs(a - b) / abs(a) for a, b in zip(base, over))
    good = len(base) == len(over) == args.steps and diff < 1e-2
    print(f"[{'ok' if good else 'FAIL'}] losses with and without chunks: max relative difference {diff:.2e}")
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())

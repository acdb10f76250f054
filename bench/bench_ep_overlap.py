"""Exposed expert all-to-all time with and without `--ep-chunks` (asynchronous, chunked dispatch/combine):
two gloo ranks train the `tiny` preset with `--ep 2`, profile steps 2..STEPS-1 (`--profile-steps`), and
deltamoe's own trace analyzer reads each run's Kineto traces (`deltamoe trace analyze RUN/traces` shows the
same): per step, the all-to-all time exposed (in flight while the training thread computes nothing:
inside the call, blocked in `work.wait()` / `wait_tensor`), all exposed communication, and the step
time; plus both runs' losses, which overlap must not change.

On gloo the exchanges run on gloo's worker threads while the training thread computes, so chunks can
hide them, but only where a spare core runs gloo's thread beside the training thread; with two cores
for two ranks (each rank a training thread plus gloo's) the exchange and the compute take turns and
the extra chunks' per-exchange costs show instead. On a GPU (NCCL) the all-to-all kernels overlap the
expert kernels: scripts/device/ep_overlap_smoke.py.
Run: python bench/bench_ep_overlap.py [--chunks 4] [--steps 5] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown_table, result_name, write_result  # noqa: E402

LOSS_RTOL = 1e-5  # losses with and without chunks agree to fp32 rounding


def _rank(rank: int, port: int, out: str, chunks: int, steps: int, quick: bool) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from deltamoe.train.config import TrainConfig
    from deltamoe.train.trainer import train

    data = {"task": "recall", "batch_size": 8 if quick else 32, "seq_len": 40, "eval_rows": 8}
    train(TrainConfig.from_dict({
        "model": {"preset": "tiny"}, "data": data,
        "parallel": {"ep": 2, "ep_chunks": chunks},
        "run": {"out": out, "steps": steps, "profile_steps": f"2:{steps}", "eval_every": 0, "progress": False,
                "threads": 1}}))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(chunks: int, steps: int, quick: bool, root: Path) -> dict:
    from deltamoe.trace.analyze import analyze
    from deltamoe.train.metrics import read_jsonl

    out = root / f"chunks{chunks}"
    # Each measurement is a fresh run: another one's checkpoints in its folder are refused by train.
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    mp.spawn(_rank, args=(_port(), str(out), chunks, steps, quick), nprocs=2, join=True)
    report = analyze(str(out / "traces")).report
    exposed = report["exposed_by_kind"]
    return {"traces": str(out / "traces"), "losses": [m["loss"] for m in read_jsonl(out / "metrics.jsonl")],
            "step_s": exposed["step_s"], "exposed_s_per_step": exposed["exposed_s_per_step"],
            "exposed_alltoall_s_per_step": exposed["by_kind_s_per_step"].get("all_to_all", 0.0),
            "exposed_by_kind_s_per_step": exposed["by_kind_s_per_step"],
            "alltoall_ops_per_rank": [r["ops"] for r in (report["alltoall"] or {}).get("ranks", [])],
            "ranks": exposed["ranks"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5, help="steps 2..STEPS-1 are profiled")
    ap.add_argument("--quick", action="store_true", help="8-row batches")
    ap.add_argument("--out", help="keep the run folders and their traces here (default: a temporary folder)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        results = {c: run(c, args.steps, args.quick, root) for c in (1, args.chunks)}
    base, over = results[1], results[args.chunks]
    rows = [[f"--ep-chunks {c}", f"{r['exposed_alltoall_s_per_step'] * 1e3:.0f} ms",
             f"{r['exposed_s_per_step'] * 1e3:.0f} ms", f"{r['step_s'] * 1e3:.0f} ms",
             f"{r['losses'][-1]:.6f}"] for c, r in results.items()]
    print(markdown_table(["run (2 gloo ranks, ep 2, tiny)", "exposed all-to-all / step", "exposed comm / step",
                          "step", "last loss"], rows))
    # The chunks' expert matmuls over fewer rows may round differently: equal up to fp32 rounding.
    diff = max(abs(a - b) / abs(b) for a, b in zip(over["losses"], base["losses"]))
    path = write_result(result_name("ep_overlap", args.quick), {
        "steps_profiled": args.steps - 2, "chunks": args.chunks, "same_losses": diff <= LOSS_RTOL,
        "max_loss_rel_diff": diff, "chunks_1": base, f"chunks_{args.chunks}": over})
    print(f"results: {path}" + ("" if args.out else " (pass --out DIR to keep the traces for `deltamoe trace`)"))


if __name__ == "__main__":
    main()

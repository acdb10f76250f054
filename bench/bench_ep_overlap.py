"""Exposed expert all-to-all time with and without `--ep-chunks` (asynchronous, chunked dispatch/combine):
two gloo ranks train the `tiny` preset with `--ep 2`, profile steps 2..3 (`--profile-steps 2:4`), and
deltamoe's own trace analyzer reads each run's traces: communication time, the part of it hidden
under compute, and the all-to-all time per rank.

On gloo the collectives run on gloo's own threads; the training thread shows the synchronous calls
(chunks 1) or the asynchronous issue and the waits (chunks > 1). On a GPU (NCCL) the same command
shows the overlap of the all-to-all kernels with the expert kernels.
Run: python bench/bench_ep_overlap.py [--chunks 4] [--steps 4] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown_table, result_name, write_result  # noqa: E402


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


def run(chunks: int, steps: int, quick: bool, tmp: Path) -> dict:
    from deltamoe.trace.analyze import analyze

    out = tmp / f"chunks{chunks}"
    mp.spawn(_rank, args=(_port(), str(out), chunks, steps, quick), nprocs=2, join=True)
    report = analyze(str(out / "traces")).report
    a2a = report.get("alltoall") or {}
    ov = report["overlap"]
    return {"comm_s": sum(r["comm_s"] for r in ov["ranks"]), "hidden_s": sum(r["overlap_s"] for r in ov["ranks"]),
            "alltoall": a2a, "report": report}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="8-row batches")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {c: run(c, args.steps, args.quick, Path(tmp)) for c in (1, args.chunks)}
    rows = [[f"--ep-chunks {c}", f"{r['comm_s'] * 1e3:.1f} ms", f"{r['hidden_s'] * 1e3:.1f} ms",
             f"{(r['comm_s'] - r['hidden_s']) * 1e3:.1f} ms"] for c, r in results.items()]
    print(markdown_table(["run (2 ranks, ep 2)", "communication", "hidden under compute", "exposed"], rows))
    path = write_result(result_name("ep_overlap", args.quick),
                        {"steps_profiled": args.steps - 2, **{f"chunks_{c}": {k: v for k, v in r.items() if k != "report"}
                                                              for c, r in results.items()}})
    print(f"results: {path}")
    print(json.dumps({c: r["alltoall"] for c, r in results.items()}, indent=1)[:2000])


if __name__ == "__main__":
    main()

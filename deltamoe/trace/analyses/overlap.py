"""How much communication is hidden under compute, per rank and for the job."""

from __future__ import annotations

import numpy as np

from deltamoe.trace.summary import RankSummary


def overlap(summaries: list[RankSummary]) -> dict:
    comm = np.array([s.comm.sum() for s in summaries], dtype=float)
    hidden = np.array([s.overlap.sum() for s in summaries], dtype=float)
    frac = np.divide(hidden, comm, out=np.zeros_like(comm), where=comm > 0)
    return {
        "job_overlap_fraction": float(hidden.sum() / comm.sum()) if comm.sum() > 0 else 0.0,
        "ranks": [{"rank": s.rank, "comm_s": float(c) / 1e6, "overlap_s": float(h) / 1e6,
                   "overlap_fraction": round(float(f), 4)}
                  for s, c, h, f in zip(summaries, comm, hidden, frac)],
    }

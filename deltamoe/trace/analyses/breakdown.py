"""Per rank: compute / communication / memcpy / idle time, summed over the kept steps.

compute + exposed communication + memcpy + idle = step time; `overlap_s` is the
communication hidden under compute, so comm_s = exposed + overlap.
"""

from __future__ import annotations

import numpy as np

from deltamoe.trace.summary import RankSummary


def breakdown(summaries: list[RankSummary]) -> list[dict]:
    rows = []
    for s in summaries:
        step = s.step_time
        rows.append({
            "rank": s.rank, "host": s.host, "mode": s.mode, "steps": len(s.step_ids),
            "time_s": float(step.sum()) / 1e6,
            "compute_s": float(s.compute.sum()) / 1e6,
            "comm_s": float(s.comm.sum()) / 1e6,
            "exposed_comm_s": float((s.comm - s.overlap).sum()) / 1e6,
            "overlap_s": float(s.overlap.sum()) / 1e6,
            "memcpy_s": float(s.memcpy.sum()) / 1e6,
            "idle_s": float(s.idle.sum()) / 1e6,
            "step_s": [round(float(x) / 1e6, 6) for x in step],
        })
    return rows


def totals(rows: list[dict]) -> dict:
    """Job-wide fractions of rank time."""
    t = sum(r["time_s"] for r in rows) or 1.0
    return {k.replace("_s", "_fraction"): sum(r[k] for r in rows) / t
            for k in ("compute_s", "exposed_comm_s", "memcpy_s", "idle_s")}


def per_step_matrix(summaries: list[RankSummary], field: str) -> tuple[np.ndarray, np.ndarray]:
    """(ranks x steps) matrix of one per-step field, aligned on step ids (NaN where missing)."""
    ids = np.unique(np.concatenate([s.step_ids for s in summaries])) if summaries else np.zeros(0)
    m = np.full((len(summaries), len(ids)), np.nan)
    for i, s in enumerate(summaries):
        vals = s.step_time if field == "step" else getattr(s, field)
        m[i, np.searchsorted(ids, s.step_ids)] = vals
    return ids, m

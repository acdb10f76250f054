"""Exposed communication per step (trace/exposed.py): per rank and the mean over ranks, in all and
per collective kind, next to the step time it is part of."""

from __future__ import annotations

import numpy as np

from deltamoe.trace.summary import RankSummary


def _mean_s(x: np.ndarray) -> float:
    return round(float(x.mean()) / 1e6, 6) if len(x) else 0.0


def exposed(summaries: list[RankSummary]) -> dict:
    ranks = [{"rank": s.rank, "steps": len(s.step_ids), "step_s": _mean_s(s.step_time),
              "exposed_s_per_step": _mean_s(s.exposed),
              "by_kind_s_per_step": {k: _mean_s(v) for k, v in s.exposed_kind.items()}}
             for s in summaries]
    kinds = sorted({k for r in ranks for k in r["by_kind_s_per_step"]})
    return {
        "exposed_s_per_step": round(float(np.mean([r["exposed_s_per_step"] for r in ranks])), 6),
        "by_kind_s_per_step": {k: round(float(np.mean([r["by_kind_s_per_step"].get(k, 0.0) for r in ranks])), 6)
                               for k in kinds},
        "step_s": round(float(np.mean([r["step_s"] for r in ranks])), 6),
        "ranks": ranks,
    }

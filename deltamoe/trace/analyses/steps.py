"""Step-time distribution over ranks and steps, and the steps that stand out."""

from __future__ import annotations

import numpy as np

from deltamoe.trace.analyses.breakdown import per_step_matrix
from deltamoe.trace.summary import RankSummary


def step_times(summaries: list[RankSummary], threshold: float = 0.15) -> dict:
    ids, m = per_step_matrix(summaries, "step")
    if m.size == 0 or np.all(np.isnan(m)):
        return {"steps": [], "outlier_steps": [], "distribution": {}}
    # A step takes as long as its slowest rank; ranks overlap their steps only slightly.
    job = np.nanmax(m, axis=0) / 1e6
    med = float(np.median(job))
    mad = float(np.median(np.abs(job - med))) or 1e-12
    outliers = [int(i) for i, t in zip(ids, job) if t > med * (1 + threshold) and t - med > 4 * mad]
    flat = m[~np.isnan(m)] / 1e6
    return {
        "steps": [{"step": int(i), "time_s": round(float(t), 6),
                   "rank_min_s": round(float(np.nanmin(m[:, k]) / 1e6), 6),
                   "rank_median_s": round(float(np.nanmedian(m[:, k]) / 1e6), 6)}
                  for k, (i, t) in enumerate(zip(ids, job))],
        "outlier_steps": outliers,
        "distribution": {q: round(float(np.percentile(flat, p)), 6)
                         for q, p in (("p10", 10), ("p50", 50), ("p90", 90), ("p99", 99))}
                        | {"max": round(float(flat.max()), 6), "mean": round(float(flat.mean()), 6)},
    }

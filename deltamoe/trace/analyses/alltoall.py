"""MoE all-to-all imbalance: bytes and time per rank, and the ranks that get more than their share.

With skewed routing the hot expert's rank receives more tokens in dispatch (and returns more
in combine), so its all-to-all payload and its expert compute grow; the others wait for it.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from deltamoe.trace.join import Joined

HOT = 1.25  # payload above 1.25x its group's median marks a hot rank


def alltoall(j: Joined) -> dict | None:
    a2a = np.flatnonzero(j.kind == "all_to_all")
    if not len(a2a):
        return None
    nbytes: dict[int, int] = defaultdict(int)
    time_s: dict[int, float] = defaultdict(float)
    wait_s: dict[int, float] = defaultdict(float)
    count: dict[int, int] = defaultdict(int)
    group_of: dict[int, str] = {}
    for i in a2a.tolist():
        r = int(j.rank[i])
        nbytes[r] += int(j.nbytes[i])
        time_s[r] += float(j.end[i] - j.arrive[i]) / 1e6
        wait_s[r] += float(j.wait[i]) / 1e6
        count[r] += 1
        group_of.setdefault(r, str(j.pg[i]))
    groups: dict[str, list[int]] = defaultdict(list)
    for r, g in group_of.items():
        groups[g].append(r)
    hot, imbalance = [], []
    for g, ranks in groups.items():
        b = np.array([nbytes[r] for r in ranks], dtype=float)
        med = float(np.median(b)) or 1.0
        imbalance.append(float(b.max() / b.mean()) if b.mean() > 0 else 1.0)
        hot += [{"rank": r, "group": g, "bytes_vs_median": round(nbytes[r] / med, 3)}
                for r in ranks if nbytes[r] > HOT * med]
    return {
        "max_over_mean_bytes": round(max(imbalance), 4),
        "hot_ranks": sorted(hot, key=lambda h: -h["bytes_vs_median"]),
        "ranks": [{"rank": r, "bytes": nbytes[r], "ops": count[r], "time_s": round(time_s[r], 6),
                   "wait_s": round(wait_s[r], 6)} for r in sorted(nbytes)],
    }

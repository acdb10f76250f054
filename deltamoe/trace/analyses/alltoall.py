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
    # Per-rank sums in one pass each (bincount adds in row order, as a loop would).
    ranks, first, inv = np.unique(j.rank[a2a], return_index=True, return_inverse=True)
    keys = ranks.tolist()
    nbytes = dict(zip(keys, np.bincount(inv, weights=j.nbytes[a2a]).astype(np.int64).tolist()))
    time_s = dict(zip(keys, np.bincount(inv, weights=(j.end[a2a] - j.arrive[a2a]) / 1e6).tolist()))
    wait_s = dict(zip(keys, np.bincount(inv, weights=j.wait[a2a] / 1e6).tolist()))
    count = dict(zip(keys, np.bincount(inv).tolist()))
    # gloo records an all-to-all's payload only with record_shapes=True (-1 otherwise): with a
    # rank's bytes unknown nothing can be said about the balance, rather than "balanced".
    unknown = set(np.unique(j.rank[a2a][j.nbytes[a2a] < 0]).tolist())
    groups: dict[str, list[int]] = defaultdict(list)
    for k in np.argsort(first, kind="stable").tolist():  # ranks in order of first appearance
        groups[str(j.pg[a2a[first[k]]])].append(keys[k])
    hot, imbalance = [], []
    for g, ranks in groups.items():
        if unknown.intersection(ranks):
            continue
        b = np.array([nbytes[r] for r in ranks], dtype=float)
        med = float(np.median(b)) or 1.0
        imbalance.append(float(b.max() / b.mean()) if b.mean() > 0 else 1.0)
        hot += [{"rank": r, "group": g, "bytes_vs_median": round(nbytes[r] / med, 3)}
                for r in ranks if nbytes[r] > HOT * med]
    return {
        "max_over_mean_bytes": round(max(imbalance), 4) if imbalance else None,
        "bytes_known": not unknown,
        "hot_ranks": sorted(hot, key=lambda h: -h["bytes_vs_median"]),
        "ranks": [{"rank": r, "bytes": None if r in unknown else nbytes[r], "ops": count[r],
                   "time_s": round(time_s[r], 6), "wait_s": round(wait_s[r], 6)} for r in sorted(nbytes)],
    }

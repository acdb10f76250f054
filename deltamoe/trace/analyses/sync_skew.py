"""Collective time split into waiting for late peers (synchronisation skew) and the transfer.

A member's time in a collective runs from its own arrival to the end. Until the last member
arrives nothing can move: that part is skew, caused by whoever was late; the rest is the
transfer itself (AMD's TraceLens splits collective time the same way). Per rank and per
group; instances some member lacks (join.py) are left out, their last arrival is unknown.
"""

from __future__ import annotations

import numpy as np

from deltamoe.trace.join import Joined


def sync_skew(j: Joined) -> dict | None:
    rows = np.flatnonzero(j.inst_complete[j.inst]) if len(j.inst) else np.zeros(0, dtype=np.int64)
    if not len(rows):
        return None
    dur = np.maximum(j.end[rows] - j.arrive[rows], 0.0)
    wait = np.minimum(j.wait[rows], dur)
    transfer = dur - wait
    ranks, r_inv = np.unique(j.rank[rows], return_inverse=True)
    per_rank = []
    for r, w, t in zip(ranks.tolist(), np.bincount(r_inv, weights=wait).tolist(),
                       np.bincount(r_inv, weights=transfer).tolist()):
        per_rank.append({"rank": r, "sync_wait_s": round(w / 1e6, 6), "transfer_s": round(t / 1e6, 6),
                         "sync_fraction": round(w / (w + t), 4) if w + t > 0 else 0.0})
    keys = [f"{pg}\x00{kind}" for pg, kind in zip(j.pg[rows].tolist(), j.kind[rows].tolist())]
    names, g_inv = np.unique(np.array(keys, dtype=object), return_inverse=True)
    inst_of = j.inst[rows]
    per_group = []
    for g, key in enumerate(names.tolist()):
        pg, kind = key.split("\x00")
        mine = g_inv == g
        insts = np.unique(inst_of[mine])
        skew = j.inst_skew[insts]
        w, t = float(wait[mine].sum()), float(transfer[mine].sum())
        per_group.append({"group": pg, "kind": kind, "instances": int(len(insts)),
                          "sync_wait_s": round(w / 1e6, 6), "transfer_s": round(t / 1e6, 6),
                          "sync_fraction": round(w / (w + t), 4) if w + t > 0 else 0.0,
                          "mean_skew_s": round(float(skew.mean()) / 1e6, 6),
                          "max_skew_s": round(float(skew.max()) / 1e6, 6)})
    per_group.sort(key=lambda g: -g["sync_wait_s"])
    w_all, t_all = float(wait.sum()), float(transfer.sum())
    return {"sync_wait_s": round(w_all / 1e6, 6), "transfer_s": round(t_all / 1e6, 6),
            "sync_fraction": round(w_all / (w_all + t_all), 4) if w_all + t_all > 0 else 0.0,
            "ranks": per_rank, "groups": per_group[:64]}

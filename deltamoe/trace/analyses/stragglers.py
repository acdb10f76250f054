"""Stragglers: the ranks others wait for, with the evidence.

For every joined collective the last arriver costs each other member (its arrival - theirs).
A late arrival is passed on to whoever made that rank late: if the last arriver itself sat in
a pipeline recv for at least half its lateness in that step, the blame moves to the sender
(repeatedly, along the pipeline). That is what keeps the downstream stages of a slow stage
from being blamed, which start-time heuristics (HTA) get wrong on pipeline traces. Pipeline recv
waits beyond what the same hop waits in the other replicas are blamed on the sender.

score = the mean wait of the other members, summed over the collectives the rank held up,
per step, as a fraction of the median step time. A rank is a straggler when its score is well above the job's typical score (robust
z > 5) and above `min_score`; the evidence says which collectives, how long others waited,
and how the rank's own compute per step compares with its peers (same pipeline stage).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from deltamoe.trace.join import Joined
from deltamoe.trace.summary import RankSummary

MIN_SCORE = 0.03


def stragglers(j: Joined, summaries: list[RankSummary], stage_of: dict[int, int] | None = None,
               hot_ranks: set[int] | None = None, min_score: float = MIN_SCORE) -> dict:
    stage_of = stage_of or {}
    by_rank = {s.rank: s for s in summaries}
    steps = max(1, int(np.median([len(s.step_ids) for s in summaries]))) if summaries else 1
    step_time = float(np.median(np.concatenate([s.step_time for s in summaries]))) if summaries else 1.0
    waits = _WaitIndex(j)
    blame: dict[int, float] = defaultdict(float)
    total: dict[int, float] = defaultdict(float)
    late_steps: dict[int, set[int]] = defaultdict(set)
    evidence: dict[int, dict] = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    first_row = np.full(j.instances, -1, dtype=np.int64)
    first_row[j.inst[::-1]] = np.arange(len(j.inst))[::-1]
    t_last_of = j.arrive[first_row] + j.wait[first_row]  # any member's arrival + wait = last arrival
    for inst in np.argsort(t_last_of, kind="stable"):
        row = first_row[inst]
        last = int(j.inst_last[inst])
        t_last = float(t_last_of[inst])
        root = waits.root(last, int(j.step[row]), t_last, t_last - float(j.inst_skew[inst]))
        waits.inst_root[int(inst)] = root
        if j.inst_size[inst] < 2 or j.inst_blame[inst] <= 0:
            continue
        # Scored per member (mean wait of the others), so one late arrival at a 5,000-rank
        # all-reduce does not outweigh being late at every expert exchange.
        blame[root] += float(j.inst_blame[inst]) / (int(j.inst_size[inst]) - 1)
        total[root] += float(j.inst_blame[inst])
        late_steps[root].add(int(j.step[row]))
        label = f"{j.kind[row]} pg={j.pg[row] or '?'}" + ("" if root == last else " (passed on)")
        ev = evidence[root][label]
        ev[0] += 1
        ev[1] += float(j.inst_blame[inst])
    for (src, step), waited in _sender_blame(j, stage_of).items():
        blame[src] += waited
        total[src] += waited
        late_steps[src].add(step)
        ev = evidence[src]["pipeline send (receiver waited)"]
        ev[0] += 1
        ev[1] += waited
    scores = {r: blame.get(r, 0.0) / steps / step_time for r in by_rank}
    vals = np.array(list(scores.values()) or [0.0])
    med = float(np.median(vals))
    mad = max(float(np.median(np.abs(vals - med))) * 1.4826, 1e-3)
    compute = _compute_vs_peers(summaries, stage_of)
    out, excluded = [], []
    for r, sc in sorted(scores.items(), key=lambda kv: -kv[1]):
        z = (sc - med) / mad
        # A straggler is late again and again: in at least half of the steps.
        if sc < min_score or z < 5 or len(late_steps[r]) < max(1, steps // 2):
            continue
        item = {
            "rank": r, "host": by_rank[r].host, "score": round(sc, 4), "robust_z": round(float(z), 1),
            "others_waited_s": round(total[r] / 1e6, 6), "steps_late": len(late_steps[r]),
            "collectives": [{"op": k, "count": c, "others_waited_s": round(t / 1e6, 6)}
                            for k, (c, t) in sorted(evidence[r].items(), key=lambda kv: -kv[1][1])[:5]],
            "compute_vs_peers": round(compute.get(r, 1.0), 3),
            "own_compute_slower": compute.get(r, 1.0) > 1.05,
        }
        if hot_ranks and r in hot_ranks:
            item["cause"] = "moe_imbalance"
            excluded.append(item)
            continue
        item["cause"] = "slow compute" if item["own_compute_slower"] else "late (host, launch or input)"
        out.append(item)
    ranking = sorted(scores.items(), key=lambda kv: -kv[1])
    return {"stragglers": out, "explained_by_imbalance": excluded,
            "ranking": [{"rank": r, "score": round(s, 4)} for r, s in ranking[:64]],
            "median_score": round(med, 5), "min_score": min_score}


class _WaitIndex:
    """Per (rank, step): when each communication op released the rank, and why.

    A late arrival is inherited when the rank was still blocked (in a collective, including
    the transfer, or in a pipeline recv) well after the first member had arrived. Then the
    blame goes to the root of the collective that held it (instances are resolved in time
    order, so that root is known), or up the pipeline to the sender of the recv.
    """

    def __init__(self, j: Joined):
        rows: dict[tuple[int, int], list[tuple[float, int, int]]] = defaultdict(list)
        for r, st, e, inst in zip(j.rank.tolist(), j.step.tolist(), j.end.tolist(), j.inst.tolist()):
            rows[(r, st)].append((e, inst, -1))
        for d, st, e, w, s in zip(j.p2p_dst.tolist(), j.p2p_step.tolist(), j.p2p_end.tolist(),
                                  j.p2p_wait.tolist(), j.p2p_src.tolist()):
            if w > 0:
                rows[(d, st)].append((e, -1, s))
        self.idx = {}
        for key, lst in rows.items():
            lst.sort()
            a = np.array(lst, dtype=float)
            self.idx[key] = (a[:, 0], a[:, 1].astype(np.int64), a[:, 2].astype(np.int64))
        self.inst_root: dict[int, int] = {}

    def root(self, rank: int, step: int, t_last: float, t_first: float, depth: int = 64) -> int:
        half = 0.5 * (t_last - t_first)
        for _ in range(depth):
            e = self.idx.get((rank, step))
            if e is None:
                return rank
            n = int(np.searchsorted(e[0], t_last + 1e-3, side="right"))
            if n == 0 or e[0][n - 1] - t_first < half:
                return rank
            inst, sender = int(e[1][n - 1]), int(e[2][n - 1])
            if inst >= 0:
                return self.inst_root.get(inst, rank)
            rank, t_last = sender, float(e[0][n - 1])
        return rank


def _sender_blame(j: Joined, stage_of: dict[int, int]) -> dict[tuple[int, int], float]:
    """Pipeline recv waits beyond what the same hop waits in the other pipelines.

    Waiting for the previous stage is normal (that is the bubble); only the excess over the
    same (stage pair, step, message) in the other data-parallel replicas points at a sender.
    """
    groups: dict[tuple, list[int]] = defaultdict(list)
    seen: dict[tuple[int, int, int], int] = defaultdict(int)
    for i, (s, d, st) in enumerate(zip(j.p2p_src.tolist(), j.p2p_dst.tolist(), j.p2p_step.tolist())):
        k = seen[(s, d, st)]
        seen[(s, d, st)] += 1
        groups[(stage_of.get(s, -1), stage_of.get(d, -1), st, k)].append(i)
    out: dict[tuple[int, int], float] = defaultdict(float)
    for rows in groups.values():
        if len(rows) < 3:
            continue
        w = j.p2p_wait[rows]
        excess = w - np.median(w)
        for i, x in zip(rows, excess.tolist()):
            if x > 0:
                out[(int(j.p2p_src[i]), int(j.p2p_step[i]))] += x
    return out


def _compute_vs_peers(summaries: list[RankSummary], stage_of: dict[int, int]) -> dict[int, float]:
    """Rank's median compute per step / median of its peers (same stage, or everyone)."""
    per = {s.rank: float(np.median(s.compute)) if len(s.compute) else 0.0 for s in summaries}
    classes: dict[int, list[float]] = defaultdict(list)
    for r, c in per.items():
        classes[stage_of.get(r, 0)].append(c)
    med = {k: float(np.median(v)) for k, v in classes.items()}
    return {r: (c / med[stage_of.get(r, 0)] if med[stage_of.get(r, 0)] > 0 else 1.0) for r, c in per.items()}

"""Stragglers: the ranks others wait for, with the evidence.

For every joined collective the last arriver costs each other member (its arrival - theirs).
Only the part of that lateness the rank produced itself is blamed on it: if it had been
held (in another collective or a pipeline recv) until after the first member arrived, the
held part was blamed where it arose, at that collective or on that sender. This local
critical-path rule is what keeps a slow stage's downstream stages, and the innocent members
of a late expert group, from being blamed; start-time heuristics (HTA) blame them. Pipeline
recv waits beyond what the same hop waits in the other replicas go to the sender by the
same rule.

score = the others' mean wait caused by the rank, per step, as a fraction of the median
step time. A rank is a straggler when its score is above `min_score`, far above the job's
typical score and it was late in at least half of the steps. "Far above": robust z > 5 (the
median and MAD of all scores); in a job of fewer than `SMALL_JOB` ranks, where a median and
MAD of a handful of scores are no baseline (one noisy peer doubles the MAD), the top rank
also qualifies when its score is at least `DOMINANCE` times every other rank's. The evidence
says which collectives, how long others waited, and how the rank's own compute per step
compares with its peers (same pipeline stage).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict

import numpy as np

from deltamoe.trace.join import Joined
from deltamoe.trace.summary import RankSummary

MIN_SCORE = 0.03
Z_MIN = 5.0
SMALL_JOB = 8     # ranks: below this the robust z has too few scores to stand on
DOMINANCE = 3.0   # small jobs: the top score over the next one that names the top rank


def stragglers(j: Joined, summaries: list[RankSummary], stage_of: dict[int, int] | None = None,
               hot_ranks: set[int] | None = None, min_score: float = MIN_SCORE) -> dict:
    stage_of = stage_of or {}
    by_rank = {s.rank: s for s in summaries}
    steps = max(1, int(np.median([len(s.step_ids) for s in summaries]))) if summaries else 1
    step_time = float(np.median(np.concatenate([s.step_time for s in summaries]))) if summaries else 1.0
    releases = _Releases(j)
    blame: dict[int, float] = defaultdict(float)
    total: dict[int, float] = defaultdict(float)
    late_steps: dict[int, set[int]] = defaultdict(set)
    evidence: dict[int, dict] = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))

    def charge(rank: int, step: int, label: str, per_member: float, waited: float) -> None:
        blame[rank] += per_member
        total[rank] += waited
        late_steps[rank].add(step)
        ev = evidence[rank][label]
        ev[0] += 1
        ev[1] += waited

    first_row = np.full(j.instances, -1, dtype=np.int64)
    first_row[j.inst[::-1]] = np.arange(len(j.inst))[::-1]
    # Collectives some member lacks are no evidence: who was last is unknown (join.py warns).
    late = np.flatnonzero((j.inst_size >= 2) & (j.inst_blame > 0) & j.inst_complete)
    rows = first_row[late]
    # Plain Python values: this loop runs once per collective instance of the whole job.
    for last, step, skew, t_last, kind, pg, inst_blame, size in zip(
            j.inst_last[late].tolist(), j.step[rows].tolist(), j.inst_skew[late].tolist(),
            (j.arrive[rows] + j.wait[rows]).tolist(),  # any member's arrival + wait = last arrival
            j.kind[rows].tolist(), j.pg[rows].tolist(), j.inst_blame[late].tolist(), j.inst_size[late].tolist()):
        own = releases.own_part(last, step, t_last, t_last - skew)
        if own <= 0:
            continue
        share = own / skew
        # Per member (the others' mean wait), so one late arrival at a 5,000-rank all-reduce
        # does not outweigh being late at every expert exchange.
        charge(last, step, f"{kind} pg={pg or '?'}", share * inst_blame / (size - 1), share * inst_blame)
    for src, step, t_send, excess in _sender_blame(j, stage_of):
        own = releases.own_part(src, step, t_send, t_send - excess)
        if own > 0:
            charge(src, step, "pipeline send (receiver waited)", own, own)
    scores = {r: blame.get(r, 0.0) / steps / step_time for r in by_rank}
    vals = np.array(list(scores.values()) or [0.0])
    med = float(np.median(vals))
    mad = max(float(np.median(np.abs(vals - med))) * 1.4826, 1e-3)
    compute = _compute_vs_peers(summaries, stage_of)
    out, excluded = [], []
    ranked = sorted(scores.items(), key=lambda kv: -kv[1])
    for place, (r, sc) in enumerate(ranked):
        z = (sc - med) / mad
        over_next = sc / max(ranked[1][1], 1e-9) if place == 0 and len(ranked) > 1 else 0.0
        if z >= Z_MIN:
            test = f"robust z {z:.1f} > {Z_MIN:g}"
        elif len(ranked) < SMALL_JOB and over_next >= DOMINANCE:
            test = (f"{over_next:.1f}x the next rank's score ({len(ranked)} ranks: too few for a robust z, "
                    f">= {DOMINANCE:g}x asked)")
        else:
            continue
        # A straggler is late again and again: in at least half of the steps.
        if sc < min_score or len(late_steps[r]) < max(1, steps // 2):
            continue
        item = {
            "rank": r, "host": by_rank[r].host, "score": round(sc, 4), "robust_z": round(float(z), 1), "test": test,
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
    return {"stragglers": out, "explained_by_imbalance": excluded,
            "ranking": [{"rank": r, "score": round(s, 4)} for r, s in ranked[:64]],
            "median_score": round(med, 5), "min_score": min_score}


class _Releases:
    """Per (rank, step): when a peer released the rank (end of a collective or recv it waited in)."""

    def __init__(self, j: Joined):
        # The ends of the ops each (rank, step) waited in, sorted: one sort for the whole job.
        held, p2p_held = j.wait > 0, j.p2p_wait > 0
        r = np.concatenate([j.rank[held], j.p2p_dst[p2p_held]]).astype(np.int64)
        st = np.concatenate([j.step[held], j.p2p_step[p2p_held]]).astype(np.int64)
        e = np.concatenate([j.end[held], j.p2p_end[p2p_held]]).astype(float)
        order = np.lexsort((e, st, r))
        r, st, e = r[order], st[order], e[order].tolist()
        starts = np.flatnonzero(np.r_[True, (r[1:] != r[:-1]) | (st[1:] != st[:-1])]) if len(r) else r
        bounds = [*starts.tolist(), len(e)]
        self.idx = {(a_r, a_st): e[a:b] for a_r, a_st, a, b in
                    zip(r[starts].tolist(), st[starts].tolist(), bounds[:-1], bounds[1:])}

    def own_part(self, rank: int, step: int, t_arrive: float, t_ref: float) -> float:
        """Lateness after t_ref that the rank spent on its own work, not held by others."""
        e = self.idx.get((rank, step))
        released = t_ref
        if e is not None:
            n = bisect_right(e, t_arrive + 1e-3)
            if n:
                released = max(t_ref, e[n - 1])
        return max(0.0, t_arrive - released)


def _sender_blame(j: Joined, stage_of: dict[int, int]) -> list[tuple[int, int, float, float]]:
    """Pipeline recv waits beyond what the same hop waits in the other pipelines.

    Returns (sender, step, send time, excess wait). With two replicas the faster one is the baseline.

    Waiting for the previous stage is normal (that is the bubble); only the excess over the
    same (stage pair, step, message) in the other data-parallel replicas points at a sender.
    """
    groups: dict[tuple, list[int]] = defaultdict(list)
    seen: dict[tuple[int, int, int], int] = defaultdict(int)
    src, step, send = j.p2p_src.tolist(), j.p2p_step.tolist(), j.p2p_send.tolist()
    for i, (s, d, st) in enumerate(zip(src, j.p2p_dst.tolist(), step)):
        k = seen[(s, d, st)]
        seen[(s, d, st)] += 1
        groups[(stage_of.get(s, -1), stage_of.get(d, -1), st, k)].append(i)
    out = []
    for rows in groups.values():
        if len(rows) < 2:
            continue
        w = j.p2p_wait[rows]
        excess = w - (np.median(w) if len(rows) >= 3 else w.min())
        for i, x in zip(rows, excess.tolist()):
            if x > 0:
                out.append((src[i], step[i], send[i], x))
    return out


def _compute_vs_peers(summaries: list[RankSummary], stage_of: dict[int, int]) -> dict[int, float]:
    """Rank's median compute per step / median of its peers (same stage, or everyone)."""
    per = {s.rank: _median(s.compute) if len(s.compute) else 0.0 for s in summaries}
    classes: dict[int, list[float]] = defaultdict(list)
    for r, c in per.items():
        classes[stage_of.get(r, 0)].append(c)
    med = {k: float(np.median(v)) for k, v in classes.items()}
    return {r: (c / med[stage_of.get(r, 0)] if med[stage_of.get(r, 0)] > 0 else 1.0) for r, c in per.items()}


def _median(x: np.ndarray) -> float:
    """float(np.median(x)) of a short 1-D array (a rank's steps) without numpy's ~25 us per call."""
    v = sorted(x.tolist())
    n = len(v)
    if n == 0 or any(t != t or t == 0 for t in v):  # NaN, or zeros whose sign numpy picks its own way
        return float(np.median(x))
    return float(v[n // 2]) if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2

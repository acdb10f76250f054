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
    # Collectives some member lacks are no evidence: who was last is unknown (join.py warns);
    # nor are gloo ops placed in no process group (their partners are a guess).
    placed = np.array([not str(g).startswith("?") for g in j.pg[first_row].tolist()], dtype=bool)
    late = np.flatnonzero((j.inst_size >= 2) & (j.inst_blame > 0) & j.inst_complete & placed)
    rows = first_row[late]
    replicated = _replicated_stages(stage_of)
    unresolved = 0
    # Plain Python values: this loop runs once per collective instance of the whole job.
    for last, first, step, skew, t_last, kind, pg, inst_blame, size in zip(
            j.inst_last[late].tolist(), j.inst_first[late].tolist(), j.step[rows].tolist(), j.inst_skew[late].tolist(),
            (j.arrive[rows] + j.wait[rows]).tolist(),  # any member's arrival + wait = last arrival
            j.kind[rows].tolist(), j.pg[rows].tolist(), j.inst_blame[late].tolist(), j.inst_size[late].tolist()):
        if skew <= 0:  # inst_blame > 0 from rounding alone
            continue
        t_ref = t_last - skew
        if releases.held_unpaired(last, step, t_ref, t_last):
            # Held in a recv whose sender is unknown: whose lateness it was cannot be told.
            unresolved += 1
            continue
        per_wait = inst_blame / skew  # the others' total wait per us of lateness
        own = releases.own_part(last, step, t_last, t_ref, first)
        if own > 0:
            # Per member (the others' mean wait), so one late arrival at a 5,000-rank all-reduce
            # does not outweigh being late at every expert exchange.
            charge(last, step, f"{kind} pg={pg or '?'}", own * per_wait / (size - 1), own * per_wait)
        for src, src_own in _held_by_senders(releases, stage_of, replicated, last, step, t_last, t_ref):
            charge(src, step, "pipeline send (receiver waited)", src_own * per_wait / (size - 1), src_own * per_wait)
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
            # A ratio over a zero score is no number to print.
            than = "the others scored 0" if ranked[1][1] <= 0 else f"{over_next:.1f}x the next rank's score"
            test = f"{than} ({len(ranked)} ranks: too few for a robust z, >= {DOMINANCE:g}x asked)"
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
            "median_score": round(med, 5), "min_score": min_score, "unresolved_instances": unresolved}


class _Releases:
    """Per (rank, step): when a peer released the rank (end of a collective or recv it waited in),
    and when each of its communication ops ended (waited in or not)."""

    def __init__(self, j: Joined):
        # The ends of the ops each (rank, step) waited in, sorted: one sort for the whole job.
        held, p2p_held = j.wait > 0, j.p2p_wait > 0
        self.idx = _ends_by_rank_step(np.concatenate([j.rank[held], j.p2p_dst[p2p_held]]),
                                      np.concatenate([j.step[held], j.p2p_step[p2p_held]]),
                                      np.concatenate([j.end[held], j.p2p_end[p2p_held]]))
        self.ends = _ends_by_rank_step(np.concatenate([j.rank, j.p2p_dst]), np.concatenate([j.step, j.p2p_step]),
                                       np.concatenate([j.end, j.p2p_end]))
        # Matched recvs by (receiver, step, end): who sent, and when.
        self.recv_from = {(d, st, e): (s, t) for s, d, st, e, t in zip(
            j.p2p_src.tolist(), j.p2p_dst.tolist(), j.p2p_step.tolist(), j.p2p_end.tolist(), j.p2p_send.tolist())}
        lone = getattr(j, "p2p_unpaired", None) or {}
        recv = lone["kind"] == "recv" if lone else np.zeros(0, dtype=bool)
        self.lone_recv = _ends_by_rank_step(lone["rank"][recv], lone["step"][recv], lone["end"][recv]) if lone else {}

    def held_unpaired(self, rank: int, step: int, t_ref: float, t_arrive: float) -> bool:
        """Did an unpaired recv (sender unknown) hold the rank after t_ref?"""
        e = self.lone_recv.get((rank, step))
        return e is not None and bisect_right(e, t_arrive + 1e-3) > bisect_right(e, t_ref)

    def held_by_recv(self, rank: int, step: int, t_arrive: float, t_ref: float) -> tuple[int, float] | None:
        """(sender, send time) of the matched recv that last released the rank, when that came after t_ref."""
        e = self.idx.get((rank, step))
        n = bisect_right(e, t_arrive + 1e-3) if e is not None else 0
        if not n or e[n - 1] <= t_ref:
            return None
        return self.recv_from.get((rank, step, e[n - 1]))

    def own_part(self, rank: int, step: int, t_arrive: float, t_ref: float, ref_rank: int | None = None) -> float:
        """Lateness after t_ref that the rank spent on its own work, not held by others.

        `ref_rank`: the member that arrived first (at t_ref). A rank released from its previous
        op before t_ref was still late if that release came later than the first arriver's: the
        delay it carried in was produced elsewhere (an expert exchange waiting for a straggler
        of another group) and was blamed there. So its own part is at most how much longer it
        worked since its last op than the first arriver did since its own."""
        released = t_ref
        e = self.idx.get((rank, step))
        if e is not None:
            n = bisect_right(e, t_arrive + 1e-3)
            if n:
                released = max(t_ref, e[n - 1])
        own = max(0.0, t_arrive - released)
        if ref_rank is None or own <= 0:
            return own
        mine, theirs = self._last_end(rank, step, t_arrive), self._last_end(ref_rank, step, t_ref)
        if mine is None or theirs is None:  # the first op of the step on either: nothing to compare
            return own
        return max(0.0, min(own, (t_arrive - mine) - (t_ref - theirs)))

    def _last_end(self, rank: int, step: int, t: float) -> float | None:
        """End of the rank's last op in the step that ended by t (None: none did)."""
        e = self.ends.get((rank, step))
        n = bisect_right(e, t + 1e-3) if e is not None else 0
        return e[n - 1] if n else None


def _ends_by_rank_step(rank: np.ndarray, step: np.ndarray, end: np.ndarray) -> dict[tuple[int, int], list[float]]:
    """{(rank, step): sorted ends}, with one sort for the whole job."""
    r, st, e = rank.astype(np.int64), step.astype(np.int64), end.astype(float)
    order = np.lexsort((e, st, r))
    r, st, e = r[order], st[order], e[order].tolist()
    starts = np.flatnonzero(np.r_[True, (r[1:] != r[:-1]) | (st[1:] != st[:-1])]) if len(r) else r
    bounds = [*starts.tolist(), len(e)]
    return {(a_r, a_st): e[a:b] for a_r, a_st, a, b in
            zip(r[starts].tolist(), st[starts].tolist(), bounds[:-1], bounds[1:])}


MAX_CHAIN = 16  # pipeline hops followed back from a late collective member


def _replicated_stages(stage_of: dict[int, int]) -> set[int]:
    """Pipeline stages held by more than one rank (data-parallel replicas of the pipeline)."""
    count: dict[int, int] = defaultdict(int)
    for st in stage_of.values():
        count[st] += 1
    return {st for st, n in count.items() if n > 1}


def _held_by_senders(releases: "_Releases", stage_of: dict[int, int], replicated: set[int], rank: int, step: int,
                     t_arrive: float, t_ref: float) -> list[tuple[int, float]]:
    """The pipeline senders that held a late collective member in its recv after t_ref, with
    the part of the lateness each produced itself: (sender, own part).

    The recv that released the rank after the first member arrived passes that part of the
    lateness back to its sender, and on up the chain while the sender was itself released
    by a recv after t_ref. A hop whose stage has replicas is judged against them instead
    (`_sender_blame`); without replicas (one pipeline) this is the only way the blame reaches
    a slow stage, since every later stage waits for it."""
    out = []
    for _ in range(MAX_CHAIN):
        hop = releases.held_by_recv(rank, step, t_arrive, t_ref)
        if hop is None:
            break
        src, t_send = hop
        if stage_of.get(src, -1) in replicated or t_send <= t_ref:
            break
        own = releases.own_part(src, step, t_send, t_ref)
        if own > 0:
            out.append((src, own))
        rank, t_arrive = src, t_send
    return out


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

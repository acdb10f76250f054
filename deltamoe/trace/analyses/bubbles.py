"""Pipeline bubbles per stage, measured on the compute stream and compared with the schedule.

Pipelines are found from matched P2P traffic: ranks connected by sends/recvs form one
pipeline; stage 0 is the rank whose first P2P op of a step is a send, and the stage order
follows each stage's first send. Per step and pipeline, the window runs from the earliest
pipeline compute of any stage to the end of the latest; a stage's bubble is the part of
that window in which it neither computed nor exchanged non-pipeline data (MoE all-to-all,
TP all-reduce). That equals (p-1)/(m+p-1) for an ideal 1F1B with uniform stages.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from deltamoe.trace.join import Joined
from deltamoe.trace.summary import RankSummary


def theoretical(p: int, m: int, v: int = 1) -> float:
    """Bubble fraction of the step for 1F1B (v=1) and interleaved 1F1B (v virtual chunks)."""
    return (p - 1) / (v * m + p - 1)


def find_pipelines(j: Joined, summaries: list[RankSummary]) -> list[list[int]]:
    """Ordered stage lists, one per pipeline (data-parallel replica)."""
    if len(j.p2p_src) == 0:
        return []
    parent: dict[int, int] = {}

    def root(x: int) -> int:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x
    for a, b in zip(j.p2p_src.tolist(), j.p2p_dst.tolist()):
        parent[root(a)] = root(b)
    comps: dict[int, list[int]] = defaultdict(list)
    for r in list(parent):
        comps[root(r)].append(r)
    first = j.first_p2p
    out = []
    for ranks in comps.values():
        starts = [r for r in ranks if first.get(r, ("", -1))[0] == "send"]
        if not starts:
            continue
        order = [min(starts)]
        while True:
            nxt = first.get(("send1", order[-1]), ("", None))[1]
            if nxt is None or nxt in order or nxt not in ranks:
                break
            order.append(nxt)
        if len(order) == len(ranks):
            out.append(order)
    return sorted(out)


def bubbles(j: Joined, summaries: list[RankSummary]) -> dict | None:
    pipes = find_pipelines(j, summaries)
    if not pipes:
        return None
    by_rank = {s.rank: s for s in summaries}
    p = max(len(x) for x in pipes)
    m, v = _microbatches(j, pipes)
    per_stage: dict[int, list[float]] = defaultdict(list)
    per_rank: dict[int, list[float]] = defaultdict(list)
    wait_s: dict[int, float] = defaultdict(float)
    # Where each step is in each rank's arrays (step ids are sorted and unique).
    index = {s.rank: {step: i for i, step in enumerate(s.step_ids.tolist())} for s in summaries}
    for stages in pipes:
        sums = [by_rank[r] for r in stages]
        steps = set.intersection(*(set(index[r]) for r in stages))
        for step in sorted(steps):
            idx = [index[s.rank][step] for s in sums]
            first = [s.pipe_first[i] for s, i in zip(sums, idx)]
            last = [s.pipe_end[i] for s, i in zip(sums, idx)]
            if any(x != x for x in first) or any(x != x for x in last):  # NaN: no pipeline compute
                continue
            w = max(last) - min(first)
            if w <= 0:
                continue
            for stage, (s, i) in enumerate(zip(sums, idx)):
                frac = 1.0 - s.pipe_busy[i] / w
                per_stage[stage].append(frac)
                per_rank[s.rank].append(frac)
                wait_s[stage] += s.p2p_wait[i] / 1e6
    theory = theoretical(p, m, v) if m else None
    return {
        "schedule": "interleaved-1f1b" if v > 1 else "1f1b",
        "stages": p, "microbatches": m, "virtual": v, "pipelines": len(pipes),
        "theoretical_bubble_fraction": theory,
        "bubble_fraction": {str(k): round(float(np.mean(x)), 4) for k, x in sorted(per_stage.items())},
        "bubble_fraction_mean": round(float(np.mean([x for xs in per_stage.values() for x in xs])), 4),
        "recv_wait_s": {str(k): round(x, 6) for k, x in sorted(wait_s.items())},
        "rank_bubble_fraction": {str(r): round(float(np.mean(x)), 4) for r, x in sorted(per_rank.items())},
        "stage_of_rank": {str(r): k for stages in pipes for k, r in enumerate(stages)},
        "pipelines_ranks": pipes[:64],
    }


def _microbatches(j: Joined, pipes: list[list[int]]) -> tuple[int, int]:
    """m and v from the traffic of stage 0: m*v forward sends to stage 1, m*(v-1) wrapped recvs."""
    # One pass over the P2P pairs (a mask per pipeline would be quadratic in the ranks).
    fwd = {(st[0], st[1]): i for i, st in enumerate(pipes) if len(st) >= 2}
    wrap = {(st[-1], st[0]): i for i, st in enumerate(pipes) if len(st) > 2}
    per_step: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0, 0])
    for src, dst, step in zip(j.p2p_src.tolist(), j.p2p_dst.tolist(), j.p2p_step.tolist()):
        if (src, dst) in fwd:
            per_step[(fwd[(src, dst)], step)][0] += 1
        if (src, dst) in wrap:
            per_step[(wrap[(src, dst)], step)][1] += 1
    counts = list(per_step.values())
    if not counts:
        return 0, 1
    sends = int(np.median([c[0] for c in counts]))
    wraps = int(np.median([c[1] for c in counts]))
    m = sends - wraps
    if m <= 0:
        return sends, 1
    return m, max(1, round(sends / m))

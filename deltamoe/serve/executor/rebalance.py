"""An EPLB-style placement plan from observed expert load: which rank should hold which expert.

Today rank r of the expert group holds the contiguous slice of experts [r * E/ep, (r + 1) * E/ep).
Given the tokens each expert received, `plan_placement` assigns each layer's experts, heaviest
first, to the rank with the least load so far that still has room (E/ep experts per rank, no
replicas): the longest-processing-time rule. `imbalance` is max rank load / mean rank load, the
figure EPLB minimises (1.0 is perfect). The plan is advice for /metrics and operators; moving
experts between ranks at run time is not done.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    experts: list[list[list[int]]]  # [layer][rank] -> expert ids held
    imbalance_now: list[float]  # per layer, with the contiguous slices
    imbalance_planned: list[float]  # per layer, with `experts`


def imbalance(rank_loads: list[int]) -> float:
    mean = sum(rank_loads) / len(rank_loads)
    return max(rank_loads) / mean if mean else 1.0


def plan_placement(load: list[list[int]], ep: int) -> Placement:
    """`load` [MoE layers][experts]: tokens per expert; `ep` ranks, each holding len(experts) / ep."""
    experts, now, planned = [], [], []
    for row in load:
        per_rank = len(row) // ep
        now.append(imbalance([sum(row[r * per_rank:(r + 1) * per_rank]) for r in range(ep)]))
        held: list[list[int]] = [[] for _ in range(ep)]
        totals = [0] * ep
        for expert in sorted(range(len(row)), key=lambda e: (-row[e], e)):
            rank = min((r for r in range(ep) if len(held[r]) < per_rank), key=lambda r: (totals[r], r))
            held[rank].append(expert)
            totals[rank] += row[expert]
        experts.append([sorted(h) for h in held])
        planned.append(imbalance(totals))
    return Placement(experts, now, planned)

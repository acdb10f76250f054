"""Clock skew between rank files: estimate each rank's offset and shift its timestamps.

Every rank of a job writes its trace on its own host's clock. When one host's clock is off
the others', its collectives seem to start late (or early) and its ops no longer overlap
their partners', which breaks the cross-rank analyses (gloo group matching, waits, who
arrived last, pipeline bubbles). A rank's own durations are unaffected by a constant offset.

Members of one synchronising collective (all-reduce, all-gather, reduce-scatter, all-to-all,
barrier) leave it together, so a rank's offset is read from its ends: per instance of three
members or more (a pair cannot tell whose clock is off), the rank's end minus the median end
of the instance's members; the rank's offset is the median of these over its instances.

The offset is applied only when it is trustworthy (`_trusted`):
- at least `MIN_INSTANCES` such instances of the rank,
- the offset is at least `MIN_OFFSET_US` (1 ms: members of a collective end within tens of
  microseconds on GPUs and within about half a millisecond on a loaded gloo host), and
- it is consistent: at least `AGREE` (3/4) of the rank's instances lie within
  max(`REL_TOL` x offset, `ABS_TOL_US`) of it (a descheduled host delays one op, not most).
Otherwise the timestamps are left as they are (and the impossible-collective warning of
`analyze._clock_skew_warnings` may still fire).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from deltamoe.trace.summary import RankSummary

SYNC_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "barrier")
MIN_INSTANCES = 4
MIN_OFFSET_US = 1000.0
AGREE = 0.75
REL_TOL = 0.1
ABS_TOL_US = 500.0
ROUNDS = 3  # re-estimate after a correction (matching improves; a second skewed rank shows)


def estimate_offsets(j) -> dict[int, float]:
    """rank -> trusted clock offset (us, positive: its clock runs ahead of the others')."""
    if not len(j.inst):
        return {}
    # Per instance (its members share the kind), not per row: isin over the object column is slow.
    member = np.empty(len(j.inst_size), dtype=np.int64)
    member[j.inst] = np.arange(len(j.inst))
    usable = np.isin(j.kind[member], SYNC_KINDS) & (j.inst_size >= 3) & j.inst_complete
    keep = np.flatnonzero(usable[j.inst])
    if len(keep) < MIN_INSTANCES:
        return {}
    inst, rank, end = j.inst[keep], j.rank[keep], j.end[keep]
    # Median end per instance (mean of the two middle ones), all instances at once.
    order = np.lexsort((end, inst))
    g, e = inst[order], end[order]
    first = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    size = np.diff(np.r_[first, len(g)])
    ref = 0.5 * (e[first + (size - 1) // 2] + e[first + size // 2])
    ref_of = np.empty(int(inst.max()) + 1)
    ref_of[g[first]] = ref
    d = end - ref_of[inst]
    # Fast exit (the usual case): a trusted offset has at least AGREE of its instances at
    # |d| >= min(0.9 x MIN_OFFSET_US, MIN_OFFSET_US - ABS_TOL_US) = 500 us.
    per_rank = np.bincount(rank)
    far = np.bincount(rank, weights=np.abs(d) >= min((1 - REL_TOL) * MIN_OFFSET_US, MIN_OFFSET_US - ABS_TOL_US),
                      minlength=len(per_rank))
    if not ((per_rank >= MIN_INSTANCES) & (far >= AGREE * per_rank)).any():
        return {}
    # Median of d per rank.
    order = np.lexsort((d, rank))
    rs, ds = rank[order], d[order]
    first = np.flatnonzero(np.r_[True, rs[1:] != rs[:-1]])
    n = np.diff(np.r_[first, len(rs)])
    med = 0.5 * (ds[first + (n - 1) // 2] + ds[first + n // 2])
    ranks = rs[first]
    med_of = np.zeros(int(rank.max()) + 1)
    med_of[ranks] = med
    tol = np.maximum(REL_TOL * np.abs(med_of), ABS_TOL_US)
    agree = np.bincount(rank, weights=np.abs(d - med_of[rank]) <= tol[rank], minlength=len(med_of))[ranks]
    ok = (n >= MIN_INSTANCES) & (np.abs(med) >= MIN_OFFSET_US) & (agree >= AGREE * n)
    return {int(r): float(m) for r, m in zip(ranks[ok], med[ok])}


def shift(s: RankSummary, by: float) -> RankSummary:
    """The summary with every timestamp moved by `by` us (durations are unchanged)."""
    c = s.coll
    return dataclasses.replace(s, window=s.window + by, pipe_first=s.pipe_first + by, pipe_end=s.pipe_end + by,
                               coll=dataclasses.replace(c, arrive=c.arrive + by, end=c.end + by))


def correct(summaries: list[RankSummary], join) -> tuple[list[RankSummary], object, dict[int, float]]:
    """Join, and while some rank's clock offset is trusted, shift that rank and join again.
    Returns the (possibly shifted) summaries, their join and rank -> total offset applied (us)."""
    j = join(summaries)
    applied: dict[int, float] = {}
    for _ in range(ROUNDS):
        off = estimate_offsets(j)
        if not off:
            break
        summaries = [shift(s, -off[s.rank]) if s.rank in off else s for s in summaries]
        for r, o in off.items():
            applied[r] = applied.get(r, 0.0) + o
        j = join(summaries)
    return summaries, j, applied

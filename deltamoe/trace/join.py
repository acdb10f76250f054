"""Match communication across ranks: collectives by (process group, sequence), P2P by (src, dst, n).

The inputs are the per-rank Collectives tables; the output is flat numpy columns for all
ranks plus per-instance facts (who arrived last, how long the others waited). Only the
communication rows of all ranks are held here (tens per rank per step), never events.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from deltamoe.trace.classify import P2P_KINDS
from deltamoe.trace.summary import RankSummary


@dataclass
class Joined:
    # one row per collective participation (non-P2P)
    rank: np.ndarray
    kind: np.ndarray
    pg: np.ndarray
    seq: np.ndarray
    nbytes: np.ndarray
    arrive: np.ndarray
    end: np.ndarray
    step: np.ndarray      # ProfilerStep number
    inst: np.ndarray      # instance id (same for all participants of one collective)
    wait: np.ndarray      # how long this rank waited for the last arriver
    # per instance
    inst_size: np.ndarray
    inst_last: np.ndarray     # rank that arrived last
    inst_first: np.ndarray    # rank that arrived first
    inst_skew: np.ndarray     # last arrival - first arrival
    inst_blame: np.ndarray    # total time the others waited for the last arriver
    inst_complete: np.ndarray  # every analysed member of the group took part (else: no evidence)
    # P2P pairs: one row per matched send/recv
    p2p_src: np.ndarray
    p2p_dst: np.ndarray
    p2p_send: np.ndarray      # sender arrival
    p2p_recv: np.ndarray      # receiver posted the recv
    p2p_wait: np.ndarray      # receiver waited for the sender
    p2p_end: np.ndarray       # recv finished (receiver released)
    p2p_step: np.ndarray      # receiver's step number
    p2p_nbytes: np.ndarray
    # each rank's first P2P op in the kept steps: rank -> (kind, peer), and ('send1', rank) -> ('send', peer)
    first_p2p: dict = field(default_factory=dict)
    # collectives some analysed member of the group lacks: {"rank", "group", "seq", "kind"}
    unmatched: list = field(default_factory=list)
    # P2P ops (inside kept steps) paired with nothing: columns rank, step, kind, peer (-1: the
    # trace does not name it, e.g. gloo without record_shapes), arrive, end
    p2p_unpaired: dict = field(default_factory=dict)

    @property
    def instances(self) -> int:
        return len(self.inst_size)


def join(summaries: list[RankSummary]) -> Joined:
    cols = _concat(summaries)
    _resolve_unnamed_groups(cols, summaries)
    p2p = np.isin(cols["kind"], list(P2P_KINDS))
    coll = {k: v[~p2p] for k, v in cols.items()}
    align_missing(coll)
    inst_cols = _instances(coll)
    members = _analysed_members(summaries)
    complete, unmatched = _completeness(coll, inst_cols, members)
    inst_cols["wait"] = np.where(complete[inst_cols["inst"]], inst_cols["wait"], 0.0)
    p2p_cols = {k: v[p2p] for k, v in cols.items()}
    pairs, unpaired = _pair_p2p(p2p_cols)
    return Joined(**{k: coll[k] for k in ("rank", "kind", "pg", "seq", "nbytes", "arrive", "end", "step")},
                  **inst_cols, inst_complete=complete, **pairs, first_p2p=_first_p2p(p2p_cols),
                  unmatched=unmatched, p2p_unpaired=unpaired)


def align_missing(c: dict[str, np.ndarray]) -> None:
    """Renumber the collectives of a rank that lacks some its group's other members have.

    Without `Seq` a collective's number is its ordinal on the rank, so a rank that misses the
    first three all-to-alls would be matched with the wrong instances from then on. Members of
    one collective finish together: each op of such a rank takes the number of the reference
    instance (median end over the ranks with the most ops) that ends closest to it, in order.
    The numbers it never takes are its missing collectives (`_completeness` reports them).
    """
    n = len(c["rank"])
    if not n:
        return
    # Ops per (group, rank), all groups at once: a loop over groups would be quadratic at scale.
    code = {name: i for i, name in enumerate(sorted(set(c["pg"].tolist())))}
    pg_id = np.fromiter(map(code.__getitem__, c["pg"].tolist()), dtype=np.int64, count=n)
    pairs, counts = np.unique(pg_id * (1 << 32) + c["rank"], return_counts=True)
    pair_pg = pairs >> 32
    lo_n = np.full(len(code), np.iinfo(np.int64).max)
    hi_n = np.zeros(len(code), dtype=np.int64)
    np.minimum.at(lo_n, pair_pg, counts)
    np.maximum.at(hi_n, pair_pg, counts)
    for g in np.flatnonzero(lo_n < hi_n).tolist():
        rows = np.flatnonzero(pg_id == g)
        ranks = c["rank"][rows]
        per_rank = {int(r): int(k) for r, k in zip(*np.unique(ranks, return_counts=True))}
        most = int(hi_n[g])
        full = rows[np.isin(ranks, [r for r, k in per_rank.items() if k == most])]
        seqs = np.unique(c["seq"][full])
        ref = np.array([np.median(c["end"][full][c["seq"][full] == q]) for q in seqs])
        for r, k in per_rank.items():
            if k == most:
                continue
            mine = rows[ranks == r]
            mine = mine[np.argsort(c["arrive"][mine], kind="stable")]
            lo = 0
            for j, i in enumerate(mine.tolist()):
                hi = len(seqs) - (len(mine) - 1 - j)  # leave room for the ops still to place
                at = lo + int(np.argmin(np.abs(ref[lo:hi] - c["end"][i]))) if hi > lo else lo
                c["seq"][i] = seqs[min(at, len(seqs) - 1)]
                lo = at + 1


def _analysed_members(summaries: list[RankSummary]) -> dict[str, set[int]]:
    """Each named group's members among the analysed ranks (a missing rank file is reported
    once as missing; its absence does not make every collective of its groups unmatched)."""
    present = {s.rank for s in summaries}
    out: dict[str, set[int]] = {}
    for s in summaries:
        for name, ranks in s.groups.items():
            if name not in out:
                out[name] = {r for r in ranks if r in present}
    return out


def _completeness(c: dict[str, np.ndarray], inst: dict[str, np.ndarray],
                  members: dict[str, set[int]]) -> tuple[np.ndarray, list[dict]]:
    """Per instance: did every analysed member of its group take part? And who did not."""
    n_inst = len(inst["inst_size"])
    complete = np.ones(n_inst, dtype=bool)
    if not n_inst:
        return complete, []
    first = np.full(n_inst, -1, dtype=np.int64)
    first[inst["inst"][::-1]] = np.arange(len(inst["inst"]))[::-1]
    pgs = c["pg"][first].tolist()
    largest: dict[str, int] = {}
    for pg, size in zip(pgs, inst["inst_size"].tolist()):
        largest[pg] = max(largest.get(pg, 0), size)
    unmatched = []
    short = [k for k, (pg, size) in enumerate(zip(pgs, inst["inst_size"].tolist()))
             if size < (len(members[pg]) if pg in members else largest[pg])]
    if not short:
        return complete, []
    by_inst: dict[int, set[int]] = {}
    for k, r in zip(inst["inst"].tolist(), c["rank"].tolist()):
        by_inst.setdefault(k, set()).add(r)
    for k in short:
        complete[k] = False
        pg = pgs[k]
        expected = members.get(pg) or set().union(*(v for kk, v in by_inst.items() if pgs[kk] == pg))
        for r in sorted(expected - by_inst[k]):
            unmatched.append({"rank": r, "group": pg, "seq": int(c["seq"][first[k]]),
                              "kind": str(c["kind"][first[k]])})
    return complete, unmatched


def _first_p2p(c: dict[str, np.ndarray]) -> dict:
    """Each rank's first P2P op (kind, peer), and under ('send1', rank) its first send.

    The rows are grouped by rank (summaries in rank order) and sorted by arrival within a
    rank (Collectives are), so the first row of each rank's run is its earliest op."""
    out: dict = {}
    for mask, key in ((np.ones(len(c["rank"]), dtype=bool), None), (c["kind"] == "send", "send1")):
        rows = np.flatnonzero(mask)
        ranks = c["rank"][rows]
        first = rows[np.flatnonzero(np.r_[True, ranks[1:] != ranks[:-1]])] if len(rows) else rows
        for r, kind, peer in zip(c["rank"][first].tolist(), c["kind"][first].tolist(), c["peer"][first].tolist()):
            out[r if key is None else (key, r)] = (str(kind), int(peer))
    return out


def _concat(summaries: list[RankSummary]) -> dict[str, np.ndarray]:
    """All ranks' rows inside kept steps, concatenated column by column (step = ProfilerStep number)."""
    colls = [s.coll for s in summaries]
    if not colls:
        return {k: np.zeros(0, dtype=np.int64) for k in ("rank", "step")} | {
            k: np.zeros(0) for k in ("seq", "nbytes", "arrive", "end", "peer")} | {
            k: np.zeros(0, dtype=object) for k in ("kind", "pg")} | {"lane": np.zeros(0, dtype=np.int64)}
    local = np.concatenate([c.step for c in colls])
    keep = local >= 0
    rows = [len(c) for c in colls]
    # A kept row's step number: its rank's step_ids at the row's step index, all ranks at once.
    ids = [s.step_ids for s in summaries]
    first_id = np.cumsum([0] + [len(x) for x in ids[:-1]])
    out = {"rank": np.repeat(np.array([s.rank for s in summaries], dtype=np.int64), rows)[keep],
           "step": np.concatenate(ids)[(np.repeat(first_id, rows) + local)[keep]]}
    for k in ("kind", "pg", "seq", "nbytes", "arrive", "end", "peer"):
        out[k] = np.concatenate([getattr(c, k) for c in colls])[keep]
    out["lane"] = np.concatenate([c.lane if c.lane is not None else np.full(len(c), -1, dtype=np.int64)
                                  for c in colls])[keep]
    out["pg"] = out["pg"].astype(object)
    out["kind"] = out["kind"].astype(object)
    return out


def _resolve_unnamed_groups(cols: dict[str, np.ndarray], summaries: list[RankSummary]) -> None:
    """gloo traces do not name the group of a collective; find it from the ops' overlap in time
    and from the threads they ran on.

    A collective cannot finish on one member before every member has entered it, so the ops of
    one instance overlap: the latest arrival precedes the earliest end (up to `_CLOCK_TOL`; a
    wider slack would let an op without partners overlap the next collective its peers start).
    Members issue a group's collectives in one order and each rank's ops are ordered, so the
    instances are rebuilt in order from each rank's next unplaced op (its head): a group fits
    when all its members' heads are of one kind and overlap. Completion times only break ties
    (they drift by milliseconds when a loaded host deschedules a process, so they never rule
    a group out): the largest fitting group whose members all end within `_END_TIGHT` wins
    (an all-reduce over the world ends on every rank at once), otherwise the smallest, the
    tightest of equal size (two data-parallel pairs that all-reduce at about the same time
    are not a world all-reduce). Ops are numbered per group in instance order, as a named
    group's are. When no group fits, the head that ends first has no partner among the other
    ranks' ops (they lack it, e.g. it lies outside their kept steps): it stays unplaced, as
    group "?<kind>".

    Timing alone cannot tell both pairs' all-reduces ending together from one over the world.
    The threads can: a process group runs its work on its own gloo worker threads, so a rank's
    ops on one thread (`lane`) all belong to one group. A first placement by timing gives each
    lane the group most of its ops went to; the placement is then redone with every op held to
    its lane's group.
    """
    unnamed = (cols["pg"] == "") & ~np.isin(cols["kind"], list(P2P_KINDS))
    if not unnamed.any():
        return
    rows = np.flatnonzero(unnamed)
    rows = rows[np.lexsort((cols["arrive"][rows], cols["rank"][rows]))]
    queue: dict[int, list[int]] = {}
    for i, r in zip(rows.tolist(), cols["rank"][rows].tolist()):
        queue.setdefault(r, []).append(i)
    groups: dict[tuple[int, ...], str] = {}
    for s in summaries:
        for name, ranks in s.groups.items():
            if len(ranks) > 1 and all(r in queue for r in ranks):
                groups.setdefault(tuple(sorted(ranks)), name)
    if not groups:
        return
    placed = _place(cols, queue, groups, {})
    lane = cols["lane"].tolist()
    votes: dict[tuple[int, int], dict[str, int]] = {}
    for i, (name, _) in placed.items():
        if lane[i] >= 0:
            tally = votes.setdefault((int(cols["rank"][i]), lane[i]), {})
            tally[name] = tally.get(name, 0) + 1
    lane_group = {}
    for key, tally in votes.items():
        best = max(tally.values())
        winners = [name for name, n in tally.items() if n == best]
        if len(winners) == 1:  # a tie says nothing
            lane_group[key] = winners[0]
    if lane_group:
        placed = _place(cols, queue, groups, lane_group)
    for i, (name, k) in placed.items():
        cols["pg"][i], cols["seq"][i] = name, k
    # The rest matched no group: named "?<kind>", which matches them by kind and ordinal as
    # before, and marks them for the consistency warning and as no straggler evidence.
    for i in rows.tolist():
        if i not in placed:
            cols["pg"][i] = "?" + str(cols["kind"][i])


def _place(cols: dict[str, np.ndarray], queue: dict[int, list[int]], groups: dict[tuple[int, ...], str],
           lane_group: dict[tuple[int, int], str]) -> dict[int, tuple[str, int]]:
    """One placement pass (see `_resolve_unnamed_groups`): row -> (group name, sequence number).
    `lane_group`: (rank, lane) -> the only group that lane's ops may join."""
    kind, arrive, end, lane = cols["kind"].tolist(), cols["arrive"].tolist(), cols["end"].tolist(), cols["lane"].tolist()
    head = dict.fromkeys(queue, 0)
    count: dict[str, int] = {}
    placed: dict[int, tuple[str, int]] = {}
    while True:
        heads = {r: q[head[r]] for r, q in queue.items() if head[r] < len(q)}
        if not heads:
            return placed
        fits = []  # (preference, members)
        for ranks, name in groups.items():
            ops = [heads.get(r) for r in ranks]
            if None in ops or len({kind[i] for i in ops}) > 1:
                continue
            if any(lane_group.get((r, lane[i]), name) != name for r, i in zip(ranks, ops)):
                continue
            if max(arrive[i] for i in ops) > min(end[i] for i in ops) + _CLOCK_TOL:
                continue
            spread = max(end[i] for i in ops) - min(end[i] for i in ops)
            fits.append(((0, -len(ranks), spread) if spread <= _END_TIGHT else (1, len(ranks), spread), ranks))
        if not fits:
            first = min(heads, key=lambda r: end[heads[r]])
            head[first] += 1
            continue
        taken: set[int] = set()
        for _, ranks in sorted(fits):
            if taken.isdisjoint(ranks):
                taken.update(ranks)
                name = groups[ranks]
                k = count.get(name, 0)
                count[name] = k + 1
                for r in ranks:
                    placed[heads[r]] = (name, k)
                    head[r] += 1


_CLOCK_TOL = 20.0    # us: timestamp rounding (all ranks of a job share the trace clock)
_END_TIGHT = 250.0  # us: members ending this close together finished one collective


def _instances(c: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    n = len(c["rank"])
    if n == 0:
        z = np.zeros(0)
        return dict(inst=z.astype(np.int64), wait=z, inst_size=z.astype(np.int64),
                    inst_last=z.astype(np.int64), inst_first=z.astype(np.int64), inst_skew=z, inst_blame=z)
    # Unnamed groups (no pg at all) fall back to matching by kind and ordinal.
    # Group ids numbered in sorted name order (as np.unique would), through a dict of the few
    # distinct names: ~3x faster than building and sorting a string array per row.
    names = [pg if pg != "" else "?" + kind for pg, kind in zip(c["pg"].tolist(), c["kind"].tolist())]
    code = {name: i for i, name in enumerate(sorted(set(names)))}
    pg_id = np.fromiter(map(code.__getitem__, names), dtype=np.int64, count=n)
    key = pg_id.astype(np.int64) * (1 << 32) + c["seq"].astype(np.int64)
    _, inst = np.unique(key, return_inverse=True)
    order = np.lexsort((c["arrive"], inst))
    si = inst[order]
    starts = np.flatnonzero(np.r_[True, si[1:] != si[:-1]])
    ends = np.r_[starts[1:], len(si)] - 1
    arr = c["arrive"][order]
    size = ends - starts + 1
    last_arr = arr[ends]
    first_arr = arr[starts]
    sum_arr = np.add.reduceat(arr, starts)
    wait = np.empty(n)
    wait[order] = np.repeat(last_arr, size) - arr
    return dict(inst=inst, wait=wait, inst_size=size, inst_last=c["rank"][order][ends],
                inst_first=c["rank"][order][starts],
                inst_skew=last_arr - first_arr, inst_blame=size * last_arr - sum_arr)


def _pair_p2p(c: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The k-th send from a to b meets the k-th recv at b from a. Also returns the ops left
    unpaired (no peer, or no counterpart on the peer), as columns."""
    sends: dict[tuple[int, int], list[int]] = {}
    recvs: dict[tuple[int, int], list[int]] = {}
    order = np.argsort(c["arrive"], kind="stable")
    # Plain Python values: this loop runs once per P2P op of the whole job.
    for i, peer, r, kind in zip(order.tolist(), c["peer"][order].tolist(), c["rank"][order].tolist(),
                                c["kind"][order].tolist()):
        if peer < 0:
            continue
        if kind == "send":
            sends.setdefault((r, peer), []).append(i)
        else:
            recvs.setdefault((peer, r), []).append(i)
    src, dst, s_idx, r_idx = [], [], [], []
    for key, ss in sends.items():
        rr = recvs.get(key, [])
        for a, b in zip(ss, rr):
            src.append(key[0])
            dst.append(key[1])
            s_idx.append(a)
            r_idx.append(b)
    s_idx, r_idx = np.array(s_idx, dtype=np.int64), np.array(r_idx, dtype=np.int64)
    lone = np.ones(len(c["rank"]), dtype=bool)
    lone[s_idx], lone[r_idx] = False, False
    unpaired = {k: c[k][lone] for k in ("rank", "step", "kind", "peer", "arrive", "end")}
    send_t = c["arrive"][s_idx] if len(s_idx) else np.zeros(0)
    recv_t = c["arrive"][r_idx] if len(r_idx) else np.zeros(0)
    recv_end = c["end"][r_idx] if len(r_idx) else np.zeros(0)
    wait = np.clip(np.minimum(send_t, recv_end) - recv_t, 0, None)
    return dict(p2p_src=np.array(src, dtype=np.int64), p2p_dst=np.array(dst, dtype=np.int64),
                p2p_send=send_t, p2p_recv=recv_t, p2p_wait=wait, p2p_end=recv_end,
                p2p_step=c["step"][r_idx] if len(r_idx) else np.zeros(0, dtype=np.int64),
                p2p_nbytes=c["nbytes"][r_idx] if len(r_idx) else np.zeros(0, dtype=np.int64)), unpaired

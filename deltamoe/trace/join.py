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
    pairs = _pair_p2p(p2p_cols)
    return Joined(**{k: coll[k] for k in ("rank", "kind", "pg", "seq", "nbytes", "arrive", "end", "step")},
                  **inst_cols, inst_complete=complete, **pairs, first_p2p=_first_p2p(p2p_cols),
                  unmatched=unmatched)


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
            k: np.zeros(0, dtype=object) for k in ("kind", "pg")}
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
    out["pg"] = out["pg"].astype(object)
    out["kind"] = out["kind"].astype(object)
    return out


def _resolve_unnamed_groups(cols: dict[str, np.ndarray], summaries: list[RankSummary]) -> None:
    """gloo traces do not name the group of a collective; find it from completion times.

    Members of one collective finish together. An op's candidates are its rank's groups in
    which every other member has an op of the same kind ending within `_END_TOL` (plus 1% of
    the op's duration) of it; their spread is the largest such distance. The largest group
    whose members all end within `_END_TIGHT` wins (an all-reduce over the world ends on
    every rank at once); otherwise the smallest candidate, the tightest of equal size (two
    data-parallel pairs that all-reduce at about the same time are not a world all-reduce,
    and gloo's ends of one collective may lie milliseconds apart). The ops are then numbered
    per group in order, as a named group's are; an op that fits no group stays unnamed.
    """
    unnamed = (cols["pg"] == "") & ~np.isin(cols["kind"], list(P2P_KINDS))
    if not unnamed.any():
        return
    groups: dict[tuple[int, ...], str] = {}
    for s in summaries:
        for name, ranks in s.groups.items():
            if len(ranks) > 1:
                groups.setdefault(tuple(sorted(ranks)), name)
    of_rank: dict[int, list[tuple[tuple[int, ...], str]]] = {}
    for ranks, name in sorted(groups.items(), key=lambda kv: -len(kv[0])):
        for r in ranks:
            of_rank.setdefault(r, []).append((ranks, name))
    rows = np.flatnonzero(unnamed)
    ends: dict[tuple[int, str], np.ndarray] = {}
    for key in set(zip(cols["rank"][rows].tolist(), cols["kind"][rows].tolist())):
        mine = rows[(cols["rank"][rows] == key[0]) & (cols["kind"][rows] == key[1])]
        ends[key] = np.sort(cols["end"][mine])

    def distance(rank: int, kind: str, t: float) -> float:
        e = ends.get((rank, kind))
        if e is None or not len(e):
            return np.inf
        i = int(np.searchsorted(e, t))
        return min(abs(float(e[j]) - t) for j in (i - 1, i) if 0 <= j < len(e))

    count: dict[tuple[int, str], int] = {}
    for i, r, kind, t, dur in zip(rows.tolist(), cols["rank"][rows].tolist(), cols["kind"][rows].tolist(),
                                  cols["end"][rows].tolist(), (cols["end"] - cols["arrive"])[rows].tolist()):
        tol = _END_TOL + 0.01 * max(dur, 0.0)
        fits = []  # (size, spread, group name), largest groups first
        for ranks, name in of_rank.get(r, []):
            spread = max((distance(m, kind, t) for m in ranks if m != r), default=0.0)
            if spread <= tol:
                fits.append((len(ranks), spread, name))
        if not fits:
            continue
        tight = [f for f in fits if f[1] <= _END_TIGHT]
        name = tight[0][2] if tight else min(fits, key=lambda f: (f[0], f[1]))[2]
        k = count.get((r, name), 0)
        count[(r, name)] = k + 1
        cols["pg"][i], cols["seq"][i] = name, k


_END_TOL = 5000.0   # us: how far apart the ends of one gloo collective may be on its members
_END_TIGHT = 250.0  # us: members ending this close together finished one collective


def _instances(c: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    n = len(c["rank"])
    if n == 0:
        z = np.zeros(0)
        return dict(inst=z.astype(np.int64), wait=z, inst_size=z.astype(np.int64),
                    inst_last=z.astype(np.int64), inst_skew=z, inst_blame=z)
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
                inst_skew=last_arr - first_arr, inst_blame=size * last_arr - sum_arr)


def _pair_p2p(c: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The k-th send from a to b meets the k-th recv at b from a."""
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
    send_t = c["arrive"][s_idx] if len(s_idx) else np.zeros(0)
    recv_t = c["arrive"][r_idx] if len(r_idx) else np.zeros(0)
    recv_end = c["end"][r_idx] if len(r_idx) else np.zeros(0)
    wait = np.clip(np.minimum(send_t, recv_end) - recv_t, 0, None)
    return dict(p2p_src=np.array(src, dtype=np.int64), p2p_dst=np.array(dst, dtype=np.int64),
                p2p_send=send_t, p2p_recv=recv_t, p2p_wait=wait, p2p_end=recv_end,
                p2p_step=c["step"][r_idx] if len(r_idx) else np.zeros(0, dtype=np.int64),
                p2p_nbytes=c["nbytes"][r_idx] if len(r_idx) else np.zeros(0, dtype=np.int64))

"""One rank's communication rows (the Collectives table) from its EventTables.

GPU traces: one row per communication kernel, described by the args Kineto copied onto
the kernel or, failing that, by its `record_param_comms` op. CPU (gloo) traces: c10d calls
on the main thread paired with the gloo exchange annotations. Both end in `finish`, which
numbers collectives per group when the trace has no `Seq` and places them in steps.

A large rank holds tens of thousands of collectives, so the GPU rows are built column by
column (one list comprehension per field) rather than as a tuple per row.
"""

from __future__ import annotations

import numpy as np

from deltamoe.trace.classify import P2P_KINDS, collective_kind, dtype_bytes, peer_from_name
from deltamoe.trace.p2p import Ranks, coalesced_parts, cpu_peer, group_ranks, to_global
from deltamoe.trace.schema import NO_ARGS
from deltamoe.trace.summary import Collectives
from deltamoe.trace.tables import EventTables


def gpu_collectives(t: EventTables, rows: np.ndarray, ext: np.ndarray, name_id: np.ndarray,
                    start: np.ndarray, end: np.ndarray, windows: np.ndarray,
                    groups: dict[str, Ranks] | None = None, launch: np.ndarray | None = None) -> Collectives:
    """`rows`: indices of the communication kernels in `t.kernels`; the other arrays are theirs.

    With `groups` (the rank's process groups) P2P peers are mapped from group ranks to global
    ranks and each coalesced kernel becomes one row per send / recv it carries (p2p.py);
    `launch`: each row's launch time, which places the parts of a coalesced kernel."""
    kc, pc = t.kernel_coll, t.param_comms
    args = [kc.get(i) or pc.get(x) or NO_ARGS for i, x in zip(rows.tolist(), ext.tolist())]
    names = {v: k for k, v in t.names.items()}
    # What names the op: its `Collective name`, else the kernel name.
    label = [c or names.get(nid, "") for c, nid in zip(_strs([a.collective for a in args]), name_id.tolist())]
    kind_of = {x: collective_kind(x) for x in set(label)}
    kinds = [kind_of[x] for x in label]
    # Payload: elements received for a recv, sent otherwise; the peer of a send / recv.
    # An all-to-all: the larger of the two, as for gloo (tables.cpu_payload).
    elems = _ints([a.out_nelems if k == "recv" else _larger(a.in_nelems, a.out_nelems) if k == "all_to_all"
                   else a.in_nelems for a, k in zip(args, kinds)], 0)
    peer = _ints([a.dst if k == "send" else a.src if k == "recv" else -1 for a, k in zip(args, kinds)], -1)
    dtypes = [d or "float" for d in _strs([a.dtype for a in args])]
    size_of = {d: dtype_bytes(d) for d in set(dtypes)}
    width = np.array([size_of[d] for d in dtypes], dtype=np.int64)
    pg = _strs([a.pg_name for a in args])
    seq, nbytes = _ints([a.seq for a in args], -1), elems * width
    if groups is not None:
        kinds, pg, seq, nbytes, start, end, peer = _resolve_p2p(
            t, args, kinds, pg, seq, nbytes, start, end, peer, ext,
            launch if launch is not None else start, groups)
    return finish(pg=_text(pg), seq=seq, kind=_text(kinds), nbytes=nbytes, arrive=start, end=end, peer=peer,
                  windows=windows)


def _resolve_p2p(t: EventTables, args: list, kinds: list[str], pg: list[str], seq: np.ndarray,
                 nbytes: np.ndarray, start: np.ndarray, end: np.ndarray, peer: np.ndarray, ext: np.ndarray,
                 launch: np.ndarray, groups: dict[str, Ranks]) -> tuple:
    """Coalesced kernels split into their sends and recvs; every peer as a global rank."""
    at = launch.tolist()  # floats at once: indexing an array per row costs a numpy scalar each
    coalesced = [(at[i], i, pg[i]) for i, k in enumerate(kinds) if k == "coalesced"]
    parts: dict[int, list] = {}
    if coalesced:
        single = [at[i] for i, k in enumerate(kinds) if k in P2P_KINDS]
        parts = coalesced_parts(t.p2p_ops, t.annotations, set(ext.tolist()), coalesced, single)
    if not parts and not any(k in P2P_KINDS for k in kinds):
        return kinds, pg, seq, nbytes, start, end, peer
    return expand_parts(parts, args, kinds, pg, seq, nbytes, start, end, peer, groups)


def expand_parts(parts: dict[int, list], args: list, kinds: list[str], pg: list[str], seq: np.ndarray,
                 nbytes: np.ndarray, start: np.ndarray, end: np.ndarray, peer: np.ndarray,
                 groups: dict[str, Ranks]) -> tuple:
    """Each row with parts (row -> [(kind, group peer, bytes)]) becomes one row per part, with the
    row's times and no Seq; a P2P row's peer becomes a global rank, any other row's -1.

    Column-wise (np.repeat), with Python only for the parts and the P2P peers: a rank holds
    thousands of collectives, and a per-row loop over seven columns was a sixth of a file's cost."""
    counts = np.ones(len(kinds), dtype=np.int64)
    for i, pieces in parts.items():
        if pieces:  # a coalesced kernel without P2P parts is a coalesced collective: kept as one row
            counts[i] = len(pieces)
    at = np.repeat(np.arange(len(kinds)), counts)  # each output row's source row
    rows = at.tolist()
    kinds_out, pg_out = [kinds[i] for i in rows], [pg[i] for i in rows]
    seq_out = np.where(counts[at] == 1, seq[at], -1)
    nbytes_out, peer_out = nbytes[at].copy(), peer[at].copy()
    first = np.cumsum(counts) - counts  # each source row's first output row
    for i, pieces in parts.items():
        for j, (part_kind, part_peer, part_bytes) in enumerate(pieces or ()):
            o = int(first[i]) + j
            kinds_out[o], peer_out[o], nbytes_out[o] = part_kind, part_peer, part_bytes
    p2p = np.fromiter((k in P2P_KINDS for k in kinds_out), dtype=bool, count=len(kinds_out))
    peer_out[~p2p] = -1
    for o in np.flatnonzero(p2p).tolist():
        ranks = group_ranks(pg_out[o], groups, args[rows[o]])
        # A group the trace does not describe: the default group, where both numberings agree.
        if ranks is not None:
            peer_out[o] = to_global(int(peer_out[o]), ranks)
    return kinds_out, pg_out, seq_out, nbytes_out, start[at], end[at], peer_out


def cpu_collectives(t: EventTables, main: int, windows: np.ndarray, rank: int = -1,
                    p2p_group: Ranks | None = None) -> Collectives:
    """gloo: c10d calls on the main thread paired with the gloo annotations of their exchange.

    P2P: the k-th c10d send (recv) with the k-th `gloo:send` (`gloo:recv`), both on the main
    thread; the peer is the group rank in `Concrete Inputs` mapped through `p2p_group`
    (p2p.cpu_peer). Collectives: gloo runs a group's work in the order it was issued, so each
    exchange annotation (on a gloo worker thread) belongs to the earliest unpaired c10d call
    issued before it. The kind comes from the call: gloo records a reduce-scatter as
    `gloo:all_reduce`. Each collective row keeps the annotation's thread (`lane`): a process
    group runs its work on its own gloo worker threads, which tells groups apart where timing
    cannot (join._resolve_unnamed_groups)."""
    calls: dict[str, list] = {}   # P2P kind -> [(ts, dur, concrete inputs)]
    coll_calls: list = []         # [(ts, dur, kind, payload bytes or -1)]
    for name, ts, dur, tid, ci, nbytes in sorted(t.cpu_coll_ops, key=lambda o: o[1]):
        if name.startswith("c10d::") and tid == main:
            kind = collective_kind(name)
            if kind in P2P_KINDS:
                calls.setdefault(kind, []).append((ts, dur, ci))
            else:
                coll_calls.append((ts, dur, kind, nbytes))
    exch: dict[str, list] = {}
    coll_exch: list = []
    for name, ts, dur, tid in sorted(t.annotations, key=lambda a: a[1]):
        kind = collective_kind(name)
        if kind in P2P_KINDS:
            exch.setdefault(kind, []).append((ts, dur, name))
        else:
            coll_exch.append((ts, dur, kind, _int(tid, -1)))
    rows = []
    for kind in set(calls) | set(exch):
        c, x = calls.get(kind, []), exch.get(kind, [])
        for j in range(max(len(c), len(x))):
            call = c[j] if j < len(c) else None
            ann = x[j] if j < len(x) else None
            arrive = call[0] if call else ann[0]
            end = max(ann[0] + ann[1] if ann else 0.0, call[0] + call[1] if call else 0.0)
            ci = call[2] if call else None
            local = _int(ci[2], -1) if isinstance(ci, list) and len(ci) > 2 else -1
            if local < 0 and ann:
                local = peer_from_name(ann[2])
            rows.append((kind, float(arrive), float(end), cpu_peer(rank, local, p2p_group), -1, -1))
    pending = 0  # the earliest unpaired call
    for ts, dur, kind, tid in coll_exch:
        if pending < len(coll_calls) and coll_calls[pending][0] <= ts:
            c_ts, c_dur, c_kind, c_bytes = coll_calls[pending]
            pending += 1
            rows.append((c_kind, float(c_ts), float(max(ts + dur, c_ts + c_dur)), -1, tid, c_bytes))
        else:
            rows.append((kind, float(ts), float(ts + dur), -1, tid, -1))
    rows += [(k, float(ts), float(ts + dur), -1, -1, b) for ts, dur, k, b in coll_calls[pending:]]
    rows.sort(key=lambda r: r[1])
    kind, arrive, end, peer, lane, nbytes = (list(c) for c in zip(*rows)) if rows else ([], [], [], [], [], [])
    # Payload: an all-to-all's from its recorded shapes; -1 where the trace does not say.
    return finish(pg=np.full(len(rows), "", dtype=str), seq=np.full(len(rows), -1, dtype=np.int64),
                  kind=np.array(kind, dtype=str), nbytes=np.array(nbytes, dtype=np.int64),
                  arrive=np.array(arrive, dtype=float), end=np.array(end, dtype=float),
                  peer=np.array(peer, dtype=np.int64), windows=windows, lane=np.array(lane, dtype=np.int64))


def finish(pg: np.ndarray, seq: np.ndarray, kind: np.ndarray, nbytes: np.ndarray, arrive: np.ndarray,
           end: np.ndarray, peer: np.ndarray, windows: np.ndarray, lane: np.ndarray | None = None) -> Collectives:
    """Sort by arrival, number collectives per group when the trace has no `Seq`, map to steps."""
    order = np.argsort(arrive, kind="stable")
    pg, seq, kind, nbytes = pg[order], seq[order].copy(), kind[order], nbytes[order]
    arrive, end, peer = arrive[order], end[order], peer[order]
    lane = lane[order] if lane is not None else None
    step = np.full(len(arrive), -1, dtype=np.int64)
    if len(windows) and len(arrive):
        k = np.searchsorted(windows[:, 0], arrive, side="right") - 1
        kk = np.maximum(k, 0)
        inside = (k >= 0) & ((arrive < windows[kk, 1]) | ((kk == len(windows) - 1) & (arrive <= windows[kk, 1])))
        step = np.where(inside, k, -1)
    unnumbered = np.flatnonzero(seq < 0)
    if len(unnumbered):
        # P2P and collectives are numbered separately (as NCCL does), per group (per kind
        # when the group is unknown); the n-th unnumbered op of a group gets n.
        count: dict[tuple[str, bool], int] = {}
        ordinal = []
        for g, k in zip(pg[unnumbered].tolist(), kind[unnumbered].tolist()):
            key = (g or k, k in P2P_KINDS)
            n = count.get(key, 0)
            count[key] = n + 1
            ordinal.append(n)
        seq[unnumbered] = ordinal
    return Collectives(pg=pg, seq=seq, kind=kind, nbytes=nbytes, arrive=arrive, end=end, peer=peer, step=step,
                       lane=lane)


def _larger(a: object, b: object) -> object:
    """The larger of two element counts where both are integers, else the first."""
    return max(a, b) if isinstance(a, int) and isinstance(b, int) else a


def _ints(values: list, default: int) -> np.ndarray:
    """Integer args as an int64 column; a missing or unreadable value gives `default`."""
    try:  # absent args (None) are the common odd case; exceptions per value would be slow
        return np.array([default if v is None else v for v in values], dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        return np.array([_int(v, default) for v in values], dtype=np.int64)


def _text(values: list[str]) -> np.ndarray:
    """np.array(values, dtype=str) through the few distinct values (5x faster on long columns)."""
    distinct = sorted(set(values))
    code = {v: i for i, v in enumerate(distinct)}
    return np.array(distinct, dtype=str)[np.array([code[v] for v in values], dtype=np.int64)]


def _strs(values: list) -> list[str]:
    """Args as text ('' when absent); values that already are str cost no call."""
    return [v if v.__class__ is str else _str(v) for v in values]


def _str(v: object) -> str:
    return "" if v is None else str(v)


def _int(v: object, default: int = 0) -> int:
    if v is None:
        return default
    try:
        return int(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return default

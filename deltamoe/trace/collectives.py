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
from deltamoe.trace.schema import NO_ARGS
from deltamoe.trace.summary import Collectives
from deltamoe.trace.tables import EventTables


def gpu_collectives(t: EventTables, rows: np.ndarray, ext: np.ndarray, name_id: np.ndarray,
                    start: np.ndarray, end: np.ndarray, windows: np.ndarray) -> Collectives:
    """`rows`: indices of the communication kernels in `t.kernels`; the other arrays are theirs."""
    kc, pc = t.kernel_coll, t.param_comms
    args = [kc.get(i) or pc.get(x) or NO_ARGS for i, x in zip(rows.tolist(), ext.tolist())]
    names = {v: k for k, v in t.names.items()}
    # What names the op: its `Collective name`, else the kernel name.
    label = [c or names.get(nid, "") for c, nid in zip(_strs([a.collective for a in args]), name_id.tolist())]
    kind_of = {x: collective_kind(x) for x in set(label)}
    kinds = [kind_of[x] for x in label]
    # Payload: elements received for a recv, sent otherwise; the peer of a send / recv.
    elems = _ints([a.out_nelems if k == "recv" else a.in_nelems for a, k in zip(args, kinds)], 0)
    peer = _ints([a.dst if k == "send" else a.src if k == "recv" else -1 for a, k in zip(args, kinds)], -1)
    dtypes = [d or "float" for d in _strs([a.dtype for a in args])]
    size_of = {d: dtype_bytes(d) for d in set(dtypes)}
    width = np.array([size_of[d] for d in dtypes], dtype=np.int64)
    return finish(pg=_text(_strs([a.pg_name for a in args])), seq=_ints([a.seq for a in args], -1),
                  kind=_text(kinds), nbytes=elems * width, arrive=start, end=end, peer=peer, windows=windows)


def cpu_collectives(t: EventTables, main: int, windows: np.ndarray) -> Collectives:
    """Pair the k-th c10d call of a kind on the main thread with the k-th gloo annotation of it."""
    calls: dict[str, list] = {}
    for name, ts, dur, tid, ci in sorted(t.cpu_coll_ops, key=lambda o: o[1]):
        if name.startswith("c10d::") and tid == main:
            calls.setdefault(collective_kind(name), []).append((ts, dur, ci))
    exch: dict[str, list] = {}
    for name, ts, dur, _tid in sorted(t.annotations, key=lambda a: a[1]):
        exch.setdefault(collective_kind(name), []).append((ts, dur, name))
    rows = []
    for kind in set(calls) | set(exch):
        c, x = calls.get(kind, []), exch.get(kind, [])
        for j in range(max(len(c), len(x))):
            call = c[j] if j < len(c) else None
            ann = x[j] if j < len(x) else None
            arrive = call[0] if call else ann[0]
            end = max(ann[0] + ann[1] if ann else 0.0, call[0] + call[1] if call else 0.0)
            peer = -1
            if kind in P2P_KINDS:
                ci = call[2] if call else None
                peer = _int(ci[2], -1) if isinstance(ci, list) and len(ci) > 2 else -1
                if peer < 0 and ann:
                    peer = peer_from_name(ann[2])
            rows.append((kind, float(arrive), float(end), peer))
    rows.sort(key=lambda r: r[1])
    kind, arrive, end, peer = (list(c) for c in zip(*rows)) if rows else ([], [], [], [])
    return finish(pg=np.full(len(rows), "", dtype=str), seq=np.full(len(rows), -1, dtype=np.int64),
                  kind=np.array(kind, dtype=str), nbytes=np.zeros(len(rows), dtype=np.int64),
                  arrive=np.array(arrive, dtype=float), end=np.array(end, dtype=float),
                  peer=np.array(peer, dtype=np.int64), windows=windows)


def finish(pg: np.ndarray, seq: np.ndarray, kind: np.ndarray, nbytes: np.ndarray, arrive: np.ndarray,
           end: np.ndarray, peer: np.ndarray, windows: np.ndarray) -> Collectives:
    """Sort by arrival, number collectives per group when the trace has no `Seq`, map to steps."""
    order = np.argsort(arrive, kind="stable")
    pg, seq, kind, nbytes = pg[order], seq[order].copy(), kind[order], nbytes[order]
    arrive, end, peer = arrive[order], end[order], peer[order]
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
    return Collectives(pg=pg, seq=seq, kind=kind, nbytes=nbytes, arrive=arrive, end=end, peer=peer, step=step)


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

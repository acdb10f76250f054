"""Exposed communication: the time a collective is in flight on a rank while that rank computes
nothing, per step and per collective kind (all_to_all, all_gather, ...). It is what overlapping
communication with compute (`--ep-chunks`, FSDP prefetch) removes, and what remains is step time.

GPU traces: a communication kernel's time outside every compute kernel.

CPU (gloo) traces: gloo runs the exchanges on its own worker threads and the training thread is
the device. A collective is in flight from its c10d call on the training thread (or its
`_c10d_functional::` call, for the asynchronous ones) to the end of its `gloo:*` exchange on a
worker thread. The training thread computes while it runs a leaf CPU op (one with no op nested
in it) that is not a collective call or a `wait_tensor`; the time it spends anywhere else while a
collective is in flight is exposed: inside the call itself, blocked in `work.wait()` behind a
synchronous call (no op runs then), or in `wait_tensor` behind an asynchronous one. A wait is not
named after what it waits for; its time counts for the kinds whose exchanges are in flight then.
"""

from __future__ import annotations

import numpy as np

from deltamoe.trace import intervals as iv
from deltamoe.trace.classify import KINDS, collective_kind


def leaf_spans(ts: np.ndarray, end: np.ndarray) -> iv.Spans:
    """Spans of the ops of one thread that have no op nested in them (ops on one thread nest)."""
    if not len(ts):
        return iv.EMPTY
    order = np.lexsort((-end, ts))  # by start; at equal starts the enclosing (longer) op first
    ts, end = ts[order], end[order]
    leaf = np.ones(len(ts), dtype=bool)
    leaf[:-1] = ts[1:] >= end[:-1]  # the next op starts after this one ends: nothing nested
    return iv.union(ts[leaf], end[leaf])


def _kind(name: str) -> str:
    """The kind as every other table names it (`sync_skew`, `alltoall`): a kind already (GPU rows
    carry theirs; "send_recv" must not be read again as "send"), else the kind of the name."""
    return name if name in KINDS else collective_kind(name)


def exposed_by_kind(names: np.ndarray, start: np.ndarray, end: np.ndarray, working: iv.Spans, lo: np.ndarray,
                    hi: np.ndarray, waits: iv.Spans = iv.EMPTY) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Per step [lo, hi): the length of (every in-flight span and every wait) minus `working`, and per
    collective kind the length of its in-flight spans minus `working`.

    `names`, `start`, `end`: the in-flight collectives (a name or kind each); `working`: when the rank
    computes; `waits`: when it blocks on a collective it does not name (in the total only)."""
    # One pass over the distinct names (a few), not over the rows (tens of thousands on a big rank).
    unique, inverse = np.unique(np.asarray(names, dtype=str), return_inverse=True)
    kind_of = np.array([_kind(n) for n in unique.tolist()], dtype=object)[inverse] if len(unique) else unique
    per_kind: dict[str, np.ndarray] = {}
    for kind in sorted(set(kind_of.tolist())):
        m = kind_of == kind
        per_kind[kind] = iv.length_outside(iv.union(start[m], end[m]), working, lo, hi)
    total = iv.merge(waits, iv.union(np.asarray(start, dtype=float), np.asarray(end, dtype=float)))
    return iv.length_outside(total, working, lo, hi), per_kind


def cpu_exposed(cpu_ops: list, coll_ops: list, functional_ops: list, annotations: list, main: object,
                lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """gloo: `cpu_ops` (ts, dur, tid); `coll_ops` c10d calls (name, ts, dur, tid, ...); `functional_ops`
    `_c10d_functional::` calls (name, ts, dur, tid); `annotations` gloo exchanges (name, ts, dur, tid);
    `main` the training thread."""
    ops = np.array([(o[0], o[0] + o[1]) for o in cpu_ops if o[2] == main] or np.zeros((0, 2)), dtype=float)
    calls = [(c[0], c[1], c[1] + c[2]) for c in (*coll_ops, *functional_ops) if c[3] == main]
    working = iv.subtract(leaf_spans(ops[:, 0], ops[:, 1]), _spans([(s, e) for _, s, e in calls]))
    waits = _spans([(s, e) for name, s, e in calls if name.endswith("wait_tensor")])
    rows = [c for c in calls if not c[0].endswith("wait_tensor")] + [(a[0], a[1], a[1] + a[2]) for a in annotations]
    names = np.array([r[0] for r in rows], dtype=str)
    start, end = np.array([r[1] for r in rows], dtype=float), np.array([r[2] for r in rows], dtype=float)
    return exposed_by_kind(names, start, end, working, lo, hi, waits)


def gpu_exposed(kinds: np.ndarray, start: np.ndarray, end: np.ndarray, compute: iv.Spans, lo: np.ndarray,
                hi: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """GPU: communication kernels (their collective kind, start, end) outside the compute kernels."""
    return exposed_by_kind(kinds, np.asarray(start, dtype=float), np.asarray(end, dtype=float), compute, lo, hi)


def _spans(pairs: list[tuple[float, float]]) -> iv.Spans:
    if not pairs:
        return iv.EMPTY
    a = np.array(pairs, dtype=float)
    return iv.union(a[:, 0], a[:, 1])

"""First reduction of raw Kineto events into small columnar tables (one pass, no lookback).

This is the hot loop of the analyzer: every event of a rank passes through `EventTables.add`
exactly once, in whatever chunk it arrived, and only the few fields later analyses need are
kept. Tables from several chunks of one file are concatenated with `merge`, so a large file
can be split across worker processes. Joins that need the whole file (kernel -> launch ->
step, kernel -> record_param_comms) happen afterwards in `build.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import msgspec
import numpy as np

from deltamoe.errors import TraceError
from deltamoe.trace.classify import P2P_KINDS, STEP, Patterns, collective_kind, dtype_bytes
from deltamoe.trace.schema import NO_ARGS as _NO_ARGS
from deltamoe.trace.schema import Event

# kernel class codes
COMPUTE, COMM, MEMORY = 0, 1, 2
_RUNTIME_CATS = frozenset({"cuda_runtime", "musa_runtime", "privateuse1_runtime", "hip_runtime",
                           "xpu_runtime", "cuda_driver", "musa_driver"})
_MEMORY_CATS = frozenset({"gpu_memcpy", "gpu_memset"})
_PLAIN, _STEP, _PARAM_COMMS, _COLLECTIVE, _FUNCTIONAL = 0, 1, 2, 3, 4  # what add() does with a CPU op / annotation
# Asynchronous collectives (torch's functional ones) and their `wait_tensor` (trace/exposed.py).
_FUNCTIONAL_PREFIXES = ("_c10d_functional::", "c10d_functional::")


@dataclass
class EventTables:
    """Columns gathered from events; lists are cheap to append and pickle.

    `kernels` and `runtimes` are flat lists (7 and 2 values per row) until `freeze`: numpy
    converts a flat list of numbers about twice as fast as a list of tuples."""

    kernels: list = field(default_factory=list)      # (ts, dur, cls, stream, correlation, ext, name_id) per kernel
    kernel_coll: dict = field(default_factory=dict)  # kernel index -> Args with the collective
    runtimes: list = field(default_factory=list)     # (correlation, ts) per runtime call
    param_comms: dict = field(default_factory=dict)  # External id -> record_param_comms Args
    p2p_ops: list = field(default_factory=list)      # (ts, Args) of record_param_comms send / recv
    annotations: list = field(default_factory=list)  # (name, ts, dur, tid) for comm annotations
    cpu_coll_ops: list = field(default_factory=list)  # (name, ts, dur, tid, concrete inputs, payload bytes)
    cpu_ops: list = field(default_factory=list)      # (ts, dur, tid) of cpu_op events
    functional_ops: list = field(default_factory=list)  # (name, ts, dur, tid) of `_c10d_functional::` calls
    steps: list = field(default_factory=list)        # (step number, ts, dur, tid)
    names: dict = field(default_factory=dict)        # kernel name -> id (interned per chunk)
    events: int = 0

    def add(self, events: list[Event], patterns: Patterns) -> None:
        comm_re = patterns.comm_regex()
        cpu_prefixes = patterns.cpu_collective_prefixes
        gpu_prefixes = patterns.gpu_collective_prefixes
        kernels, runtimes, cpu_ops = self.kernels.extend, self.runtimes.extend, self.cpu_ops.append
        names, kernel_coll, param_comms = self.names, self.kernel_coll, self.param_comms
        # Names repeat thousands of times: each is classified once, then looked up.
        kernel_of: dict[str, tuple[int, int]] = {}  # kernel name -> (class, name id)
        cpu_kind: dict[str, int] = {}  # cpu_op name -> _PLAIN / _STEP / _PARAM_COMMS / _COLLECTIVE
        ann_kind: dict[str, int] = {}  # user_annotation name -> _PLAIN (ignored) / _STEP / _COLLECTIVE
        self.events += len(events)
        for e in events:
            if e.__class__ is not Event:  # flows, metadata, instants, counters
                continue
            cat = e.cat
            if cat == "kernel":
                name = e.name
                info = kernel_of.get(name)
                if info is None:
                    nid = names.get(name)
                    if nid is None:
                        nid = names[name] = len(names)
                    info = kernel_of[name] = (COMM if comm_re.search(name) else COMPUTE, nid)
                cls, nid = info
                a = e.args or _NO_ARGS
                if a.collective is not None:  # Kineto copies the collective's args to its kernel:
                    cls = COMM  # communication whatever the vendor named it (`xcclKernel_*`)
                    kernel_coll[len(self.kernels) // 7] = a
                kernels((e.ts, e.dur, cls, e.tid if a.stream is None else a.stream,
                         -1 if a.correlation is None else a.correlation,
                         -1 if a.external_id is None else a.external_id, nid))
            elif cat == "cpu_op":
                name = e.name
                kind = cpu_kind.get(name)
                if kind is None:
                    kind = cpu_kind[name] = (
                        _STEP if name.startswith("ProfilerStep")  # older exports record steps as cpu_op
                        else _PARAM_COMMS if name == "record_param_comms"
                        else _COLLECTIVE if name.startswith(cpu_prefixes)
                        else _FUNCTIONAL if name.startswith(_FUNCTIONAL_PREFIXES) else _PLAIN)
                if kind == _STEP:
                    self._step(name, e.ts, e.dur, e.tid)
                    continue
                cpu_ops((e.ts, e.dur, e.tid))
                if kind == _PLAIN:
                    continue
                if kind == _FUNCTIONAL:
                    self.functional_ops.append((name, e.ts, e.dur, e.tid))
                elif kind == _PARAM_COMMS:
                    a = e.args or _NO_ARGS
                    param_comms[a.external_id] = a
                    if a.collective == "send" or a.collective == "recv":
                        # Inside batch_isend_irecv these launch no kernel of their own: the
                        # `coalesced` kernel that follows carries them (collectives.py).
                        self.p2p_ops.append((e.ts, a))
                else:
                    a = e.args or _NO_ARGS
                    self.cpu_coll_ops.append((name, e.ts, e.dur, e.tid, a.concrete_inputs, cpu_payload(name, a)))
            elif cat in _RUNTIME_CATS:
                corr = (e.args or _NO_ARGS).correlation
                if corr is not None:
                    runtimes((corr, e.ts))
            elif cat in _MEMORY_CATS:
                a = e.args or _NO_ARGS
                kernels((e.ts, e.dur, MEMORY, e.tid if a.stream is None else a.stream,
                         -1 if a.correlation is None else a.correlation, -1, -1))
            elif cat == "user_annotation":  # GPU mirrors of annotations would double count
                name = e.name
                kind = ann_kind.get(name)
                if kind is None:
                    kind = ann_kind[name] = (
                        _STEP if name.startswith("ProfilerStep")
                        else _COLLECTIVE if name.startswith(cpu_prefixes) or name.startswith(gpu_prefixes)
                        else _PLAIN)
                if kind == _STEP:
                    self._step(name, e.ts, e.dur, e.tid)
                elif kind == _COLLECTIVE:
                    self.annotations.append((name, e.ts, e.dur, e.tid))

    def _step(self, name: str, ts: float, dur: float, tid: object) -> None:
        m = STEP.search(name)
        if m:
            self.steps.append((int(m.group(1)), ts, dur, tid))

    def freeze(self) -> "EventTables":
        """Pack the big columns into numpy arrays (before building, or pickling a slice back).

        CPU ops, c10d calls and annotations only matter for CPU-only traces, so a table that
        saw a compute or communication kernel (a GPU trace) drops them, except the P2P
        annotations (`nccl:send 3->4`), which name the parts of a coalesced kernel. The args of a
        `record_param_comms` op whose kernel carries them too (Kineto copies them) are
        never looked up, so they are dropped as well.
        """
        self.kernels = _rows_array(self.kernels, 7, _KERNEL_FIELDS)
        self.runtimes = _rows_array(self.runtimes, 2, _RUNTIME_FIELDS)
        if (self.kernels[:, 2] != MEMORY).any():
            self.cpu_ops, self.cpu_coll_ops, self.functional_ops = [], [], []
            self.annotations = [a for a in self.annotations if collective_kind(a[0]) in P2P_KINDS]
        if self.kernel_coll:  # ops whose kernels carry their args are never looked up
            own = set(self.kernels[list(self.kernel_coll), 5].astype(np.int64).tolist())
            self.param_comms = {x: a for x, a in self.param_comms.items() if x not in own}
        return self

    @staticmethod
    def merge(parts: list["EventTables"]) -> "EventTables":
        """Concatenate frozen chunk tables in file order, re-interning kernel names."""
        out = EventTables()
        kernels, runtimes = [], []
        for p in parts:
            remap = np.full(len(p.names) + 1, -1.0)  # index -1 (memcpy rows) maps to -1
            for name, nid in p.names.items():
                remap[nid] = out.names.setdefault(name, len(out.names))
            k = _rows_array(p.kernels, 7).copy()
            base = sum(len(x) for x in kernels)
            k[:, 6] = remap[k[:, 6].astype(np.int64)]
            kernels.append(k)
            runtimes.append(_rows_array(p.runtimes, 2))
            out.kernel_coll.update({base + i: a for i, a in p.kernel_coll.items()})
            out.param_comms.update(p.param_comms)
            out.p2p_ops.extend(p.p2p_ops)
            out.annotations.extend(p.annotations)
            out.cpu_coll_ops.extend(p.cpu_coll_ops)
            out.cpu_ops.extend(p.cpu_ops)
            out.functional_ops.extend(p.functional_ops)
            out.steps.extend(p.steps)
            out.events += p.events
        out.kernels = np.concatenate(kernels) if kernels else np.zeros((0, 7))
        out.runtimes = np.concatenate(runtimes) if runtimes else np.zeros((0, 2))
        return out


def cpu_payload(name: str, a: object) -> int:
    """Bytes an all-to-all call moves, from its recorded input shapes (record_shapes=True): the
    larger of what it sends and what it receives (a hot expert's rank receives more in the
    dispatch and sends more in the combine). `c10d::alltoall_base_(output, input, ...)` lists
    both tensors first. -1: unknown (no shapes recorded, or another op)."""
    if collective_kind(name) != "all_to_all" or not len(a.input_dims):
        return -1
    try:
        dims, types = msgspec.json.decode(a.input_dims), msgspec.json.decode(a.input_type) if len(a.input_type) else []
        sizes = [math.prod(d) * dtype_bytes(t or "float") for d, t in zip(dims[:2], [*types, "", ""][:2])
                 if isinstance(d, list) and d and all(isinstance(x, int) for x in d)]
    except (msgspec.DecodeError, TypeError):
        return -1
    return max(sizes) if len(sizes) == 2 else -1


# What each column of the flat rows holds, as the trace names it (for the error on a non-number).
_KERNEL_FIELDS = ("ts", "dur", "class", "args.stream / tid", "args.correlation", "args.External id", "name")
_RUNTIME_FIELDS = ("args.correlation", "ts")


def _rows_array(rows: list | np.ndarray, width: int, fields: tuple[str, ...] = ()) -> np.ndarray:
    """A flat list of numbers, `width` per row, as a float (n, width) array; arrays pass through.

    fromiter over a flat list is ~2x faster than over chained tuples and than np.array. A value
    that is not a number (a missing `ts`, `"dur": "abc"`) raises a TraceError naming the field."""
    if isinstance(rows, np.ndarray):
        return rows.reshape(-1, width)
    try:
        out = np.fromiter(rows, dtype=float, count=len(rows)).reshape(-1, width)
    except (TypeError, ValueError):
        for i, v in enumerate(rows):
            try:
                float(v)
            except (TypeError, ValueError):
                field = fields[i % width] if fields else f"column {i % width}"
                what = "kernel or memcpy" if width == 7 else "runtime"
                raise TraceError(f"a {what} event's `{field}` is {v!r}; expected a number",
                                 hint="times are microseconds as JSON numbers") from None
        raise
    # fromiter reads None (a missing field) as NaN: the times every analysis needs must be there.
    for col in (0, 1) if width == 7 else (1,):
        bad = np.isnan(out[:, col])
        if bad.any():
            field = fields[col] if fields else f"column {col}"
            what = "kernel or memcpy" if width == 7 else "runtime"
            raise TraceError(f"{int(bad.sum())} {what} event(s) without `{field}`", hint="complete events ('ph': 'X') need `ts` and `dur` in microseconds")
    return out

"""Turn one rank's EventTables into its RankSummary (per-step breakdown, collectives, pipeline).

Runs once per file, in the worker that parsed it (or in the parent after a chunked parse).
"""

from __future__ import annotations

import numpy as np

from deltamoe.errors import TraceError
from deltamoe.trace import intervals as iv
from deltamoe.trace.classify import P2P_KINDS
from deltamoe.trace.collectives import cpu_collectives, gpu_collectives
from deltamoe.trace.exposed import cpu_exposed, gpu_exposed
from deltamoe.trace.p2p import cpu_p2p_group
from deltamoe.trace.summary import HEAT_BINS, Collectives, RankSummary
from deltamoe.trace.tables import COMM, COMPUTE, MEMORY, EventTables

StepRange = tuple[int | None, int | None]
_PIPE_KINDS = P2P_KINDS | {"send_recv", "coalesced"}


def rank_info(header: dict, path: str) -> tuple[int, int, str, dict[str, tuple[int, ...] | range], dict[str, str]]:
    """Rank, world size, backend, process groups (name -> global ranks) and their descriptions
    from `distributedInfo` (never the file name)."""
    info = header.get("distributedInfo")
    if not isinstance(info, dict) or info.get("rank") is None:
        raise TraceError("no distributedInfo.rank in the trace metadata", field=path,
                         hint="record with torch.distributed initialised so Kineto writes it")
    rank = _integer(info["rank"])
    if rank is None:
        raise TraceError(f"distributedInfo.rank must be an integer, got {info['rank']!r}", field=path)
    world = _integer(info.get("world_size"))
    if world is not None and world > 0 and not 0 <= rank < world:
        raise TraceError(f"rank {rank} outside the world size {world}", field=path,
                         hint="distributedInfo.rank must be in 0..world_size-1")
    groups, descs = {}, {}
    for pg in info.get("pg_config") or []:
        if isinstance(pg, dict) and "ranks" in pg:
            name = str(pg.get("pg_name", ""))
            groups[name] = _compact_ranks(pg["ranks"])
            descs[name] = str(pg.get("pg_desc", ""))
    world = world if world is not None else int(info.get("world_size", 0) or 0)
    return rank, world, str(info.get("backend", "")), groups, descs


def _integer(x: object) -> int | None:
    """An int, or a string of one ("0", as some exporters write it); None for anything else."""
    if isinstance(x, int) and not isinstance(x, bool):
        return x
    if isinstance(x, str):
        try:
            return int(x)
        except ValueError:
            return None
    return None


def _compact_ranks(ranks: list) -> tuple[int, ...] | range:
    """Strided rank lists (world, DP, TP groups) as a `range`: every file lists the world
    group, and 10,000 files x 10,000 ranks must not travel back to the parent as tuples."""
    # Short lists (most groups) without numpy's per-call cost; long ones (the world group of a
    # large job) are faster in numpy.
    if isinstance(ranks, list) and len(ranks) <= 256 and set(map(type, ranks)) == {int}:
        if len(ranks) >= 2:
            step = ranks[1] - ranks[0]
            if step > 0 and ranks == list(range(ranks[0], ranks[-1] + 1, step)):
                return range(ranks[0], ranks[-1] + 1, step)
        return tuple(ranks)
    a = np.asarray(ranks, dtype=np.int64)
    if len(a) >= 2:
        d = np.diff(a)
        if d[0] > 0 and (d == d[0]).all():
            return range(int(a[0]), int(a[-1]) + 1, int(d[0]))
    return tuple(a.tolist())


def build_summary(t: EventTables, header: dict, path: str, steps: StepRange = (None, None)) -> RankSummary:
    rank, world, backend, groups, descs = rank_info(header, path)
    if t.events == 0:
        raise TraceError("the trace has no events", field=path)
    t.freeze()
    negative = _zero_negative_durations(t)
    gpu = bool((t.kernels[:, 2] != MEMORY).any())
    builder = _GpuView(t, groups) if gpu else _CpuView(t, rank, cpu_p2p_group(rank, groups, descs))
    step_ids, windows = builder.step_windows()
    step_ids = step_ids + _step_offset(header)
    in_trace = tuple(step_ids.tolist())
    keep = _select(step_ids, steps)
    step_ids, windows = step_ids[keep], windows[keep]
    coll = builder.collectives(windows)
    s = RankSummary(rank=rank, world_size=world, backend=backend, path=path,
                    host=str(header.get("host_name", "")), mode="gpu" if gpu else "cpu",
                    events=t.events, groups=groups, step_ids=step_ids, window=windows,
                    compute=np.zeros(len(step_ids)), comm=np.zeros(len(step_ids)),
                    memcpy=np.zeros(len(step_ids)), idle=np.zeros(len(step_ids)),
                    overlap=np.zeros(len(step_ids)), p2p_wait=np.zeros(len(step_ids)),
                    pipe_first=np.full(len(step_ids), np.nan), pipe_end=np.full(len(step_ids), np.nan),
                    pipe_busy=np.zeros(len(step_ids)), heat=np.zeros((len(step_ids), HEAT_BINS), np.float32),
                    coll=coll, steps_in_trace=in_trace)
    if not t.steps:
        s.warnings.append("no ProfilerStep markers in the trace: analysed as one step (step 0) spanning the whole "
                          "trace (call prof.step() once per training step)")
    elif not len(step_ids):
        s.warnings.append("no ProfilerStep in the selected range")
    unknown = builder.unrecognised_comm() if gpu else ""
    if unknown:
        s.warnings.append(unknown)
    if negative:
        s.warnings.append(f"{negative} event(s) with a negative duration (dur < 0), read as zero-length: "
                          "the exporter's clock or the file is broken")
    compute, comm, mem = builder.spans()
    _breakdown(s, compute, comm, mem)
    _pipeline(s, compute, comm, coll)
    if len(step_ids):
        s.exposed, s.exposed_kind = builder.exposed(s, compute)
    return s


# Where each row list keeps its duration (`EventTables`).
_DUR_AT = {"cpu_ops": 1, "steps": 2, "annotations": 2, "cpu_coll_ops": 2, "functional_ops": 2}


def _zero_negative_durations(t: EventTables) -> int:
    """Events whose `dur` is negative (no profiler writes one; a broken clock or a hand-edited
    file does) would make intervals that run backwards and subtract from every union: each is
    read as zero-length -> how many there were, for a warning."""
    count = 0
    if len(t.kernels):
        bad = t.kernels[:, 1] < 0
        count += int(bad.sum())
        t.kernels[bad, 1] = 0.0
    for name, at in _DUR_AT.items():
        rows = getattr(t, name)
        n = sum(1 for r in rows if r[at] < 0)
        if n:
            count += n
            setattr(t, name, [r if r[at] >= 0 else r[:at] + (0.0,) + r[at + 1:] for r in rows])
    return count


def _breakdown(s: RankSummary, compute: iv.Spans, comm: iv.Spans, mem: iv.Spans) -> None:
    """Per-step compute / comm / memcpy / idle / overlap, all steps at once.

    Each quantity is a length of a union inside the step windows; unions are built once
    for the whole rank and measured with the cumulative busy curve (intervals.length_in).
    """
    if not len(s.step_ids):
        return
    lo, hi = s.window[:, 0], s.window[:, 1]
    compute_and_comm = iv.merge(compute, comm)
    busy = iv.merge(compute_and_comm, mem)
    s.compute = iv.length_in(compute, lo, hi)
    s.comm = iv.length_in(comm, lo, hi)
    both = iv.length_in(compute_and_comm, lo, hi)
    busy_len = iv.length_in(busy, lo, hi)
    s.overlap = s.compute + s.comm - both
    s.memcpy = busy_len - both
    s.idle = (hi - lo) - busy_len
    s.heat = iv.binned_busy(compute, lo, hi, HEAT_BINS).astype(np.float32)


def _step_offset(header: dict) -> int:
    """ProfilerStep#N counts `prof.step()` calls from 0; a recorder that knows which training
    step that was writes it as the top-level `profiler_step_offset`, and steps are reported
    (and selected with --steps) as training steps."""
    off = header.get("profiler_step_offset")
    return off if isinstance(off, int) and not isinstance(off, bool) else 0


def _select(step_ids: np.ndarray, steps: StepRange) -> np.ndarray:
    lo, hi = steps
    keep = np.ones(len(step_ids), dtype=bool)
    if lo is not None:
        keep &= step_ids >= lo
    if hi is not None:
        keep &= step_ids < hi
    return keep


def _pipeline(s: RankSummary, compute: iv.Spans, comm: iv.Spans, coll: Collectives) -> None:
    """Pipeline facts per step: compute idle while waiting on P2P, and the pipeline block.

    The working time of a stage is compute plus non-pipeline communication (MoE all-to-all,
    TP all-reduce): time exposed to those is communication, not bubble.

    The pipeline phase of a stage ends with its last pipeline compute: after a final recv
    that is the compute block consuming it; after a final send it is the compute that
    produced it. Gradient sync and the optimizer that follow are not pipeline work.
    """
    is_pipe = np.array([k in _PIPE_KINDS for k in coll.kind.tolist()], dtype=bool)
    in_step = is_pipe & (coll.step >= 0)
    # sorted(set()): np.unique would load numpy.ma (~5 ms) in every reader process
    steps = np.array(sorted(set(coll.step[in_step].tolist())), dtype=np.int64)
    if not len(steps) or not len(compute[0]):
        return
    pipe = iv.union(coll.arrive[is_pipe], coll.end[is_pipe])
    working = iv.merge(compute, iv.subtract(comm, pipe))
    lo, hi = s.window[steps, 0], s.window[steps, 1]
    # Idle compute under a pending P2P op: |(p2p u compute) in W| - |compute in W|
    # (the latter is s.compute of those steps, measured per window by _breakdown).
    wait = iv.length_in(iv.merge(pipe, compute), lo, hi) - s.compute[steps]
    # The last pipeline op of each step, by when the rank issued it (an asynchronous send issued
    # early may complete after everything else; the first of equal issues, as argmax picks; of the
    # send and the recv one coalesced kernel carries, the recv, whose data compute consumes).
    rows = np.flatnonzero(in_step)
    rows = rows[np.lexsort((coll.kind[rows] == "send", -coll.end[rows], -coll.arrive[rows], coll.step[rows]))]
    first_of_step = np.empty(len(rows), dtype=bool)
    first_of_step[:1] = True
    np.not_equal(coll.step[rows][1:], coll.step[rows][:-1], out=first_of_step[1:])
    kinds = coll.kind.tolist()
    done = []
    for k, w, a, b, last in zip(steps.tolist(), wait.tolist(), lo.tolist(), hi.tolist(),
                                rows[first_of_step].tolist()):
        cs, ce = iv.clip(compute, a, b)
        if not len(cs):
            continue
        s.p2p_wait[k] = w
        if kinds[last] == "send":
            before = cs < coll.arrive[last]
            end = float(ce[before].max()) if before.any() else float(ce[0])
        else:
            end = _block_end(cs, ce, float(coll.end[last]), iv.clip(pipe, a, b))
        s.pipe_first[k] = float(cs[0])
        s.pipe_end[k] = end
        done.append(k)
    if done:  # working time in [first compute, block end) of each step, measured at once
        s.pipe_busy[done] = iv.length_in(working, s.pipe_first[done], s.pipe_end[done])


def _block_end(cs: np.ndarray, ce: np.ndarray, after: float, p2p: iv.Spans) -> float:
    """End of the contiguous compute block that starts after `after`.

    "Contiguous" allows gaps as long as the longest gap seen inside earlier blocks (gaps
    not covered by a pipeline op: MoE all-to-all, TP all-reduce), so the block is not cut
    at an expert exchange but stops at the gradient sync.
    """
    start = int(np.searchsorted(cs, after - 1e-3))
    if start >= len(cs):
        return float(ce[-1])
    gaps_s, gaps_e = ce[:start - 1] if start > 1 else ce[:0], cs[1:start] if start > 1 else cs[:0]
    inner = 0.0
    if len(gaps_s):
        g = gaps_e - gaps_s
        # Gaps that overlap a pipeline op are waits for a peer, not gaps inside a block.
        ps, pe = p2p
        i = np.searchsorted(pe, gaps_s, side="right")
        covered = (i < len(ps)) & (ps[np.minimum(i, len(ps) - 1)] < gaps_e)
        inside = g[~covered]
        inner = float(inside.max()) if len(inside) else 0.0
    limit = 1.5 * inner + 1.0
    # The block runs on until the first gap to the next span wider than the limit.
    wide = np.flatnonzero(cs[start + 1:] - ce[start:-1] > limit)
    return float(ce[start + wide[0]] if len(wide) else ce[-1])


class _GpuView:
    """Kernels on GPU streams; steps from kernel launch times."""

    def __init__(self, t: EventTables, groups: dict):
        self.t, self.groups = t, groups
        k = t.kernels
        self.ts, self.dur, self.cls = k[:, 0], k[:, 1], k[:, 2].astype(np.int8)
        self.corr, self.ext, self.nid = k[:, 4].astype(np.int64), k[:, 5].astype(np.int64), k[:, 6].astype(np.int64)
        self.launch = self._launch_times()

    def _launch_times(self) -> np.ndarray:
        r = self.t.runtimes
        if not len(r):
            return self.ts.copy()
        rc, rts = r[:, 0].astype(np.int64), r[:, 1]
        order = np.argsort(rc, kind="stable")
        rc, rts = rc[order], rts[order]
        i = np.clip(np.searchsorted(rc, self.corr), 0, len(rc) - 1)
        found = rc[i] == self.corr
        return np.where(found, rts[i], self.ts)

    def unrecognised_comm(self) -> str:
        """Compute kernels launched by a `record_param_comms` op itself (they share its External
        id): a collective whose kernel neither matches a communication pattern nor carries the
        `Collective name` arg (a kernel that does is communication, tables.py) -> a warning."""
        pc = self.t.param_comms
        if not pc:
            return ""
        ids = np.array([x for x in pc if isinstance(x, int) and not isinstance(x, bool)], dtype=np.int64)
        hit = np.flatnonzero((self.cls == COMPUTE) & np.isin(self.ext, ids))
        if not len(hit):
            return ""
        name = {v: k for k, v in self.t.names.items()}.get(int(self.nid[hit[0]]), "?")
        return (f"{len(hit)} kernel(s) launched by record_param_comms were not recognised as communication "
                f"(e.g. {name.split('(')[0]}) and count as compute (use --comm-pattern)")

    def step_windows(self) -> tuple[np.ndarray, np.ndarray]:
        steps = _steps(self.t)
        if not len(steps):
            return np.array([0]), np.array([[self.ts.min(), (self.ts + self.dur).max()]])
        ids, st, en = steps
        k = np.searchsorted(st, self.launch, side="right") - 1
        valid = (k >= 0) & (self.launch < en[np.maximum(k, 0)])
        self.kstep = np.where(valid, k, -1)
        first = np.full(len(ids), np.inf)
        last = np.full(len(ids), -np.inf)
        np.minimum.at(first, self.kstep[valid], self.ts[valid])
        np.maximum.at(last, self.kstep[valid], (self.ts + self.dur)[valid])
        win = np.zeros((len(ids), 2))
        for j in range(len(ids)):
            if not np.isfinite(first[j]):  # a step without kernels: fall back to the CPU span
                first[j], last[j] = st[j], en[j]
            win[j, 0] = first[j]
            nxt = first[j + 1:][np.isfinite(first[j + 1:])]
            win[j, 1] = max(last[j], nxt[0]) if j + 1 < len(ids) and len(nxt) else last[j]
        return ids, win

    def spans(self) -> tuple[iv.Spans, iv.Spans, iv.Spans]:
        end = self.ts + self.dur
        out = []
        for cls in (COMPUTE, COMM, MEMORY):
            m = self.cls == cls
            out.append(iv.union(self.ts[m], end[m]))
        return out[0], out[1], out[2]

    def collectives(self, windows: np.ndarray) -> Collectives:
        rows = np.flatnonzero(self.cls == COMM)
        return gpu_collectives(self.t, rows, self.ext[rows], self.nid[rows], self.ts[rows],
                               self.ts[rows] + self.dur[rows], windows, self.groups, self.launch[rows])

    def exposed(self, s: RankSummary, compute: iv.Spans) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        return gpu_exposed(s.coll.kind, s.coll.arrive, s.coll.end, compute, s.window[:, 0], s.window[:, 1])


class _CpuView:
    """gloo / CPU-only traces: the main thread is the device; collectives are c10d + gloo ops."""

    def __init__(self, t: EventTables, rank: int, p2p_group):
        self.t, self.rank, self.p2p_group = t, rank, p2p_group
        tids = [s[3] for s in t.steps] or [o[2] for o in t.cpu_ops]
        self.main = max(set(tids), key=tids.count) if tids else 0

    def step_windows(self) -> tuple[np.ndarray, np.ndarray]:
        steps = _steps(self.t)
        if not len(steps):
            ops = np.array([(o[0], o[0] + o[1]) for o in self.t.cpu_ops] or [(0.0, 0.0)])
            return np.array([0]), np.array([[ops[:, 0].min(), ops[:, 1].max()]])
        ids, st, en = steps
        return ids, np.stack([st, en], axis=1)

    def spans(self) -> tuple[iv.Spans, iv.Spans, iv.Spans]:
        t = self.t
        # c10d calls, and the asynchronous collectives' issue and `wait_tensor` (waiting is not compute).
        calls = [(o[1], o[1] + o[2]) for o in (*t.cpu_coll_ops, *t.functional_ops) if o[3] == self.main]
        ops = [(o[0], o[0] + o[1]) for o in t.cpu_ops if o[2] == self.main]
        exchanges = [(a[1], a[1] + a[2]) for a in t.annotations if a[3] == self.main]
        comm_all = calls + exchanges + [(a[1], a[1] + a[2]) for a in t.annotations if a[3] != self.main]
        # Ops nested in a blocking c10d call (aten::empty inside recv) are communication, and so is
        # the time the thread is held in a gloo exchange; an asynchronous one it goes on computing in is not.
        held = blocking_parts(exchanges, calls + ops)
        compute = iv.subtract(_spans(ops), _spans(calls + held))
        return compute, _spans(comm_all), iv.EMPTY

    def collectives(self, windows: np.ndarray) -> Collectives:
        return cpu_collectives(self.t, self.main, windows, self.rank, self.p2p_group)

    def exposed(self, s: RankSummary, compute: iv.Spans) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        t = self.t
        return cpu_exposed(t.cpu_ops, t.cpu_coll_ops, t.functional_ops, t.annotations, self.main, s.window[:, 0],
                           s.window[:, 1])


def blocking_parts(exchanges: list[tuple[float, float]], ops: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of a thread's gloo exchanges (`gloo:send`, ... annotations: start, end) during which the
    thread is held in them. A blocking exchange runs nothing inside it. An asynchronous one (isend,
    irecv, batch_isend_irecv: how `torch.distributed.pipelining` sends) stays open on the thread until
    its transfer completes while the thread goes on: it holds the thread only until the first op the
    thread starts inside it (`ops`, start and end, the thread's own) and after the last one ends (a
    final `wait()`, which records no op)."""
    if not exchanges or not ops:
        return exchanges
    spans = np.array(ops, dtype=float)
    spans = spans[np.argsort(spans[:, 0], kind="stable")]
    starts, ends = spans[:, 0], spans[:, 1]
    a = np.array(exchanges, dtype=float)
    first = np.searchsorted(starts, a[:, 0], side="right")  # ops starting strictly after the exchange does
    stop = np.searchsorted(starts, a[:, 1], side="left")  # ... and before it ends
    out = []
    for (lo, hi), i, j in zip(exchanges, first.tolist(), stop.tolist()):
        if j <= i:
            out.append((lo, hi))
            continue
        out.append((lo, float(starts[i])))
        last = float(ends[i:j].max())
        if last < hi:
            out.append((last, hi))
    return out


def _steps(t: EventTables) -> tuple[np.ndarray, np.ndarray, np.ndarray] | tuple:
    if not t.steps:
        return ()
    best: dict[int, tuple[float, float]] = {}
    for n, ts, dur, _tid in t.steps:
        best.setdefault(n, (ts, ts + dur))
    ids = np.array(sorted(best))
    st = np.array([best[i][0] for i in ids])
    en = np.array([best[i][1] for i in ids])
    return ids, st, en


def _spans(pairs: list[tuple[float, float]]) -> iv.Spans:
    if not pairs:
        return iv.EMPTY
    a = np.array(pairs, dtype=float)
    return iv.union(a[:, 0], a[:, 1])

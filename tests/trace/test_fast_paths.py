"""Fast paths against their readable references, on fresh random inputs.

Each reference below is the straightforward version a fast path replaced (kept here, not in
the package); both must give identical results on random inputs, including odd values.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from deltamoe.errors import TraceError
from deltamoe.trace import collectives as C
from deltamoe.trace.build import _compact_ranks
from deltamoe.trace.classify import P2P_KINDS, STEP, Patterns, collective_kind, dtype_bytes
from deltamoe.trace.schema import NO_ARGS, Args, Event
from deltamoe.trace.summary import Collectives
from deltamoe.trace.tables import _MEMORY_CATS, _RUNTIME_CATS, COMM, COMPUTE, MEMORY, EventTables, cpu_payload


# ---- references -------------------------------------------------------------------------

def ref_compact_ranks(ranks):
    a = np.asarray(ranks, dtype=np.int64)
    if len(a) >= 2:
        d = np.diff(a)
        if d[0] > 0 and (d == d[0]).all():
            return range(int(a[0]), int(a[-1]) + 1, int(d[0]))
    return tuple(a.tolist())


class RefTables(EventTables):
    def _ref_step(self, name, ts, dur, tid):
        m = STEP.search(name)
        if m:
            self.steps.append((int(m.group(1)), ts, dur, tid))

    def add(self, events, patterns):
        comm_re = patterns.comm_regex()
        cpu_prefixes = patterns.cpu_collective_prefixes
        gpu_prefixes = patterns.gpu_collective_prefixes
        kernels, runtimes, cpu_ops = self.kernels.append, self.runtimes.append, self.cpu_ops.append
        names, kernel_coll, param_comms = self.names, self.kernel_coll, self.param_comms
        cls_of: dict[str, int] = {}
        self.events += len(events)
        for e in events:
            if e.__class__ is not Event:  # flows, metadata, instants, counters
                continue
            cat = e.cat
            if cat == "kernel":
                name = e.name
                cls = cls_of.get(name)
                if cls is None:
                    cls = COMM if comm_re.search(name) else COMPUTE
                    cls_of[name] = cls
                nid = names.get(name)
                if nid is None:
                    nid = names[name] = len(names)
                a = e.args or NO_ARGS
                if a.collective is not None:  # a kernel with the collective's args is communication (F8)
                    cls = COMM
                    kernel_coll[len(self.kernels)] = a
                kernels((e.ts, e.dur, cls, e.tid if a.stream is None else a.stream,
                         -1 if a.correlation is None else a.correlation,
                         -1 if a.external_id is None else a.external_id, nid))
            elif cat == "cpu_op":
                name = e.name
                if name.startswith("ProfilerStep"):  # older exports record steps as cpu_op
                    self._ref_step(name, e.ts, e.dur, e.tid)
                    continue
                cpu_ops((e.ts, e.dur, e.tid))
                if name == "record_param_comms":
                    a = e.args or NO_ARGS
                    param_comms[a.external_id] = a
                elif name.startswith(cpu_prefixes):
                    a = e.args or NO_ARGS
                    self.cpu_coll_ops.append((name, e.ts, e.dur, e.tid, a.concrete_inputs, cpu_payload(name, a)))
                elif name.startswith(("_c10d_functional::", "c10d_functional::")):
                    self.functional_ops.append((name, e.ts, e.dur, e.tid))
            elif cat in _RUNTIME_CATS:
                corr = (e.args or NO_ARGS).correlation
                if corr is not None:
                    runtimes((corr, e.ts))
            elif cat in _MEMORY_CATS:
                a = e.args or NO_ARGS
                kernels((e.ts, e.dur, MEMORY, e.tid if a.stream is None else a.stream,
                         -1 if a.correlation is None else a.correlation, -1, -1))
            elif cat == "user_annotation":  # GPU mirrors of annotations would double count
                name = e.name
                if name.startswith("ProfilerStep"):
                    self._ref_step(name, e.ts, e.dur, e.tid)
                elif name.startswith(cpu_prefixes) or name.startswith(gpu_prefixes):
                    self.annotations.append((name, e.ts, e.dur, e.tid))



def ref_gpu_collectives(t: EventTables, rows: np.ndarray, ext: np.ndarray, name_id: np.ndarray,
                    start: np.ndarray, end: np.ndarray, windows: np.ndarray) -> Collectives:
    """`rows`: indices of the communication kernels in `t.kernels`; the other arrays are theirs."""
    kc, pc = t.kernel_coll, t.param_comms
    args = [kc.get(i) or pc.get(x) or NO_ARGS for i, x in zip(rows.tolist(), ext.tolist())]
    names = {v: k for k, v in t.names.items()}
    # What names the op: its `Collective name`, else the kernel name.
    label = [c or names.get(nid, "") for c, nid in zip(C._strs([a.collective for a in args]), name_id.tolist())]
    kind_of = {x: collective_kind(x) for x in set(label)}
    kind = C._text([kind_of[x] for x in label])
    dtypes = [d or "float" for d in C._strs([a.dtype for a in args])]
    size_of = {d: dtype_bytes(d) for d in set(dtypes)}
    sent = [max(a.in_nelems, a.out_nelems) if k == "all_to_all" and isinstance(a.in_nelems, int)
            and isinstance(a.out_nelems, int) else a.in_nelems for a, k in zip(args, kind.tolist())]
    elems = np.where(kind == "recv", C._ints([a.out_nelems for a in args], 0), C._ints(sent, 0))
    peer = np.where(kind == "send", C._ints([a.dst for a in args], -1),
                    np.where(kind == "recv", C._ints([a.src for a in args], -1), -1))
    return ref_finish(pg=C._text(C._strs([a.pg_name for a in args])), seq=C._ints([a.seq for a in args], -1),
                  kind=kind, nbytes=elems * np.array([size_of[d] for d in dtypes], dtype=np.int64),
                  arrive=start, end=end, peer=peer, windows=windows)


def ref_finish(pg: np.ndarray, seq: np.ndarray, kind: np.ndarray, nbytes: np.ndarray, arrive: np.ndarray,
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
        p2p = np.isin(kind[unnumbered], list(P2P_KINDS))
        group = np.char.add(np.where(pg[unnumbered] != "", pg[unnumbered], kind[unnumbered]),
                            np.where(p2p, "\x01", "\x00"))
        seq[unnumbered] = ref_ordinal_within(group)
    return Collectives(pg=pg, seq=seq, kind=kind, nbytes=nbytes, arrive=arrive, end=end, peer=peer, step=step)


def ref_ordinal_within(group: np.ndarray) -> np.ndarray:
    """0, 1, 2, ... along the array, counted separately for each distinct group value."""
    _, gid = np.unique(group, return_inverse=True)
    by_group = np.argsort(gid, kind="stable")
    first = np.searchsorted(gid[by_group], gid[by_group])  # start of each row's group run
    out = np.empty(len(group), dtype=np.int64)
    out[by_group] = np.arange(len(group)) - first
    return out


# ---- random inputs ----------------------------------------------------------------------

_VALUES = [None, None, 0, 1, 3, 17, -1, 4096, "12", "x", "", 2.0, 3.7, float("nan"), True, [1, 2]]
_NAMES = ["ncclKernel_AllReduce_RING", "ncclDevKernel_SendRecv", "rcclKernel_x", "sm90_gemm", "elementwise",
          "nccl:all_reduce", "nccl:send 3->4", "gloo:recv 2<-1", "c10d::allreduce_", "c10d::send",
          "ProfilerStep#3", "ProfilerStep#12", "ProfilerStep", "record_param_comms", "aten::mm", "Memcpy HtoD",
          "_c10d_functional::wait_tensor"]
_CATS = ["kernel", "kernel", "cpu_op", "cpu_op", "cuda_runtime", "hip_runtime", "cuda_driver", "gpu_memcpy",
         "gpu_memset", "user_annotation", "python_function", None, 3]
_KINDS = ["all_reduce", "send", "recv", "all_to_all", "other"]


def _args(rng: random.Random) -> Args | None:
    if rng.random() < 0.1:
        return None
    v = lambda: rng.choice(_VALUES)  # noqa: E731
    return Args(external_id=rng.choice([None, rng.randrange(20)]), correlation=rng.choice([None, rng.randrange(50)]),
                stream=rng.choice([None, 7, 20]), collective=rng.choice([None, "", "allreduce", "send", "recv",
                                                                         "all_to_all", 5]),
                pg_name=rng.choice([None, "", "0", "ep_1", 3]), seq=v(), in_nelems=v(), out_nelems=v(),
                dtype=rng.choice([None, "", "BFloat16", "float", "Half", "weird", 4]), src=v(), dst=v(),
                concrete_inputs=rng.choice([None, ["", "", 3], "x"]))


def _events(rng: random.Random, n: int, tids: tuple = (1, 2, "t")) -> list:
    from deltamoe.trace.schema import _OTHER_PHASES

    out = []
    for _ in range(n):
        if rng.random() < 0.15:
            out.append(rng.choice(_OTHER_PHASES)())
            continue
        out.append(Event(cat=rng.choice(_CATS), name=rng.choice(_NAMES), tid=rng.choice(tids),
                         ts=rng.uniform(0, 1e4), dur=rng.uniform(0, 50), args=_args(rng)))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_event_tables_add_matches_reference(seed):
    rng = random.Random(seed)
    patterns = Patterns().with_extra(["^rccl"] if seed % 2 else [])
    chunks = [_events(rng, rng.randrange(0, 300)) for _ in range(rng.randrange(1, 4))]
    new, ref = EventTables(), RefTables()
    for ev in chunks:  # several chunks into one table, as slices of a file are
        new.add(ev, patterns)
        ref.add(ev, patterns)
    from itertools import chain

    # kernels and runtimes are flat lists now: the same numbers, row after row
    assert new.kernels == list(chain.from_iterable(ref.kernels))
    assert new.runtimes == list(chain.from_iterable(ref.runtimes))
    for f in ("kernel_coll", "param_comms", "annotations", "cpu_coll_ops", "cpu_ops", "functional_ops", "steps", "names",
              "events"):
        assert getattr(new, f) == getattr(ref, f), f
    try:
        ref_k = np.array(ref.kernels, dtype=float).reshape(-1, 7)
    except (TypeError, ValueError):  # odd tids: freezing fails, naming the column
        with pytest.raises(TraceError, match="event.s `.*` is .*; expected a number"):
            new.freeze()
        return
    new.freeze()
    np.testing.assert_array_equal(new.kernels, ref_k)
    np.testing.assert_array_equal(new.runtimes, np.array(ref.runtimes, dtype=float).reshape(-1, 2))


@pytest.mark.parametrize("seed", range(40))
def test_gpu_collectives_match_reference(seed):
    rng = random.Random(seed)
    t = EventTables()
    t.add(_events(rng, rng.randrange(1, 400), tids=(1, 2)), Patterns())  # numeric rows
    t.freeze()
    k = t.kernels
    rows = np.flatnonzero(k[:, 2] == COMM)
    ext, nid = k[rows, 5].astype(np.int64), k[rows, 6].astype(np.int64)
    start, end = k[rows, 0], k[rows, 0] + k[rows, 1]
    windows = np.sort(rng.sample(range(10_000), 2 * rng.randrange(0, 4))).astype(float).reshape(-1, 2)
    try:
        ref = ref_gpu_collectives(t, rows, ext, nid, start, end, windows)
    except Exception as e:  # the reference's odd-value failures must stay failures
        with pytest.raises(type(e)):
            C.gpu_collectives(t, rows, ext, nid, start, end, windows)
        return
    _same(C.gpu_collectives(t, rows, ext, nid, start, end, windows), ref)


def ref_expand_parts(parts, args, kinds, pg, seq, nbytes, start, end, peer, groups):
    """Row by row: each row's parts (or the row itself), peers of P2P rows as global ranks."""
    from deltamoe.trace.p2p import group_ranks, to_global

    out = {k: [] for k in ("kind", "pg", "seq", "nbytes", "start", "end", "peer")}
    for i, kind in enumerate(kinds):
        pieces = parts.get(i) or [(kind, int(peer[i]), int(nbytes[i]))]
        ranks = group_ranks(pg[i], groups, args[i])
        for part_kind, part_peer, part_bytes in pieces:
            out["kind"].append(part_kind)
            out["pg"].append(pg[i])
            out["seq"].append(int(seq[i]) if len(pieces) == 1 else -1)
            out["nbytes"].append(part_bytes)
            out["start"].append(float(start[i]))
            out["end"].append(float(end[i]))
            out["peer"].append((to_global(part_peer, ranks) if ranks is not None else part_peer)
                               if part_kind in P2P_KINDS else -1)
    return (out["kind"], out["pg"], np.array(out["seq"], dtype=np.int64), np.array(out["nbytes"], dtype=np.int64),
            np.array(out["start"], dtype=float), np.array(out["end"], dtype=float),
            np.array(out["peer"], dtype=np.int64))


@pytest.mark.parametrize("seed", range(40))
def test_expand_parts_matches_reference(seed):
    """Coalesced kernels split into their sends / recvs, peers mapped to global ranks (p2p.py)."""
    rng = random.Random(seed)
    n = rng.randrange(0, 60)
    groups = {"0": tuple(range(8)), "1": (1, 3, 5, 7), "2": range(2, 16, 4)}
    kinds = [rng.choice(["send", "recv", "all_reduce", "coalesced", "all_to_all"]) for _ in range(n)]
    pg = [rng.choice(["0", "1", "2", "9", ""]) for _ in range(n)]  # "9", "": groups the trace does not describe
    args = [rng.choice([NO_ARGS, Args(pg_ranks="[4, 6]"), Args(pg_ranks="[1, ...]"),
                        Args(rank_start=1, rank_stride=2, group_size=3)]) for _ in range(n)]
    seq = np.array([rng.randrange(-1, 9) for _ in range(n)], dtype=np.int64)
    nbytes = np.array([rng.randrange(0, 1 << 20) for _ in range(n)], dtype=np.int64)
    start = np.sort(np.array([rng.uniform(0, 1e4) for _ in range(n)]))
    end = start + np.array([rng.uniform(0, 50) for _ in range(n)])
    peer = np.array([rng.randrange(-1, 10) if k in P2P_KINDS else -1 for k in kinds], dtype=np.int64)
    parts = {i: [(rng.choice(["send", "recv"]), rng.randrange(-1, 10), rng.randrange(0, 4096))
                 for _ in range(rng.randrange(0, 4))]
             for i, k in enumerate(kinds) if k == "coalesced" and rng.random() < 0.8}
    new = C.expand_parts(parts, args, kinds, pg, seq, nbytes, start, end, peer, groups)
    ref = ref_expand_parts(parts, args, kinds, pg, seq, nbytes, start, end, peer, groups)
    assert new[0] == ref[0] and new[1] == ref[1]
    for a, b in zip(new[2:], ref[2:]):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("seed", range(40))
def test_finish_numbering_matches_reference(seed):
    rng = random.Random(seed)
    n = rng.randrange(0, 200)
    cols = dict(pg=np.array([rng.choice(["", "0", "ep_1", "pp"]) for _ in range(n)], dtype=str),
                seq=np.array([rng.choice([-1, -1, 0, 5, 9]) for _ in range(n)], dtype=np.int64),
                kind=np.array([rng.choice(_KINDS) for _ in range(n)], dtype=str),
                nbytes=np.arange(n, dtype=np.int64), arrive=np.array([rng.uniform(0, 100) for _ in range(n)]),
                end=np.zeros(n), peer=np.full(n, -1, dtype=np.int64), windows=np.array([[0.0, 50.0], [50.0, 100.0]]))
    _same(C.finish(**cols), ref_finish(**cols))


def _same(a: Collectives, b: Collectives) -> None:
    for f in ("pg", "seq", "kind", "nbytes", "arrive", "end", "peer", "step"):
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and x.shape == y.shape, f
        np.testing.assert_array_equal(x, y, err_msg=f)


def test_compact_ranks_matches_reference():
    rng = random.Random(0)
    for _ in range(5000):
        n = rng.choice([0, 1, 2, 3, 5, 8, 64, 256, 257, 300])
        start, step = rng.randrange(0, 10), rng.choice([-2, -1, 0, 1, 2, 3])
        ranks = [start + step * j for j in range(n)]
        if n and rng.random() < 0.4:
            ranks[rng.randrange(n)] += rng.choice([0, 1, 5])
        if rng.random() < 0.1:
            ranks = [float(r) for r in ranks]
        got, want = _compact_ranks(ranks), ref_compact_ranks(ranks)
        assert got == want and type(got) is type(want), ranks


def ref_releases_idx(j) -> dict:
    from collections import defaultdict

    rows: dict[tuple[int, int], list[float]] = defaultdict(list)
    for r, st, e, w in zip(j.rank.tolist(), j.step.tolist(), j.end.tolist(), j.wait.tolist()):
        if w > 0:
            rows[(r, st)].append(e)
    for d, st, e, w in zip(j.p2p_dst.tolist(), j.p2p_step.tolist(), j.p2p_end.tolist(), j.p2p_wait.tolist()):
        if w > 0:
            rows[(d, st)].append(e)
    return {k: sorted(v) for k, v in rows.items()}


@pytest.mark.parametrize("seed", range(30))
def test_releases_match_reference(seed):
    from types import SimpleNamespace

    from deltamoe.trace.analyses.stragglers import _Releases

    rng = np.random.default_rng(seed)
    n, m = int(rng.integers(0, 300)), int(rng.integers(0, 100))
    j = SimpleNamespace(rank=rng.integers(0, 6, n), step=rng.integers(0, 4, n), end=rng.choice([1.0, 2.5, 7.0, 9.25], n),
                        wait=rng.choice([0.0, 0.0, 1.0, 3.5], n), p2p_dst=rng.integers(0, 6, m),
                        p2p_step=rng.integers(0, 4, m), p2p_end=rng.uniform(0, 10, m),
                        p2p_wait=rng.choice([0.0, 2.0], m), p2p_src=rng.integers(0, 6, m),
                        p2p_send=rng.uniform(0, 10, m))
    assert _Releases(j).idx == ref_releases_idx(j)


def ref_find_traces(folder) -> list[str]:
    from pathlib import Path

    files = [p for p in Path(folder).rglob("*") if p.is_file() and not p.name.startswith(("_", "."))
             and (p.name.lower().endswith(".json") or p.name.lower().endswith(".json.gz"))]  # any case (F11)
    return sorted(str(p) for p in files)


@pytest.mark.parametrize("seed", range(5))
def test_find_traces_matches_rglob(tmp_path, seed, monkeypatch):
    import os

    from deltamoe.trace.reader import find_traces

    rng = random.Random(seed)
    dirs = [tmp_path]
    for _ in range(rng.randrange(1, 8)):
        d = rng.choice(dirs) / rng.choice(["a", "_b", ".c", "d.json", "e"]) / str(rng.randrange(3))
        d.mkdir(parents=True, exist_ok=True)
        dirs.append(d)
    for _ in range(rng.randrange(1, 30)):
        name = rng.choice(["r", "_r", ".r", "x"]) + str(rng.randrange(99)) + rng.choice(
            [".json", ".json.gz", ".JSON", ".Json.GZ", ".txt", ".json.gz.tmp", ""])
        (rng.choice(dirs) / name).write_text("{}")
    os.symlink(dirs[-1], tmp_path / "linked_dir")  # not entered, as rglob does not
    os.symlink(tmp_path / "missing", tmp_path / "dangling.json")
    monkeypatch.chdir(tmp_path.parent)
    for arg in (str(tmp_path), str(tmp_path) + "/", tmp_path.name, "./" + tmp_path.name):
        try:
            want = ref_find_traces(arg)
        except Exception:
            want = None
        if want:
            assert find_traces(arg) == want


def test_median_matches_numpy():
    from deltamoe.trace.analyses.stragglers import _median

    rng = np.random.default_rng(0)
    pool = np.array([0.0, -0.0, 1.5, 2.25, 1e300, -7.0, np.inf, -np.inf, 3.0, 1 / 3])
    for _ in range(3000):
        n = int(rng.integers(1, 9))
        x = rng.choice(pool, n) if rng.random() < 0.5 else rng.normal(size=n)
        if rng.random() < 0.05:
            x[int(rng.integers(n))] = np.nan
        with np.errstate(invalid="ignore"):  # inf - inf
            want, got = float(np.median(x)), _median(x)
        assert (np.isnan(want) and np.isnan(got)) or (want == got and np.signbit(want) == np.signbit(got)), x


def ref_first_p2p(summaries) -> dict:
    out: dict = {}
    for s in summaries:
        c = s.coll
        for kinds, key in ((["send", "recv"], s.rank), (["send"], ("send1", s.rank))):
            rows = np.flatnonzero(np.isin(c.kind, kinds) & (c.step >= 0))
            if len(rows):
                i = rows[np.argmin(c.arrive[rows])]
                out[key] = (str(c.kind[i]), int(c.peer[i]))
    return out


@pytest.mark.parametrize("job", ["pipeline_job", "dp_job", "clean_pipeline_job"])
def test_first_p2p_and_group_ids_match_reference(job, request):
    from deltamoe.trace.join import join
    from deltamoe.trace.reader import ReadConfig, dedupe_ranks, find_traces, read_one

    folder = request.getfixturevalue(job)[0]
    for steps in ((None, None), (1, 3)):
        summaries, _ = dedupe_ranks([read_one(p, ReadConfig(steps=steps)) for p in find_traces(folder)])
        j = join(summaries)
        assert j.first_p2p == ref_first_p2p(summaries)


@pytest.mark.parametrize("seed", range(20))
def test_instance_ids_match_reference(seed):
    from deltamoe.trace.join import _instances

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 400))
    c = {"rank": rng.integers(0, 8, n), "pg": rng.choice(np.array(["", "0", "ep_1", "b", "?x"], dtype=object), n),
         "kind": rng.choice(np.array(["all_reduce", "x", "all_to_all"], dtype=object), n),
         "seq": rng.integers(0, 5, n), "arrive": rng.uniform(0, 10, n)}
    key_pg = np.where(c["pg"] == "", "?" + c["kind"], c["pg"]).astype(str)  # the replaced version
    _, pg_id = np.unique(key_pg, return_inverse=True)
    _, inst = np.unique(pg_id.astype(np.int64) * (1 << 32) + c["seq"].astype(np.int64), return_inverse=True)
    np.testing.assert_array_equal(_instances(c)["inst"], inst)


def ref_concat(summaries) -> dict:
    colls = [s.coll for s in summaries]
    local = np.concatenate([c.step for c in colls]) if colls else np.zeros(0, dtype=np.int64)
    keep = local >= 0
    out = {"rank": np.repeat(np.array([s.rank for s in summaries], dtype=np.int64), [len(c) for c in colls])[keep],
           "step": np.concatenate([s.step_ids[np.maximum(s.coll.step, 0)] if len(s.step_ids)
                                   else np.zeros(len(s.coll), dtype=np.int64) for s in summaries]
                                  or [np.zeros(0, dtype=np.int64)])[keep]}
    for k in ("kind", "pg", "seq", "nbytes", "arrive", "end", "peer"):
        out[k] = np.concatenate([getattr(c, k) for c in colls])[keep] if colls else np.zeros(0)
    lanes = [c.lane if c.lane is not None else np.full(len(c), -1, dtype=np.int64) for c in colls]
    out["lane"] = np.concatenate(lanes)[keep] if colls else np.zeros(0, dtype=np.int64)
    out["pg"] = out["pg"].astype(object)
    out["kind"] = out["kind"].astype(object)
    return out


@pytest.mark.parametrize("job", ["pipeline_job", "dp_job", "clean_pipeline_job"])
def test_concat_matches_reference(job, request):
    from deltamoe.trace.join import _concat
    from deltamoe.trace.reader import ReadConfig, dedupe_ranks, find_traces, read_one

    folder = request.getfixturevalue(job)[0]
    for steps in ((None, None), (1, 3), (2, 3), (7, 9)):
        summaries, _ = dedupe_ranks([read_one(p, ReadConfig(steps=steps)) for p in find_traces(folder)])
        summaries = [s for s in summaries if not isinstance(s, Exception)]
        got, want = _concat(summaries), ref_concat(summaries)
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype, k
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)

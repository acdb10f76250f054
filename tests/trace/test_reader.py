"""Reading: bad files are reported and skipped, slices equal whole parses, layouts and vendors vary."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import numpy as np
import orjson
import pytest

from deltamoe.errors import TraceError
from deltamoe.trace.analyze import analyze
from deltamoe.trace.classify import Patterns, collective_kind
from deltamoe.trace.reader import ReadConfig, find_traces, read_one, read_sliced
from deltamoe.trace.summary import RankError


def _copy_job(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_bad_files_are_reported_and_skipped(dp_job, tmp_path):
    folder = _copy_job(dp_job[0], tmp_path / "job")
    good = sorted(folder.glob("rank*.json.gz"))
    raw = gzip.decompress(good[0].read_bytes())
    (folder / "truncated.json.gz").write_bytes(gzip.compress(raw)[:5000])
    (folder / "invalid.json").write_bytes(raw[: len(raw) // 2])
    doc = orjson.loads(raw)
    del doc["distributedInfo"]
    (folder / "nodist.json").write_bytes(orjson.dumps(doc))
    (folder / "dup.json").write_bytes(raw)  # same rank as rank0 again
    rep = analyze(str(folder), workers=2).report
    assert rep["ranks_analyzed"] == 16 and rep["ranks_found"] == 20
    errors = {Path(s["path"]).name: s["error"] for s in rep["skipped"]}
    # Of two files claiming rank 0, the first by path is kept and the other reported.
    assert set(errors) == {"truncated.json.gz", "invalid.json", "nodist.json", "rank0.pt.trace.json.gz"}
    assert "gzip" in errors["truncated.json.gz"]
    assert "invalid JSON" in errors["invalid.json"]
    assert "distributedInfo" in errors["nodist.json"]
    assert "duplicate rank 0" in errors["rank0.pt.trace.json.gz"] and "dup.json" in errors["rank0.pt.trace.json.gz"]
    assert sorted(s["rank"] for s in rep["stragglers"]) == [3, 12]


def test_missing_dir_and_empty_dir(tmp_path):
    with pytest.raises(TraceError, match="not a directory"):
        find_traces(tmp_path / "nope")
    with pytest.raises(TraceError, match="no \\*.json"):
        find_traces(tmp_path)


def _same(a, b) -> None:
    assert a.rank == b.rank and a.events == b.events
    for f in ("compute", "comm", "idle", "overlap", "memcpy", "pipe_busy"):
        np.testing.assert_allclose(getattr(a, f), getattr(b, f), rtol=1e-9)
    np.testing.assert_array_equal(a.coll.seq, b.coll.seq)
    np.testing.assert_allclose(a.coll.arrive, b.coll.arrive)


@pytest.mark.parametrize("job", ["pipeline_job", "dp_job"])
def test_sliced_parse_equals_whole_parse(job, request):
    """Pretty plain files (byte ranges) and compact gzip files (streamed) cut into tiny slices."""
    folder = request.getfixturevalue(job)[0]
    cfg = ReadConfig(slice_bytes=20_000)
    for path in find_traces(folder)[:3]:
        whole, sliced = read_one(path, cfg), read_sliced(path, cfg)
        assert not isinstance(sliced, RankError), sliced
        _same(whole, sliced)


def test_metadata_after_events_and_seq_numbers(pipeline_job, tmp_path):
    """Older exports put metadata after traceEvents; newer NCCL builds record `Seq`."""
    path = find_traces(pipeline_job[0])[0]
    doc = orjson.loads(Path(path).read_bytes())
    events = doc.pop("traceEvents")
    for e in events:
        if e.get("cat") == "kernel" and "Collective name" in e.get("args", {}):
            e["args"]["Seq"] = 1000 + e["args"].get("External id", 0)
    reordered = {"schemaVersion": 1, "traceEvents": events, **doc}
    out = tmp_path / "old.json"
    out.write_bytes(orjson.dumps(reordered, option=orjson.OPT_INDENT_2))
    cfg = ReadConfig(slice_bytes=50_000)
    a, b, c = read_one(path, cfg), read_one(str(out), cfg), read_sliced(str(out), cfg)
    np.testing.assert_allclose(a.compute, b.compute)
    _same(b, c)
    assert (b.coll.seq[b.coll.kind == "all_to_all"] >= 1000).all()


@pytest.mark.parametrize("collective_args", [True, False])
def test_vendor_comm_pattern(tmp_path, collective_args):
    """An unknown collective library's kernel counts as compute until its kernel pattern is given,
    unless it carries the collective's args (`Collective name`): then it is communication anyway."""
    args = {"stream": 9, "Collective name": "allreduce", "Process Group Name": "0"} if collective_args else {"stream": 9}
    ev = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 100},
          {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 0, "dur": 40, "args": {"stream": 7}},
          {"ph": "X", "cat": "kernel", "name": "xcclAllReduceKernel", "pid": 0, "tid": 9, "ts": 40, "dur": 30,
           "args": args}]
    doc = {"distributedInfo": {"rank": 0, "world_size": 1, "backend": "xccl"}, "traceEvents": ev}
    p = tmp_path / "r0.json"
    p.write_bytes(orjson.dumps(doc))
    plain = read_one(str(p), ReadConfig())
    custom = read_one(str(p), ReadConfig(patterns=Patterns().with_extra([r"^xccl"])))
    if collective_args:
        assert plain.compute[0] == 40 and plain.comm[0] == 30 and list(plain.coll.kind) == ["all_reduce"]
    else:
        assert plain.compute[0] == 70 and plain.comm[0] == 0
    assert custom.compute[0] == 40 and custom.comm[0] == 30 and list(custom.coll.kind) == ["all_reduce"]


def test_unknown_phase_falls_back_to_generic_decoding(pipeline_job, tmp_path):
    """An event phase outside the Chrome trace format, or none at all, is counted and skipped."""
    path = find_traces(pipeline_job[0])[0]
    doc = orjson.loads(Path(path).read_bytes())
    doc["traceEvents"] += [{"ph": "Z", "name": "vendor thing", "ts": 1}, {"name": "no phase", "ts": 2}]
    out = tmp_path / "odd.json"
    out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    want, cfg = read_one(path, ReadConfig()), ReadConfig(slice_bytes=50_000)
    for got in (read_one(str(out), cfg), read_sliced(str(out), cfg)):
        assert not isinstance(got, RankError), got
        assert got.events == want.events + 2
        np.testing.assert_allclose(got.compute, want.compute)
        np.testing.assert_array_equal(got.coll.seq, want.coll.seq)


def test_kernels_without_args_use_record_param_comms(pipeline_job, tmp_path):
    """Builds that do not copy the collective args onto the kernel: the launching op has them."""
    path = find_traces(pipeline_job[0])[0]
    doc = orjson.loads(Path(path).read_bytes())
    for e in doc["traceEvents"]:
        if e.get("cat") == "kernel" and "Collective name" in e.get("args", {}):
            e["args"] = {k: e["args"][k] for k in ("External id", "stream", "correlation")}
    out = tmp_path / "bare.json"
    out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    want, cfg = read_one(path, ReadConfig()), ReadConfig(slice_bytes=50_000)
    for got in (read_one(str(out), cfg), read_sliced(str(out), cfg)):
        for f in ("pg", "seq", "kind", "nbytes", "peer", "step"):
            np.testing.assert_array_equal(getattr(got.coll, f), getattr(want.coll, f))


def test_collective_kind_names():
    cases = {"ncclDevKernel_AllReduce_Sum_bf16_RING_LL(x)": "all_reduce", "nccl:send 3->4": "send",
             "nccl:recv 4<-3": "recv", "c10d::recv_": "recv", "c10d::alltoall_base_": "all_to_all",
             "ncclDevKernel_SendRecv(x)": "send_recv", "reduce_scatter_tensor": "reduce_scatter",
             "_allgather_base": "all_gather", "gloo:all_reduce": "all_reduce", "coalesced": "coalesced"}
    assert {k: collective_kind(k) for k in cases} == cases


def test_forked_reader_reports_files_of_a_dead_child(dp_job, monkeypatch):
    """A reader process that dies costs the files it had claimed, as errors; nothing hangs."""
    import os

    from deltamoe.trace import reader

    paths = find_traces(dp_job[0])
    victim = paths[3]
    real = reader.read_one

    def dying(path, cfg, size=None):
        if path == victim:
            os._exit(3)
        return real(path, cfg, size)
    monkeypatch.setattr(reader, "read_one", dying)
    results = list(reader.read_all(paths, ReadConfig(), workers=2))
    assert sorted(r.path for r in results) == sorted(paths)
    died = {r.path for r in results if isinstance(r, RankError)}
    assert victim in died and all("died" in r.message for r in results if isinstance(r, RankError))
    assert len(died) < len(paths)


def test_forked_reader_equals_in_process_reading(dp_job):
    from deltamoe.trace import reader

    paths = find_traces(dp_job[0])
    one = {r.path: r for r in reader.read_all(paths, ReadConfig(), workers=1)}
    two = {r.path: r for r in reader.read_all(paths, ReadConfig(), workers=3)}
    assert one.keys() == two.keys() == set(paths)
    for p in paths:
        a, b = one[p], two[p]
        assert a.rank == b.rank and a.events == b.events
        np.testing.assert_array_equal(a.step_time, b.step_time)
        np.testing.assert_array_equal(a.coll.arrive, b.coll.arrive)


@pytest.mark.parametrize("workers", [1, 2, 16, 256])
def test_claims_cover_every_file_once_and_fit_a_pipe(workers):
    from deltamoe.trace.reader import _claims

    for n in (1, 2, 7, 64, 256, 1024, 10_000, 300_000):
        runs = _claims(n, workers)
        assert [i for start, count in runs for i in range(start, start + count)] == list(range(n))
        assert len(runs) <= 4096 and all(count >= 1 for _, count in runs)


@pytest.mark.parametrize("workers", [1, 2])
def test_analyze_restores_the_collector_state(dp_job, workers):
    import gc

    was = gc.isenabled()
    try:
        for state in (True, False):
            gc.enable() if state else gc.disable()
            analyze(dp_job[0], workers=workers)
            assert gc.isenabled() is state
    finally:
        gc.enable() if was else gc.disable()


def test_pool_workers_end_on_sigterm_whatever_handler_the_parent_had():
    """`Pool.terminate` stops workers with SIGTERM; a handler installed in the parent (a CLI command
    run in-process that takes SIGTERM as Ctrl-C) was inherited by the forked workers and once kept one
    alive, blocked on the task queue, so the pool's exit (and the test run) waited forever."""
    import multiprocessing as mp
    import signal

    from deltamoe.trace.reader import _init_pool_worker

    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        with mp.get_context("fork").Pool(1, initializer=_init_pool_worker) as pool:
            assert pool.apply(signal.getsignal, (signal.SIGTERM,)) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("sliced", [False, True])
@pytest.mark.parametrize("ts, message", [('"12x"', "`ts` is '12x'; expected a number"),
                                         (None, "1 kernel or memcpy event(s) without `ts`")])
def test_a_time_that_is_not_a_number_names_the_field(tmp_path, sliced, ts, message):
    kernel = '"ph":"X","cat":"kernel","name":"k",' + (f'"ts":{ts},' if ts else "") + '"dur":5,"tid":7,'
    doc = ('{"distributedInfo":{"rank":0,"world_size":1},"traceEvents":['
           '{"ph":"X","cat":"kernel","name":"k","ts":1,"dur":5,"tid":7,"args":{"correlation":1}},'
           '{' + kernel + '"args":{"correlation":2}}]}')
    path = tmp_path / "rank0.json"
    path.write_text(doc)
    cfg = ReadConfig(slice_bytes=64, whole_bytes=0) if sliced else ReadConfig()
    res = read_sliced(str(path), cfg) if sliced else read_one(str(path), cfg)
    assert isinstance(res, RankError) and res.message.startswith(f"{path}: ") and message in res.message

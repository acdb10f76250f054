"""Regressions from the QA report on `deltamoe trace analyze` (one test or more per finding)."""

from __future__ import annotations

import pytest

from deltamoe.trace.analyze import analyze
from deltamoe.trace.synth import SynthConfig, generate


def test_inherited_alltoall_wait_does_not_blame_innocent_tp_members(tmp_path):
    """F1: rank 9 is slow; its expert-group partners 1, 5, 13 leave the all-to-all late and so
    arrive late at their TP all-reduce, but the delay is 9's: only 9 is a straggler."""
    truth = generate(SynthConfig(ranks=16, pp=1, tp=4, steps=3, stragglers=(9,), slowdown=1.3), tmp_path)
    rep = analyze(str(tmp_path), workers=1).report
    assert truth["stragglers"] == [9]
    assert [s["rank"] for s in rep["stragglers"]] == [9]
    scores = {x["rank"]: x["score"] for x in rep["straggler_detail"]["ranking"]}
    # The partners' inherited lateness used to score ~0.07 each (above min_score 0.03).
    assert max(scores[r] for r in (1, 5, 13)) < 0.03


# --- small hand-built gloo (CPU-only) jobs: the events torch.profiler records, nothing more ---

MAIN, WORKER = 100, 101
COMPUTE_US, SEND_US = 4000.0, 100.0


class _GlooRank:
    """The events of one rank of a gloo job (c10d calls, gloo annotations, aten ops, steps)."""

    def __init__(self, rank: int, world: int, shapes: bool = True):
        self.rank, self.world, self.shapes, self.events = rank, world, shapes, []

    def op(self, name: str, ts: float, dur: float, cat: str = "cpu_op", tid: int = MAIN, ci: list | None = None,
           dims: list | None = None):
        args = {"External id": len(self.events)}
        if ci is not None and self.shapes:
            args["Concrete Inputs"] = ci
        if dims is not None and self.shapes:
            args["Input Dims"], args["Input type"] = dims, ["float", "float"] + [""] * (len(dims) - 2)
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur,
                            "args": args})

    def compute(self, ts: float, dur: float = COMPUTE_US) -> float:
        self.op("aten::mm", ts, dur)
        return ts + dur

    def p2p(self, kind: str, peer: int, post: float, end: float) -> None:
        """A blocking gloo send / recv: the c10d call, then the exchange on the main thread."""
        self.op(f"c10d::{kind}" + ("_" if kind == "recv" else ""), post, 20.0, ci=["", "", str(peer), "0"])
        self.op(f"gloo:{kind}", post + 20.0, end - post - 20.0, cat="user_annotation")

    def collective(self, kind: str, arrive: float, end: float, call: str = "", dims: list | None = None) -> None:
        """A c10d call on the main thread, its gloo exchange on a worker thread."""
        self.op(call or f"c10d::{kind}", arrive, 20.0, dims=dims)
        self.op(f"gloo:{kind}", arrive + 20.0, end - arrive - 20.0, cat="user_annotation", tid=WORKER)

    def step(self, n: int, ts: float, end: float) -> None:
        self.op(f"ProfilerStep#{n}", ts, end - ts, cat="user_annotation")

    def write(self, folder, extra: dict | None = None) -> None:
        import orjson

        doc = {"schemaVersion": 1, "deviceProperties": [],
               "distributedInfo": {"backend": "gloo", "rank": self.rank, "world_size": self.world,
                                   "pg_config": [{"pg_name": "0", "pg_desc": "default_pg",
                                                  "ranks": list(range(self.world))}]},
               "traceEvents": self.events, **(extra or {})}
        (folder / f"rank{self.rank}.json").write_bytes(orjson.dumps(doc))


def _gloo_chain(folder, shapes: bool, slow: int = 2, sleep: float = 30_000.0, steps: int = 4) -> None:
    """A 4-rank send/recv chain 0 -> 1 -> 2 -> 3 per step (compute, recv, compute, send, barrier),
    as /work/qa_trace/scripts/gloo_job.py MODE=p2p records it; rank `slow` sleeps before its recv.
    A blocking send ends when its receiver has posted the recv; a recv when the data arrived."""
    ranks = [_GlooRank(r, 4, shapes) for r in range(4)]
    t0 = 1_000_000.0
    for n in range(steps):
        post = [t0 + COMPUTE_US + (sleep if r == slow else 0.0) for r in range(4)]
        send_post, arrive = {}, {}
        for r in range(4):
            ready = post[r]
            if r > 0:  # the recv completes once the upstream send was posted
                got = max(post[r], send_post[r - 1]) + SEND_US
                ranks[r].p2p("recv", r - 1, post[r], got)
                ready = got
            send_post[r] = ranks[r].compute(ready, COMPUTE_US / 2)
            arrive[r] = send_post[r]
        for r in range(3):  # each send ends when the next rank has posted its recv
            arrive[r] = max(send_post[r], post[r + 1]) + SEND_US
            ranks[r].p2p("send", r + 1, send_post[r], arrive[r])
        end = max(arrive.values()) + 50.0
        for r in range(4):
            ranks[r].compute(t0, COMPUTE_US)
            ranks[r].collective("barrier", arrive[r], end)
            ranks[r].step(n, t0, end + 10.0)
        t0 = end + 200.0
    for x in ranks:
        x.write(folder)


def test_gloo_chain_without_record_shapes_warns_and_blames_nobody(tmp_path):
    """F2: without record_shapes a 4-rank gloo chain's P2P peers are unknown: say so, and do not
    blame rank 3 (the end of the chain, last at every barrier) on evidence that cannot be resolved."""
    _gloo_chain(tmp_path, shapes=False)
    rep = analyze(str(tmp_path), workers=1).report
    assert rep["p2p_matched"] == 0
    assert any("24 P2P ops could not be paired (record with record_shapes=True)" in w
               for w in rep["consistency"]["warnings"])
    assert rep["stragglers"] == []
    assert rep["straggler_detail"]["unresolved_instances"] == 4  # rank 3 held at each step's barrier


def test_gloo_chain_blames_the_slow_stage_through_the_recvs(tmp_path):
    """F3: with record_shapes the same chain pairs its P2P ops; rank 2 sleeps 30 ms per step,
    rank 3 is last at the barrier because its recv waited for rank 2: rank 2 is the straggler."""
    _gloo_chain(tmp_path, shapes=True)
    rep = analyze(str(tmp_path), workers=1).report
    assert rep["p2p_matched"] == 12
    assert [s["rank"] for s in rep["stragglers"]] == [2]
    s = rep["stragglers"][0]
    assert s["collectives"][0]["op"] == "pipeline send (receiver waited)" and s["steps_late"] == 4
    # Per step rank 2 sends 30 ms after rank 0 reached the barrier (t_ref), all of it its own; the
    # others waited 38.2 ms in all for a 32.1 ms skew, so 30 ms of it is 35.7 ms of their waiting.
    assert s["others_waited_s"] / 4 == pytest.approx(0.030 * 38.2 / 32.1, abs=0.0005)


def test_clean_gloo_chain_names_nobody(tmp_path):
    """F3: the chain's normal structure (each stage computes after its recv) is no straggler."""
    _gloo_chain(tmp_path, shapes=True, sleep=0.0)
    assert analyze(str(tmp_path), workers=1).report["stragglers"] == []


def test_gloo_broadcast_in_no_group_is_warned_and_no_evidence(tmp_path):
    """F5: the root of a gloo broadcast returns before the others enter it, so its ops overlap
    no group's members and stay unplaced: warned per rank, and rank 3 entering it 20 ms late
    is not named a straggler on that evidence (it was "broadcast pg=?")."""
    ranks = [_GlooRank(r, 4) for r in range(4)]
    t0 = 1_000_000.0
    for n in range(3):
        ar_end = t0 + COMPUTE_US + 500.0
        for r, x in enumerate(ranks):
            x.compute(t0)
            x.collective("all_reduce", t0 + COMPUTE_US + 10.0 * r, ar_end)
            bc = ar_end + 1000.0 + (20_000.0 if r == 3 else 0.0)
            x.collective("broadcast", bc, bc + 200.0)
            x.step(n, t0, ar_end + 22_000.0)
        t0 = ar_end + 22_500.0
    for x in ranks:
        x.write(tmp_path)
    rep = analyze(str(tmp_path), workers=1).report
    warnings = rep["consistency"]["warnings"]
    for r in range(4):
        assert f"rank {r}: 3 broadcast op(s) matched no process group (gloo does not name it; no group's members " \
               "overlap it in time); excluded from straggler evidence" in warnings
    assert rep["stragglers"] == []
    assert all(not c["op"].startswith("broadcast") for s in rep["stragglers"] for c in s["collectives"])


@pytest.mark.parametrize("shapes", [True, False])
def test_gloo_alltoall_bytes_come_from_the_recorded_shapes(tmp_path, shapes):
    """F4: every rank sends 4x more to rank 2 (as /work/qa_trace/ovl4): with record_shapes the
    payload is in the call's `Input Dims` (output, input); without, it is unknown, not balanced."""
    ranks = [_GlooRank(r, 4, shapes) for r in range(4)]
    t0 = 1_000_000.0
    for n in range(2):
        for r, x in enumerate(ranks):
            x.compute(t0)
            out_elems, in_elems = (4 * 65536 if r == 2 else 65536 + 3 * 16384), 3 * 16384 + 65536
            x.collective("all_to_all", t0 + COMPUTE_US, t0 + COMPUTE_US + 3000.0, call="c10d::alltoall_base_",
                         dims=[[out_elems], [in_elems], [], [], [], [], []])
            x.step(n, t0, t0 + COMPUTE_US + 3100.0)
        t0 += COMPUTE_US + 4000.0
    for x in ranks:
        x.write(tmp_path)
    a = analyze(str(tmp_path), workers=1).report["alltoall"]
    if shapes:
        assert [x["bytes"] for x in a["ranks"]] == [2 * 4 * 114688] * 2 + [2 * 4 * 262144] + [2 * 4 * 114688]
        assert a["bytes_known"]
        assert a["max_over_mean_bytes"] == pytest.approx(4 * 262144 / (3 * 114688 + 262144), abs=1e-4)
        assert [(h["rank"], h["bytes_vs_median"]) for h in a["hot_ranks"]] == [(2, round(262144 / 114688, 3))]
    else:
        assert [x["bytes"] for x in a["ranks"]] == [None] * 4
        assert not a["bytes_known"] and a["max_over_mean_bytes"] is None and a["hot_ranks"] == []


def _all_reduce_job(folder, world: int = 4, t0: float = 1_000_000.0, ranks: range | None = None,
                    world_size: dict[int, int] | None = None) -> None:
    """Two steps of compute + a world all-reduce per rank; `ranks`: which files to write."""
    for r in ranks if ranks is not None else range(world):
        x = _GlooRank(r, (world_size or {}).get(r, world))
        t = t0
        for n in range(2):
            x.compute(t)
            x.collective("all_reduce", t + COMPUTE_US, t + COMPUTE_US + 500.0)
            x.step(n, t, t + COMPUTE_US + 600.0)
            t += COMPUTE_US + 1000.0
        x.write(folder)


def test_rank_files_from_different_windows_are_warned(tmp_path):
    """F6: ranks 0-1 from one job, ranks 2-3 from another run 80 s later."""
    _all_reduce_job(tmp_path, ranks=range(2))
    _all_reduce_job(tmp_path, ranks=range(2, 4), t0=81_000_000.0)
    warnings = analyze(str(tmp_path), workers=1).report["consistency"]["warnings"]
    assert warnings[0] == ("rank files do not overlap in time: rank 0 ends 80.0 s before rank 2 starts (ranks "
                           "starting after rank 0 ended: 2, 3); files from different jobs or profiling windows?")


def test_world_size_disagreement_is_warned(tmp_path):
    """F6: one file says world_size 8, the others 4."""
    _all_reduce_job(tmp_path, world_size={3: 8})
    warnings = analyze(str(tmp_path), workers=1).report["consistency"]["warnings"]
    assert ("rank files disagree on world_size (4 in ranks 0, 1, 2; 8 in rank 3): files from different jobs? "
            "the largest is used") in warnings
    clean = tmp_path / "clean"
    clean.mkdir()
    _all_reduce_job(clean)
    assert analyze(str(clean), workers=1).report["consistency"]["warnings"] == []


def test_small_job_test_text_when_the_others_scored_zero(tmp_path):
    """F12: a 2-rank job whose straggler is the only rank with a score (was "200000000.0x the next
    rank's score"); the report carries a schema_version."""
    for r in range(2):
        x, t = _GlooRank(r, 2), 1_000_000.0
        for n in range(3):
            late = 3000.0 if r == 1 else 0.0  # rank 1 computes 3 ms longer before every all-reduce
            x.compute(t, COMPUTE_US + late)
            x.collective("all_reduce", t + COMPUTE_US + late, t + COMPUTE_US + 3500.0)
            x.step(n, t, t + COMPUTE_US + 3600.0)
            t += COMPUTE_US + 4000.0
        x.write(tmp_path)
    rep = analyze(str(tmp_path), workers=1).report
    assert rep["schema_version"] == 2
    ranking = [(x["rank"], x["score"]) for x in rep["straggler_detail"]["ranking"]]
    assert ranking == [(1, round(3000 / 7600, 4)), (0, 0.0)]
    assert rep["stragglers"][0]["test"] == "the others scored 0 (2 ranks: too few for a robust z, >= 3x asked)"


def test_same_json_and_html_path_is_one_line_error_before_analysing(tmp_path, capsys):
    """F10: `--json X --html X` used to write the JSON, then overwrite it with the HTML (exit 0).
    The folder holds no trace: the error comes before any analysis (which would say "no *.json")."""
    from deltamoe.trace.command import main

    out = tmp_path / "out" / "report"
    for html in (str(out), str(tmp_path / "out" / ".." / "out" / "report")):
        assert main(["analyze", str(tmp_path), "--json", str(out), "--html", html]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: --html: --json and --html name the same file")
    assert not out.exists()


def test_atomic_write_removes_its_temporary_file_when_the_write_fails(tmp_path):
    """F10: a failed write (here: the target is a non-empty folder, so the rename fails) left
    `.report.tmpPID` behind."""
    from deltamoe.trace.report import atomic_write

    target = tmp_path / "report"
    (target / "x").mkdir(parents=True)
    with pytest.raises(OSError):
        atomic_write(target, b"{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]
    atomic_write(tmp_path / "ok.json", b"{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.json", "report"]


def test_upper_case_suffixes_are_read(tmp_path):
    """F11: `rank1.JSON` and `rank2.Json.GZ` were silently ignored (rank reported missing)."""
    import gzip

    _all_reduce_job(tmp_path)
    (tmp_path / "rank1.json").rename(tmp_path / "rank1.JSON")
    (tmp_path / "rank2.Json.GZ").write_bytes(gzip.compress((tmp_path / "rank2.json").read_bytes()))
    (tmp_path / "rank2.json").unlink()
    rep = analyze(str(tmp_path), workers=1).report
    assert rep["ranks_found"] == 4 and rep["ranks_analyzed"] == 4 and rep["skipped"] == []
    assert rep["consistency"]["missing_ranks"] == []


def test_empty_file_is_named_empty(tmp_path):
    """F11: a zero-byte rank file was "invalid JSON (Input data was truncated)"."""
    _all_reduce_job(tmp_path)
    (tmp_path / "zzz.json").write_bytes(b"")
    (tmp_path / "zzz_blank.json").write_bytes(b"\n  \n")
    rep = analyze(str(tmp_path), workers=1).report
    assert sorted(s["error"] for s in rep["skipped"]) == [f"{tmp_path}/zzz.json: empty file",
                                                          f"{tmp_path}/zzz_blank.json: empty file (only whitespace)"]
    assert rep["ranks_analyzed"] == 4


def test_rank_as_a_numeric_string_is_read(tmp_path):
    """F11: `"rank": "0"` gave "no distributedInfo.rank"; a numeric string is the rank, anything
    else is named."""
    import orjson

    _all_reduce_job(tmp_path)
    for r, value in ((0, "0"), (3, "three")):
        doc = orjson.loads((tmp_path / f"rank{r}.json").read_bytes())
        doc["distributedInfo"]["rank"] = value
        (tmp_path / f"rank{r}.json").write_bytes(orjson.dumps(doc))
    rep = analyze(str(tmp_path), workers=1).report
    assert [x["rank"] for x in rep["ranks"]] == [0, 1, 2]
    assert [s["error"] for s in rep["skipped"]] == [
        f"{tmp_path}/rank3.json: distributedInfo.rank must be an integer, got 'three'"]


def test_trace_without_profiler_steps_is_warned(tmp_path):
    """F11: without ProfilerStep markers the whole trace was analysed as one step without a word."""
    import orjson

    _all_reduce_job(tmp_path)
    for r in range(4):
        doc = orjson.loads((tmp_path / f"rank{r}.json").read_bytes())
        doc["traceEvents"] = [e for e in doc["traceEvents"] if not e["name"].startswith("ProfilerStep")]
        (tmp_path / f"rank{r}.json").write_bytes(orjson.dumps(doc))
    rep = analyze(str(tmp_path), workers=1).report
    assert rep["consistency"]["warnings"] == [
        "ranks 0, 1, 2, 3: no ProfilerStep markers in the trace: analysed as one step (step 0) spanning the whole "
        "trace (call prof.step() once per training step)"]
    assert [x["step"] for x in rep["step_times"]["steps"]] == [0]


@pytest.mark.parametrize("gz", [False, True])
def test_parse_error_in_a_sliced_file_names_the_file_offset(tmp_path, gz):
    """F11: files above 4 MB are decoded in 1 MB slices; a parse error's "byte N" was counted from
    the start of its slice, not the file (as /work/qa_trace/rob/bigcorrupt/rank1.json)."""
    import gzip

    import msgspec
    import orjson

    from deltamoe.trace.reader import ReadConfig, read_one

    _all_reduce_job(tmp_path, ranks=range(1))
    doc = orjson.loads((tmp_path / "rank0.json").read_bytes())
    filler = [{"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": MAIN, "ts": 1_000_000.0 + i,
               "dur": 0.5, "args": {"External id": 10_000 + i}} for i in range(28_000)]
    doc["traceEvents"] = filler + doc["traceEvents"]
    data = orjson.dumps(doc, option=orjson.OPT_INDENT_2)
    assert 5 << 20 < len(data) < 8 << 20
    at = data.index(b'"name"', len(data) // 3)  # in the second 1 MB slice
    data = data[:at] + b'"na"me' + data[at + 6:]
    with pytest.raises(msgspec.DecodeError) as whole:
        msgspec.json.decode(data)
    want = int(str(whole.value).rsplit("(byte ", 1)[1].rstrip(")"))  # the offset in the whole file
    assert want > 1 << 20  # past the first slice
    path = tmp_path / ("rank0.json.gz" if gz else "rank0.json")
    path.write_bytes(gzip.compress(data, 1) if gz else data)
    res = read_one(str(path), ReadConfig())
    assert res.message == f"{path}: invalid JSON (JSON is malformed: expected ':' (byte {want} of the file))"


def test_gloo_barrier_has_one_name_in_every_table(tmp_path):
    """F12: a gloo barrier was "other" in exposed_by_kind but "barrier" in sync_skew."""
    for r in range(2):
        x, t = _GlooRank(r, 2), 1_000_000.0
        for n in range(2):
            x.compute(t)
            x.collective("barrier", t + COMPUTE_US + 100.0 * r, t + COMPUTE_US + 300.0)
            x.step(n, t, t + COMPUTE_US + 400.0)
            t += COMPUTE_US + 1000.0
        x.write(tmp_path)
    rep = analyze(str(tmp_path), workers=1).report
    assert [g["kind"] for g in rep["sync_skew"]["groups"]] == ["barrier"]
    ex = rep["exposed_by_kind"]
    assert list(ex["by_kind_s_per_step"]) == ["barrier"]
    # rank 0 waits in it from its call to the end (300 us), rank 1 from 100 us later
    assert [x["by_kind_s_per_step"] for x in ex["ranks"]] == [{"barrier": 0.0003}, {"barrier": 0.0002}]


def test_exposed_keeps_gpu_kinds_as_named(tmp_path):
    """F12: GPU rows carry their kind already; "send_recv" was read again as "send"."""
    import numpy as np

    from deltamoe.trace import intervals as iv
    from deltamoe.trace.exposed import gpu_exposed

    total, kinds = gpu_exposed(np.array(["send_recv", "barrier", "all_to_all"]), np.array([0.0, 10.0, 20.0]),
                               np.array([5.0, 12.0, 21.0]), iv.EMPTY, np.array([0.0]), np.array([30.0]))
    assert {k: v.tolist() for k, v in kinds.items()} == {"send_recv": [5.0], "barrier": [2.0], "all_to_all": [1.0]}
    assert total.tolist() == [8.0]


def _renamed_comm_kernels(src, dst, drop_args: bool = False) -> int:
    """Copy a synthetic job with its NCCL kernels renamed `xcclKernel_*` (as /work/qa_trace/synth/x8);
    `drop_args`: without the collective args Kineto copies onto a kernel -> kernels renamed."""
    import orjson

    n = 0
    dst.mkdir()
    for f in src.glob("rank*.json"):
        doc = orjson.loads(f.read_bytes())
        for e in doc["traceEvents"]:
            if e.get("cat") == "kernel" and e["name"].startswith("nccl"):
                e["name"] = "xccl" + e["name"][len("ncclDev"):]
                n += 1
                if drop_args:
                    e["args"] = {k: v for k, v in e["args"].items()
                                 if k in ("External id", "correlation", "stream", "device")}
        (dst / f.name).write_bytes(orjson.dumps(doc))
    return n


def test_unknown_vendor_comm_kernels_with_collective_args_are_communication(tmp_path):
    """F8: `xcclKernel_*` kernels matched no pattern and counted as compute (x8: 99.5 % compute,
    no straggler); they carry `Collective name`, so they are communication: the same report as
    with NCCL names. Without the args, the kernels launched by record_param_comms are warned about."""
    generate(SynthConfig(ranks=8, steps=2, stragglers=(3,), slowdown=1.5), tmp_path / "nccl")
    want = analyze(str(tmp_path / "nccl"), workers=1).report
    assert _renamed_comm_kernels(tmp_path / "nccl", tmp_path / "x") > 0
    got = analyze(str(tmp_path / "x"), workers=1).report
    assert [s["rank"] for s in got["stragglers"]] == [s["rank"] for s in want["stragglers"]] == [3]
    assert got["totals"] == want["totals"] and got["totals"]["exposed_comm_fraction"] > 0.05
    assert got["ranks"] == want["ranks"] and got["collectives_matched"] == want["collectives_matched"]
    assert got["consistency"]["warnings"] == []

    n = _renamed_comm_kernels(tmp_path / "nccl", tmp_path / "bare", drop_args=True)
    warnings = analyze(str(tmp_path / "bare"), workers=1).report["consistency"]["warnings"]
    per_rank = n // 8
    assert warnings == [f"ranks 0, 1, 2, 3, 4, 5, 6, 7: {per_rank} kernel(s) launched by record_param_comms were not "
                        "recognised as communication (e.g. xcclKernel_SendRecv) and count as compute "
                        "(use --comm-pattern)"]


@pytest.mark.parametrize("offset_ms", [20.0, -20.0])
def test_clock_offset_of_one_rank_is_warned(tmp_path, offset_ms):
    """F7: rank 3's clock runs 20 ms ahead (behind): on its clock it enters every all-reduce after
    the others have left it (leaves it before they entered), which no real run can do."""
    import orjson

    _all_reduce_job(tmp_path)
    doc = orjson.loads((tmp_path / "rank3.json").read_bytes())
    for e in doc["traceEvents"]:
        e["ts"] += offset_ms * 1e3
    (tmp_path / "rank3.json").write_bytes(orjson.dumps(doc))
    warnings = analyze(str(tmp_path), workers=1).report["consistency"]["warnings"]
    which = ("started after all other members had finished them" if offset_ms > 0
             else "ended before any other member had started them")
    assert [w for w in warnings if "clock" in w] == [
        f"rank 3: in 2 of 2 collectives it {which}, impossible without clock skew: its clock is about "
        f"{offset_ms:+.1f} ms off the others'; lateness measured against it is unreliable"]

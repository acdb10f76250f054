"""Exposed communication (trace/exposed.py): communication in flight while the rank computes nothing."""

import numpy as np
import pytest

from deltamoe.trace.analyze import analyze
from deltamoe.trace.exposed import cpu_exposed, gpu_exposed, leaf_spans


def test_leaf_spans_keep_ops_with_nothing_nested():
    # [0, 10) holds [1, 3) and [4, 6) (which holds [4, 5)); [12, 13) stands alone.
    ts = np.array([0.0, 1.0, 4.0, 4.0, 12.0])
    end = np.array([10.0, 3.0, 6.0, 5.0, 13.0])
    s, e = leaf_spans(ts, end)
    assert s.tolist() == [1.0, 4.0, 12.0] and e.tolist() == [3.0, 5.0, 13.0]


MAIN, GLOO = 1, 2


def test_cpu_sync_call_and_async_wait_are_exposed_hidden_exchange_is_not():
    # Step [0, 60) on the training thread (tid 1); gloo's exchanges on tid 2.
    cpu_ops = [
        (0, 10, MAIN),                                # compute
        (10, 10, MAIN), (10, 1, MAIN),                # AllToAll wrapper [10, 20) around its c10d call [10, 11);
                                                      # then work.wait() until 20: no op runs
        (20, 10, MAIN),                               # compute
        (30, 1, MAIN), (30, 1, MAIN),                 # functional all_to_all_single around its c10d call
        (31, 9, MAIN),                                # compute [31, 40) while the exchange runs
        (40, 5, MAIN),                                # wait_tensor [40, 45)
        (45, 15, MAIN),                               # compute; an all-gather [50, 55) under it is hidden
    ]
    coll_ops = [("c10d::alltoall_base_", 10, 1, MAIN, None), ("c10d::alltoall_base_", 30, 1, MAIN, None)]
    functional = [("_c10d_functional::all_to_all_single", 30, 1, MAIN),
                  ("_c10d_functional::wait_tensor", 40, 5, MAIN)]
    annotations = [("gloo:all_to_all", 10.5, 9.5, GLOO), ("gloo:all_to_all", 31, 14, GLOO),
                   ("gloo:all_gather", 50, 5, GLOO)]
    total, kinds = cpu_exposed(cpu_ops, coll_ops, functional, annotations, MAIN, np.array([0.0]), np.array([60.0]))
    # sync: the whole [10, 20); async: the call [30, 31) and the wait [40, 45); not [31, 40), not the all-gather.
    assert total.tolist() == [16.0]
    assert kinds["all_to_all"].tolist() == [16.0] and kinds["all_gather"].tolist() == [0.0]
    # Without the overlap (the wait spans the whole exchange) all of it is exposed.
    cpu_ops[6] = (31, 0.0, MAIN)
    functional[1] = ("_c10d_functional::wait_tensor", 31, 14, MAIN)
    cpu_ops[7] = (31, 14, MAIN)
    total, kinds = cpu_exposed(cpu_ops, coll_ops, functional, annotations, MAIN, np.array([0.0]), np.array([60.0]))
    assert total.tolist() == [10.0 + 15.0] and kinds["all_to_all"].tolist() == [25.0]


def test_gpu_comm_kernels_outside_compute_per_kind_and_step():
    kinds = np.array(["all_to_all", "all_reduce", "all_to_all"])
    start, end = np.array([0.0, 20.0, 110.0]), np.array([10.0, 30.0, 120.0])
    compute = (np.array([5.0, 100.0]), np.array([25.0, 115.0]))
    total, per = gpu_exposed(kinds, start, end, compute, np.array([0.0, 100.0]), np.array([100.0, 200.0]))
    assert total.tolist() == [5.0 + 5.0, 5.0]
    assert per["all_to_all"].tolist() == [5.0, 5.0] and per["all_reduce"].tolist() == [5.0, 0.0]


def test_report_on_gpu_traces_agrees_with_the_breakdown(dp_job):
    # On kernels, exposed communication is communication minus its overlap with compute (rounded to 1 us a step).
    rep = analyze(dp_job[0]).report
    ex = {r["rank"]: r for r in rep["exposed_by_kind"]["ranks"]}
    for r in rep["ranks"]:
        assert ex[r["rank"]]["exposed_s_per_step"] * r["steps"] == pytest.approx(r["exposed_comm_s"], abs=r["steps"] * 1e-6)
    assert rep["exposed_by_kind"]["exposed_s_per_step"] > 0


def test_an_asynchronous_gloo_send_does_not_hide_the_compute_the_thread_runs_meanwhile():
    """isend / batch_isend_irecv (torch.distributed.pipelining's sends): the `gloo:send` annotation stays
    open on the training thread until the transfer completes while the thread goes on computing. It holds
    the thread only at its issue and in the final wait; a blocking recv with nothing inside holds it whole."""
    from deltamoe.trace.build import _CpuView, blocking_parts
    from deltamoe.trace.tables import EventTables

    # [0, 10) compute; send issued [10, 11), its exchange open [11, 100); compute [20, 30); a blocking recv
    # [35, 36) + [36, 50); compute [50, 70); then the thread waits for the send until 100.
    ops = [(20.0, 30.0), (50.0, 70.0)]
    calls = [(10.0, 11.0), (35.0, 36.0)]
    assert blocking_parts([(11.0, 100.0), (36.0, 50.0)], calls + ops) == [(11.0, 20.0), (70.0, 100.0), (36.0, 50.0)]
    t = EventTables()
    t.cpu_ops = [(0.0, 10.0, MAIN), (20.0, 10.0, MAIN), (50.0, 20.0, MAIN)]
    t.cpu_coll_ops = [("c10d::send", 10.0, 1.0, MAIN, None, 0), ("c10d::recv_", 35.0, 1.0, MAIN, None, 0)]
    t.annotations = [("gloo:send", 11.0, 89.0, MAIN), ("gloo:recv", 36.0, 14.0, MAIN)]
    t.steps = [(1, 0.0, 100.0, MAIN)]
    compute, comm, _ = _CpuView(t, 0, None).spans()
    assert iv_total(compute) == 40.0  # all three compute ops (it was 10: the send hid the other two)
    assert iv_total(comm) == 90.0  # [10, 100): the calls and both exchanges, in flight


def iv_total(spans) -> float:
    start, end = spans
    return float((np.asarray(end) - np.asarray(start)).sum())

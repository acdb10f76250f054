"""P2P as torch.distributed records it: group-local peers and coalesced (batched) SendRecv kernels."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from deltamoe.trace.analyze import analyze
from deltamoe.trace.p2p import coalesced_parts, cpu_peer, group_ranks, to_global
from deltamoe.trace.schema import Args
from deltamoe.trace.synth import SynthConfig, generate


def _ranks(report: dict) -> list[int]:
    return sorted(s["rank"] for s in report["stragglers"])


def test_group_ranks_from_pg_config_then_args():
    groups = {"5": (1, 13, 25, 37)}
    assert to_global(0, group_ranks("5", groups)) == 1 and to_global(3, group_ranks("5", groups)) == 37
    assert to_global(4, group_ranks("5", groups)) == -1  # outside the group
    assert group_ranks("9", {}, Args(pg_ranks="[2, 6, 10]")) == (2, 6, 10)
    # Kineto truncates lists beyond 30 entries: then the start and stride give the ranks.
    truncated = Args(pg_ranks="[0, 4, ..., 124]", rank_start=0, rank_stride=4, group_size=32)
    assert to_global(31, group_ranks("9", {}, truncated)) == 124
    assert group_ranks("9", {}, Args(pg_ranks="[0, 4, ..., 124]")) is None


def test_gloo_peer_without_concrete_inputs_is_the_other_member():
    assert cpu_peer(2, -1, (0, 2)) == 0 and cpu_peer(0, -1, (0, 2)) == 2
    assert cpu_peer(1, 1, (1, 5, 9)) == 5      # group rank 1 of the pipeline group
    assert cpu_peer(1, -1, (1, 5, 9)) == -1    # three members: unknown without the index


def test_coalesced_parts_follow_their_kernel_and_group():
    send = Args(external_id=10, collective="send", dst=1, pg_name="3", in_nelems=4, dtype="BFloat16")
    recv = Args(external_id=11, collective="recv", src=1, pg_name="3", out_nelems=4, dtype="Float")
    owned = Args(external_id=12, collective="send", dst=0, pg_name="3")  # launched its own kernel
    later = Args(external_id=13, collective="recv", src=0, pg_name="3", out_nelems=2)
    parts = coalesced_parts([(1.0, send), (2.0, recv), (3.0, owned), (7.0, later)], [], {12},
                            [(5.0, 0, "3"), (9.0, 1, "3")], [])
    assert parts == {0: [("send", 1, 8), ("recv", 1, 16)], 1: [("recv", 0, 8)]}
    # Without record_param_comms ops the annotations name the parts; one spanning the launch of
    # a plain send kernel (at 21.0) belongs to that kernel.
    anns = [("nccl:send 0->1", 1.0, 1.0, 7), ("nccl:recv 0<-1", 2.0, 1.0, 7), ("nccl:send 0->1", 20.0, 3.0, 7)]
    assert coalesced_parts([], anns, set(), [(5.0, 0, "3")], [21.0]) == {0: [("send", 1, 0), ("recv", 1, 0)]}


def test_synth_writes_group_local_coalesced_p2p(tmp_path):
    generate(SynthConfig(ranks=8, steps=1, pp=4), tmp_path)
    doc = orjson.loads((tmp_path / "rank6.pt.trace.json").read_bytes())  # stage 3 of pipeline [0, 2, 4, 6]
    groups = {g["pg_name"]: g for g in doc["distributedInfo"]["pg_config"]}
    pp = next(g for g in groups.values() if g["pg_desc"] == "pp")
    assert pp["ranks"] == [0, 2, 4, 6] and len(groups) >= 3
    ev = doc["traceEvents"]
    assert any(e.get("name") == "nccl:recv 3<-2" for e in ev)  # group ranks, not 6 <- 4
    kernels = [e for e in ev if e.get("cat") == "kernel" and e["args"].get("Collective name") == "coalesced"]
    assert kernels and all(k["name"].startswith("ncclDevKernel_SendRecv") for k in kernels)
    assert all("Src Rank" not in k["args"] and "Dst Rank" not in k["args"] for k in kernels)
    parts = [e for e in ev if e.get("name") == "record_param_comms" and e["args"].get("Collective name") == "recv"]
    assert {p["args"]["Src Rank"] for p in parts} == {2} and {p["args"]["Process Group Name"] for p in parts} == {
        pp["pg_name"]}


@pytest.mark.parametrize("layout", [
    dict(ranks=48, pp=4, microbatches=8, stragglers=(17,), slowdown=1.3),        # DP 12 x PP 4 (the job)
    dict(ranks=16, pp=2, tp=2, microbatches=4, stragglers=(6,), slowdown=1.3),   # DP 4 x PP 2 x TP 2
    dict(ranks=16, pp=2, ep=4, microbatches=4, stragglers=(9,), slowdown=1.3),   # DP 8 (EP 4) x PP 2
    dict(ranks=16, pp=4, microbatches=4, stragglers=(5,), slowdown=1.3, p2p="single"),
])
def test_layouts_with_group_local_ranks(layout, tmp_path):
    truth = generate(SynthConfig(steps=2, **layout), tmp_path, workers=1)
    rep = analyze(str(tmp_path), workers=1).report
    pipe = rep["pipeline"]
    assert pipe is not None and pipe["pipelines_ranks"] == truth["pipeline"]["pipelines"]
    assert pipe["stages"] == layout["pp"] and pipe["microbatches"] == layout["microbatches"]
    for stage, frac in truth["pipeline"]["bubble_fraction"].items():
        assert abs(pipe["bubble_fraction"][stage] - frac) < 0.02, stage
    assert _ranks(rep) == truth["stragglers"]
    assert rep["stragglers"][0]["compute_vs_peers"] == pytest.approx(1.3, abs=0.03)


def test_single_rank_file_lists_every_group_it_belongs_to(tmp_path):
    generate(SynthConfig(ranks=16, steps=1, pp=2, tp=2, ep=2), tmp_path)
    info = orjson.loads(Path(tmp_path, "rank5.pt.trace.json").read_bytes())["distributedInfo"]
    descs = sorted(g["pg_desc"] for g in info["pg_config"])
    assert descs == ["default_pg", "dp", "ep", "pp", "tp"] and info["pg_count"] == 5

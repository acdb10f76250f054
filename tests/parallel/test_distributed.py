"""Distributed equals single process (DESIGN contract 4): every layout's loss and gradients match the
one-process step on the same global batch (labels with -100 holes, so ranks and microbatches hold
unequal token counts). One spawned gloo job per world size runs all its cases (dist_job.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).with_name("dist_job.py")
FAST = ["dp2", "ep2", "ep2_ac_mb2", "tp2", "tp2_kimi_linear", "pp2", "pp2_interleaved", "pp2_kimi_linear",
        "fp8_dp2_ep2", "pp2_interleaved_ac_offload", "ep2_overlap", "ep2_offload_layer", "ep2_offload_mlp",
        "ep2_ac_offload_layer"]
COMPOSED = ["dp2_ep2_tp2", "dp4_ep2", "pp2_dp2", "pp2_tp2_ac", "pp2_ep2", "pp2_ep2_interleaved_ac"]

# What rank 0 holds in each layout: proof that the parallelism was applied, not only that numbers agree.
# k31_toy: 8 layers (AttnRes blocks of 2), 8 experts, 4 KDA heads of 8, dense MLP 48 wide, hidden 32.
LAYOUT = {
    "dp2": {"kda_heads": [16, 32]},  # FSDP: half the rows of q_proj
    "ep2": {"expert_rows": [4, 16, 20], "kda_heads": [16, 32]},  # 4 of 8 experts; dense params FSDP-sharded
    "ep2_ac_mb2": {"expert_rows": [4, 16, 20]},  # + activation checkpointing, 2 accumulated microbatches
    "tp2": {"kda_heads": [16, 32], "mlp_cols": [24, 32], "expert_rows": [8, 16, 20]},
    "pp2": {"layers": [0, 1, 2, 3], "kda_heads": [32, 32]},
    "pp2_interleaved": {"layers": [0, 1, 4, 5]},  # stages 0 and 2 of 4
    "pp2_kimi_linear": {"layers": [0, 1]},
    "dp2_ep2_tp2": {"expert_rows": [4, 16, 20], "kda_heads": [8, 32], "mlp_cols": [12, 32]},
    "dp4_ep2": {"expert_rows": [2, 16, 20], "kda_heads": [8, 32]},  # 4 experts per EP rank, FSDP halves them
    "pp2_dp2": {"layers": [0, 1, 2, 3], "expert_rows": [4, 16, 20], "kda_heads": [16, 32]},  # FSDP rows
    "pp2_tp2_ac": {"layers": [0, 1, 4, 5], "kda_heads": [16, 32], "mlp_cols": [24, 32]},
    # blockwise fp8 with FSDP2 and EP: the 100 bias-free linears of the 8 decoder layers converted; 4 of 8 experts
    "fp8_dp2_ep2": {"expert_rows": [4, 16, 20], "fp8_linears": 100},
    "pp2_interleaved_ac_offload": {"layers": [0, 1, 4, 5]},
    "ep2_overlap": {"expert_rows": [4, 16, 20], "dispatcher": "OverlappedExpertDispatcher"},
    "ep2_offload_layer": {"expert_rows": [4, 16, 20]},
    "ep2_offload_mlp": {"expert_rows": [4, 16, 20]},
    "ep2_ac_offload_layer": {"expert_rows": [4, 16, 20]},
    "pp2_ep2": {"layers": [0, 1, 2, 3], "expert_rows": [4, 16, 20], "kda_heads": [16, 32]},  # dp 2 inferred
    "pp2_ep2_interleaved_ac": {"layers": [0, 1, 4, 5], "expert_rows": [4, 16, 20]},
}


def run_job(world: int, cases: list[str], out: Path) -> dict:
    proc = subprocess.run([sys.executable, "-W", "ignore", str(JOB), str(world), str(out), *cases],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_job(2, FAST, tmp_path_factory.mktemp("dist") / "two.json")


def check(result: dict, case: str) -> None:
    assert result["loss"] == pytest.approx(result["ref_loss"], rel=1e-6)
    # The step's measurements come back as values, equal to the one-process ones in every layout.
    assert result["lm_loss"] == pytest.approx(result["ref_lm_loss"], rel=1e-6)
    if case.startswith("fp8"):  # its model has no MTP
        assert result["mtp_loss"] is None and result["ref_mtp_loss"] is None
    else:
        assert result["mtp_loss"] == pytest.approx(result["ref_mtp_loss"], rel=1e-6)
    assert result["expert_load"] == result["ref_expert_load"]
    assert result["grad_rel_err"] < 1e-5, result["worst_param"]
    assert result["norm"] == pytest.approx(result["ref_norm"], rel=1e-5)  # clip_grad_norm_ sees every shard
    assert result["clipped_norm"] == pytest.approx(result["ref_norm"] / 2, rel=1e-4)
    assert result["unchecked"] == []  # every parameter's gradient was compared on some rank
    # Evaluation's forward (through the stages under a pipeline) gives the one-process logits on the
    # ranks of the last stage, and its sums reduce to the whole batch's.
    assert result["eval_rel_err"] < 1e-5
    assert result["eval_holders"] == result["world"] // result["pp"]
    assert result["eval_sum"] == pytest.approx(result["ref_eval_sum"], rel=1e-6, abs=1e-6)
    assert result["state_dict_mismatch"] == []
    # Offload moved every checkpointed layer's saved inputs (h and the AttnRes bank: >= 1 [rows, T, 32]
    # fp32 tensor per layer and microbatch), and nothing when it is off.
    assert (result["offloaded_bytes"] >= 8 * 4 * 12 * 32 * 4) == ("offload" in case)  # 8 layers, 4 rows x 12
    for key, value in LAYOUT.get(case, {}).items():
        assert result["layout"][key] == value, key


@pytest.mark.parametrize("case", FAST)
def test_two_ranks_match_one_process(two_ranks, case):
    check(two_ranks[case], case)


@pytest.mark.parametrize("case", ["ep2_offload_layer", "ep2_offload_mlp", "ep2_ac_offload_layer"])
def test_offload_with_expert_shards_equals_ep_without_it(two_ranks, case):
    """EP expert weights are DTensors without storage of their own: the offload hooks once crashed telling
    them from activations. Offload moves activations only, so the step is the plain EP step, bit for bit."""
    plain, offloaded = two_ranks["ep2"], two_ranks[case]
    assert offloaded["loss"] == plain["loss"] and offloaded["mtp_loss"] == plain["mtp_loss"]
    assert offloaded["grad_rel_err"] == pytest.approx(plain["grad_rel_err"], abs=1e-7)
    assert offloaded["norm"] == pytest.approx(plain["norm"], rel=1e-6)
    assert offloaded["offloaded_bytes"] > 0 and plain["offloaded_bytes"] == 0


@pytest.mark.slow
def test_composed_four_ranks_match_one_process(tmp_path):
    results = run_job(4, COMPOSED, tmp_path / "four.json")
    for case in COMPOSED:
        check(results[case], case)

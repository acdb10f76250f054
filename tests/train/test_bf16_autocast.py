"""`--precision bf16` on a CPU: the whole step runs under bf16 autocast (KDA's chunked op and its
triangular solve inside it in fp32) and learns as fp32 does."""

import pytest

from deltamoe.train.trainer import train


def test_bf16_autocast_step_runs_on_cpu_and_tracks_fp32(micro, tmp_path):
    run = {"run.steps": 2}
    fp32 = train(micro(**run, **{"run.out": str(tmp_path / "fp32")})).metrics
    bf16 = train(micro(**run, **{"run.out": str(tmp_path / "bf16"), "run.precision": "bf16"})).metrics
    assert [m["step"] for m in bf16] == [1, 2]
    for a, b in zip(fp32, bf16):
        # Same weights and rows: bf16 rounding only (losses ~5.6, ~2e-4 apart relative).
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=2e-3)
        assert b["lm_loss"] != a["lm_loss"]  # the region was active: bf16 matmuls round differently

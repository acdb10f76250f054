"""bench/bench_train_fp8.py's bookkeeping: per-layer fp8 error, the seed-pair summary, and reading
kept run folders (--from-runs) through the last step and evaluation every run reached."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bench_train_fp8.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_train_fp8", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_run(folder: Path, losses: list[float], evals: dict[int, float], fp8: bool) -> None:
    folder.mkdir(parents=True)
    rows = []
    for step, loss in enumerate(losses, start=1):
        row = {"step": step, "loss": loss + 1, "lm_loss": loss}
        if fp8 and step % 2 == 0:
            row["fp8_error"] = {"model.layers.0.mlp.up_proj": {"x": 0.02 * step, "w": 0.03, "dy": 0.01},
                                "model.layers.0.mlp.down_proj": {"x": 0.04 * step, "w": 0.05, "dy": 0.03},
                                "mtp.layers.0.eh_proj": {"x": 0.1, "w": 0.2, "dy": 0.3}}
        rows.append(row)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "eval.jsonl").write_text("".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in evals.items()))
    (folder / "train_config.json").write_text(json.dumps({"run": {"steps": 6}}))


def test_from_runs_compares_through_the_common_step_and_evaluation(bench, tmp_path):
    _write_run(tmp_path / "fp32_seed0", [4, 3, 2, 2, 2, 2], {3: 2.5, 6: 2.0}, fp8=False)
    _write_run(tmp_path / "fp8_seed0", [4, 3, 2.2, 2.2, 2.2, 2.2], {3: 2.6, 6: 2.1}, fp8=True)
    _write_run(tmp_path / "fp32_seed1", [4, 3, 1, 1, 1, 1], {3: 2.0, 6: 1.5}, fp8=False)
    _write_run(tmp_path / "fp8_seed1", [4, 3, 1.1, 1.1], {3: 2.2}, fp8=True)  # stopped at step 4
    ref, fp8, reached, schedule = bench.read_runs(tmp_path, "fp32", tail=2)
    assert (reached, schedule) == (4, 6)
    assert [r["seed"] for r in ref] == [0, 1] and all(len(r["losses"]) == 4 for r in ref + fp8)
    assert [r["final_loss"] for r in ref] == [2.0, 1.0] and fp8[0]["final_loss"] == pytest.approx(2.2)
    assert [r["eval_loss"] for r in ref + fp8] == [2.5, 2.0, 2.6, 2.2] and ref[0]["eval_step"] == 3
    # the last fp8 stats through step 4, averaged per layer over its modules
    assert fp8[1]["fp8_error_by_layer_last_step"] == {"model.layers.0": pytest.approx({"x": 0.12, "w": 0.04, "dy": 0.02}),
                                                      "mtp": {"x": 0.1, "w": 0.2, "dy": 0.3}}
    s = bench.summarise(ref, fp8)
    assert [p["rel_gap"] for p in s["pairs"]] == pytest.approx([0.1, 0.1])
    assert [p["eval_rel_gap"] for p in s["pairs"]] == pytest.approx([0.04, 0.1])
    assert s["eval_rel_gap"]["mean"] == pytest.approx(0.07) and s["eval_rel_gap"]["std"] == pytest.approx(0.0424, abs=1e-4)
    assert s["seed_rel_spread"] == pytest.approx(0.4714, abs=1e-4) and not s["within_goal"]


def test_from_runs_refuses_a_folder_without_seed_pairs(bench, tmp_path):
    _write_run(tmp_path / "fp32_seed0", [4, 3], {2: 3.0}, fp8=False)
    with pytest.raises(SystemExit, match="needs fp32_seedN and fp8_seedN"):
        bench.read_runs(tmp_path, "fp32", tail=1)

"""bench/spec_train_recipe.py: the one command that rebuilds the spec checkpoint. Fast checks of its
pieces; the whole build (two trunk steps, two distillation steps), twice from the same seed, behind
`-m slow`."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def bench_script(monkeypatch):
    """Imported by name (not conftest's file loader): these scripts define dataclasses, which need their
    module in sys.modules, and import each other the same way."""
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module


def test_bad_until_and_rows_name_the_flag(bench_script):
    fresh = bench_script("spec_distill_fresh")
    with pytest.raises(SystemExit, match="--until: '6.40' is not a UTC time HH:MM"):
        fresh.deadline("6.40")
    with pytest.raises(SystemExit, match="--rows: 'copy=0'"):
        fresh.parse_rows("repeat=2,copy=0")
    assert fresh.parse_rows("copy=4,repeat=4,recall=2") == {"copy": 4, "repeat": 4, "recall": 2}
    assert fresh.deadline(None) is None


def test_trunk_steps_run_reads_the_training_log(bench_script, tmp_path):
    spec = bench_script("bench_spec_decode")
    assert spec.trunk_steps_run(tmp_path) == 0  # nothing trained yet
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)))
    assert spec.trunk_steps_run(tmp_path) == 3


@pytest.mark.slow
def test_the_build_is_whole_and_repeats_from_its_seed(bench_script, tmp_path):
    recipe_module = bench_script("spec_train_recipe")
    fresh = bench_script("spec_distill_fresh")
    recipe = recipe_module.SpecRecipe(seed=3, trunk_steps=2, train_threads=1, distill=fresh.FreshDistill(
        steps=2, lr=2e-3, warmup=1, rows="copy=1,repeat=1", every=1, eval_prompts=1, eval_seed=2))
    records = [recipe_module.build(tmp_path / name, recipe, None, "test") for name in ("a", "b")]
    for name, record in zip(("a", "b"), records):
        out = tmp_path / name
        assert record["complete"] and record["stages"]["trunk"]["steps_run"] == 2
        assert record["stages"]["distill"]["steps_run"] == 2
        assert json.loads((out / recipe_module.RECIPE_JSON).read_text())["recipe"]["seed"] == 3
        kept = json.loads((out / recipe_module.RECIPE_FILE).read_text())
        assert kept["train_steps"] == 2 and "seed 3" in kept["mtp_distill_data"]
        assert (out / "config.json").exists() and (out / "latest" / "config.json").exists()
    tensors = [load_file(next((tmp_path / name).glob("*.safetensors"))) for name in ("a", "b")]
    assert tensors[0].keys() == tensors[1].keys()
    assert all(torch.equal(tensors[0][k], tensors[1][k]) for k in tensors[0])

"""A run stops on a non-finite loss keeping its last good checkpoint; a resume refuses a changed
configuration (or accepts a safe change with a notice) and keeps the original run's record."""

from __future__ import annotations

import json

import pytest
import torch

from deltamoe.errors import ConfigError, TrainingError
from deltamoe.train import checkpoint
from deltamoe.train.manifest import verify_manifest
from deltamoe.train.step import TrainStep
from deltamoe.train.resume_check import RESUME_LOG
from deltamoe.train.trainer import train
from tests.train.conftest import micro_config

SMALL = {"data.batch_size": 2, "data.eval_rows": 2}


def test_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    original = TrainStep.__call__

    def poisoned(self, step, micro_batches):
        if step == 3:  # a real NaN: poison the embeddings so the forward, loss and gradients all go NaN
            with torch.no_grad():
                self.pm.model_parts[0].model.embed_tokens.weight.fill_(float("nan"))
        return original(self, step, micro_batches)

    monkeypatch.setattr(TrainStep, "__call__", poisoned)
    out = tmp_path / "run"
    with pytest.raises(TrainingError, match=r"step 3: non-finite loss nan.*step-00000002") as e:
        train(micro_config(out, **SMALL, **{"run.steps": 5, "run.save_every": 1, "run.keep_checkpoints": 2}))
    assert "lower --lr" in e.value.one_line()
    assert [p.name for p in checkpoint.list_checkpoints(out)] == ["step-00000001", "step-00000002"]
    verify_manifest(checkpoint.latest_checkpoint(out))
    assert not (out / "model").exists()  # nothing exported from the spoiled weights
    logged = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2]


def test_non_finite_before_any_checkpoint_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(TrainStep, "__call__", lambda self, step, mb: {"loss": 1.0, "grad_norm": float("inf")})
    with pytest.raises(TrainingError, match="non-finite grad_norm inf; stopped, no checkpoint was saved"):
        train(micro_config(tmp_path / "run", **SMALL, **{"run.steps": 2}))


@pytest.fixture
def saved_run(run_copy):
    """`run_copy` (2 steps, checkpoint step-2) with its original train_config.json text."""
    return run_copy, (run_copy / "train_config.json").read_text()


@pytest.mark.parametrize("change, field", [({"optim.lr": 1e-2}, "optim.lr"), ({"data.batch_size": 4}, "data.batch_size"),
                                           ({"data.task": "copy"}, "data.task"), ({"run.seed": 7}, "run.seed"),
                                           ({"run.precision": "bf16"}, "run.precision")])
def test_resume_refuses_an_unsafe_change(saved_run, change, field):
    out, record = saved_run
    with pytest.raises(ConfigError, match="a resumed run keeps") as e:
        train(micro_config(out, **{**SMALL, "run.steps": 3, "run.resume": True, **change}))
    assert e.value.field == field
    assert (out / "train_config.json").read_text() == record


def test_resume_refuses_steps_below_the_checkpoint(saved_run):
    out, record = saved_run
    with pytest.raises(ConfigError, match="at step 2, beyond run.steps=1") as e:
        train(micro_config(out, **{**SMALL, "run.steps": 1, "run.resume": True}))
    assert e.value.field == "run.steps"
    assert (out / "train_config.json").read_text() == record


def test_resume_accepts_a_safe_change_with_a_notice_and_keeps_the_record(saved_run, capfd):
    out, record = saved_run
    result = train(micro_config(out, **{**SMALL, "run.steps": 3, "run.resume": True, "run.eval_every": 1}))
    assert result.step == 3
    err = capfd.readouterr().err
    assert "run.steps 2 -> 3" in err and "run.eval_every 0 -> 1" in err and "schedule" in err
    assert (out / "train_config.json").read_text() == record  # the original run's record is untouched
    (entry,) = [json.loads(line) for line in (out / RESUME_LOG).read_text().splitlines()]
    assert entry["step"] == 2 and entry["changes"]["run.steps"] == [2, 3]
    # The new checkpoint records the configuration it was trained with.
    saved = checkpoint.read_saved_config(checkpoint.latest_checkpoint(out))
    assert saved["run"]["steps"] == 3

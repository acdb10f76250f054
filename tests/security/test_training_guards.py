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
    with pytest.raises(TrainingError, match="non-finite grad_norm inf; stopped, no checkpoint was saved") as e:
        train(micro_config(tmp_path / "run", **SMALL, **{"run.steps": 2}))
    assert e.value.hint.startswith("start again")  # not "resume from it": there is nothing to resume from


@pytest.fixture
def saved_run(run_copy):
    """`run_copy` (2 steps, checkpoint step-2) with its original train_config.json text."""
    return run_copy, (run_copy / "train_config.json").read_text()


@pytest.mark.parametrize("change, field", [({"optim.weight_decay": 0.5}, "optim.weight_decay"),
                                           ({"data.batch_size": 4}, "data.batch_size"),
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


def test_resume_with_a_lower_lr_and_clipping_the_recovery_the_error_names(saved_run, capfd):
    """The non-finite stop's hint (resume with a lower --lr or --clip-grad) is a path that runs: both
    change on resume with a notice, and the steps after it follow the new peak LR."""
    from deltamoe.train.optim import LRSchedule

    out, _ = saved_run
    saved = checkpoint.read_saved_config(checkpoint.latest_checkpoint(out))
    lower = saved["optim"]["lr"] / 10
    result = train(micro_config(out, **{**SMALL, "run.steps": 3, "run.resume": True, "optim.lr": lower,
                                        "optim.clip_grad": 0.5, "run.fp8_stats_every": 1}))
    assert result.step == 3
    err = capfd.readouterr().err
    assert "optim.lr" in err and "optim.clip_grad" in err
    (entry,) = [json.loads(line) for line in (out / RESUME_LOG).read_text().splitlines()]
    assert entry["changes"]["optim.lr"] == [saved["optim"]["lr"], lower]
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    expected = LRSchedule(lower, saved["optim"]["warmup_steps"], 3, saved["optim"]["min_lr_ratio"])(3)
    assert last["step"] == 3 and last["lr"] == pytest.approx(expected, rel=1e-12)


def test_a_new_run_into_a_folder_with_checkpoints_is_refused(saved_run):
    """A fresh run's saves would sort before the earlier run's checkpoints: it pruned its own and
    --resume / the export read the other run. Refused before the model is built, nothing touched."""
    out, record = saved_run
    before = sorted(p.name for p in checkpoint.list_checkpoints(out))
    with pytest.raises(ConfigError, match=r"holds checkpoints of an earlier run \(step-00000002\)") as e:
        train(micro_config(out, **{**SMALL, "run.steps": 1}))
    assert e.value.field == "run.out" and "--resume" in e.value.one_line()
    assert sorted(p.name for p in checkpoint.list_checkpoints(out)) == before
    assert (out / "train_config.json").read_text() == record


def test_resuming_an_earlier_checkpoint_than_the_folders_newest_is_refused(saved_run, tmp_path):
    """Resuming step 2 of another folder into one holding step 3 would mix two runs' checkpoints."""
    out, _ = saved_run
    later = tmp_path / "later"
    train(micro_config(later, **{**SMALL, "run.steps": 3, "run.resume_from": str(checkpoint.latest_checkpoint(out))}))
    assert [p.name for p in checkpoint.list_checkpoints(later)] == ["step-00000003"]
    with pytest.raises(ConfigError, match="holds step-00000003, past step 2 this run resumes from") as e:
        train(micro_config(later, **{**SMALL, "run.steps": 4, "run.resume_from": str(checkpoint.latest_checkpoint(out))}))
    assert e.value.field == "run.out"

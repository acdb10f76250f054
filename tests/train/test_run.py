"""End-to-end runs of the loop on the micro model: outputs, learning, resume equality, profiles."""

import json
import shutil

import pytest
import torch

from deltamoe.model.load import build_model, load_model
from deltamoe.train import checkpoint
from deltamoe.train.metrics import read_jsonl
from deltamoe.train.trainer import train

REQUIRED = {"step", "loss", "lr", "tokens_per_s", "grad_norm", "lm_loss", "mtp_loss", "expert_load_max_mean"}


def test_run_writes_outputs_and_exports_loadable_model(micro):
    cfg = micro(**{"run.steps": 3, "run.eval_every": 2})
    result = train(cfg)
    out = result.out
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(REQUIRED <= set(m) for m in metrics)
    m = metrics[-1]
    assert m["loss"] == pytest.approx(m["lm_loss"] + 0.3 * m["mtp_loss"], rel=1e-5)
    assert m["lr"] == pytest.approx(cfg.optim.lr * cfg.optim.min_lr_ratio, rel=1e-12)  # the cosine ends at its floor
    assert [e["step"] for e in read_jsonl(out / "eval.jsonl")] == [2, 3]
    final = json.loads((out / "eval.json").read_text())
    # Two 12-token examples fit a 32-token row: 2 answers per row, 16 rows.
    assert final["step"] == 3 and 0 <= final["accuracy"] <= 1 and final["answers"] == 32
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((out / "train_config.json").read_text())
    assert saved["optim"]["lr"] == cfg.optim.lr
    assert saved["run"]["threads"] == torch.get_num_threads() >= 1  # the count used, not null
    assert [p.name for p in checkpoint.list_checkpoints(out)] == ["step-00000003"]
    # The exported safetensors folder holds the trained weights: the same as the final DCP checkpoint.
    exported = load_model(out / "model")
    from_dcp = build_model(exported.config)
    checkpoint.load_model_weights(checkpoint.latest_checkpoint(out), from_dcp)
    for (name, x), (_, y) in zip(exported.state_dict().items(), from_dcp.state_dict().items()):
        assert torch.equal(x, y), name
    assert not torch.equal(exported.lm_head.weight, build_model(exported.config).lm_head.weight)  # it trained


def test_loss_decreases_on_a_trivial_task(micro):
    cfg = micro(**{"data.task": "copy", "data.string_len": 3, "data.seq_len": 24, "data.batch_size": 8,
                   "data.eval_rows": 4, "optim.lr": 1e-2, "optim.warmup_steps": 2, "run.steps": 12})
    losses = [m["lm_loss"] for m in train(cfg).metrics]
    # From ln(264) ~ 5.6 (uniform over the vocabulary) towards ln(26) ~ 3.3 (the answer alphabet) and below.
    assert losses[0] > 5.0 and sum(losses[-3:]) / 3 < 0.75 * losses[0]


def test_resume_logs_the_same_losses(micro, tmp_path):
    keys = ("loss", "lm_loss", "mtp_loss", "grad_norm", "lr", "expert_load_max_mean", "router_bias_abs_mean")
    run = {"run.steps": 4, "run.save_every": 2, "optim.grad_accum": 2, "data.batch_size": 4, "data.eval_rows": 4}
    full = micro(**run, **{"run.out": str(tmp_path / "a")})
    reference = train(full).metrics
    # A second run that "crashes" after its step-2 checkpoint: keep only that checkpoint and a
    # half-written temp folder for step 4, as a kill during the save would leave.
    out = tmp_path / "b"
    shutil.copytree(tmp_path / "a", out)
    ckpts = out / "checkpoints"
    (ckpts / "step-00000004").rename(ckpts / ".tmp-step-00000004")
    (ckpts / ".tmp-step-00000004" / ".metadata").unlink()
    assert checkpoint.latest_checkpoint(out).name == "step-00000002"
    again = train(micro(**run, **{"run.out": str(out), "run.resume": True})).metrics
    assert [m["step"] for m in again] == [3, 4]
    for ref, got in zip(reference[2:], again):
        assert {k: got[k] for k in keys} == pytest.approx({k: ref[k] for k in keys}, rel=1e-6, abs=1e-9)
    # The log reads as one run; the stale temp folder is gone; the router biases were restored.
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3, 4]
    assert not (ckpts / ".tmp-step-00000004").exists()
    a, b = load_model(tmp_path / "a" / "model"), load_model(out / "model")
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.allclose(x, y, rtol=1e-6, atol=1e-7), name
    assert a.model.layers[1].block_sparse_moe.gate.e_score_correction_bias.abs().sum() > 0


def test_keeps_last_k_checkpoints(micro):
    result = train(micro(**{"run.steps": 4, "run.save_every": 1, "run.keep_checkpoints": 2,
                            "data.batch_size": 2, "data.eval_rows": 2}))
    assert [p.name for p in checkpoint.list_checkpoints(result.out)] == ["step-00000003", "step-00000004"]


def test_profile_window_writes_an_analyzable_trace(micro):
    from deltamoe.trace.analyze import analyze

    result = train(micro(**{"run.steps": 4, "run.profile_steps": "2:4", "run.eval_every": 2, "data.batch_size": 2,
                            "data.eval_rows": 2}))
    trace = result.out / "traces" / "rank0.json"
    data = json.loads(trace.read_text())
    assert data["distributedInfo"]["rank"] == 0
    steps = {e["name"]: e for e in data["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    assert len(steps) == 2
    assert data["profiler_step_offset"] == 1  # ProfilerStep#1..#2 are training steps 2..3
    # Step 2's evaluation is labelled and lies in step 2's window, not in step 3's.
    (evaluate,) = [e for e in data["traceEvents"] if e.get("name") == "deltamoe.evaluate"]
    two = steps["ProfilerStep#1"]
    assert two["ts"] <= evaluate["ts"] and evaluate["ts"] + evaluate["dur"] <= two["ts"] + two["dur"]
    report = analyze(str(result.out / "traces"), workers=1)
    assert [x["step"] for x in report.report["step_times"]["steps"]] == [2, 3]


def test_stops_at_target_accuracy(micro):
    cfg = micro(**{"run.steps": 20, "run.eval_every": 1, "run.target_accuracy": 0.01, "data.batch_size": 2,
                   "data.eval_rows": 8})
    result = train(cfg)
    assert result.step < 20 and result.final_eval["step"] == result.step
    assert result.final_eval["accuracy"] >= 0.01
    evals = read_jsonl(result.out / "eval.jsonl")
    assert [e["step"] for e in evals] == list(range(1, result.step + 1))  # no duplicate final evaluation


def test_time_budget_stops_after_a_step_and_still_finishes(micro):
    result = train(micro(**{"run.steps": 50, "run.max_minutes": 1e-6, "data.batch_size": 2, "data.eval_rows": 2}))
    assert result.step == 1 and result.final_eval["step"] == 1
    assert (result.out / "model" / "config.json").exists()
    assert [p.name for p in checkpoint.list_checkpoints(result.out)] == ["step-00000001"]


def test_ctrl_c_during_a_checkpoint_save_is_a_keyboard_interrupt_and_leaves_the_complete_ones(micro, tmp_path,
                                                                                               monkeypatch, capsys):
    """DCP catches a Ctrl-C inside its writer and wraps it (CheckpointException): the save hands it on as
    the KeyboardInterrupt it was, so the CLI says "interrupted" rather than printing tracebacks, and
    removes its own temp folder."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    cfg = micro(**{"run.steps": 4, "run.save_every": 2, "run.out": str(tmp_path / "a")})
    real_write = FileSystemWriter.write_data
    saves = []

    def write_data(self, plan, planner):
        saves.append(1)
        if len(saves) == 2:  # the step-4 save
            raise KeyboardInterrupt
        return real_write(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", write_data)
    with pytest.raises(KeyboardInterrupt):
        train(cfg)
    ckpts = tmp_path / "a" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000002"]
    # The one-process run says where it can go on from.
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"training interrupted; the newest checkpoint is {ckpts / 'step-00000002'}: continue with --resume "
        f"--out {tmp_path / 'a'}")


def test_a_tampered_checkpoint_names_the_setting_that_chose_it(micro, tmp_path):
    from deltamoe.errors import CheckpointError

    out = tmp_path / "t"
    train(micro(**{"run.steps": 2, "run.out": str(out)}))
    shard = next((out / "checkpoints" / "step-00000002").glob("*.distcp"))
    size = shard.stat().st_size
    with shard.open("r+b") as f:
        f.truncate(1000)
    with pytest.raises(CheckpointError) as e:
        train(micro(**{"run.steps": 3, "run.out": str(out), "run.resume": True}))
    assert e.value.one_line() == (f"run.resume: {shard} has 1000 bytes, the manifest says {size} (hint: the "
                                  "checkpoint is truncated or was changed after it was saved)")


def test_resume_with_no_checkpoint_starts_a_new_run_and_says_so(micro, tmp_path, capfd):
    out = tmp_path / "fresh"
    metrics = train(micro(**{"run.steps": 1, "run.out": str(out), "run.resume": True})).metrics
    assert [m["step"] for m in metrics] == [1]
    assert f"--resume: no checkpoint in {out / 'checkpoints'} yet: starting a new run" in capfd.readouterr().err

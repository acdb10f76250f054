"""`deltamoe demo` end to end on a micro model: the run folder it leaves, reuse, --fresh, and Ctrl-C."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deltamoe.cli import main
from deltamoe.demo import train_stage
from deltamoe.demo.serve_stage import held_out_prompts
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.train import trainer as trainer_module
from deltamoe.train.data.tasks import QUERY, in_eval_split
from tests.train.conftest import MICRO_MODEL  # every feature of tiny, at a size where a step takes milliseconds


@pytest.fixture(autouse=True)
def micro_recipe(monkeypatch):
    monkeypatch.setitem(train_stage.RECIPE, "model", {"preset": "tiny", "overrides": MICRO_MODEL})
    monkeypatch.setitem(train_stage.RECIPE, "data", {**train_stage.RECIPE["data"], "batch_size": 4})


def demo(out: Path, *args: str) -> int:
    try:
        return main(["demo", "--out", str(out), "--prompts", "3", "--eval-rows", "4", "--threads", "1", *args])
    except SystemExit as e:  # Ctrl-C ends the process with code 130
        return e.code


def temp_files(root: Path) -> list[Path]:
    """Leftovers of a write that did not finish: temp files and staging folders."""
    return [p for p in root.rglob("*") if "tmp" in p.name]


def test_run_folder_reuse_and_fresh(tmp_path, capsys):
    out = tmp_path / "demo"
    assert demo(out, "--steps", "20") == 0  # long enough for the up-front time estimate
    first = capsys.readouterr().out
    weights = out / "checkpoint" / "model.safetensors"
    assert (out / "checkpoint" / "config.json").is_file() and weights.is_file()
    r = json.loads((out / "results.json").read_text())
    assert r["train"]["steps"] == 20 and not r["train"]["reused"] and r["train"]["task"] == "recall+arithmetic"
    assert not r["train"]["stopped_by_time"] and r["train"]["estimated_s"] > 0
    assert "training: about" in first and "at this machine's current speed (20 steps at" in first
    s = r["serve"]
    assert s["prompts"] == 6 and set(s["per_task"]) == {"recall", "arithmetic"}
    assert 0 <= s["accuracy"] <= 1 and s["tokens_per_s"] > 0 and s["output_tokens"] > 0
    assert r["plans"]["h200-4-nodes"]["chips"] == 32 and r["plans"]["h200-4-nodes"]["output_tok_s_per_chip"] > 0
    assert "hbm_tbps" in r["plans"]["m890-superpod"]["refused"]  # the catalog states no bandwidth
    assumed = r["plans"]["m890-superpod-assumed"]
    assert assumed["chips"] == 64 and set(assumed["assumed_figures"]) >= {"hbm_tbps", "fp4_tflops"}
    for name in ("h200-4-nodes.json", "h200-4-nodes.txt", "m890-superpod.txt", "m890-superpod-assumed.json"):
        assert (out / "plans" / name).is_file()
    assert r["trace"]["ranks"] == 1 and (out / "trace-report.json").is_file()
    assert "assumed" in first and "refused" in first and "accuracy" in first
    assert temp_files(out) == []

    # A second run finds the finished checkpoint and goes straight to serving.
    mtime = weights.stat().st_mtime_ns
    assert demo(out, "--steps", "20") == 0
    assert "skipping training" in capsys.readouterr().out
    r2 = json.loads((out / "results.json").read_text())
    assert r2["train"]["reused"] and r2["train"]["steps"] == 20 and weights.stat().st_mtime_ns == mtime
    assert r2["serve"]["prompts"] == 6

    # --fresh forgets all of it and trains again.
    assert demo(out, "--fresh", "--steps", "2", "--no-profile") == 0
    r3 = json.loads((out / "results.json").read_text())
    assert not r3["train"]["reused"] and r3["train"]["steps"] == 2 and weights.stat().st_mtime_ns != mtime
    assert "estimated_s" not in r3["train"]  # a run this short starts without timing steps first
    assert "trace" not in r3 and not (out / "trace-report.json").exists() and not (out / "train" / "traces").exists()


def test_ctrl_c_leaves_only_complete_files_and_the_next_run_resumes(tmp_path, capsys, monkeypatch):
    out = tmp_path / "demo"
    monkeypatch.setitem(train_stage.RECIPE, "run", {**train_stage.RECIPE["run"], "save_every": 2})
    advance = trainer_module.Trainer._advance

    def interrupted_at_step_3(self):
        advance(self)
        if self.state.step == 3:
            raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(trainer_module.Trainer, "_advance", interrupted_at_step_3)
        assert demo(out, "--steps", "4", "--no-profile") == 130
    assert "interrupted" in capsys.readouterr().out
    assert not (out / "checkpoint").exists() and not (out / "results.json").exists()
    assert temp_files(out) == []
    saved = sorted((out / "train" / "checkpoints").iterdir())
    assert [p.name for p in saved] == ["step-00000002"] and (saved[0] / ".metadata").is_file()

    assert demo(out, "--steps", "4", "--no-profile") == 0
    assert "resuming the interrupted training" in capsys.readouterr().out
    r = json.loads((out / "results.json").read_text())
    assert r["train"]["resumed_from_step"] == 2 and r["train"]["steps"] == 4
    assert (out / "checkpoint" / "model.safetensors").is_file() and temp_files(out) == []


def test_held_out_prompts_are_distinct_unseen_and_correct():
    recall, arithmetic = train_stage.demo_tasks()
    for task in (recall, arithmetic):
        prompts = held_out_prompts(task, 32)
        assert len({p.prompt for p in prompts}) == len(prompts) == 32
    for p in held_out_prompts(arithmetic, 32):
        a, b = p.prompt.rstrip("=").split("+")
        assert p.answer == str(int(a) + int(b)) and in_eval_split([(p.prompt + p.answer, True)])
    for p in held_out_prompts(recall, 32):
        context, queries = p.prompt.split(QUERY)
        assert context[context.index(queries[-1]) + 1] == p.answer


def test_ctrl_c_while_serving_keeps_the_finished_checkpoint(tmp_path, capsys, monkeypatch):
    out = tmp_path / "demo"

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(LLMEngine, "generate", interrupted)
        assert demo(out, "--steps", "2", "--no-profile") == 130
    assert "finished checkpoint" in capsys.readouterr().out
    r = json.loads((out / "results.json").read_text())
    assert r["train"]["steps"] == 2 and "serve" not in r and temp_files(out) == []

    assert demo(out, "--steps", "2", "--no-profile") == 0
    assert "skipping training" in capsys.readouterr().out
    assert json.loads((out / "results.json").read_text())["serve"]["prompts"] == 6

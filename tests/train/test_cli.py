"""`deltamoe train` as a user runs it: a subprocess of `python -m deltamoe`."""

import json
import subprocess
import sys

import pytest

from deltamoe.train.metrics import read_jsonl


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "deltamoe", "train", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def test_tiny_preset_two_steps(tmp_path):
    run_file = tmp_path / "run.toml"
    run_file.write_text('[data]\neval_rows = 2\nnum_pairs = 4\nnum_queries = 2\n[optim]\nlr = 0.5\n')
    out = tmp_path / "run"
    proc = run_cli("--preset", "tiny", "--steps", "2", "--batch-size", "2", "--seq-len", "24", "--task", "recall",
                   "--config", str(run_file), "--lr", "1e-3", "--out", str(out), "--no-progress", "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    saved = json.loads((out / "train_config.json").read_text())
    assert saved["optim"]["lr"] == 1e-3 and saved["data"]["eval_rows"] == 2  # flag beats file; file beats default
    assert (out / "model" / "config.json").exists() and (out / "curves.png").exists()


@pytest.mark.parametrize("args, needle", [
    (["--steps", "0"], "run.steps: expected a positive integer, got 0"),
    (["--data", "/no/such/corpus.jsonl"], "/no/such/corpus.jsonl"),
    (["--preset", "huge"], "unknown preset 'huge'"),
    (["--profile-steps", "4"], "run.profile_steps"),
    (["--batch-size", "3", "--dp", "2"], "data.batch_size"),
    (["--lr", "inf"], "optim.lr: expected a finite number in (0.0, inf)"),
    (["--steps", "3", "--profile-steps", "5:7"], "run.profile_steps: expected a window that starts by the last step"),
    # One process runs its batch in one forward: microbatches only scaled the balance gradient down.
    (["--microbatches", "4"], "microbatches: expected 1 on one process, got 4"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, needle):
    from deltamoe.cli import main

    assert main(["train", *args, "--out", str(tmp_path / "run")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0]
    assert not (tmp_path / "run").exists()  # nothing written before the input was checked


def test_bad_input_exit_code_from_the_shell(tmp_path):
    proc = run_cli("--data", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "run"))
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"error: data.path: data file {tmp_path / 'missing.txt'} does not exist")


def test_task_mixture_is_accepted_and_unknown_parts_name_the_field() -> None:
    from deltamoe.errors import ConfigError
    from deltamoe.train.config import TrainConfig

    cfg = TrainConfig.from_dict({"model": {"preset": "tiny"}, "data": {"task": "recall+arithmetic"}}).validate()
    assert cfg.data.task == "recall+arithmetic"
    with pytest.raises(ConfigError, match="recall\\+poetry") as err:
        TrainConfig.from_dict({"model": {"preset": "tiny"}, "data": {"task": "recall+poetry"}}).validate()
    assert err.value.field == "data.task"


def test_empty_out_is_refused_not_the_working_directory(tmp_path, capsys, monkeypatch):
    from deltamoe.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "--preset", "tiny", "--steps", "1", "--out", ""]) == 2
    assert capsys.readouterr().err.strip() == "error: run.out: empty path (hint: name the folder to write to)"
    assert not list(tmp_path.iterdir())

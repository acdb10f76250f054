"""`deltamoe generate` end to end in a subprocess: a saved checkpoint works, a bad path is a one-line exit 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from deltamoe.model.load import build_model
from deltamoe.model.weights import save_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, helpers):
    path = tmp_path_factory.mktemp("ckpt")
    save_checkpoint(build_model(helpers.k31_tiny(), seed=1), path)
    return path


def deltamoe(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "deltamoe", *args], capture_output=True, text=True, timeout=120, env=env)


def test_generate_prints_text(checkpoint):
    r = deltamoe("generate", str(checkpoint), "--prompt", "hi", "--max-tokens", "5", "--temperature", "0",
                 "--ignore-eos")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()


def test_generate_two_prompts_chat_mode(checkpoint, capsys):
    from deltamoe.cli import main  # in-process: the subprocess tests above cover the real entry point

    assert main(["generate", str(checkpoint), "-p", "a", "-p", "b", "--max-tokens", "3", "--seed", "1", "--chat"]) == 0
    assert capsys.readouterr().out.count("--- [") == 2


def test_bad_model_path_is_one_line_exit_2(tmp_path):
    r = deltamoe("generate", str(tmp_path / "nope"), "--prompt", "hi")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: model:")


def test_bad_sampling_field_is_exit_2(checkpoint, capsys):
    from deltamoe.cli import main

    assert main(["generate", str(checkpoint), "--prompt", "hi", "--top-p", "0"]) == 2
    assert "error: top_p:" in capsys.readouterr().err

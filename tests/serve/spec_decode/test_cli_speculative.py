"""`deltamoe generate --speculative mtp`: same greedy text as without, acceptance reported; bad K is exit 2."""

from __future__ import annotations

import pytest

from deltamoe.cli import main
from deltamoe.model.load import build_model
from deltamoe.model.weights import save_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, helpers):
    path = tmp_path_factory.mktemp("mtp_ckpt")
    save_checkpoint(build_model(helpers.k31_tiny(num_nextn_predict_layers=1), seed=1), path)
    return path


def test_generate_speculative_matches_plain(checkpoint, capsys):
    args = ["generate", str(checkpoint), "-p", "hello", "--max-tokens", "12", "--temperature", "0", "--ignore-eos",
            "--cache-memory", "8MiB"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main(args + ["--speculative", "mtp", "--num-draft-tokens", "3", "--spec-min-acceptance", "0"]) == 0
    captured = capsys.readouterr()
    assert captured.out == plain
    assert "acceptance per draft position" in captured.err


def test_bad_num_draft_tokens_is_exit_2(checkpoint, capsys):
    assert main(["generate", str(checkpoint), "-p", "x", "--speculative", "mtp", "--num-draft-tokens", "5"]) == 2
    assert "num_draft_tokens" in capsys.readouterr().err


def test_generate_counts_steps_run_plain_by_the_batch_rule(checkpoint, capsys):
    args = ["generate", str(checkpoint), "-p", "hello", "-p", "world", "--max-tokens", "10", "--temperature", "0",
            "--ignore-eos", "--cache-memory", "8MiB"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main(args + ["--speculative", "mtp", "--num-draft-tokens", "2", "--spec-min-acceptance", "0",
                        "--spec-max-batch", "2"]) == 0
    captured = capsys.readouterr()
    assert captured.out == plain
    steps = int(captured.err.split(" steps ran plain by the batch-size rule")[0].rsplit(" ", 1)[-1])
    assert steps >= 9  # both requests decode together: every step at the limit


def test_bad_spec_max_batch_is_exit_2(checkpoint, capsys):
    assert main(["generate", str(checkpoint), "-p", "x", "--speculative", "mtp", "--spec-max-batch", "-1"]) == 2
    assert "spec_max_batch" in capsys.readouterr().err

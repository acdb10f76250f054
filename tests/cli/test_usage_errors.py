"""The `deltamoe` entry point turns usage mistakes into one line on stderr and exit code 2, not a
traceback or click's four-line usage block."""

from __future__ import annotations

import pytest

from deltamoe.cli import main, usage_line


@pytest.mark.parametrize("argv, message, command", [
    (["demo", "--run-dir", "x"], "No such option: --run-dir", "deltamoe demo"),
    (["plan", "--chips", "many"], "Invalid value for '--chips'", "deltamoe plan"),
    (["no-such-command"], "No such command 'no-such-command'", "deltamoe"),
    (["info"], "Missing argument 'model'", "deltamoe info"),
    (["serve", "tiny", "--port", "99999"], "Invalid value for '--port'", "deltamoe serve"),
    (["trace", "nope"], "No such command 'nope'", "deltamoe trace"),
])
def test_usage_errors_are_one_line_with_exit_2(argv: list[str], message: str, command: str, capsys) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1, captured.err
    line = captured.err.rstrip("\n")
    assert line.startswith("error: ") and message in line
    assert line.endswith(f"(see '{command} --help')")
    assert "Usage:" not in line and "Traceback" not in line


def test_usage_line_folds_a_multi_line_message() -> None:
    assert usage_line("Got unexpected\n  extra argument (x)", "deltamoe plan") == \
        "error: Got unexpected extra argument (x) (see 'deltamoe plan --help')"
    assert usage_line("No such command 'x'.", None) == "error: No such command 'x'. (see 'deltamoe --help')"


def test_help_still_exits_0(capsys) -> None:
    assert main(["plan", "--help"]) == 0
    out = capsys.readouterr().out
    assert "Usage: deltamoe plan" in out and "--no-slo" in out


@pytest.mark.parametrize("argv, message", [
    (["generate", "tiny", "-p", "x", "--device", "bogus"], "error: device: expected cpu or cuda[:N], got 'bogus'"),
    (["generate", "tiny", "-p", "x", "--device", "meta"], "error: device: expected cpu or cuda[:N], got 'meta'"),
    (["chat", "tiny", "--device", "cuda:99"], "error: device: 'cuda:99': this torch sees"),
    (["serve", "tiny", "--device", "bogus"], "error: device: expected cpu or cuda[:N]"),
    (["serve", "tiny", "--log-level", "loud"], "error: log_level: expected one of ['critical'"),
    (["generate", "tiny", "-p", "x", "--num-draft-tokens", "2"],
     "error: num_draft_tokens: --num-draft-tokens applies only with --speculative mtp"),
    (["serve", "tiny", "--spec-max-batch", "0"], "error: spec_max_batch: --spec-max-batch applies only with"),
    (["chat", "tiny", "--spec-min-acceptance", "0.5"], "error: spec_min_acceptance: --spec-min-acceptance applies"),
    (["generate", "tiny", "-p", "x", "--no-compile", "--compile-form", "whole"],
     "error: compile_form: --compile-form applies only with --compile"),
])
def test_bad_or_unused_options_fail_before_the_model_loads(argv: list[str], message: str, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(message), err


def test_ctrl_c_exits_130_with_a_line(monkeypatch, capsys) -> None:
    """An interrupted command reports failure to the shell (typer hands the 130 back as a value)."""
    import deltamoe.plan.search as plan_search

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(plan_search, "best_plan", interrupted)
    assert main(["plan", "--model", "kimi-k3", "--hardware", "h200", "--nodes", "4"]) == 130
    assert capsys.readouterr().err.strip().endswith("interrupted")


def test_layouts_the_engine_refuses_fail_before_any_rank_starts(tmp_path, capsys) -> None:
    """Speculation with workers or a P/D role: one line, exit 2,
    before worker ranks or a transfer engine start (they printed rank tracebacks on the way down)."""
    for argv, message in [
        (["generate", "tiny", "-p", "x", "--speculative", "mtp", "--tp", "2"], "runs on one process"),
        (["serve", "tiny", "--speculative", "mtp", "--role", "prefill", "--kv-transfer", "mooncake"], "no MTP latents"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err

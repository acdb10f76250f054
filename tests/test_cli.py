"""The `deltamoe` entry point turns usage mistakes into a usage message and exit code 2, not a traceback."""

from __future__ import annotations

import pytest

from deltamoe.cli import main


@pytest.mark.parametrize("argv, message", [
    (["demo", "--run-dir", "x"], "No such option: --run-dir"),
    (["plan", "--chips", "many"], "--chips"),
    (["no-such-command"], "No such command"),
])
def test_usage_errors_exit_2_with_a_message(argv: list[str], message: str, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err

"""`deltamoe chat` keeps its session: a conversation that outgrows the context drops its oldest
exchange, a message that cannot be answered is an error line, and bad options fail before the model loads."""

from __future__ import annotations

import io

from deltamoe.cli import main

ARGS = ["--max-tokens", "4", "--temperature", "0", "--cache-memory", "1MiB"]  # 1,552 tokens of context


def test_chat_drops_the_oldest_exchange_and_survives_a_message_too_long(monkeypatch, capsys):
    lines = ["a" * 900, "b" * 800, "12+34=", "c" * 3000, "/exit"]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    assert main(["chat", "tiny", *ARGS]) in (0, None)
    out = capsys.readouterr().out
    assert out.count("(the 2 oldest messages left the context)") == 1  # for the second message
    assert "leave no room to generate" in out  # the 3000-byte message alone does not fit
    assert out.count("assistant>") == 3  # answers to the three that fit; the session went on to /exit


def test_chat_options_fail_before_the_model_loads(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["chat", "tiny", "--temperature", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "temperature" in err


def test_an_unknown_command_is_said_not_sent(monkeypatch, capsys):
    """`/foo` went to the model as a message; `//text` sends "/text"."""
    monkeypatch.setattr("sys.stdin", io.StringIO("/foo\n//path\n/exit\n"))
    assert main(["chat", "tiny", *ARGS]) in (0, None)
    out = capsys.readouterr().out
    assert "unknown command /foo (try /reset, /exit" in out
    assert out.count("assistant>") == 1  # only //path was sent

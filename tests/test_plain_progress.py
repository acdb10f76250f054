"""Progress shows as plain lines when the output is not a terminal (`deltamoe.plain_progress`)."""

from __future__ import annotations

import io

from rich.console import Console

from deltamoe.plain_progress import PlainProgress
from deltamoe.train.progress import RunProgress


def test_lines_at_most_every_interval_and_always_the_last():
    out = io.StringIO()
    bar = PlainProgress("train", 10, Console(file=out), interval=0.0)
    for step in range(1, 11):
        bar.update(step, f"loss {1 / step:.2f}")
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "train 1/10 loss 1.00" and lines[-1] == "train 10/10 loss 0.10" and len(lines) == 10

    out = io.StringIO()
    bar = PlainProgress("generate", 10, Console(file=out), interval=3600.0)
    for done in range(1, 10):
        bar.update(done, "5 tok/s")
    assert out.getvalue() == ""  # within the interval: nothing yet
    bar.close()
    assert out.getvalue().splitlines() == ["generate 9/10 5 tok/s"]  # the latest state when it ends


def test_training_progress_prints_when_redirected(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr("deltamoe.train.progress.Console", lambda stderr: Console(file=out))
    bar = RunProgress(total=3, start=0, enabled=True)
    for step in (1, 2, 3):
        bar.update(step, {"loss": 2.5, "tokens_per_s": 1000.0})
    bar.close()
    assert out.getvalue().splitlines()[-1] == "train 3/3 loss 2.5000  1,000 tok/s"

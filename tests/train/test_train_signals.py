"""`train` ends on SIGTERM (a scheduler, `timeout`, torchrun's agent) as on Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = [sys.executable, "-m", "deltamoe"]


def test_sigterm_ends_train_as_ctrl_c_does_and_names_the_checkpoint(tmp_path):
    """A scheduler's or `timeout`'s SIGTERM killed `train` at once, silently (exit -15); it now stops as
    Ctrl-C does: exit 130 and the line naming the newest checkpoint to resume from."""
    out = tmp_path / "run"
    proc = subprocess.Popen([*CLI, "train", "--preset", "tiny", "--task", "recall", "--steps", "10000",
                             "--save-every", "1", "--out", str(out), "--threads", "1"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list((out / "checkpoints").glob("step-*")):  # one checkpoint saved: training is under way
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert "training interrupted; the newest checkpoint is" in err and "--resume" in err

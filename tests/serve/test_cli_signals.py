"""`generate` ends on SIGTERM as on Ctrl-C (its cleanup runs, exit 130), and a compiler cache folder torch
cannot use is a one-line error naming its variable, not a traceback from torch._dynamo's import."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = [sys.executable, "-m", "deltamoe"]


def test_sigterm_ends_generate_as_ctrl_c_does():
    proc = subprocess.Popen([*CLI, "generate", "tiny", "-p", "hi", "--no-compile", "--max-tokens", "4000",
                             "--ignore-eos", "--threads", "1"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(8)  # past the imports and the model load: decoding
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted" in err or "aborted" in err


def test_an_unusable_compiler_cache_folder_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "afile" / "cache")}
    done = subprocess.run([*CLI, "generate", "tiny", "-p", "hi", "--no-compile", "--max-tokens", "2"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().startswith("error: TORCHINDUCTOR_CACHE_DIR: cannot create the folder")
    assert "Traceback" not in done.stderr


def test_a_cxx_that_is_not_a_compiler_is_named(tmp_path):
    """inductor takes $CXX as it is: a wrong path there, with g++ on PATH, says $CXX is the problem."""
    env = {**os.environ, "CXX": str(tmp_path / "no-such-g++")}
    done = subprocess.run([*CLI, "generate", "tiny", "-p", "hi", "--compile", "--max-tokens", "2"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().startswith("error: compile_decode: $CXX is"), done.stderr[-1000:]


def test_a_command_run_in_process_gives_the_callers_sigterm_handler_back():
    """`generate` takes SIGTERM as Ctrl-C while it runs; a program (or a test worker) that calls `main`
    in-process keeps its own handler afterwards (an inherited one kept a forked pool worker alive)."""
    from deltamoe.cli import main

    mine = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        assert main(["generate", "tiny", "-p", "x", "--max-tokens", "1", "--no-compile", "--threads", "1"]) == 0
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, mine)

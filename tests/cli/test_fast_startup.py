"""`--help` and the early errors never import torch: registration imports only the command
modules, and each command checks what a user can get wrong before it imports the model.

Each case runs in a fresh interpreter (this test process has torch loaded already); the check is
which modules got imported, not a timing, so a loaded machine cannot make it flaky.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import contextlib, io, json, socket, sys
busy = socket.socket(); busy.bind(("127.0.0.1", 0)); busy.listen()
argv = [a.replace("BUSY_PORT", str(busy.getsockname()[1])) for a in json.loads(sys.argv[1])]
from deltamoe.cli import main
err = io.StringIO()
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
    rc = main(argv)
heavy = sorted(m for m in ("torch", "deltamoe.model", "deltamoe.serve.engine.llm_engine", "uvicorn", "fastapi") if m in sys.modules)
print(json.dumps({"rc": rc, "heavy": heavy, "err": err.getvalue()}))
"""


def probe(argv: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(argv)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("argv", [["--help"], ["info", "--help"], ["serve", "--help"], ["generate", "--help"],
                                  ["chat", "--help"], ["plan", "--help"], ["bench", "--help"], ["train", "--help"],
                                  ["trace", "--help"], ["demo", "--help"]])
def test_help_imports_no_torch(argv: list[str]) -> None:
    result = probe(argv)
    assert result["rc"] == 0 and result["heavy"] == [], result


@pytest.mark.parametrize("argv, field", [
    (["serve", "tiny", "--port", "BUSY_PORT"], "port"),
    (["serve", "tiny", "--host", "no-such-host.invalid"], "host"),
    (["serve", "no-such-model"], "model"),
    (["serve", "tiny", "--cache-memory", "lots"], "cache_memory"),
    (["serve", "tiny", "--dtype", "int3"], "dtype"),
    (["generate", "no-such-model", "-p", "hi"], "model"),
    (["generate", "tiny", "-p", "hi", "--dtype", "int3"], "dtype"),
    (["chat", "no-such-model"], "model"),
    (["info", "no-such-model"], "model"),
    (["plan", "--model", "kimi-k3", "--hardware", "nope"], "hardware"),
])
def test_early_errors_are_one_line_before_torch_loads(argv: list[str], field: str) -> None:
    result = probe(argv)
    assert result["rc"] == 2 and result["heavy"] == [], result
    assert result["err"].count("\n") == 1 and result["err"].startswith(f"error: {field}: "), result["err"]

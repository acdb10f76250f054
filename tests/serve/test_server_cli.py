"""`deltamoe serve`: its flags reach the app (the HTTP side itself is tested in api/test_api*.py)."""

from __future__ import annotations

import json

import pytest
import torch

from deltamoe.cli import main
from deltamoe.model.load import build_model
from deltamoe.model.weights import save_checkpoint
from deltamoe.serve.api import server as api
from deltamoe.serve.cli import engine_threads

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


def test_serve_flags_reach_the_server(tmp_path, monkeypatch, helpers):
    save_checkpoint(build_model(helpers.k31_tiny(), seed=1), tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    seen = {}
    monkeypatch.setattr(api, "run", lambda engine, **kw: seen.update(engine=engine, **kw))
    rc = main(["serve", str(tmp_path), "--port", "8123", "--api-key", "sk-1", "--served-model-name", "kimi",
               "--max-model-len", "96", "--cache-memory", "8MiB", "--log-level", "warning", "--threads", "1"])
    assert rc == 0 and torch.get_num_threads() == 1
    assert (seen["model_name"], seen["host"], seen["port"], seen["api_key"]) == ("kimi", "127.0.0.1", 8123, "sk-1")
    assert seen["engine"].max_model_len == 96 and seen["chat_template"].source == TEMPLATE
    assert seen["log_level"] == "warning"


def test_serve_bad_flags_exit_2(capsys):
    assert main(["serve", "tiny", "--max-model-len", "0"]) == 2
    assert "max_model_len" in capsys.readouterr().err
    assert main(["serve", "tiny", "--cache-memory", "lots"]) == 2
    assert "cache_memory" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["serve", "tiny"], ["router", "--prefill", "http://127.0.0.1:1",
                                                       "--decode", "http://127.0.0.1:2"]])
def test_an_empty_api_key_variable_is_refused_not_read_as_no_key(command, monkeypatch, capsys):
    """`DELTAMOE_API_KEY=$SECRET` with SECRET unset: the option parser sees no variable, so the server
    would have started open to anyone; like an empty --api-key it is refused before anything loads."""
    monkeypatch.setenv("DELTAMOE_API_KEY", "")
    assert main(command) == 2
    assert "DELTAMOE_API_KEY" in capsys.readouterr().err
    assert main([*command, "--api-key", ""]) == 2
    assert "empty API key" in capsys.readouterr().err


def test_engine_threads_leave_a_core_for_the_front_end(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("deltamoe.threads.available_cores", lambda: 8)
    monkeypatch.setattr("deltamoe.threads.busy_cores", lambda: 0)
    assert engine_threads(None) == 7 and engine_threads(3) == 3
    monkeypatch.setattr("deltamoe.threads.available_cores", lambda: 1)
    assert engine_threads(None) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert engine_threads(None) == 4  # the user's setting stands
    with pytest.raises(Exception, match="threads"):
        engine_threads(0)


def test_async_scheduling_keeps_a_core_for_its_host_thread(monkeypatch):
    """`serve --async-scheduling` keeps one core for the front end and one for the host thread;
    `generate --async-scheduling` (build_engine) one for the host thread; given counts stand."""
    import torch

    from deltamoe.serve.cli import build_engine

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("deltamoe.threads.available_cores", lambda: 8)
    monkeypatch.setattr("deltamoe.threads.busy_cores", lambda: 0)
    assert engine_threads(None, async_scheduling=True) == 6 and engine_threads(3, async_scheduling=True) == 3
    before = torch.get_num_threads()
    try:
        for async_scheduling, want in ((True, 7), (False, 8)):
            engine = build_engine("tiny", None, "8MiB", 4, 64, "float32", "cpu", async_scheduling=async_scheduling)
            assert torch.get_num_threads() == want
            engine.shutdown()
    finally:
        torch.set_num_threads(before)
    monkeypatch.setattr("deltamoe.threads.available_cores", lambda: 2)
    assert engine_threads(None, async_scheduling=True) == 1  # never fewer than one

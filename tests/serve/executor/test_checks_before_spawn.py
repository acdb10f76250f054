"""What would fail after every rank of a --tp/--ep replica loaded its shard is refused before any
rank starts, in one line: a tokenizer that does not fit the model, a cache too small for one block
and one state slot per rank (each printed a worker's 20-line traceback after the whole load)."""

from __future__ import annotations

import pytest

from deltamoe.cli import main
from deltamoe.errors import ConfigError
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.executor.config import WorkerConfig


@pytest.fixture
def no_ranks(monkeypatch):
    def start_replica(*_, **__):
        raise AssertionError("a rank was started")

    monkeypatch.setattr("deltamoe.serve.executor.launch.start_replica", start_replica)


def test_a_bad_tokenizer_is_refused_before_the_ranks_start(no_ranks, tmp_path):
    with pytest.raises(ConfigError) as e:
        LLMEngine.from_pretrained("tiny", tokenizer=tmp_path / "missing", workers=WorkerConfig(tp=2))
    assert e.value.field == "tokenizer"


def test_a_cache_too_small_for_a_rank_is_refused_before_the_ranks_start(no_ranks, capsys):
    assert main(["generate", "tiny", "-p", "x", "--ep", "2", "--cache-memory", "1KiB", "--no-compile"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: cache_memory: 1024 bytes cannot hold one state slot")

"""The context an engine reports is the one it serves: the cache's capacity where that is less than the
model's positions; a --max-model-len past the model's positions is refused, as vLLM does."""

from __future__ import annotations

import pytest

from deltamoe.cli import main
from deltamoe.errors import ConfigError, RequestError
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams


def test_reported_limit_is_what_the_cache_holds(k31_model):
    engine = LLMEngine(k31_model, config=EngineConfig(cache_memory="32KiB", max_num_seqs=2))
    held = engine.cache.max_tokens_per_sequence()
    assert held < k31_model.config.max_position_embeddings
    assert engine.max_model_len == held
    with pytest.raises(RequestError, match=f"limit of {held} tokens"):
        engine.add_request([1] * 8, SamplingParams(max_tokens=held))
    roomy = LLMEngine(k31_model, config=EngineConfig(cache_memory="16MiB"))
    assert roomy.max_model_len == k31_model.config.max_position_embeddings


def test_max_model_len_past_the_positions_is_refused(k31_model):
    too_long = k31_model.config.max_position_embeddings + 1
    with pytest.raises(ConfigError, match="max_position_embeddings") as error:
        LLMEngine(k31_model, config=EngineConfig(cache_memory="16MiB", max_model_len=too_long))
    assert error.value.field == "max_model_len"


def test_serve_refuses_it_in_one_line_before_loading(capsys):
    assert main(["serve", "tiny", "--max-model-len", "100000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: max_model_len: 100000 is more than")

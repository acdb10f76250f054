"""`kv_cache_dtype="fp8"`: e4m3 latent / indexer-key pages with per-tile scales."""

from __future__ import annotations

import pytest
import torch

from deltamoe.config import load_preset
from deltamoe.errors import ConfigError
from deltamoe.ops.quant import FP8_DTYPE
from deltamoe.serve.engine.cache_layout import CacheLayout, fp8_tile
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams


@pytest.mark.parametrize("preset", ["kimi-k3", "kimi-k3.1-pro", "small"])
def test_fp8_pages_take_about_half_the_bytes_of_bf16(preset):
    config = load_preset(preset)
    bf16 = CacheLayout.from_config(config, dtype=torch.bfloat16)
    fp8 = CacheLayout.from_config(config, dtype=torch.bfloat16, kv_fp8=True)
    lat, idx = len(bf16.latent_layers), len(bf16.index_layers)
    assert fp8.bytes_per_token == lat * (bf16.latent_dim + bf16.latent_dim // fp8_tile(bf16.latent_dim) * 4) \
        + idx * (bf16.index_dim + bf16.index_dim // fp8_tile(bf16.index_dim) * 4)
    assert 0.5 < fp8.bytes_per_token / bf16.bytes_per_token <= 0.5625  # small: 160-wide rows, tiles of 32


def test_k3_latent_row_is_576_e4m3_values_and_nine_scales():
    assert fp8_tile(576) == 64 and fp8_tile(128) == 128 and fp8_tile(40) == 8
    config = load_preset("kimi-k3")
    layout = CacheLayout.from_config(config, kv_fp8=True)
    assert layout.bytes_per_token == 24 * (576 + 9 * 4)


def test_fp8_engine_stores_e4m3_and_greedy_stays_on_the_argmax(k31_model):
    engine = LLMEngine(k31_model, config=EngineConfig(cache_memory="8MiB", kv_cache_dtype="fp8"))
    assert engine.cache.latent.dtype == FP8_DTYPE and engine.cache.index_keys.dtype == FP8_DTYPE
    plain = LLMEngine(k31_model, config=EngineConfig(cache_memory="8MiB"))
    # fp32 model, 12-wide latent rows (3 tiles of 4) and 8-wide index keys (one tile), 2 DSA layers.
    assert engine.cache.layout.bytes_per_token == 2 * (12 + 3 * 4) + 2 * (8 + 4)
    assert plain.cache.layout.bytes_per_token == 2 * 12 * 4 + 2 * 8 * 4
    prompts = [[5, 17, 33, 2 + i, 90, 41, 7, 8, 9, 10, 11, 12] for i in range(3)]  # > index_topk: sparse DSA
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    got = engine.generate(prompts, params, progress=False)
    with torch.no_grad():
        for prompt, c in zip(prompts, got):
            ids = torch.tensor([prompt + c.token_ids])
            logits = k31_model(ids).logits[0, len(prompt) - 1:-1]  # full precision, no cache
            chosen = logits.gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
            # Each fp8 pick is the full-precision argmax or within fp8 noise of it.
            assert (logits.max(-1).values - chosen).max() < 0.05 * logits.abs().max()
    exact = [c.token_ids for c in plain.generate(prompts, params, progress=False)]
    agree = sum(a == b for x, y in zip(exact, [c.token_ids for c in got]) for a, b in zip(x, y))
    assert agree >= 0.8 * 36


def test_kv_cache_dtype_is_checked():
    with pytest.raises(ConfigError, match="auto or fp8") as e:
        EngineConfig(kv_cache_dtype="int8")
    assert e.value.field == "kv_cache_dtype"


# Parts (attention / FFN regions) is the default compile form; whole layers and the whole-call graph
# compile the same fp8 reads and writes, each a minute more of compiling on two cores.
@pytest.mark.parametrize("form", ["parts", pytest.param("layers", marks=pytest.mark.slow),
                                  pytest.param("whole", marks=pytest.mark.slow)])
def test_compiled_decode_over_fp8_pages_equals_eager(form, helpers):
    """The compiled regions quantise each new row and dequantise the rows they read as the eager
    view does (`LayerCacheView`): greedy tokens equal the eager fp8 engine's, in a batch with
    contexts beyond DSA's top-k."""
    from deltamoe.model.load import build_model
    from deltamoe.serve.engine import compiled_decode

    if not compiled_decode.compiler_available():
        pytest.skip("torch.compile's CPU kernels need a C++ compiler")
    model = build_model(helpers.k31_tiny(num_hidden_layers=2, layer_types=("kda", "dsa")), seed=3).eval()
    prompts = helpers.prompts(6, 2, 30, seed=31)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def run(**compiled):
        engine = LLMEngine(model, config=EngineConfig(cache_memory="16MiB", kv_cache_dtype="fp8", **compiled))
        assert engine.cache.latent.dtype == FP8_DTYPE and engine.runner.compiles_decode == bool(compiled)
        return [c.token_ids for c in engine.generate(prompts, params, progress=False)]

    assert run(compile_decode=True, compile_form=form) == run()

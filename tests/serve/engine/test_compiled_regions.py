"""The regional form of compiled decode, checked without compiling: `LayerCacheView` against the
batch view it slices, and the keys that decide which layers share a region's graph.

With `_compile` swapped for the identity, `decode_form(model, key)` runs every region eagerly over
its layer's `LayerCacheView`: the logits and every cache tensor afterwards must equal the plain
eager call over the `PagedBatchView` (test_compiled_decode.py checks the compiled regions).
"""

from __future__ import annotations

import pytest
import torch

from deltamoe.model.load import build_model
from deltamoe.serve.engine import compiled_decode
from deltamoe.serve.engine.cache_view import PagedBatchView
from deltamoe.serve.engine.compiled_regions import region_key
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams


@pytest.mark.parametrize("form", ["parts", "layers"])
def test_layer_views_give_the_batch_views_logits_and_cache(form, helpers, monkeypatch):
    config = helpers.k31_tiny(num_hidden_layers=4, layer_types=("kda", "dsa", "kda", "dsa"))
    model = build_model(config, seed=7).eval()
    engine = LLMEngine(model, config=EngineConfig(cache_memory="16MiB"))
    for p in helpers.prompts(3, 5, 30, seed=8):  # contexts below and above DSA's top-k
        engine.add_request(p, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    seqs = engine.scheduler.running
    while not (len(seqs) == 3 and all(s.num_computed == len(s.token_ids) - 1 for s in seqs)):
        engine.step()
    seqs = list(seqs)
    cache = engine.cache
    tensors = (cache.conv, cache.recurrent, cache.latent, cache.index_keys)
    saved = [t.clone() for t in tensors]
    monkeypatch.setattr(compiled_decode, "compile_for_decode", lambda fn: fn)
    regions = compiled_decode.decode_form(model, "key", form)

    @torch.inference_mode()
    def step(fn):
        for t, s in zip(tensors, saved):
            t.copy_(s)
        view = PagedBatchView(cache, [s.block_table for s in seqs], [s.num_computed for s in seqs],
                              [s.slot for s in seqs], 1, min_table_width=2, slice_consecutive=False)
        logits = fn(torch.tensor([[s.token_ids[-1]] for s in seqs]), view)
        return logits, [t.clone() for t in tensors]

    eager_form = compiled_decode.decode_form(model)  # the same static expert form, no regions
    want, want_cache = step(lambda i, v: eager_form(i, cache=v, logits_to_keep=1).logits)
    got, got_cache = step(lambda i, v: regions(i, cache=v, logits_to_keep=1).logits)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, w in zip(got_cache, want_cache):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert any(not torch.equal(g, s) for g, s in zip(got_cache, saved))  # the step did write


def test_layers_of_one_kind_share_a_region_key(helpers):
    config = helpers.k31_tiny(num_hidden_layers=4, layer_types=("kda", "dsa", "kda", "dsa"))
    model = build_model(config, seed=7).eval()
    layers = model.model.layers
    attn = [region_key("m", layer.self_attn) for layer in layers[:4]]
    assert attn[0] == attn[2] and attn[1] == attn[3] and attn[0] != attn[1]  # KDA, DSA
    assert region_key("other model", layers[0].self_attn) != attn[0]
    ffn = [region_key("m", layer.block_sparse_moe if layer.is_moe else layer.mlp) for layer in layers[:4]]
    assert ffn[1] == ffn[2] == ffn[3] and ffn[0] != ffn[1]  # dense first layer, then MoE


def test_a_row_run_twice_leaves_the_cache_and_logits_of_the_row_alone(helpers):
    """`CompiledDecode.with_min_rows`: a one-row decode call runs as two copies of the row (the
    traced form run eagerly here); its logits and every cache tensor afterwards equal the call of
    the row alone (up to rounding)."""
    config = helpers.k31_tiny(num_hidden_layers=2, layer_types=("kda", "dsa"))
    model = build_model(config, seed=7).eval()
    engine = LLMEngine(model, config=EngineConfig(cache_memory="16MiB", compile_decode=True))
    runner = engine.runner
    runner._compiled_decode = compiled_decode.CompiledDecode(model, form="whole")
    runner._compiled_decode._call = compiled_decode._decode_call
    engine.add_request(helpers.prompts(1, 30, 30, seed=3)[0], SamplingParams(max_tokens=4, temperature=0.0))
    seq, tensors, saved = helpers.step_until_decode(engine)
    (_, call), = runner.plan(engine.scheduler.schedule())
    assert call.compiled and len(call.counts) == 1

    def step(min_rows: int):
        for t, s in zip(tensors, saved):
            t.copy_(s)
        runner._compiled_decode.min_rows = min_rows
        with torch.inference_mode():
            return runner.forward(call), [t.clone() for t in tensors]

    want, want_cache = step(1)
    got, got_cache = step(2)
    assert got.shape == want.shape == (1, config.vocab_size)
    # Equal up to rounding: a matmul of two rows may sum in another order than one of one row.
    torch.testing.assert_close(got, want)
    for g, w in zip(got_cache, want_cache):
        torch.testing.assert_close(g, w)
    assert any(not torch.equal(g, s) for g, s in zip(got_cache, saved))  # the step did write


def test_engine_config_picks_the_compiled_form(helpers, monkeypatch):
    """`EngineConfig.compile_form` (`--compile-form`) reaches the runner's compiled call; greedy tokens
    through the whole-layer form (traced code run eagerly here) equal the eager engine's."""
    from deltamoe.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        EngineConfig(cache_memory="16MiB", compile_decode=True, compile_form="layer")
    assert err.value.field == "compile_form"
    config = helpers.k31_tiny(num_hidden_layers=2, layer_types=("kda", "dsa"))
    model = build_model(config, seed=7).eval()
    monkeypatch.setattr(compiled_decode, "compile_for_decode", lambda fn: fn)
    prompts = helpers.prompts(3, 5, 30, seed=4)

    def run(**kw) -> tuple[LLMEngine, list[list[int]]]:
        engine = LLMEngine(model, config=EngineConfig(cache_memory="16MiB", **kw))
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        return engine, [c.token_ids for c in engine.generate(prompts, params, progress=False)]

    layers, got = run(compile_decode=True, compile_form="layers")
    assert layers.runner._compiled_decode.form == "layers"
    assert got == run()[1]


def test_batch_one_rows_follow_the_expert_stack(helpers, monkeypatch):
    """`CompiledDecode(form="layers")` runs batch 1 as the first all-experts batch's rows where the
    expert stack is small (`tiny`: 16 experts of 64 x 96, all experts from 4 rows), so the
    gathered-experts graphs are never built; many small experts (64 experts, top-2: from 32 rows)
    keep two rows, and so does a dense model. A large stack (`small`'s 64 experts of 256 x 256)
    runs batch 1 as one row in every form (a copy would gather its experts again). The attention +
    FFN form keeps two rows for small stacks; the whole call always one."""
    from deltamoe.config import load_preset

    monkeypatch.setattr(compiled_decode, "probe_vector_isa_once", lambda: None)  # no compiles here

    def min_rows(config, form="layers") -> int:
        return compiled_decode.CompiledDecode(build_model(config, seed=0).eval(), form=form).min_rows

    tiny = load_preset("tiny")
    assert min_rows(tiny) == 4
    assert min_rows(tiny, "parts") == 2
    small_like = load_preset("small").replace(num_hidden_layers=2, layer_types=("kda", "kda"))
    assert min_rows(small_like) == min_rows(small_like, "parts") == min_rows(small_like, "whole") == 1
    assert compiled_decode.largest_expert_stack_bytes(build_model(small_like, seed=0)) > \
        compiled_decode.SMALL_EXPERT_STACK_BYTES
    assert min_rows(tiny, "whole") == 1
    assert min_rows(helpers.k31_tiny(num_experts=64, num_experts_per_token=2)) == 2
    assert min_rows(helpers.k31_tiny(num_experts=0, first_k_dense_replace=4)) == 2

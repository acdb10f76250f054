"""`LLMEngine.warm_up` reaches every decode graph class through the scheduler and leaves no trace.

The compiled regions run eagerly here (`_compile` is the identity), so no compile runs: what is checked is
which decode calls the warm-up's made-up requests make (the experts' form of their rows) and
that the engine afterwards is the engine before. `test_compiled_decode.py` checks, with real
compiles, that traffic after a warm-up never compiles again.
"""

from __future__ import annotations

import pytest
import torch

from deltamoe.model.load import build_model
from deltamoe.config import load_preset
from deltamoe.ops.moe import static_expert_form
from deltamoe.serve.engine import compiled_decode
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not compiled_decode.compiler_available(),
                                reason="an engine with compile_decode needs a C++ compiler")


@pytest.fixture(scope="module")
def model(helpers):
    """8 experts, top-2 (the all-experts form from 4 rows), DSA top-k 8, 16-token blocks."""
    config = helpers.k31_tiny(num_hidden_layers=2, layer_types=("kda", "dsa"), num_experts=8)
    return build_model(config, seed=4).eval()


def engine_recording_decodes(model, monkeypatch, **config) -> tuple[LLMEngine, list[tuple]]:
    """An engine whose compiled regions run eagerly and whose decode calls are recorded as graph
    classes: the experts' form of the rows a call runs (a batch of one runs as `min_rows` rows;
    contexts and page layouts share a graph)."""
    monkeypatch.setattr(compiled_decode, "compile_for_decode", lambda fn: fn)
    engine = LLMEngine(model, config=EngineConfig(cache_memory="16MiB", compile_decode=True, **config))
    runner, cfg = engine.runner, model.config
    seen: list[tuple] = []
    forward = runner.forward

    def recording(call):
        if call.compiled:
            rows = max(len(call.counts), runner._compiled_decode.min_rows)
            seen.append(("batch", static_expert_form(rows, cfg.num_experts_per_token, cfg.num_experts, cfg.expert_dim,
                                                     cfg.moe_intermediate_size)))
        return forward(call)

    runner.forward = recording
    return engine, seen


def engine_state(engine: LLMEngine) -> tuple:
    """What a warm-up must leave as it found: statistics, free blocks and slots in hand-out order,
    prefix cache and snapshots, and the ids and seeds the next request gets."""
    cache = engine.cache
    probe = engine.make_sequence([1, 2, 3])  # draws the next id and seed without queueing anything
    return (engine.stats(), cache.blocks.free_order(), cache.slots.free_order(), dict(cache.blocks.hash_to_block),
            dict(cache.slots.snapshots), probe.request_id, probe.generator.initial_seed())


# The classes a form's decode calls meet: attention + FFN regions run batches on both sides of the
# experts' switch (batch 1 as two rows); whole layers over this small expert stack run batch 1 as
# four rows, so every call takes the all-experts form (the sorted form pays only for far more rows).
@pytest.mark.parametrize("form, classes", [("parts", {("batch", "gather"), ("batch", "all")}),
                                           ("layers", {("batch", "all")})])
def test_warm_up_reaches_every_class_and_leaves_no_trace(form, classes, model, monkeypatch):
    engine, seen = engine_recording_decodes(model, monkeypatch, compile_form=form)
    fresh, _ = engine_recording_decodes(model, monkeypatch, compile_form=form)
    engine.warm_up()
    assert set(seen) == classes
    assert engine_state(engine) == engine_state(fresh)
    assert not engine.has_unfinished()
    # And the engine serves as a fresh one does.
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7], list(range(20, 60))]
    assert ([c.token_ids for c in engine.generate(prompts, params, progress=False)]
            == [c.token_ids for c in fresh.generate(prompts, params, progress=False)])


@pytest.mark.parametrize("form, classes", [("parts", {("batch", "gather")}), ("layers", {("batch", "all")})])
def test_warm_up_plans_only_classes_the_limits_allow(form, classes, model, monkeypatch):
    """One sequence at a time: no batches, only batch 1's class (two rows in parts, four in layers)."""
    engine, seen = engine_recording_decodes(model, monkeypatch, max_num_seqs=1, compile_form=form)
    forgotten = []  # the per-rank step times a multi-worker server reports start after the warm-up
    monkeypatch.setattr(engine.executor, "forget_stats", lambda: forgotten.append(True))
    engine.warm_up()
    assert set(seen) == classes and forgotten == [True]


def test_warm_up_plans_the_sorted_experts_class():
    """`small` (64 experts of 256 x 256, top-8): gathered below 8 rows, sorted from 8 (all experts
    would multiply 8x the selected pairs' work); no all-experts class between them."""
    cfg = load_preset("small")
    rounds = compiled_decode.warm_up_rounds(cfg, max_num_seqs=64, max_context=4096)
    assert [r.graph for r in rounds] == ["batch 1", "batch 2", "batch 8"]
    assert [static_expert_form(n, 8, 64, cfg.expert_dim, cfg.moe_intermediate_size) for n in (7, 8, 64)] == \
        ["gather", "sorted", "sorted"]


@pytest.mark.parametrize("threads, first_sorted", [(1, 19), (2, 37)])
def test_warm_up_plans_int4_stacks_by_their_own_budget(threads, first_sorted, monkeypatch):
    """Int4 stacks take every expert at once for more rows than full precision does, the more
    the more threads share the joint kernel calls (`ops.int4_experts.all_experts_budget`):
    `small` int4 runs 8 rows and on over every expert, the loop from 19 rows on one thread, 37 on two."""
    from deltamoe.ops import int4_experts

    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    cfg = load_preset("small")
    budget = int4_experts.all_experts_budget()
    assert budget == threads * int4_experts.ALL_EXPERTS_EXTRA_MACS_PER_EXPERT_PER_THREAD
    rounds = compiled_decode.warm_up_rounds(cfg, max_num_seqs=64, max_context=4096, extra_macs_per_expert=budget)
    assert [r.graph for r in rounds] == ["batch 1", "batch 2", "batch 8", f"batch {first_sorted}"]
    assert [static_expert_form(n, 8, 64, cfg.expert_dim, cfg.moe_intermediate_size, budget)
            for n in (8, first_sorted - 1, first_sorted)] == ["all", "all", "sorted"]


def test_warm_up_refuses_a_busy_engine(model, monkeypatch):
    engine, _ = engine_recording_decodes(model, monkeypatch)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.warm_up()

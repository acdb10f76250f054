"""`LLMEngine.warm_up` with `--compile --speculative mtp` compiles every graph class of the compiled
verification and MTP regions before traffic (`spec_decode.runner.verification_warm_up_rounds`).

A call's graph class, as torch tells them apart (written out here, not read from the code under test):
torch specialises size 1 (one row; one position), the MTP layer's MLA attention absorbs up to
`ABSORB_MAX_TOKENS` new positions and expands past them, and the MoE takes one form per row count
(`ops.moe.static_expert_form`). The fast tests check the planned shapes against every shape's class,
and run the regions eagerly (`compile_for_decode` the identity) to compare the classes the warm-up
and a workload meet; the slow one compiles for real and counts graphs.
"""

from __future__ import annotations

import random

import pytest
import torch

from deltamoe.config import load_preset
from deltamoe.model.load import build_model
from deltamoe.model.mla_layer import ABSORB_MAX_TOKENS
from deltamoe.ops.moe import static_expert_form
from deltamoe.serve.engine import compiled_decode
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.serve.spec_decode import compiled_draft, compiled_verify
from deltamoe.serve.spec_decode.compiled_draft import CompiledDraft
from deltamoe.serve.spec_decode.compiled_verify import CompiledVerify
from deltamoe.serve.spec_decode.runner import verification_warm_up_rounds

pytestmark = pytest.mark.skipif(not compiled_decode.compiler_available(),
                                reason="an engine with compile_decode needs a C++ compiler")

# A small server: 4 sequences, 32 tokens a step (so a long prompt's later chunks, catch-ups of more
# than ABSORB_MAX_TOKENS positions, run through the compiled MTP region).
LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=32)


def form(config, rows: int) -> str:
    return static_expert_form(rows, config.num_experts_per_token, config.num_experts, config.expert_dim,
                              config.moe_intermediate_size)


def graph_class(config, kind: str, rows: int, positions: int) -> tuple:
    if kind == "verification":  # trunk regions, T = K + 1 fixed
        return kind, rows == 1, form(config, rows * positions)
    return kind, rows == 1, positions == 1, positions <= ABSORB_MAX_TOKENS, form(config, rows * positions)


@pytest.fixture(scope="module")
def mtp_model(helpers):
    return build_model(helpers.k31_tiny(num_nextn_predict_layers=1), seed=3).eval()


def speculative_engine(model, k: int, **overrides) -> LLMEngine:
    config = dict(cache_memory="16MiB", compile_decode=True, speculative="mtp", num_draft_tokens=k, **LIMITS)
    config.update(overrides)
    return LLMEngine(model, config=EngineConfig(**config))


def recording_classes(monkeypatch, config) -> list[tuple]:
    """Every compiled speculative call from now on, as its graph class."""
    seen: list[tuple] = []
    verify, draft = CompiledVerify.__call__, CompiledDraft.__call__

    def verify_call(self, ids, view):
        seen.append(graph_class(config, "verification", *ids.shape))
        return verify(self, ids, view)

    def draft_call(self, hidden, next_embeds, view):
        seen.append(graph_class(config, "draft", *hidden.shape[:2]))
        return draft(self, hidden, next_embeds, view)

    monkeypatch.setattr(CompiledVerify, "__call__", verify_call)
    monkeypatch.setattr(CompiledDraft, "__call__", draft_call)
    return seen


def workload(engine: LLMEngine, seed: int = 0) -> None:
    """Concurrent requests of every batch size up to the limit, greedy and sampled: short prompts,
    and long ones whose later prefill chunks catch the MTP layer up over a whole chunk."""
    rng = random.Random(seed)
    for n in range(1, engine.config.max_num_seqs + 1):
        for temperature in (0.0, 0.8):
            for _ in range(n):
                length = rng.choice([rng.randrange(1, 20), rng.randrange(20, 100)])
                engine.add_request([rng.randrange(1, 250) for _ in range(length)],
                                   SamplingParams(max_tokens=rng.randrange(8, 24), temperature=temperature,
                                                  ignore_eos=True, seed=rng.randrange(100) if temperature else None))
            while engine.has_unfinished():
                engine.step()
    engine.generate([list(range(1, 101))], SamplingParams(max_tokens=4, ignore_eos=True), progress=False)


@pytest.mark.parametrize("preset", ["test", "tiny", "small"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_shapes_cover_every_class_once(preset, k, helpers):
    """The planned shapes meet every graph class that verifications of 1 .. 16 rows (K + 1 positions
    each) and MTP calls of 1 .. 16 rows of 1 .. 299 positions meet, each class once and by its
    smallest call. `test`: 4 experts, top-2 (gathered at 1 row, all experts after); `tiny`: 16,
    top-4 (gathered up to 3 rows, sorted from 38); `small`: 64, top-8 (gathered up to 7, sorted from 8)."""
    config = helpers.k31_tiny(num_nextn_predict_layers=1) if preset == "test" else load_preset(preset)
    batches = compiled_verify.verification_batches(config, k, 16)
    planned = [graph_class(config, "verification", b, k + 1) for b in batches]
    every = {graph_class(config, "verification", b, k + 1): b for b in range(16, 0, -1)}  # smallest last
    assert len(planned) == len(set(planned)) and set(planned) == set(every)
    assert batches == sorted(every.values())

    shapes = compiled_draft.draft_shapes(config, 16, lambda b: 299)
    planned = [graph_class(config, "draft", b, t) for b, t in shapes]
    smallest: dict[tuple, tuple[int, int]] = {}
    for b in range(1, 17):
        for t in range(1, 300):
            key = graph_class(config, "draft", b, t)
            if key not in smallest or (b * t, b) < (smallest[key][0] * smallest[key][1], smallest[key][0]):
                smallest[key] = (b, t)
    assert len(planned) == len(set(planned)) and set(planned) == set(smallest)
    assert sorted(shapes) == sorted(smallest.values())


@pytest.mark.parametrize("k", [1, 2, 3])
def test_warm_up_reaches_every_class_a_speculative_workload_meets(k, mtp_model, monkeypatch):
    """Regions eager: the warm-up's calls go through the compiled call sites and reach every class
    that a workload of greedy and sampled requests, batches 1 .. 4, long prompts included, meets
    afterwards; the engine then serves as a fresh one does."""
    for module in (compiled_decode, compiled_verify, compiled_draft):
        monkeypatch.setattr(module, "compile_for_decode", lambda fn: fn)
    engine = speculative_engine(mtp_model, k)
    seen = recording_classes(monkeypatch, mtp_model.config)
    engine.warm_up()
    warmed = set(seen)
    planned = {graph_class(mtp_model.config, c.kind, c.rows, c.positions)
               for c in verification_warm_up_rounds(engine.runner, engine.max_model_len)}
    # Verifications at batch 1 and 2; MTP calls of 1 x 1, 2 x 1, 1 x 2, 2 x 2, 1 x 17 and 2 x 17 positions.
    assert len(planned) == 8
    assert planned <= warmed
    stats = engine.stats()
    assert (stats.requests_finished, stats.generation_tokens_total, stats.num_free_blocks) == (0, 0, stats.num_blocks)
    del seen[:]
    workload(engine)
    assert engine.runner.tracker.verifications > 0
    assert ("draft", True, False, False, "all") in seen  # a long prompt's chunk: > ABSORB_MAX_TOKENS positions
    assert set(seen) <= warmed, f"met after the warm-up: {set(seen) - warmed}"
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7], list(range(20, 60))]
    assert ([c.token_ids for c in engine.generate(prompts, params, progress=False)]
            == [c.token_ids for c in speculative_engine(mtp_model, k).generate(prompts, params, progress=False)])


@pytest.mark.slow
def test_speculative_traffic_compiles_nothing_after_warm_up(mtp_model):
    """Real compiles (a few minutes on two cores): after `warm_up`, a speculative workload (K = 2)
    compiles no graph, and torch would raise on any recompile."""
    engine = speculative_engine(mtp_model, 2)
    engine.warm_up()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch.compiler.set_stance("fail_on_recompile"):
        workload(engine, seed=1)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == before
    assert engine.runner.tracker.verifications > 0

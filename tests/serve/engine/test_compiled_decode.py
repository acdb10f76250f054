"""The compiled decode graph (`EngineConfig.compile_decode`) gives the eager engine's results.

Greedy tokens are held to plain greedy decoding of each prompt alone (the same oracle as the
eager engine's contract tests), for a prompt alone and in a batch, on the K3.1-shaped model (KDA,
DSA with contexts beyond its top-k, latent MoE, AttnRes) and the Kimi Linear one (dense MLA).
"""

from __future__ import annotations

import pytest
import torch

from deltamoe.errors import ConfigError
from deltamoe.model.load import build_model
from deltamoe.serve.engine import compiled_decode
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not compiled_decode.compiler_available(),
                                reason="torch.compile's CPU kernels need a C++ compiler")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(helpers):
    """Two layers of each kind keep the compile time down (each graph compiles in seconds)."""
    return {"k31": build_model(helpers.k31_tiny(num_hidden_layers=2, layer_types=("kda", "dsa")), seed=3).eval(),
            "kimi_linear": build_model(helpers.kimi_linear_tiny(num_hidden_layers=2, layer_types=("kda", "mla")),
                                       seed=5).eval()}


# Compiled kernels sum in another order than eager ones (vectorised reductions, fused matmuls), so
# logits differ at the 1e-6 level: greedy tokens must match the reference wherever its top two
# logits are further apart than this, and may part ways only after a closer call.
NEAR_TIE = 1e-4


@torch.inference_mode()
def reference_with_margins(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Plain greedy decoding (ContiguousCache) and, per token, the gap between its top two logits."""
    from deltamoe.model.cache import ContiguousCache

    cache = ContiguousCache(model.config, batch_size=1, max_length=len(prompt) + max_tokens)
    logits = model(torch.tensor([prompt]), cache=cache).logits[0, -1]
    tokens, margins = [], []
    for _ in range(max_tokens):
        top = torch.topk(logits.float(), 2).values
        tokens.append(int(torch.argmax(logits)))
        margins.append(float(top[0] - top[1]))
        logits = model(torch.tensor([[tokens[-1]]]), cache=cache).logits[0, -1]
    return tokens, margins


def assert_greedy_matches(model, prompts: list[list[int]], outputs: list[list[int]]) -> None:
    for prompt, out in zip(prompts, outputs, strict=True):
        want, margins = reference_with_margins(model, prompt, len(out))
        checked = next((i + 1 for i, m in enumerate(margins) if m < NEAR_TIE), len(want))
        assert out[:checked] == want[:checked], (prompt, out, want, margins)


def generate(model, prompts: list[list[int]]) -> list[list[int]]:
    engine = LLMEngine(model, config=EngineConfig(cache_memory="16MiB", compile_decode=True))
    return [c.token_ids for c in engine.generate(prompts, GREEDY, progress=False)]


@pytest.mark.parametrize("name", ["k31", "kimi_linear"])
def test_compiled_decode_equals_greedy_alone(name, models, helpers):
    model = models[name]
    prompts = helpers.prompts(6, 2, 30, seed=31)  # up to 42 tokens of context: beyond DSA's top-k of 8
    assert_greedy_matches(model, prompts[:1], generate(model, prompts[:1]))  # batch 1: runs as two rows
    assert_greedy_matches(model, prompts, generate(model, prompts))


def test_multi_step_windows_run_the_same_graphs(models, helpers):
    """Multi-step decode (`num_scheduler_steps`) feeds each window's sampled tokens back into the same
    compiled regions: after the engine ran the prompts one step at a time, its windows compile nothing
    (torch would raise under `fail_on_recompile`), and give the same tokens, held to the greedy oracle too."""
    model, prompts = models["k31"], helpers.prompts(5, 2, 30, seed=33)
    engine = LLMEngine(model, config=EngineConfig(cache_memory="16MiB", compile_decode=True, num_scheduler_steps=4))
    windows, engine.multi_step = engine.multi_step, None  # one step at a time first: it compiles the graphs
    one_step = [c.token_ids for c in engine.generate(prompts, GREEDY, progress=False)]
    engine.multi_step = windows
    with torch.compiler.set_stance("fail_on_recompile"):
        windowed = [c.token_ids for c in engine.generate(prompts, GREEDY, progress=False)]
    assert engine.multi_step.windows > 0
    assert windowed == one_step
    assert_greedy_matches(model, prompts, windowed)


def test_two_models_never_share_a_graph(models, helpers):
    """Torch keeps graphs per code object and the module guards are skipped; the per-model key
    keeps one model from running the other's graph (other layers, other weights)."""
    prompts = helpers.prompts(3, 5, 20, seed=32)
    for name in ("k31", "kimi_linear", "k31"):
        model = models[name]
        assert_greedy_matches(model, prompts, generate(model, prompts))


def test_compile_decode_refuses_what_it_cannot_run(models, monkeypatch, helpers):
    training = build_model(helpers.k31_tiny(), seed=1)  # build_model leaves train mode on
    with pytest.raises(ConfigError, match="eval mode"):
        LLMEngine(training, config=EngineConfig(compile_decode=True))
    monkeypatch.setattr(compiled_decode, "compiler_available", lambda: False)
    with pytest.raises(ConfigError, match="C\\+\\+ compiler"):
        LLMEngine(models["k31"], config=EngineConfig(compile_decode=True))


def test_eager_and_compiled_logits_agree(models, helpers):
    """Beyond argmax: one decode step's logits, eager and compiled, from the same cache contents."""
    from deltamoe.serve.engine.cache_view import PagedBatchView

    model = models["k31"]
    engine = LLMEngine(model, config=EngineConfig(cache_memory="16MiB", compile_decode=True))
    for p in helpers.prompts(4, 10, 25, seed=33):
        engine.add_request(p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    seqs = engine.scheduler.running
    while not (len(seqs) == 4 and all(s.num_computed == len(s.token_ids) - 1 for s in seqs)):
        engine.step()  # until every prompt's prefill is done (chunks stop at block boundaries)
    seqs = list(seqs)
    ids = torch.tensor([[s.token_ids[-1]] for s in seqs])
    cache = engine.cache
    saved = [t.clone() for t in (cache.conv, cache.recurrent, cache.latent, cache.index_keys)]

    @torch.inference_mode()
    def logits(fn):
        for t, s in zip((cache.conv, cache.recurrent, cache.latent, cache.index_keys), saved):
            t.copy_(s)  # a step advances the KDA states: both forms start from the same ones
        view = PagedBatchView(cache, [s.block_table for s in seqs], [s.num_computed for s in seqs],
                              [s.slot for s in seqs], 1, min_table_width=compiled_decode.CompiledDecode.min_table_width)
        return fn(ids, view)[:, -1]

    compiled = logits(engine.runner._compiled_decode)
    eager = logits(lambda i, v: model(i, cache=v, logits_to_keep=1).logits)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)


def test_warm_up_compiles_and_leaves_no_trace(models):
    engine = LLMEngine(models["kimi_linear"], config=EngineConfig(cache_memory="16MiB", compile_decode=True))
    engine.warm_up()
    stats = engine.stats()
    assert (stats.requests_finished, stats.prompt_tokens_total, stats.generation_tokens_total, stats.steps) == (0, 0, 0, 0)
    assert stats.num_free_blocks == stats.num_blocks and stats.num_snapshots == 0 and stats.prefix_query_tokens == 0


def test_generate_cli_flag(models, tmp_path, capsys):
    """`deltamoe generate --compile` (and its old spelling `--compile-decode`) prints what the eager
    engine (the default, `--no-compile`) prints."""
    from deltamoe.cli import main
    from deltamoe.model.weights import save_checkpoint

    save_checkpoint(models["kimi_linear"], tmp_path)
    args = ["generate", str(tmp_path), "-p", "hello", "--max-tokens", "6", "--temperature", "0", "--ignore-eos"]
    assert main([*args, "--no-compile"]) == 0
    eager = capsys.readouterr().out
    for flag in (["--compile"], ["--compile-decode"]):
        assert main([*args, *flag]) == 0
        assert capsys.readouterr().out == eager


def scatter_free_blocks(engine: LLMEngine, seed: int = 0) -> None:
    """The pool's free blocks in random order, as a long-running server's: a new sequence's blocks
    are then scattered and can no longer be read as one slice."""
    blocks = engine.cache.blocks
    taken = [blocks.allocate() for _ in range(blocks.num_free)]
    for i in torch.randperm(len(taken), generator=torch.Generator().manual_seed(seed)).tolist():
        blocks.release(taken[i])


@pytest.mark.parametrize("form, graphs", [("layers", 3), pytest.param("parts", 4, marks=pytest.mark.slow)])
def test_warm_up_compiles_every_graph_traffic_meets(form, graphs, helpers):
    """After `warm_up`, traffic never compiles (torch would raise under `fail_on_recompile`): one
    sequence on consecutive and on scattered pages, batches on both sides of the experts'
    gather / all-experts switch (8 experts, top-2: from 4 rows), contexts below and above the
    DSA indexer's top-k (8), and one-token prompts. Regions are shared by the layers of their kind
    whatever their place in the AttnRes blocks (KDA and DSA layers that start a block and ones that
    do not, banks of one to three inputs): the default form, whole layers, compiles three graphs
    (the dense first layer, the KDA and the DSA layer; this small expert stack runs every batch in
    its all-experts form, batch 1 as four rows), attention + FFN regions four (KDA and DSA
    attention, the MoE in the experts' two forms; batch 1 runs as two rows); contexts and page
    layouts share the graphs."""
    config = helpers.k31_tiny(num_hidden_layers=5, layer_types=("kda", "kda", "kda", "dsa", "dsa"), num_experts=8)
    model = build_model(config, seed=4).eval()
    engine = LLMEngine(model, config=EngineConfig(cache_memory="16MiB", compile_decode=True, max_snapshots=0))
    engine.runner._compiled_decode = compiled_decode.CompiledDecode(model, form=form)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    engine.warm_up()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == graphs
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with torch.compiler.set_stance("fail_on_recompile"):
        outs = [engine.generate([[5, 6, 7]], params, progress=False)]  # one sequence, context 3 -> 15
        outs.append(engine.generate([[1, 2], [3, 4, 5]], params, progress=False))
        outs.append(engine.generate([[i, i + 1, 9] for i in range(6)], params, progress=False))
        outs.append(engine.generate([[7], [8]], params, progress=False))
        scatter_free_blocks(engine)
        outs.append(engine.generate([list(range(40, 80))], params, progress=False))  # 40 + 12 tokens, 4 blocks
    assert all(len(c.token_ids) == 12 for batch in outs for c in batch)
    assert_greedy_matches(model, [[i, i + 1, 9] for i in range(6)], [c.token_ids for c in outs[2]])


def test_a_lone_long_sequence_decodes_eagerly(models, helpers, monkeypatch):
    """A call of fewer rows than `min_rows` runs as copies of its rows, each gathering and attending
    over the whole context: once the copies' share passes `COPIES_MAX_EXTRA_VALUES` the call runs
    eagerly (the limit lowered here to a context of 24 tokens, so that a 16-token prompt crosses it
    mid-generation). Its greedy tokens still equal plain greedy decoding; a call of `min_rows`
    rows stays compiled at any context."""
    from types import SimpleNamespace

    model = models["kimi_linear"]
    engine = LLMEngine(model, config=EngineConfig(cache_memory="16MiB", compile_decode=True))
    compiled = engine.runner._compiled_decode
    assert compiled.min_rows > 1
    per_position = compiled_decode.context_values_per_position(model.config)
    assert per_position == model.config.latent_cache_dim  # one dense MLA layer
    monkeypatch.setattr(compiled_decode, "COPIES_MAX_EXTRA_VALUES", (compiled.min_rows - 1) * 24 * per_position)
    contexts = []
    call = compiled._call
    compiled._call = lambda m, key, ids, view: contexts.append(int(view.past_lengths.max()) + 1) or call(m, key, ids, view)
    prompt = helpers.prompts(1, 16, 16, seed=7)[0]
    out = [c.token_ids for c in engine.generate([prompt], GREEDY, progress=False)]
    assert contexts == list(range(17, 25))  # the decode steps at contexts 25..28 ran eagerly
    assert_greedy_matches(model, [prompt], out)

    def group(rows: int, context: int) -> list:
        return [(SimpleNamespace(num_computed=context - 1), 1)] * rows

    assert compiled.runs(group(1, 24)) and not compiled.runs(group(1, 25))
    assert compiled.runs(group(compiled.min_rows, 1 << 20))


def test_a_large_expert_stack_decodes_batch_one_as_one_row(helpers, monkeypatch):
    """Over an expert stack counted as large (`compiled_decode.copies_reread_experts`; the threshold
    lowered so that a two-layer model's stack is over it) the compiled regions run a lone sequence
    as one row, through batch-1 graphs of their own: its greedy tokens equal plain greedy decoding
    of the prompt alone, and one step's logits equal eager ones from the same cache contents.
    (Batches of two or more run the graphs they always did: the rule changes batch 1 only.)"""
    from deltamoe.serve.engine.cache_view import PagedBatchView

    monkeypatch.setattr(compiled_decode, "SMALL_EXPERT_STACK_BYTES", 0)
    config = helpers.k31_tiny(num_hidden_layers=2, layer_types=("kda", "dsa"))
    model = build_model(config, seed=11).eval()
    engine = LLMEngine(model, config=EngineConfig(cache_memory="16MiB", compile_decode=True))
    compiled = engine.runner._compiled_decode
    assert compiled.min_rows == 1
    rows = []
    call = compiled._call
    compiled._call = lambda m, key, ids, view: rows.append(ids.shape[0]) or call(m, key, ids, view)
    prompts = helpers.prompts(2, 2, 30, seed=34)
    alone = [c.token_ids for c in engine.generate(prompts[:1], GREEDY, progress=False)]
    assert set(rows) == {1}
    assert_greedy_matches(model, prompts[:1], alone)

    engine.add_request(prompts[1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    seq, tensors, saved = helpers.step_until_decode(engine)

    @torch.inference_mode()
    def logits(fn):
        for t, s in zip(tensors, saved):
            t.copy_(s)
        view = PagedBatchView(engine.cache, [seq.block_table], [seq.num_computed], [seq.slot], 1,
                              min_table_width=compiled_decode.CompiledDecode.min_table_width,
                              slice_consecutive=compiled_decode.CompiledDecode.slices_consecutive_pages)
        return fn(torch.tensor([[seq.token_ids[-1]]]), view)[:, -1]

    torch.testing.assert_close(logits(compiled), logits(lambda i, v: model(i, cache=v, logits_to_keep=1).logits),
                               rtol=1e-4, atol=1e-5)


def test_many_rows_over_many_experts_call_the_sorted_experts_op(helpers, monkeypatch):
    """Where the all-experts form would multiply more than it saves (`ops.moe.static_expert_form`; the
    budget set to 0 here so that every batch past the gathered form is such a batch), the graphs
    call the sorted experts as one opaque op: greedy tokens still equal plain greedy decoding, batched."""
    from deltamoe.ops import moe

    monkeypatch.setattr(moe, "ALL_EXPERTS_EXTRA_MACS_PER_EXPERT", 0)
    sorted_calls = []
    sorted_form = moe.experts_forward
    monkeypatch.setattr(moe, "experts_forward", lambda x, *a, **k: sorted_calls.append(x.shape[0]) or sorted_form(x, *a, **k))
    model = build_model(helpers.k31_tiny(num_hidden_layers=2, layer_types=("kda", "dsa")), seed=13).eval()
    prompts = helpers.prompts(6, 2, 30, seed=35)
    assert_greedy_matches(model, prompts, generate(model, prompts))
    assert sorted_calls and min(sorted_calls) >= 2  # only batches take it (batch 1 gathers)

"""Compiled decode of an int4 (W4A16) model: the traced forms of its projection groups and expert
stacks, and the engine's greedy output against the eager int4 engine's."""

from __future__ import annotations

import pytest
import torch

from deltamoe.errors import ConfigError
from deltamoe.model.load import build_model, load_model
from deltamoe.model.quant_scheme import make_scheme
from deltamoe.model.quantized_linear import Int4Linear
from deltamoe.model.weights import save_checkpoint
from deltamoe.ops.int4_experts import kernel_block_rows
from deltamoe.quantize.checkpoint import quantize_checkpoint
from deltamoe.serve.engine import compiled_decode
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams

pytestmark = pytest.mark.skipif(kernel_block_rows() is None, reason="no CPU int4 kernel with a known layout")

KERNEL = torch.ops.aten._weight_int4pack_mm_for_cpu.default


@pytest.fixture(scope="module")
def int4_checkpoint(helpers, tmp_path_factory):
    """A two-layer K3.1-shaped model, int4 group 32 (wide enough that its experts are quantized too)."""
    config = helpers.k31_tiny(num_hidden_layers=2, layer_types=("kda", "dsa"), hidden_size=64, num_experts=8,
                              moe_intermediate_size=32, latent_moe_size=32, first_k_dense_replace=0)
    root = tmp_path_factory.mktemp("int4")
    save_checkpoint(build_model(config, seed=6).eval(), root / "fp32")
    quantize_checkpoint(root / "fp32", root / "int4", make_scheme("int4", 32), dtype=torch.float32)
    return root / "int4"


@pytest.fixture(scope="module")
def int4_model(int4_checkpoint):
    return load_model(int4_checkpoint)


def traced(fn):
    """`fn` through dynamo (fullgraph, dynamic sizes) with a backend that keeps each FX graph and
    runs it as traced: what a compiled region holds, without compiling kernels."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(fn, backend=keep, fullgraph=True, dynamic=True), graphs


def kernel_calls(graphs) -> int:
    return sum(node.target in (KERNEL, KERNEL.overloadpacket) for gm in graphs for node in gm.graph.nodes)


@torch.inference_mode()
def test_traced_layers_hold_one_kernel_call_per_group_and_match_eager(int4_model):
    """A KDA layer's six input projections are one joint kernel call in the graph (the group's
    bookkeeping runs while tracing); the MoE reads its few rows' experts in place (no kernel call:
    `int4_experts_in_place`) beside the group of the latent down and shared expert's gate and up,
    plus the shared down and latent up."""
    twin = compiled_decode.decode_form(int4_model)
    layer = twin.model.layers[0]
    x = torch.randn(3, 1, 64, generator=torch.Generator().manual_seed(1))

    moe = layer.block_sparse_moe
    fn, graphs = traced(lambda h: moe(h))
    eager = int4_model.model.layers[0].block_sparse_moe(x)  # the eager forms: expert by expert
    torch.testing.assert_close(fn(x), eager, rtol=2**-7, atol=1e-3)
    assert kernel_calls(graphs) == 0 + 1 + 2

    def group_members(attn):
        return [m for m in attn.modules() if isinstance(m, Int4Linear) and m.group is attn.q_proj.group]

    members = group_members(layer.self_attn)
    assert len(members) >= 6
    fn, graphs = traced(lambda h: [m(h) for m in members])
    got = fn(x)
    assert kernel_calls(graphs) == 1
    for out, want in zip(got, [m(x) for m in group_members(int4_model.model.layers[0].self_attn)], strict=True):
        assert torch.equal(out, want)

@torch.inference_mode()
def test_an_int4_stacks_static_form_calls_the_loop_op_where_the_expert_form_says_sorted(int4_model):
    """`Int4ExpertStack.forward_static` follows `ops.moe.static_expert_form`: gathered or all experts
    under the budget (the kernel's joint calls in the graph), the expert-by-expert loop as one op
    (`deltamoe::int4_sorted_experts`) past it; each against the eager stack."""
    from deltamoe.ops import int4_experts, moe

    assert compiled_decode.expert_form_budget(int4_model) == int4_experts.all_experts_budget()
    assert compiled_decode.expert_form_budget(build_model(int4_model.config, seed=6)) is None  # full precision's
    stack = int4_model.model.layers[0].block_sparse_moe.experts.stack
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, stack.dim, generator=gen)
    weights, indices = moe.route_tokens(torch.randn(6, stack.num_experts, generator=gen), None, 2)
    eager = stack(x, weights, indices)
    op = torch.ops.deltamoe.int4_sorted_experts.default
    for budget, loop_calls, joint_calls in ((int4_experts.all_experts_budget(), 0, 2), (0, 1, 0)):
        fn, graphs = traced(stack.forward_static)
        got = fn(x, weights, indices, budget)
        assert sum(node.target == op for gm in graphs for node in gm.graph.nodes) == loop_calls
        assert kernel_calls(graphs) == joint_calls
        torch.testing.assert_close(got, eager, rtol=2**-7, atol=1e-3)


def test_a_batch_of_one_runs_as_one_row_over_int4_experts(int4_model, helpers, monkeypatch):
    """Regions over int4 expert stacks run batch 1 as one row (two copies would double the experts'
    gather and kernel reads), full-precision ones as two or more (this small stack: as the first
    all-experts batch's 4 rows, `rows_skipping_expert_gather`); the int4 engine's
    tokens through the regions' code (run eagerly here) equal the eager engine's."""
    monkeypatch.setattr(compiled_decode, "compile_for_decode", lambda fn: fn)
    float_model = build_model(int4_model.config, seed=6).eval()
    assert compiled_decode.CompiledDecode(float_model).min_rows == 4
    assert compiled_decode.CompiledDecode(float_model, form="parts").min_rows == 2
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = helpers.prompts(1, 5, 5, seed=8)
    outputs, rows = [], []
    for compiled in (False, True):
        engine = LLMEngine(int4_model, config=EngineConfig(cache_memory="16MiB", compile_decode=compiled))
        if compiled:
            call = engine.runner._compiled_decode
            assert call.min_rows == 1
            traced_call = call._call
            call._call = lambda model, key, ids, view: rows.append(ids.shape[0]) or traced_call(model, key, ids, view)
        outputs.append(engine.generate(prompt, params, progress=False)[0].token_ids)
    assert rows == [1] * 5 and outputs[0] == outputs[1]


def test_compiled_decode_refuses_experts_without_a_static_form(helpers, tmp_path):
    config = helpers.k31_tiny(num_hidden_layers=1, layer_types=("kda",), hidden_size=64, moe_intermediate_size=32,
                              latent_moe_size=32, first_k_dense_replace=0)
    save_checkpoint(build_model(config, seed=2).eval(), tmp_path / "fp32")
    quantize_checkpoint(tmp_path / "fp32", tmp_path / "mxfp4", make_scheme("mxfp4"), dtype=torch.float32)
    with pytest.raises(ConfigError, match="mxfp4 experts") as err:
        compiled_decode.CompiledDecode(load_model(tmp_path / "mxfp4"))
    assert err.value.field == "compile_decode"


@pytest.mark.slow
@pytest.mark.skipif(not compiled_decode.compiler_available(), reason="torch.compile's CPU kernels need a C++ compiler")
@pytest.mark.parametrize("many_rows_form", ["all", "sorted"])
def test_compiled_int4_engine_gives_the_eager_int4_engines_tokens(int4_model, helpers, monkeypatch, many_rows_form):
    """Alone (one row: graphs of its own) and in batches on both sides of the
    gather / all-experts switch (8 experts, top-2: from 4 rows); past it, every expert on every
    row or (the budget set to 0) the expert-by-expert loop as one op of the graph."""
    from deltamoe.ops import int4_experts

    if many_rows_form == "sorted":
        monkeypatch.setattr(int4_experts, "ALL_EXPERTS_EXTRA_MACS_PER_EXPERT_PER_THREAD", 0)
    torch._dynamo.reset()  # the two forms must not share graphs compiled under the other budget
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = helpers.prompts(5, 3, 20, seed=41)
    outputs = {}
    for compiled in (False, True):
        engine = LLMEngine(int4_model, config=EngineConfig(cache_memory="16MiB", compile_decode=compiled))
        outputs[compiled] = [[c.token_ids for c in engine.generate(batch, params, progress=False)]
                             for batch in (prompts[:1], prompts[:2], prompts)]
    assert outputs[True] == outputs[False]


@pytest.mark.slow
@pytest.mark.skipif(not compiled_decode.compiler_available(), reason="torch.compile's CPU kernels need a C++ compiler")
def test_a_second_start_reuses_the_int4_graphs_from_the_disk_cache(int4_checkpoint, tmp_path):
    """Two processes on one fresh inductor cache: the second loads the first's graphs (a graph
    guarded on the int4 operands' sizes could not be checked there) and prints the same tokens."""
    import os
    import subprocess
    import sys

    args = [sys.executable, "-m", "deltamoe", "generate", str(int4_checkpoint), "-p", "hello", "--max-tokens", "6",
            "--temperature", "0", "--ignore-eos", "--compile"]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "OMP_NUM_THREADS": "1"}
    runs = [subprocess.run(args, env=env, capture_output=True, text=True, timeout=900) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    assert runs[0].stdout == runs[1].stdout and runs[0].stdout.strip()

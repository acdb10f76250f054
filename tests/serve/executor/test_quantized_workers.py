"""Quantized checkpoints on a tp * ep replica: each EP rank loads and holds only its share of the packed
routed experts (read from the checkpoint's per-expert tensors), each TP rank its rows or columns of
the int4 projections (column- and row-parallel by the training plan), and greedy tokens equal one
process's for mxfp4, int4 and w4a8-fp8 (whose row-parallel shards scale activations by the whole
row's maximum); w4a8-int8's row-parallel projections are refused with --tp, naming the field."""

from __future__ import annotations

import pytest
import torch

from deltamoe.errors import ConfigError
from deltamoe.model.load import build_model
from deltamoe.model.packed_experts import PackedExperts
from deltamoe.model.quant_scheme import make_scheme
from deltamoe.model.weights import save_checkpoint
from deltamoe.quantize.checkpoint import quantize_checkpoint
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.serve.executor.config import WorkerConfig
from deltamoe.serve.executor.int4_shards import Int4LinearShard

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
FORMATS = {"mxfp4": ("mxfp4", None, None), "int4": ("int4", 32, None), "w4a8": ("w4a8", 32, "fp8"),
           "w4a8-int8": ("w4a8", 32, "int8")}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, helpers):
    # Widths that are multiples of 32 (over tp 2 too for row-parallel inputs: 2 KDA heads of 32, MLP 64),
    # so the int4 formats pack the routed experts and both kinds of TP-split projections.
    float_path = tmp_path_factory.mktemp("float")
    config = helpers.k31_tiny(moe_intermediate_size=64, latent_moe_size=32, kda_head_dim=32, v_head_dim=32,
                              intermediate_size=64, num_shared_experts=1)
    save_checkpoint(build_model(config, seed=3).eval(), float_path)
    out = {}
    for key, args in FORMATS.items():
        out[key] = str(tmp_path_factory.mktemp(key))
        quantize_checkpoint(float_path, out[key], make_scheme(*args), dtype=torch.float32)
    return out


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (20, 37, 9, 50)]


def tokens(engine: LLMEngine, prompts) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(prompts, GREEDY, progress=False)]


def packed_experts(engine: LLMEngine) -> list[PackedExperts]:
    return [m for m in engine.runner.model.modules() if isinstance(m, PackedExperts)]


@pytest.mark.parametrize("fmt, tp, ep", [("mxfp4", 1, 2), ("mxfp4", 2, 1), ("int4", 1, 2), ("int4", 2, 1),
                                         ("w4a8", 2, 1), pytest.param("w4a8", 1, 2, marks=pytest.mark.slow),
                                         pytest.param("mxfp4", 2, 2, marks=pytest.mark.slow),
                                         pytest.param("int4", 2, 2, marks=pytest.mark.slow)])
def test_quantized_checkpoint_on_workers_equals_one_process(checkpoints, prompts, fmt, tp, ep):
    one = LLMEngine.from_pretrained(checkpoints[fmt], EngineConfig(cache_memory="16MiB"))
    want, whole = tokens(one, prompts), packed_experts(one)
    engine = LLMEngine.from_pretrained(checkpoints[fmt], EngineConfig(cache_memory="16MiB"),
                                       workers=WorkerConfig(tp=tp, ep=ep))
    try:
        shares = packed_experts(engine)
        assert len(shares) == len(whole) > 0
        # rank 0 holds experts 0 .. E/ep - 1 of each layer, and that share's bytes only
        assert all(s.held == range(w.num_experts // ep) for s, w in zip(shares, whole))
        assert sum(s.resident_bytes() for s in shares) * ep == sum(w.resident_bytes() for w in whole)
        split = {m.how for m in engine.runner.model.modules() if isinstance(m, Int4LinearShard)}
        assert split == (set() if fmt == "mxfp4" or tp == 1 else {"col", "row"})
        assert tokens(engine, prompts) == want
    finally:
        engine.shutdown()
    assert all(p.poll() is not None for p in engine.executor.group.processes)


def test_row_parallel_int8_activations_are_refused_with_tp(checkpoints):
    with pytest.raises(ConfigError, match="o_proj: a row-parallel w4a8 int8 projection") as e:
        LLMEngine.from_pretrained(checkpoints["w4a8-int8"], EngineConfig(cache_memory="16MiB"),
                                  workers=WorkerConfig(tp=2))
    assert str(e.value).startswith("tp: ")  # every rank's load outcome, as one line naming the field


@pytest.mark.slow
def test_compiled_decode_over_int4_tp_equals_one_process(checkpoints, prompts):
    """The int4 shards inside every rank's compiled decode regions (the row-parallel all-reduce traced)."""
    want = tokens(LLMEngine.from_pretrained(checkpoints["int4"], EngineConfig(cache_memory="16MiB")), prompts)
    engine = LLMEngine.from_pretrained(checkpoints["int4"], EngineConfig(cache_memory="16MiB", compile_decode=True),
                                       workers=WorkerConfig(tp=2))
    try:
        assert engine.runner.compiles_decode and tokens(engine, prompts) == want
    finally:
        engine.shutdown()

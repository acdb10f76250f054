"""Quantized checkpoints on a tp * ep replica: each EP rank loads and holds only its share of the packed
routed experts (read from the checkpoint's per-expert tensors) and greedy tokens equal one process's;
mxfp4 (routed experts only, as K3 ships) also shards over --tp; int4 / w4a8 checkpoints, whose
attention and dense projections are int4-packed, are refused with --tp before any rank starts."""

from __future__ import annotations

import pytest
import torch

from deltamoe.errors import ConfigError
from deltamoe.model.load import build_model
from deltamoe.model.packed_experts import PackedExperts
from deltamoe.model.quant_scheme import make_scheme
from deltamoe.model.weights import save_checkpoint
from deltamoe.quantize.checkpoint import quantize_checkpoint
from deltamoe.serve.cli import check_workers
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.serve.executor.config import WorkerConfig

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
FORMATS = {"mxfp4": ("mxfp4", None, None), "int4": ("int4", 32, None), "w4a8": ("w4a8", 32, "fp8")}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, helpers):
    # Expert widths that are multiples of 32, so every format packs the routed experts.
    float_path = tmp_path_factory.mktemp("float")
    save_checkpoint(build_model(helpers.k31_tiny(moe_intermediate_size=64, latent_moe_size=32), seed=3).eval(),
                    float_path)
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


@pytest.mark.parametrize("fmt, tp, ep", [("mxfp4", 1, 2), ("mxfp4", 2, 1), ("int4", 1, 2), ("w4a8", 1, 2),
                                         pytest.param("mxfp4", 2, 2, marks=pytest.mark.slow)])
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
        assert tokens(engine, prompts) == want
    finally:
        engine.shutdown()
    assert all(p.poll() is not None for p in engine.executor.group.processes)


@pytest.mark.parametrize("fmt", ["int4", "w4a8"])
def test_int4_projections_are_refused_with_tp(checkpoints, fmt):
    with pytest.raises(ConfigError, match="--tp 2: this .* checkpoint packs the attention") as e:
        check_workers(checkpoints[fmt], tp=2, ep=1)  # what `serve` / `generate` check before spawning
    assert e.value.field == "tp" and "--ep" in e.value.hint
    with pytest.raises(ConfigError, match="int4-packed, which has no tensor-parallel form") as e:
        LLMEngine.from_pretrained(checkpoints[fmt], EngineConfig(cache_memory="16MiB"), workers=WorkerConfig(tp=2))
    assert str(e.value).startswith("tp: ")  # every rank's load outcome, as one line naming the field
    assert check_workers(checkpoints["mxfp4"], tp=2, ep=1) is not None  # experts-only packing shards over tp

"""The decode call as one compiled graph (`EngineConfig.compile_decode`, `--compile-decode`).

Why: a small model's decode step on a CPU is bound by per-op overhead, not arithmetic: about
900 tensor ops of a few microseconds each for a four-layer model, against ~1 ms of weight reads.
`torch.compile` (inductor's C++ backend) fuses the elementwise work between the matmuls into a
few dozen kernels, so a step costs roughly half (bench/bench_serve_offline.py and
bench/bench_serve_dsa_decode.py report both modes). It is what vLLM's CUDA graphs and
torch.compile are for on a GPU.

What makes the decode forward one graph (each branch tested against the eager form):
- the cache view writes through whole cache tensors (`cache_view._put`), never through a view
  of one layer, so the graph updates pages in place instead of rebuilding the cache;
- experts take `ops.moe.experts_forward_static` (no per-expert slices sized on the host);
- DSA's top-k is one `torch.topk` over distinct keys (no flag read back to the host);
- absorbed MLA reads the cache's own [latent | k_pe] rows (`mla_attention_absorbed_joined`).

Shapes are dynamic (batch, context length), traced without duck shaping (see
`_call_without_duck_shapes`); torch still compiles batch 1 apart (one slice of pages, or gathered
ones), the experts' gather / all-experts sides of a batch and, with DSA, contexts on either side
of the indexer's top-k, each once per process (~10-30 s per graph for a 4-layer model on two
cores, cached on disk by inductor afterwards).
`LLMEngine.warm_up` compiles them all before traffic.
Prefill chunks stay eager: their lengths vary and they are a small share of the steps.

Guards on the model's modules are skipped (`skip_guard_on_all_nn_modules_unsafe`): checking
hundreds of parameters costs ~0.2-0.4 ms per step. Torch keeps compiled graphs per code object,
not per model, so each model gets a key of its own that the graph is guarded on: two models in
one process never share a graph. What stays the caller's promise: a served model does not change
its parameter shapes, dtypes or module attributes (weights updated in place, as an RL weight
sync does, are read afresh every call).
"""

from __future__ import annotations

import functools
import uuid
from typing import Callable

import torch

from deltamoe.errors import ConfigError
from deltamoe.serve.engine.decode_matvec_pass import DecodeMatvecPass


def compiler_available() -> bool:
    """Whether inductor finds the C++ compiler it builds CPU kernels with."""
    from torch._inductor import cpp_builder

    try:
        cpp_builder.get_cpp_compiler()
    except Exception:  # inductor raises its own error types for a missing compiler
        return False
    return True


def _decode_call(model: torch.nn.Module, model_key: str, input_ids: torch.Tensor, cache: object) -> torch.Tensor:
    if not model_key:  # reading the key makes torch guard the graph on it (see the module docstring)
        raise ValueError("model_key: expected a non-empty key")
    return model(input_ids, cache=cache, logits_to_keep=1).logits


@functools.cache
def _compiled_call() -> Callable[..., torch.Tensor]:
    # Shape classes (`LLMEngine._decode_shape_classes`) and models each take an entry.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    # cpp_wrapper: the graph's launcher is C++ too, not Python calling ~150 kernels and matmuls one
    # by one (measured 10-17 % off a compiled step, bench models, same process side by side).
    # The matvec pass turns one-sequence decode's [1, K] @ [K, N] calls into fused reductions
    # (decode_matvec_pass.py: a one-sequence step ~2.1 -> ~1.2 ms on the DSA bench model).
    return torch.compile(_decode_call, dynamic=True,
                         options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
                                  "cpp_wrapper": True, "post_grad_custom_post_pass": DecodeMatvecPass()})


def compile_decode(model: torch.nn.Module) -> Callable[[torch.Tensor, object], torch.Tensor]:
    """(input_ids [B, 1], cache view) -> last-position logits [B, 1, V], through the compiled graph.

    Compiles lazily on first use; raises ConfigError where it cannot run (training mode, no C++
    compiler for CPU kernels)."""
    if model.training:
        raise ConfigError("expected a model in eval mode for the compiled decode graph", field="compile_decode")
    if next(model.parameters()).device.type == "cpu" and not compiler_available():
        raise ConfigError("needs a C++ compiler for torch.compile's CPU kernels (g++ or $CXX); "
                          "install one or run without --compile-decode", field="compile_decode")
    key = model.__dict__.get("_compiled_decode_key")
    if key is None:
        key = model._compiled_decode_key = uuid.uuid4().hex
    return functools.partial(_call_without_duck_shapes, _compiled_call(), model, key)


def _call_without_duck_shapes(compiled: Callable[..., torch.Tensor], *args: object) -> torch.Tensor:
    """Trace (when a call compiles) with every dynamic size its own symbol. Torch's default "duck
    shaping" gives sizes that happen to be equal at trace time one symbol: a block table two
    blocks wide next to two KDA heads came out as "width == 2", and every longer context then
    compiled again, in the middle of traffic. Set per call (~4 us), not process-wide."""
    from torch.fx.experimental import _config as shape_config

    previous = shape_config.use_duck_shape
    shape_config.use_duck_shape = False
    try:
        return compiled(*args)
    finally:
        shape_config.use_duck_shape = previous

"""Regional compilation of the decode step: one graph per kind of layer part, reused by every layer.

The whole decode call as one graph (`compiled_decode._decode_call`) compiles every layer's code
once per graph class: minutes on two cores for an 8-layer model. Here each decoder layer's
attention (KDA, MLA, DSA) and FFN (dense, MoE) runs through a compiled region, and every layer of
the same kind reuses its graph (torch's "regional compilation"): the compile covers one layer of
each kind. The glue between regions (embedding, AttnRes mixes, norms, residuals, LM head) runs
eagerly, a few dozen small ops per step.

What makes one graph serve many layers:
- parameters are graph inputs (dynamo inlines built-in nn modules), not constants;
- the cache a region sees is its layer's own slices (`LayerCacheView`), so no layer index is
  baked into the graph;
- guards on modules are skipped (as for the whole graph); instead each region call passes a key
  (`region_key`) naming what its graph bakes in: the module's class, its parameters' shapes and
  dtypes and its plain attributes other than `layer_idx`. Equal keys share a graph; two models
  in one process never do (the model's own key is part of it).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from deltamoe.serve.engine.cache_view import PagedBatchView
from deltamoe.serve.engine.layer_cache_view import LayerCacheView

# Module attributes that differ between layers of one kind and that the region's code reads only
# to find the layer's cache (which LayerCacheView already did).
_PER_LAYER = ("layer_idx",)


def region_key(model_key: str, module: nn.Module) -> str:
    """What a region's graph bakes in about `module` (see the module docstring)."""
    parts = [model_key]
    for name, sub in module.named_modules():
        plain = sorted((k, repr(v)) for k, v in vars(sub).items()
                       if isinstance(v, (bool, int, float, str, type(None))) and k not in _PER_LAYER
                       and not k.startswith("_"))
        parts.append(f"{name}:{type(sub).__qualname__}:{plain}")
    parts += [f"{name}:{tuple(t.shape)}:{t.dtype}" for name, t in [*module.named_parameters(), *module.named_buffers()]]
    return "|".join(parts)


def _attention_call(module: nn.Module, key: str, x: torch.Tensor, cache: LayerCacheView) -> torch.Tensor:
    if not key:  # reading the key makes torch guard the graph on it
        raise ValueError("key: expected a non-empty region key")
    return type(module).forward(module, x, cache)


def _ffn_call(module: nn.Module, key: str, x: torch.Tensor) -> torch.Tensor:
    if not key:
        raise ValueError("key: expected a non-empty region key")
    return type(module).forward(module, x)


class AttentionRegion:
    """`module.forward(x, cache)` through the compiled attention region, over the layer's slices."""

    def __init__(self, module: nn.Module, model_key: str, compile_: Callable[[Callable], Callable]):
        self.module, self.key, self.call = module, region_key(model_key, module), compile_(_attention_call)

    def __call__(self, x: torch.Tensor, cache: PagedBatchView) -> torch.Tensor:
        return self.call(self.module, self.key, x, LayerCacheView(cache, self.module.layer_idx))


class FFNRegion:
    """`module.forward(x)` through the compiled FFN region."""

    def __init__(self, module: nn.Module, model_key: str, compile_: Callable[[Callable], Callable]):
        self.module, self.key, self.call = module, region_key(model_key, module), compile_(_ffn_call)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.call(self.module, self.key, x)


"""Regional compilation of the decode step: one graph per kind of layer part, reused by every layer.

The whole decode call as one graph (`compiled_decode._decode_call`) compiles every layer's code
once per graph class: minutes on two cores for an 8-layer model. Here each decoder layer's
attention (KDA, MLA, DSA) and FFN (dense, MoE) runs through a compiled region, and every layer of
the same kind reuses its graph (torch's "regional compilation"): the compile covers one layer of
each kind. The glue between regions (embedding, AttnRes mixes, norms, residuals, LM head) runs
eagerly, a few dozen small ops per step. `LayerRegionTrunk` (form "layers") draws the boundary
around whole decoder layers instead, glue included.

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

from deltamoe.model.bank_slots import BankSlots, LayerSlots, decoder_layer_slots, trunk_with_bank_slots
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


def check_region_key(key: str) -> None:
    """Called first in every compiled region's function: reading the key makes torch guard the
    graph on it (`region_key`), so layers of another kind or model never share it."""
    if not key:
        raise ValueError("key: expected a non-empty region key")


def _attention_call(module: nn.Module, key: str, x: torch.Tensor, cache: LayerCacheView) -> torch.Tensor:
    check_region_key(key)
    return type(module).forward(module, x, cache)


def _ffn_call(module: nn.Module, key: str, x: torch.Tensor) -> torch.Tensor:
    check_region_key(key)
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



def _layer_call(layer: nn.Module, key: str, h: torch.Tensor, bank: torch.Tensor | None, slots: LayerSlots | None,
                cache: LayerCacheView) -> torch.Tensor:
    check_region_key(key)
    if bank is None:  # plain residuals: the layer's own forward (its bank stays empty)
        return type(layer).forward(layer, h, [], cache)[0]
    return decoder_layer_slots(layer, h, bank, slots, cache)


class LayerRegionTrunk:
    """`DeltaMoEModel.forward` with every trunk layer as one compiled region: attention, FFN, norms,
    residuals and the AttnRes bank in one graph, shared by the layers of one kind (equal
    `region_key`: for `tiny` the dense first layer, the KDA layers, the DSA layers). The bank is a
    tensor of fixed size (`model.bank_slots`), so what differs between layers (their bank slots,
    their cache slices) is graph inputs; only the embedding and the output mix run eagerly."""

    def __init__(self, module: nn.Module, model_key: str, compile_: Callable[[Callable], Callable]):
        self.module, self.call = module, compile_(_layer_call)
        self.keys = [region_key(model_key, layer) for layer in module.trunk]
        self._slots: dict[torch.device, BankSlots] = {}

    def __call__(self, input_ids: torch.Tensor | None = None, cache: PagedBatchView | None = None,
                 inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        m = self.module
        h = m.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        keys = iter(self.keys)

        def run_layer(layer: nn.Module, h: torch.Tensor, bank: torch.Tensor | None, slots: LayerSlots | None,
                      cache: PagedBatchView) -> torch.Tensor:
            return self.call(layer, next(keys), h, bank, slots, LayerCacheView(cache, layer.layer_idx))

        if m.config.attn_res_block_size is None:
            for layer in m.trunk:
                h = run_layer(layer, h, None, None, cache)
            return h
        if h.device not in self._slots:
            self._slots[h.device] = BankSlots.plan(m.config, h.device)
        return trunk_with_bank_slots(m, h, cache, self._slots[h.device], run_layer)

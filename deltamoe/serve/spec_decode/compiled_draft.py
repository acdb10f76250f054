"""The MTP layer's drafting calls through compiled regions (`--compile` with `--speculative mtp`).

The drafter calls the MTP layer (one MLA attention and one MoE: a trunk layer's worth of ops)
K times a step: the catch-up over the positions just computed, then K - 1 chained drafts of one
position each. Here the whole layer (input projection, norms, attention, MoE, residuals) runs as one compiled
region over its own cache slices (`LayerCacheView`), as the decode step's whole-layer form does
for a trunk layer (`serve/engine/compiled_regions.py`): one graph, and no eager glue between
attention and MoE. The embedding and the head's logits stay eager.

A call runs compiled when its rows have a past (a call over a fresh prompt's first chunk is a
prefill) and append the same number of tokens (a compiled region reads no padding): the chained
drafts always, the catch-up after a verification when the batch's rows kept the same number of
drafts. Other calls run eagerly.

Graph classes (`draft_shapes`): rows and positions are dynamic, but torch specialises size 1 (one
row; one position), the attention absorbs up to `ABSORB_MAX_TOKENS` new positions and expands
past them, and the experts take one form per row count; what the drafts keep decides which of
them traffic meets, so `LLMEngine.warm_up` calls the region once per class directly
(`spec_decode.runner.verification_warm_up_rounds`).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from deltamoe.config import ModelConfig
from deltamoe.model.mla_layer import ABSORB_MAX_TOKENS
from deltamoe.model.mtp import MTPLayer
from deltamoe.serve.engine.cache_view import PagedBatchView
from deltamoe.serve.engine.compiled_decode import (CompiledDecode, compile_for_decode, decode_form, decode_tracing,
                                                   expert_form, first_of_each_class)
from deltamoe.serve.engine.compiled_regions import check_region_key, region_key
from deltamoe.serve.engine.layer_cache_view import LayerCacheView


def _mtp_layer_call(layer: nn.Module, key: str, hidden: torch.Tensor, next_embeds: torch.Tensor,
                    cache: LayerCacheView) -> torch.Tensor:
    check_region_key(key)
    return type(layer).forward(layer, hidden, next_embeds, cache)


class CompiledDraft:
    """The first MTP layer as one compiled region over its own cache slices; the same parameters."""

    def __init__(self, model: nn.Module, decode: CompiledDecode):
        self.layer: MTPLayer = decode_form(model.model.mtp_layers[0], None)
        self.key = region_key(model._compiled_decode_key, self.layer)  # key set by CompiledDecode
        self.call = compile_for_decode(_mtp_layer_call)
        self.min_table_width = decode.min_table_width

    def __call__(self, hidden: torch.Tensor, next_embeds: torch.Tensor, view: PagedBatchView) -> torch.Tensor:
        with decode_tracing():  # the decode graphs' tracing settings, as `CompiledDecode` sets them
            return self.call(self.layer, self.key, hidden, next_embeds, LayerCacheView(view, self.layer.layer_idx))

    @staticmethod
    def runs(starts: list[int], counts: list[int]) -> bool:
        """Whether a call appending counts[b] tokens at starts[b] runs compiled (see the module docstring)."""
        return any(starts) and min(counts) == max(counts)


def draft_shapes(config: ModelConfig, max_rows: int, max_positions: Callable[[int], int],
                 extra_macs_per_expert: int | None = None) -> list[tuple[int, int]]:
    """(rows B, positions T) of the smallest call of each graph class that the compiled MTP calls of
    1 .. `max_rows` rows, each of 1 .. `max_positions(B)` positions, meet. The region's graph has B
    and T dynamic; what splits it:
    - torch specialises size 1: B = 1 (a lone row) and T = 1 (the chained drafts, a catch-up of
      one position) are classes of their own;
    - the MLA attention's form: absorbed for up to `ABSORB_MAX_TOKENS` new positions, expanded
      past that (`model/mla_layer.py`);
    - the experts' form over the B x T rows (`compiled_decode.expert_form`).
    `extra_macs_per_expert`: the experts' budget (`compiled_decode.expert_form_budget`)."""
    def graph_class(shape: tuple[int, int]) -> tuple[object, ...]:
        b, t = shape
        return b == 1, t == 1, t <= ABSORB_MAX_TOKENS, expert_form(config, b * t, extra_macs_per_expert)

    shapes = ((b, t) for b in range(1, max_rows + 1) for t in range(1, max_positions(b) + 1))
    return first_of_each_class(shapes, graph_class, cost=lambda shape: (shape[0] * shape[1], shape[0]))

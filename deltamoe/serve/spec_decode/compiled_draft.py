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
"""

from __future__ import annotations

import torch
from torch import nn

from deltamoe.model.mtp import MTPLayer
from deltamoe.serve.engine.cache_view import PagedBatchView
from deltamoe.serve.engine.compiled_decode import CompiledDecode, compile_for_decode, decode_form, decode_tracing
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

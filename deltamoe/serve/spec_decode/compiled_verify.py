"""The verification call through compiled regions (`--compile` with `--speculative mtp`).

Without it a verification runs eagerly while a plain decode step runs compiled, and a step that
emits K + 1 tokens costs several plain steps. Here each trunk layer's attention and MoE run
through compiled regions shared by the layers of one kind, as the decode step's "parts" form
does (`serve/engine/compiled_regions.py`), with T = K + 1 a fixed size: one graph per region
kind and K, reused for every batch size and context. The glue (embedding, norms, AttnRes mixes,
residuals, dense MLPs, the final norm and LM head) stays eager, as there.

The KDA region hands back the conv and recurrent state after every position (the checkpoints a
rollback restores, `checkpoint_view.py`) as outputs of its graph, and this module files them in
the step's `CheckpointView`, so rollback works as in the eager call. The module tree traced is
`compiled_decode.decode_form`'s (the experts' static dispatch, DSA's padded top-k) over the
served model's own parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from deltamoe.config import ModelConfig
from deltamoe.model.decoder import DecoderLayer
from deltamoe.model.kda_layer import KimiDeltaAttention
from deltamoe.serve.engine.compiled_decode import (CompiledDecode, compile_for_decode, decode_form, decode_tracing,
                                                   expert_form, first_of_each_class)
from deltamoe.serve.engine.compiled_regions import FFNRegion, check_region_key, region_key
from deltamoe.serve.engine.layer_cache_view import LayerCacheView
from deltamoe.serve.spec_decode.checkpoint_view import CheckpointView


class CheckpointLayerView(LayerCacheView):
    """One layer's share of a verification's cache view; keeps that layer's KDA checkpoints."""

    keeps_kda_checkpoints = True

    def __init__(self, view: CheckpointView, layer: int):
        super().__init__(view, layer)
        self.checkpoints: tuple[torch.Tensor, torch.Tensor] | None = None

    def keep_kda_checkpoints(self, layer: int, conv_states: torch.Tensor, recurrent_states: torch.Tensor) -> None:
        self.checkpoints = (conv_states, recurrent_states)


def _verify_attention_call(module: nn.Module, key: str, x: torch.Tensor, cache: CheckpointLayerView
                           ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    check_region_key(key)
    out = type(module).forward(module, x, cache)
    return out, cache.checkpoints


class VerifyAttentionRegion:
    """`module.forward(x, cache)` of a trunk layer's attention through its compiled verification region."""

    def __init__(self, module: nn.Module, model_key: str):
        self.module, self.key, self.call = module, region_key(model_key, module), compile_for_decode(_verify_attention_call)
        self.keeps_checkpoints = isinstance(module, KimiDeltaAttention)

    def __call__(self, x: torch.Tensor, cache: CheckpointView) -> torch.Tensor:
        layer = self.module.layer_idx
        out, checkpoints = self.call(self.module, self.key, x, CheckpointLayerView(cache, layer))
        if self.keeps_checkpoints:
            cache.keep_kda_checkpoints(layer, *checkpoints)
        return out


class CompiledVerify:
    """(ids [B, K+1], CheckpointView) -> logits [B, K+1, V] fp32 and hidden states [B, K+1, D], the
    trunk's attention and MoE through compiled regions. Compiles on first use of each region kind
    and batch class: batch 1 and batch >= 2 (torch specialises size 1), and in the MoE regions each
    form of the experts over the B x (K + 1) rows (`verification_batches`). A lone row is not repeated
    into two as the decode step's regions do: that saves one graph class per region kind at the
    price of doubling, at every step, the K + 1 rows each region computes.

    The view must gather its pages (`slice_consecutive=False`) with tables at least
    `min_table_width` wide."""

    def __init__(self, model: nn.Module, decode: CompiledDecode, num_draft_tokens: int):
        self.k = num_draft_tokens
        self.min_table_width = decode.min_table_width
        key = model._compiled_decode_key  # set by CompiledDecode: graphs of two models never mix
        self._model = decode_form(model, None)
        for layer in self._model.model.trunk:
            _with_verify_regions(layer, key)

    def __call__(self, ids: torch.Tensor, view: CheckpointView) -> tuple[torch.Tensor, torch.Tensor]:
        with decode_tracing():  # the decode graphs' tracing settings, as `CompiledDecode` sets them
            forward = self._model(ids, cache=view, logits_to_keep=self.k + 1)
        return forward.logits.float(), forward.hidden_states


def verification_batches(config: ModelConfig, num_draft_tokens: int, max_batch: int,
                         extra_macs_per_expert: int | None = None) -> list[int]:
    """The smallest batch of each graph class that verifications of 1 .. `max_batch` rows meet
    (T = K + 1 fixed): batch 1 apart from the others (torch specialises size 1), and in each, one
    MoE region graph per form of the experts (`compiled_decode.expert_form`) over the B x (K + 1)
    rows it computes. `extra_macs_per_expert`: the experts' budget (`compiled_decode.expert_form_budget`)."""
    positions = num_draft_tokens + 1
    return first_of_each_class(range(1, max_batch + 1),
                               lambda b: (b == 1, expert_form(config, b * positions, extra_macs_per_expert)),
                               cost=lambda b: b)


def _with_verify_regions(layer: DecoderLayer, key: str) -> None:
    layer.self_attn.forward = VerifyAttentionRegion(layer.self_attn, key)
    if layer.is_moe:  # a dense MLP stays eager, as in the decode step's regions
        layer.block_sparse_moe.forward = FFNRegion(layer.block_sparse_moe, key, compile_for_decode)

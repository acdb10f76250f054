"""The MTP layer's drafting calls through compiled regions (`--compile` with `--speculative mtp`).

The drafter calls the MTP layer (one MLA attention and one MoE: a trunk layer's worth of ops)
K times a step: the catch-up over the positions just computed, then K - 1 chained drafts of one
position each. Eager, those calls cost about as much as the verification's extra over a plain
step. Here the layer's attention and MoE run through compiled regions, as a decode step's layers
do (`serve/engine/compiled_regions.py`, the region classes reused as they are); its input
projection and norms stay eager, like the glue between a decode step's regions.

A call runs compiled when its rows have a past (a call over a fresh prompt's first chunk is a
prefill) and append the same number of tokens (a compiled region reads no padding): the chained
drafts always, the catch-up after a verification when the batch's rows kept the same number of
drafts. Other calls run eagerly.
"""

from __future__ import annotations

from torch import nn

from deltamoe.model.mtp import MTPLayer
from deltamoe.serve.engine.compiled_decode import CompiledDecode, _compile, decode_form
from deltamoe.serve.engine.compiled_regions import AttentionRegion, FFNRegion


class CompiledDraft:
    """The first MTP layer with its attention and MoE through compiled regions; the same parameters."""

    def __init__(self, model: nn.Module, decode: CompiledDecode):
        key = model._compiled_decode_key  # set by CompiledDecode: graphs of two models never mix
        self.layer: MTPLayer = decode_form(model.model.mtp_layers[0], None)
        self.layer.self_attn.forward = AttentionRegion(self.layer.self_attn, key, _compile)
        if self.layer.is_moe:
            self.layer.block_sparse_moe.forward = FFNRegion(self.layer.block_sparse_moe, key, _compile)
        self.min_table_width = decode.min_table_width

    @staticmethod
    def runs(starts: list[int], counts: list[int]) -> bool:
        """Whether a call appending counts[b] tokens at starts[b] runs compiled (see the module docstring)."""
        return any(starts) and min(counts) == max(counts)

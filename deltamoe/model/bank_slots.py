"""The Block AttnRes bank as one tensor of fixed size: the decoder layer's form for a graph shared by layers.

`DecoderLayer.forward` keeps the bank as a Python list that grows by one entry at each block's
first layer, and decides with `layer_idx` whether the layer starts a block. A graph traced from it
bakes both in: one graph per bank length and per side of the block boundary. Here the bank is a
tensor [..., S + 1, D] (S = the model's blocks, one input banked per block, plus a scratch slot)
and what differs between layers is data (`LayerSlots`: which slot the layer banks its input
into, which slots its two mixes read, whether it starts a block), so every layer of one kind runs
the same code on the same shapes. The math is `DecoderLayer.forward`'s: slots that a mix does not
read weigh exactly 0 (`ops.norms.attn_res_mix_slots`), and a layer that does not start a block
banks its input into the scratch slot, which no mix reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from deltamoe.config import ModelConfig
from deltamoe.model.cache import ModelCache
from deltamoe.model.decoder import DecoderLayer, res_query
from deltamoe.ops.norms import attn_res_mix_slots


@dataclass(frozen=True)
class LayerSlots:
    """One layer's use of the bank, as tensors (graph inputs, never constants of a graph)."""

    write: torch.Tensor  # [1] long: the slot the layer's input goes to (the scratch slot unless it starts a block)
    starts_block: torch.Tensor  # [] bool: the partial sum restarts at the attention output
    attn_live: torch.Tensor  # [S + 2] bool: the slots the attention's input mix reads (then the current value)
    mlp_live: torch.Tensor  # [S + 2] bool: the slots the FFN's input mix reads (then the current value)


@dataclass(frozen=True)
class BankSlots:
    """The bank's plan for a model: its slot count and each trunk layer's `LayerSlots`."""

    slots: int  # S + 1: one per block, plus the scratch slot
    layers: tuple[LayerSlots, ...]
    output_live: torch.Tensor  # [S + 2] bool: the output mix reads every block's slot

    @classmethod
    def plan(cls, config: ModelConfig, device: torch.device) -> BankSlots:
        if config.attn_res_block_size is None:
            raise ValueError("BankSlots: the model has no Block AttnRes (attn_res_block_size is None)")
        size, layers = config.attn_res_block_size, config.num_hidden_layers
        blocks = -(-layers // size)

        def live(banked: int) -> torch.Tensor:  # the first `banked` slots, not the scratch, and the current value
            return torch.tensor([j < banked for j in range(blocks)] + [False, True], device=device)

        plans = []
        for i in range(layers):
            starts = i % size == 0
            plans.append(LayerSlots(write=torch.tensor([i // size if starts else blocks], device=device),
                                    starts_block=torch.tensor(starts, device=device),
                                    attn_live=live(-(-i // size)), mlp_live=live(i // size + 1)))
        return cls(slots=blocks + 1, layers=tuple(plans), output_live=live(blocks))

    def empty_bank(self, h: torch.Tensor) -> torch.Tensor:
        """The bank of a forward over h [..., D]: zeros (finite in the slots no mix reads)."""
        return h.new_zeros(*h.shape[:-1], self.slots, h.shape[-1])


def decoder_layer_slots(layer: DecoderLayer, h: torch.Tensor, bank: torch.Tensor, slots: LayerSlots,
                        cache: ModelCache | None) -> torch.Tensor:
    """`layer.forward(h, bank_list, cache)` with the bank as a tensor: returns the layer's output and
    banks the layer's input into `bank` in place (see the module docstring)."""
    eps = layer.config.rms_norm_eps
    x = attn_res_mix_slots(h, bank, slots.attn_live,
                           res_query(layer.self_attention_res_norm, layer.self_attention_res_proj), eps)
    attn = layer.self_attn(layer.input_layernorm(x), cache)
    bank.index_copy_(-2, slots.write, h.unsqueeze(-2))
    p = torch.where(slots.starts_block, attn, h + attn)
    m = attn_res_mix_slots(p, bank, slots.mlp_live, res_query(layer.mlp_res_norm, layer.mlp_res_proj), eps)
    return p + layer.ffn(layer.post_attention_layernorm(m))


def trunk_with_bank_slots(model: torch.nn.Module, h: torch.Tensor, cache: ModelCache | None, slots: BankSlots,
                          run_layer: Callable[..., torch.Tensor] = decoder_layer_slots) -> torch.Tensor:
    """`DeltaMoEModel.forward` after the embedding, with the bank as a tensor: every trunk layer
    through `run_layer(layer, h, bank, layer_slots, cache)` (a compiled region or
    `decoder_layer_slots` itself), then the output mix over every block's slot."""
    bank = slots.empty_bank(h)
    for layer, layer_slots in zip(model.trunk, slots.layers, strict=True):
        h = run_layer(layer, h, bank, layer_slots, cache)
    return attn_res_mix_slots(h, bank, slots.output_live,
                              res_query(model.output_attn_res_norm, model.output_attn_res_proj),
                              model.config.rms_norm_eps)

"""Tensor parallelism by attention heads and MLP widths (`parallelize_module`, Megatron layout).

What is sharded over the TP group (each rank keeps 1/tp):
- KDA: q/k/v_proj, f_b_proj (decay gate), b_proj (beta), g_proj or g_b_proj (output gate)
  column-wise by heads; o_proj row-wise.
- MLA (and DSA, MTP blocks): q_proj or q_b_proj, kv_b_proj, g_proj column-wise by heads; o_proj row-wise.
- Dense MLP and shared experts: gate/up column-wise, down row-wise.
What stays replicated in training: embeddings, LM head, norms, AttnRes vectors, the low-rank "a" projections
(f_a, g_a, q_a, kv_a), the DSA indexer, the router, latent MoE projections and routed experts
(those are expert-parallel instead).

Small per-head KDA parameters (A_log, dt_bias, the three depthwise convs) and the per-head-dim
o_norm stay replicated; each rank reads its heads' slice (`KimiDeltaAttention.head_shard`), so their gradients
are partial sums over TP ranks and `TensorParallelGradSync` adds them up after backward.
The MLA rope key k_pe is computed once and used by every head: it is entered into the
head-parallel region with an all-reduce in backward (Megatron's "f").

Serving (`serve/executor/sharding.py`) applies the same plan and adds `apply_vocab_parallel`:
embedding and LM head rows split by vocabulary, so no rank holds the full vocabulary matrices.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from deltamoe.model.decoder import DecoderLayer
from deltamoe.model.ffn import DenseMLP
from deltamoe.model.kda_layer import KimiDeltaAttention
from deltamoe.model.mla_layer import LatentAttention


def reduce_grad_in_backward(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Identity forward; the gradient is all-reduced over `mesh` (a replicated value entering sharded work)."""
    if not torch.is_grad_enabled():  # inference (serving): no gradient, and no DTensor for a compiled graph to take in
        return x
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


# The plans, by child module name: "col" (output features split: heads / width) or "row" (input
# features split, partial sums all-reduced). Serving shards a quantized checkpoint's int4 projections
# by the same plans (serve/executor/int4_shards.py); here only the float Linears are planned.
def kda_plan(attn: KimiDeltaAttention) -> dict[str, str]:
    plan = {name: "col" for name in ("q_proj", "k_proj", "v_proj", "f_b_proj", "b_proj")}
    plan["g_proj" if hasattr(attn, "g_proj") else "g_b_proj"] = "col"
    plan["o_proj"] = "row"
    return plan


def mla_plan(attn: LatentAttention) -> dict[str, str]:
    plan = {"q_proj" if attn.config.q_lora_rank is None else "q_b_proj": "col", "kv_b_proj": "col", "o_proj": "row"}
    if attn.config.mla_output_gate:
        plan["g_proj"] = "col"
    return plan


MLP_PLAN = {"gate_proj": "col", "up_proj": "col", "down_proj": "row"}


def tp_plans(module: nn.Module) -> list[tuple[nn.Module, dict[str, str]]]:
    """Every (module, plan) the TP layout shards under `module`: each decoder layer's attention, and its
    dense MLP or its MoE's shared experts."""
    out: list[tuple[nn.Module, dict[str, str]]] = []
    for layer in [m for m in module.modules() if isinstance(m, DecoderLayer)]:
        attn = layer.self_attn
        out.append((attn, kda_plan(attn) if isinstance(attn, KimiDeltaAttention) else mla_plan(attn)))
        if not layer.is_moe:
            out.append((layer.mlp, MLP_PLAN))
        elif layer.config.num_shared_experts > 0:
            out.append((layer.block_sparse_moe.shared_experts, MLP_PLAN))
    return out


def _parallelize_linears(module: nn.Module, mesh: DeviceMesh, plan: dict[str, str]) -> None:
    """`parallelize_module` over the plan's float Linears (an int4-packed projection is not one)."""
    styles = {"col": ColwiseParallel, "row": RowwiseParallel}
    linears = {name: styles[how]() for name, how in plan.items() if isinstance(getattr(module, name), nn.Linear)}
    if linears:
        parallelize_module(module, mesh, linears)


def _tp_kda(attn: KimiDeltaAttention, mesh: DeviceMesh) -> list[tuple[nn.Module, str]]:
    _parallelize_linears(attn, mesh, kda_plan(attn))
    attn.head_shard = (mesh.get_local_rank(), mesh.size())  # per-head parameters read as this rank's slice
    attn.num_heads //= mesh.size()
    return [(attn, "A_log"), (attn, "dt_bias"), (attn.q_conv1d, "weight"), (attn.k_conv1d, "weight"),
            (attn.v_conv1d, "weight"), (attn.o_norm, "weight")]


def _tp_mla(attn: LatentAttention, mesh: DeviceMesh) -> None:
    _parallelize_linears(attn, mesh, mla_plan(attn))
    attn.num_heads //= mesh.size()
    rank = attn.kv_rank

    def k_pe_enters_heads(_module: nn.Module, _inputs: tuple, out: torch.Tensor) -> torch.Tensor:
        # c_kv reaches the heads through the column-parallel kv_b_proj (which reduces its gradient);
        # k_pe is used by all local heads directly, so its gradient needs the same reduction.
        return torch.cat([out[..., :rank], reduce_grad_in_backward(out[..., rank:], mesh)], dim=-1)

    attn.kv_a_proj_with_mqa.register_forward_hook(k_pe_enters_heads)


def _tp_mlp(mlp: DenseMLP, mesh: DeviceMesh) -> None:
    _parallelize_linears(mlp, mesh, MLP_PLAN)


def apply_tensor_parallel(module: nn.Module, tp_mesh: DeviceMesh) -> "TensorParallelGradSync":
    """Shard every decoder layer (trunk and MTP) under `module`; returns the post-backward gradient sync."""
    partial: list[tuple[nn.Module, str]] = []
    for layer in [m for m in module.modules() if isinstance(m, DecoderLayer)]:
        if isinstance(layer.self_attn, KimiDeltaAttention):
            partial += _tp_kda(layer.self_attn, tp_mesh)
        else:
            _tp_mla(layer.self_attn, tp_mesh)
        if not layer.is_moe:
            _tp_mlp(layer.mlp, tp_mesh)
        elif layer.config.num_shared_experts > 0:
            _tp_mlp(layer.block_sparse_moe.shared_experts, tp_mesh)
    return TensorParallelGradSync(partial, tp_mesh.get_group())


def apply_vocab_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard `model.embed_tokens` and `lm_head` of a DeltaMoEForCausalLM by vocabulary rows over the TP group.

    Each rank looks up only the token ids in its rows (zeros elsewhere, then an all-reduce: the sum has
    one non-zero term, so it is exact) and computes the logits of its rows (then an all-gather), so
    both give exactly the one-process values. A tied LM head gets its own sharded copy.
    """
    vocab = model.config.vocab_size
    if vocab % tp_mesh.size() != 0:
        raise ValueError(f"tp = {tp_mesh.size()} must divide vocab_size ({vocab})")
    parallelize_module(model, tp_mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    })


class TensorParallelGradSync:
    """Sums the gradients of replicated parameters that each TP rank only partly used (local head views)."""

    def __init__(self, params: list[tuple[nn.Module, str]], group: dist.ProcessGroup):
        # (module, name), not the tensors: FSDP2 replaces the parameter objects when it shards them.
        self.params, self.group = params, group

    def __call__(self) -> None:
        for module, name in self.params:
            p = module._parameters[name]
            if p.grad is not None:
                # Under FSDP the gradient is a dp-sharded DTensor; the TP ranks hold the same dp shard.
                g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                dist.all_reduce(g, group=self.group)

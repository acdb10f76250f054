"""Swap a model skeleton's Linears and routed experts for their quantized forms (before loading).

`quantize_modules` runs on the model built on the meta device, so the float weights it
replaces are never allocated; the quantized modules are then filled by `load_weights`.
"""

from __future__ import annotations

import torch
from torch import nn

from deltamoe.model.ffn import MoE, RoutedExperts
from deltamoe.model.int4_expert_stack import Int4ExpertStack
from deltamoe.model.model import DeltaMoEForCausalLM
from deltamoe.model.packed_experts import PackedExperts, packed_local_experts
from deltamoe.model.quant_scheme import QuantScheme
from deltamoe.model.quantized_linear import Int4Linear


def quantized_module_names(model: DeltaMoEForCausalLM, scheme: QuantScheme) -> list[str]:
    """Module names (ours: `model.layers.N...`) whose weights the scheme stores quantized."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, RoutedExperts) and scheme.quantizes(name, module.w1.shape[2]) \
                and module.w2.shape[2] % scheme.group_size == 0:
            names.append(name)
        elif isinstance(module, nn.Linear) and not scheme.experts_only and module.bias is None \
                and scheme.quantizes(name, module.in_features):
            names.append(name)
    return names


def quantize_modules(model: DeltaMoEForCausalLM, scheme: QuantScheme, use_kernel: bool | None = None) -> list[str]:
    """Replace every module `quantized_module_names` lists; returns those names. `use_kernel=False`
    makes the int4 modules run their dequantising references (the default: the kernel when present)."""
    names = quantized_module_names(model, scheme)
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, leaf)
        if isinstance(old, RoutedExperts):
            setattr(parent, leaf, PackedExperts(old.config, scheme, use_kernel))
            assert isinstance(parent, MoE)
            parent.dispatcher = packed_local_experts
        else:
            setattr(parent, leaf, Int4Linear(old.in_features, old.out_features, scheme, use_kernel))
    return names


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter, buffer and quantized weight the model holds (tied tensors once)."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    for m in model.modules():  # int4 experts are Int4Linear modules themselves: counted once, here
        if isinstance(m, (Int4Linear, Int4ExpertStack)) or \
                (isinstance(m, PackedExperts) and m.scheme.weight_format == "mxfp4"):
            total += m.resident_bytes()
    return total


def plain_tensor_operands(module: nn.Module) -> list[torch.Tensor]:
    """The kernel operands `module` itself holds as plain attributes, not as parameters or buffers
    (an int4 projection's, its projection group's, an int4 expert stack's)."""
    if isinstance(module, Int4Linear):
        tensors = [module.qweight, module.scales_and_zeros, module.weight_scale]
        if module.group is not None:
            tensors += [module.group.weight, module.group.scales_and_zeros]
    elif isinstance(module, Int4ExpertStack) and module.ops is not None:
        tensors = [module.ops.w13, module.ops.sz13, module.ops.w2, module.ops.sz2]
    else:
        tensors = []
    return [t for t in tensors if t is not None]


def holds_int4_expert_stacks(model: nn.Module) -> bool:
    """Whether any MoE of `model` runs its routed experts as an int4 W4A16 `Int4ExpertStack`."""
    return any(isinstance(m, Int4ExpertStack) for m in model.modules())

"""Write a quantized checkpoint from a float one, in the published compressed-tensors layout."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from deltamoe.errors import ConfigError
from deltamoe.hf_config import config_to_hf
from deltamoe.model.load import load_model
from deltamoe.model.model import DeltaMoEForCausalLM
from deltamoe.model.ffn import RoutedExperts
from deltamoe.model.quant_scheme import QuantScheme, quantize_weight, scheme_to_config
from deltamoe.model.quantize_modules import quantized_module_names
from deltamoe.model.checkpoint_names import param_to_checkpoint
from deltamoe.model.weights import read_quant_scheme, save_tensors, state_dict_for_checkpoint


def float_kept_modules(model: DeltaMoEForCausalLM, scheme: QuantScheme) -> list[str]:
    """The `ignore` entries (published module names) for what the scheme targets but keeps in float:
    Linears and expert stacks whose input width is no multiple of the group, so that a compressed-tensors
    reader that trusts the config (vLLM, llm-compressor) expects a plain `weight` there. An expert stack
    is one regex over its experts. Exact names, as those readers match them (`scheme.ignore`'s short
    forms, e.g. `lm_head`, match by suffix here only)."""
    quantized = set(quantized_module_names(model, scheme))
    out: list[str] = []
    for name, module in model.named_modules():
        if name in quantized:
            continue
        if isinstance(module, RoutedExperts):
            first = param_to_checkpoint(f"{name}.w1", model.config)[0]  # {stem}.0.w1.weight
            stem = first.removesuffix(".0.w1.weight")
            out.append(f"re:{re.escape(stem)}\\.\\d+\\.w[123]")
        elif isinstance(module, nn.Linear) and not scheme.experts_only:
            out.append(param_to_checkpoint(f"{name}.weight", model.config).removesuffix(".weight"))
    return [entry for entry in out if entry not in scheme.ignore]


def quantized_state_dict(model: DeltaMoEForCausalLM, scheme: QuantScheme,
                         dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Published names -> tensors: each quantized weight `X.weight` becomes `X.weight_packed`,
    `X.weight_scale` (+ `X.weight_shape` for int4); other floating tensors are cast to `dtype`,
    except fp32 buffers (the router correction bias stays fp32, as in the released checkpoints)."""
    targets: set[str] = set()
    for module in quantized_module_names(model, scheme):
        for name, _ in model.get_submodule(module).named_parameters(prefix=module):
            ck = param_to_checkpoint(name, model.config)
            targets.update(ck if isinstance(ck, list) else [ck])
    buffers = {param_to_checkpoint(n, model.config) for n, _ in model.named_buffers()}
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict_for_checkpoint(model).items():
        if name in targets:
            stem = name.removesuffix(".weight")
            for part, value in quantize_weight(scheme, t).items():
                out[f"{stem}.{part}"] = value.contiguous()
        elif t.is_floating_point() and name not in buffers:
            out[name] = t.to(dtype).contiguous()
        else:
            out[name] = t
    return out


def quantize_checkpoint(source: str | Path, out: str | Path, scheme: QuantScheme,
                        dtype: torch.dtype = torch.bfloat16, max_shard_bytes: int = 2 * 1024**3) -> dict[str, int]:
    """Load `source` (checkpoint folder or preset) in fp32, quantize, write to `out`. Returns byte counts,
    module counts (quantized, and targeted but kept float for their width), and under "requantized_from" the source's format when it was a quantized checkpoint (dequantized
    first, e.g. K3's MXFP4 experts to int4: the two roundings add)."""
    if not str(out).strip():
        raise ConfigError("empty output folder", field="out", hint="name the folder to write to")
    if Path(source).is_dir() and Path(out).resolve() == Path(source).resolve():
        raise ConfigError(f"{out} is the source checkpoint: quantizing in place would replace its float weights",
                          field="out", hint="write the quantized checkpoint to another folder")
    if Path(out).exists() and not Path(out).is_dir():
        raise ConfigError(f"{out} exists and is not a folder", field="out")
    source_scheme = read_quant_scheme(Path(source)) if Path(source).is_dir() else None
    model = load_model(source, dtype=torch.float32, dequantize=True)
    if not quantized_module_names(model, scheme):
        hint = (f"a --group-size that divides the layers' input widths ({model.config.hidden_size} and others)"
                if scheme.weight_format == "int4" else "a checkpoint with routed experts")
        raise ConfigError(f"{scheme.format} with group size {scheme.group_size} quantizes no layer of {source}: "
                          "every targeted layer's input width is no multiple of the group",
                          field="--group-size" if scheme.weight_format == "int4" else "--format", hint=f"use {hint}")
    tensors = quantized_state_dict(model, scheme, dtype)
    config = config_to_hf(model.config)
    config["quantization_config"] = scheme_to_config(scheme)
    kept_float = float_kept_modules(model, scheme)
    config["quantization_config"]["ignore"] += kept_float
    try:
        save_tensors(tensors, out, config, max_shard_bytes)
    except OSError as e:
        raise ConfigError(f"cannot write {out} ({e.strerror or e})", field="out") from None
    quantized = sum(t.numel() * t.element_size() for n, t in tensors.items() if n.rsplit(".", 1)[-1].startswith("weight_"))
    return {"tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "quantized_bytes": quantized, "quantized_modules": len(quantized_module_names(model, scheme)),
            "kept_float_modules": len(kept_float), "requantized_from": source_scheme.format if source_scheme else None}

"""`load_model(path_or_preset)`: the one entry point that builds a model from a preset or a checkpoint."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from deltamoe.config import ModelConfig
from deltamoe.errors import CheckpointError
from deltamoe.hf_config import load_config
from deltamoe.model.checkpoint_names import param_to_checkpoint
from deltamoe.model.init import init_weights
from deltamoe.model.model import DeltaMoEForCausalLM
from deltamoe.model.quant_scheme import QuantScheme
from deltamoe.model.int4_projection_group import join_shared_input_projections
from deltamoe.model.quantize_modules import quantize_modules
from deltamoe.model.weights import checkpoint_files, load_weights, read_quant_scheme


def build_model(config: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                seed: int | None = 0) -> DeltaMoEForCausalLM:
    """A randomly initialised model (built on meta, then materialised once on `device`)."""
    with torch.device("meta"):
        model = DeltaMoEForCausalLM(config)
    model.to_empty(device=device)
    init_weights(model, seed=seed)
    return model.to(dtype)


def load_model(source: str | Path | ModelConfig, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", seed: int | None = 0,
               dequantize: bool = False, quant_kernels: bool = True) -> DeltaMoEForCausalLM:
    """A preset name or ModelConfig gives random weights (seeded); a checkpoint folder loads its safetensors.

    A quantized checkpoint (config.json `quantization_config`) runs quantized (`quantized_skeleton`);
    `dequantize=True` loads it into a float model instead; `quant_kernels=False` keeps it quantized
    but runs the dequantising reference matmuls (the forms the kernels are tested against)."""
    if isinstance(source, ModelConfig):
        return build_model(source, dtype, device, seed).eval()
    config = load_config(source)
    path = Path(source)
    if not path.is_dir():
        return build_model(config, dtype, device, seed).eval()
    checkpoint_files(path)  # fail early, naming the folder, when there are no weights
    scheme = read_quant_scheme(path)
    with torch.device("meta"):
        model = DeltaMoEForCausalLM(config)
    if scheme is not None and not dequantize:
        quantized_skeleton(model, scheme, device, use_kernel=None if quant_kernels else False)
    materialize(model, dtype, device)
    load_weights(model, path, scheme)
    if scheme is not None and not dequantize:
        join_shared_input_projections(model)
    if config.tie_word_embeddings:
        _warn_if_untied_head_is_dropped(model, path)
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def materialize(model: DeltaMoEForCausalLM, dtype: torch.dtype, device: str | torch.device) -> None:
    """Give a meta-built model empty storage on `device` in `dtype`, for the checkpoint to fill. The
    dtype is set while still on meta, so the storage is made once, never in fp32 first."""
    model.to(dtype)
    # Buffers (router correction bias) stay fp32: they steer routing and are updated in small steps.
    for module in model.modules():
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.data = module.e_score_correction_bias.data.float()
    model.to_empty(device=device)


def _warn_if_untied_head_is_dropped(model: DeltaMoEForCausalLM, path: Path) -> None:
    """config.json ties the head to the embedding (as transformers reads it, the embedding wins), but
    the checkpoint also holds an lm_head that differs: a different model, which deserves a word."""
    head_name = param_to_checkpoint("lm_head.weight", model.config)
    if not any(head_name in names for names in checkpoint_files(path).values()):
        return
    head, embed = model.lm_head.weight, model.model.embed_tokens.weight
    if head.shape == embed.shape and not torch.equal(head, embed):
        warnings.warn(f"{path}: config.json sets tie_word_embeddings, so {head_name} in the checkpoint, which "
                      "differs from the embedding, is not used (the embedding is the head, as in transformers); "
                      "set tie_word_embeddings to false to use it", stacklevel=3)


def quantized_skeleton(model: DeltaMoEForCausalLM, scheme: QuantScheme, device: str | torch.device,
                       use_kernel: bool | None = None) -> None:
    """Swap the meta-built model's quantized Linears and experts for their packed forms (CPU kernels only)."""
    if torch.device(device).type != "cpu":
        raise CheckpointError(f"quantized checkpoints ({scheme.format}) run on the CPU, got device {device}",
                              field="device", hint="load with dequantize=True for another device")
    quantize_modules(model, scheme, use_kernel)

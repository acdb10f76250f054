"""`load_model(path_or_preset)`: the one entry point that builds a model from a preset or a checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from deltamoe.config import ModelConfig
from deltamoe.hf_config import load_config
from deltamoe.model.init import init_weights
from deltamoe.model.model import DeltaMoEForCausalLM
from deltamoe.model.weights import checkpoint_files, load_weights


def build_model(config: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                seed: int | None = 0) -> DeltaMoEForCausalLM:
    """A randomly initialised model (built on meta, then materialised once on `device`)."""
    with torch.device("meta"):
        model = DeltaMoEForCausalLM(config)
    model.to_empty(device=device)
    init_weights(model, seed=seed)
    return model.to(dtype)


def load_model(source: str | Path | ModelConfig, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", seed: int | None = 0) -> DeltaMoEForCausalLM:
    """A preset name or ModelConfig gives random weights (seeded); a checkpoint folder loads its safetensors."""
    if isinstance(source, ModelConfig):
        return build_model(source, dtype, device, seed).eval()
    config = load_config(source)
    path = Path(source)
    if not path.is_dir():
        return build_model(config, dtype, device, seed).eval()
    checkpoint_files(path)  # fail early, naming the folder, when there are no weights
    with torch.device("meta"):
        model = DeltaMoEForCausalLM(config)
    model.to_empty(device=device)
    model.to(dtype)
    # Buffers (router correction bias) stay fp32: they steer routing and are updated in small steps.
    for module in model.modules():
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.data = module.e_score_correction_bias.data.float()
    load_weights(model, path)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()

"""Which model a run trains: a preset, a config.json, or a checkpoint folder (its weights and,
when present, its tokenizer), optionally with ModelConfig fields replaced."""

from __future__ import annotations

from pathlib import Path

import torch

from deltamoe.config import ModelConfig, load_preset
from deltamoe.errors import ConfigError
from deltamoe.hf_config import load_config
from deltamoe.model.load import build_model, load_model
from deltamoe.model.model import DeltaMoEForCausalLM
from deltamoe.train.config import ModelSection


def weights_folder(section: ModelSection) -> Path | None:
    path = Path(section.path) if section.path else None
    if path is not None and path.is_dir() and any(path.glob("*.safetensors")):
        return path
    return None


def resolve_model_config(section: ModelSection) -> ModelConfig:
    if section.path is not None:
        if not Path(section.path).exists():
            raise ConfigError(f"model path {section.path} does not exist", field="model.path")
        config = load_config(section.path)
    else:
        config = load_preset(section.preset)
    if section.overrides:
        if weights_folder(section) is not None:
            raise ConfigError("overrides would not match the checkpoint's weights", field="model.overrides")
        try:
            config = config.replace(**section.overrides)
        except TypeError as e:
            raise ConfigError(f"{e}; see deltamoe.config.ModelConfig", field="model.overrides") from None
    return config


def build_train_model(section: ModelSection, config: ModelConfig, seed: int,
                      device: torch.device) -> DeltaMoEForCausalLM:
    """fp32 master weights in training mode; random (seeded) unless a checkpoint is given."""
    weights = weights_folder(section)
    model = load_model(weights, device=device) if weights is not None else build_model(config, device=device, seed=seed)
    return model.train()

"""deltamoe: the Kimi Linear / K3 / K3.1 hybrid-attention MoE family in readable PyTorch."""

from deltamoe.errors import CheckpointError, ConfigError, DeltaMoEError

__version__ = "0.1.0"

__all__ = ["ModelConfig", "load_config", "load_preset", "load_model", "save_checkpoint",
           "CheckpointError", "ConfigError", "DeltaMoEError"]

# Lazy: `import deltamoe` (the trace analyzer, the CLI's --help) must not pay for the config
# module (~15 ms) or for building torch modules; each name is imported on first use.
_LAZY = {"ModelConfig": "deltamoe.config", "load_config": "deltamoe.hf_config", "load_preset": "deltamoe.config",
         "load_model": "deltamoe.model.load", "save_checkpoint": "deltamoe.model.weights"}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'deltamoe' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)

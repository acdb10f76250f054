"""deltamoe: the Kimi Linear / K3 / K3.1 hybrid-attention MoE family in readable PyTorch."""

from deltamoe.config import ModelConfig, load_config, load_preset
from deltamoe.errors import CheckpointError, ConfigError, DeltaMoEError

__version__ = "0.1.0"

__all__ = ["ModelConfig", "load_config", "load_preset", "load_model", "save_checkpoint",
           "CheckpointError", "ConfigError", "DeltaMoEError"]


def __getattr__(name: str):
    # Lazy: `import deltamoe` for config or the CLI must not pay for building torch modules.
    if name == "load_model":
        from deltamoe.model.load import load_model

        return load_model
    if name == "save_checkpoint":
        from deltamoe.model.weights import save_checkpoint

        return save_checkpoint
    raise AttributeError(name)

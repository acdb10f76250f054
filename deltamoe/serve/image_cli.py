"""Images on the command line: `deltamoe generate --image PATH` and `/image PATH` in `deltamoe chat`."""

from __future__ import annotations

from pathlib import Path

from deltamoe.config import ModelConfig
from deltamoe.errors import ConfigError, RequestError
from deltamoe.hf_config import load_config


def check_image_model(model: str, paths: list[str]) -> ModelConfig | None:
    """The model's config when images are given (before anything loads); an error if it cannot see."""
    if not paths:
        return None
    config = load_config(model)
    if config.vision is None:
        raise ConfigError(f"{model} has no vision tower (its config has no vision section)", field="image")
    for p in paths:
        if Path(p).is_dir():
            raise ConfigError(f"{p} is a directory; expected an image file", field="image")
        if not Path(p).is_file():
            raise ConfigError(f"no such file: {p}", field="image")
    return config


def load_cli_images(paths: list[str], config: ModelConfig | None) -> list:
    """Decode and prepare the images (errors name the file)."""
    from deltamoe.vision.preprocess import load_image

    return [load_image(p, config.vision, field=f"image {p}") for p in paths] if config is not None else []


def placeholder_tokens(config: ModelConfig, images: list) -> list[list[int]]:
    """What ChatTemplate.encode writes for each image mark: its placeholder tokens."""
    return [[config.media_placeholder_token_id] * img.num_tokens for img in images]


def read_chat_image(line: str, config: ModelConfig) -> object:
    """`/image PATH` -> the prepared image; a RequestError naming the file if it is unusable."""
    path = line.strip()[len("/image"):].strip()
    if not path:
        raise RequestError("usage: /image PATH", field="/image")
    if config.vision is None:
        raise RequestError("this model has no vision tower", field="/image")
    from deltamoe.vision.preprocess import load_image

    return load_image(path, config.vision, field=f"/image {path}")

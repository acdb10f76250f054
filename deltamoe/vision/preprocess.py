"""Image bytes or a file -> a normalised [3, H, W] float tensor the vision tower takes.

- Decoding: Pillow, with every failure a `RequestError` that names the problem: not an image /
  unsupported format, truncated or corrupt data, zero size, more pixels than `max_pixels`
  (Pillow's decompression-bomb guard, checked from the header before any pixel is decoded).
- Size: H and W become multiples of patch_size * merge (so the 2x2 merge has whole
  neighbourhoods), keeping the aspect ratio, scaled down (never up) until the image fits
  `max_tokens` placeholder tokens; one merge cell (patch * merge) is the smallest side.
- Colour: converted to RGB (palette, grey, CMYK; alpha composited on white), bicubic resize, then
  (x / 255 - mean) / std per channel (CLIP's constants, as MoonViT's processor uses).
"""

from __future__ import annotations

import hashlib
import io
import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from deltamoe.config import VisionConfig
from deltamoe.errors import RequestError

if TYPE_CHECKING:  # torch loads with the first image: the chat template imports this module
    import torch

IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)
FORMATS = ("PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF")  # what a request may carry


@dataclass(frozen=True)
class ImageLimits:
    """What one image may cost. max_tokens bounds the placeholder tokens after resizing;
    max_pixels (before resizing) and max_bytes bound decoding work and memory."""

    max_tokens: int = 1024
    max_pixels: int = 40_000_000
    max_bytes: int = 20 * 1024 * 1024

    def check_fields(self) -> None:
        for name in ("max_tokens", "max_pixels", "max_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise RequestError(f"expected a positive integer, got {value!r}", field=f"image_limits.{name}")


@dataclass(frozen=True)
class PreparedImage:
    """One image ready for the tower: pixels [3, H, W], its placeholder token count, a content hash."""

    pixels: torch.Tensor
    num_tokens: int
    content_hash: int  # of the decoded, resized pixels: equal images share prefix-cache blocks

    @property
    def size(self) -> tuple[int, int]:
        return int(self.pixels.shape[-2]), int(self.pixels.shape[-1])


def load_image(source: bytes | str | Path, vision: VisionConfig, limits: ImageLimits = ImageLimits(),
               field: str = "image") -> PreparedImage:
    """Decode (bytes, or a file path) and prepare one image; a RequestError naming `field` on bad input."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        try:
            size = path.stat().st_size
            if size > limits.max_bytes:
                raise RequestError(f"{path} is {size} bytes, over the limit of {limits.max_bytes}", field=field)
            data = path.read_bytes()
        except OSError as e:
            raise RequestError(f"cannot read {path}: {e.strerror or e}", field=field) from None
    else:
        data = source
    return prepare_image(decode_image(data, limits, field), vision, limits, field)


def decode_image(data: bytes, limits: ImageLimits = ImageLimits(), field: str = "image"):
    """Bytes -> an RGB PIL image, fully decoded; every failure a RequestError naming the problem."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise RequestError("the image is empty (0 bytes)", field=field)
    if len(data) > limits.max_bytes:
        raise RequestError(f"the image is {len(data)} bytes, over the limit of {limits.max_bytes}", field=field)
    try:
        with warnings.catch_warnings():
            # Pillow warns (and past twice the limit, raises) on decompression bombs; both are errors here.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            if img.format not in FORMATS:
                raise RequestError(f"unsupported image format {img.format}; expected one of {', '.join(FORMATS)}",
                                   field=field)
            w, h = img.size
            if w < 1 or h < 1:
                raise RequestError(f"the image has zero size ({w}x{h})", field=field)
            if w * h > limits.max_pixels:
                raise RequestError(f"the image is {w}x{h} = {w * h} pixels, over the limit of {limits.max_pixels} "
                                   "(a decompression bomb?)", field=field)
            img.load()
    except RequestError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        # Pillow's own check fires in Image.open, before ours, past its limit (89 M pixels, 179 M for
        # the error): the message names our limit, whichever check stopped it.
        found = re.search(r"\((\d+) pixels\)", str(e))
        size = f"{int(found.group(1))} pixels" if found else "too many pixels"
        limit = min(limits.max_pixels, Image.MAX_IMAGE_PIXELS or limits.max_pixels)
        raise RequestError(f"the image is {size}, over the limit of {limit} (a decompression bomb?)",
                           field=field) from None
    except UnidentifiedImageError:
        raise RequestError(f"not an image, or an unsupported format (expected one of {', '.join(FORMATS)})",
                           field=field) from None
    except (OSError, SyntaxError, ValueError) as e:  # truncated data, corrupt chunks, bad headers
        raise RequestError(f"the image is corrupt or truncated: {e}", field=field) from None
    return _to_rgb(img)


def _to_rgb(img):
    from PIL import Image

    if img.mode in ("RGBA", "LA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def target_size(height: int, width: int, vision: VisionConfig, max_tokens: int) -> tuple[int, int]:
    """(H, W): multiples of patch * merge, aspect kept, scaled down (never up) to fit max_tokens."""
    cell_h = vision.patch_size * vision.merge_kernel_size[0]
    cell_w = vision.patch_size * vision.merge_kernel_size[1]
    scale = min(1.0, math.sqrt(max_tokens * cell_h * cell_w / (height * width)))
    rows = max(1, math.floor(height * scale / cell_h + 0.5))
    cols = max(1, math.floor(width * scale / cell_w + 0.5))
    if rows * cols > max_tokens:  # rounding overshot: round down instead (fits unless one side is clamped at 1)
        rows = max(1, math.floor(height * scale / cell_h))
        cols = max(1, math.floor(width * scale / cell_w))
    while rows * cols > max_tokens:  # a very thin image: shorten the long side
        if rows > cols:
            rows -= 1
        else:
            cols -= 1
    return rows * cell_h, cols * cell_w


def image_token_count(vision: VisionConfig, height: int, width: int) -> int:
    """Placeholder tokens an image of height x width pixels (multiples of patch * merge) becomes."""
    return (height // (vision.patch_size * vision.merge_kernel_size[0])) * (
        width // (vision.patch_size * vision.merge_kernel_size[1]))


def prepare_image(img, vision: VisionConfig, limits: ImageLimits = ImageLimits(), field: str = "image") -> PreparedImage:
    """An RGB PIL image -> PreparedImage (resized to the grid, normalised)."""
    import torch
    from PIL import Image

    limits.check_fields()
    h, w = target_size(img.height, img.width, vision, limits.max_tokens)
    if (img.height, img.width) != (h, w):
        img = img.resize((w, h), Image.Resampling.BICUBIC)
    raw = img.tobytes()
    pixels = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(h, w, 3).permute(2, 0, 1).float() / 255.0
    mean = torch.tensor(IMAGE_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGE_STD).view(3, 1, 1)
    digest = hashlib.blake2b(raw + h.to_bytes(4, "little") + w.to_bytes(4, "little"), digest_size=8).digest()
    return PreparedImage(pixels=(pixels - mean) / std, num_tokens=image_token_count(vision, h, w),
                         content_hash=int.from_bytes(digest, "little"))

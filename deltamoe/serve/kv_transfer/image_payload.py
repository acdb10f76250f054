"""A hand-off request's images, from the decode server to the prefill server.

The decode server has parsed the request (its chat template wrote the image placeholders) and
prepared its images; the prefill server computes prompt[:-1] with them, so it needs the same
pixels and token counts. They travel inside the hand-off request's JSON as the prepared pixels' raw bytes
(base64, in their own dtype: re-encoding them would change the prompt's embeddings), not as the
client's original image file, which the prefill server would have to fetch or decode again.
The prefill side checks every field against its vision config and the prompt before decoding any
pixels, and keys its prefix cache by a hash of the bytes it received (never a key the sender names).
"""

from __future__ import annotations

import base64
import hashlib

import torch

from deltamoe.config import VisionConfig
from deltamoe.errors import RequestError
from deltamoe.vision.preprocess import PreparedImage, image_token_count

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FIELD = "kv_transfer.images"


def images_to_json(images: list[PreparedImage]) -> list[dict]:
    out = []
    for img in images:
        pixels = img.pixels.detach().cpu().contiguous()
        out.append({"shape": list(pixels.shape), "dtype": str(pixels.dtype).removeprefix("torch."),
                    "num_tokens": img.num_tokens,
                    "data": base64.b64encode(pixels.view(torch.uint8).numpy().tobytes()).decode("ascii")})
    return out


def images_from_json(items: object, vision: VisionConfig | None, max_tokens: int) -> list[PreparedImage] | None:
    """The images of a hand-off request (None when it has none); RequestError naming what is wrong.
    `max_tokens`: the most placeholder tokens they may take together (the prompt's length), checked
    before any pixels are decoded."""
    if items is None:
        return None
    if vision is None:
        raise RequestError("the request carries images but this model has no vision tower", field=FIELD)
    if not isinstance(items, list) or not items:
        raise RequestError("expected a non-empty list", field=FIELD)
    images, total = [], 0
    for k, item in enumerate(items):
        image = _image(item, vision, f"{FIELD}[{k}]", max_tokens - total)
        total += image.num_tokens
        images.append(image)
    return images


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _image(item: object, vision: VisionConfig, field: str, tokens_left: int) -> PreparedImage:
    if not isinstance(item, dict) or not isinstance(item.get("shape"), list) or not all(map(_whole, item["shape"])) \
            or item.get("dtype") not in _DTYPES or not _whole(item.get("num_tokens")) \
            or not isinstance(item.get("data"), str):
        raise RequestError(f"malformed image; expected shape (integers), dtype ({'/'.join(_DTYPES)}), num_tokens "
                           "(an integer), data (base64)", field=field)
    shape, dtype, num_tokens = item["shape"], _DTYPES[item["dtype"]], item["num_tokens"]
    if len(shape) != 3 or shape[0] != 3 or min(shape) < 1:
        raise RequestError(f"shape {shape}: expected [3, H, W]", field=field)
    cell_h = vision.patch_size * vision.merge_kernel_size[0]
    cell_w = vision.patch_size * vision.merge_kernel_size[1]
    if shape[1] % cell_h or shape[2] % cell_w:  # what the decode side's preprocessing makes
        raise RequestError(f"shape {shape}: H and W must be multiples of {cell_h} x {cell_w}", field=field)
    if num_tokens != image_token_count(vision, shape[1], shape[2]):
        raise RequestError(f"num_tokens {num_tokens} does not match a {shape[1]} x {shape[2]} image "
                           f"({image_token_count(vision, shape[1], shape[2])})", field=field)
    if num_tokens > tokens_left:
        raise RequestError("the images take more placeholder tokens than the prompt holds", field=field)
    expect = shape[0] * shape[1] * shape[2] * dtype.itemsize
    if len(item["data"]) != 4 * -(-expect // 3):  # base64's length, before decoding anything
        raise RequestError(f"{len(item['data'])} base64 characters, expected {4 * -(-expect // 3)} for {shape} "
                           f"{item['dtype']}", field=field)
    try:
        data = base64.b64decode(item["data"], validate=True)
    except ValueError:
        raise RequestError("data is not base64", field=field) from None
    pixels = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).view(shape)
    if not bool(torch.isfinite(pixels).all()):
        raise RequestError("pixels hold NaN or inf", field=field)
    # The prefix-cache key comes from the bytes received, never from the sender: a key that names
    # other pixels would hand later requests the wrong image's cache.
    digest = hashlib.blake2b(data + bytes(str(shape) + item["dtype"], "ascii"), digest_size=8).digest()
    return PreparedImage(pixels, num_tokens, int.from_bytes(digest, "little"))

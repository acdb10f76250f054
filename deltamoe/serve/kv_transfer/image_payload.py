"""A hand-off request's images, from the decode server to the prefill server.

The decode server has parsed the request (its chat template wrote the image placeholders) and
prepared its images; the prefill server computes prompt[:-1] with them, so it needs the same
pixels, token counts and content hashes (the prefix cache keys placeholders by hash on both
sides). They travel inside the hand-off request's JSON as the prepared pixels' raw bytes
(base64, in their own dtype: re-encoding them would change the prompt's embeddings), not as the
client's original image file, which the prefill server would have to fetch or decode again.
The prefill side checks every field against its vision config before computing anything.
"""

from __future__ import annotations

import base64

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
                    "num_tokens": img.num_tokens, "content_hash": img.content_hash,
                    "data": base64.b64encode(pixels.view(torch.uint8).numpy().tobytes()).decode("ascii")})
    return out


def images_from_json(items: object, vision: VisionConfig | None) -> list[PreparedImage] | None:
    """The images of a hand-off request (None when it has none); RequestError naming what is wrong."""
    if items is None:
        return None
    if vision is None:
        raise RequestError("the request carries images but this model has no vision tower", field=FIELD)
    if not isinstance(items, list) or not items:
        raise RequestError("expected a non-empty list", field=FIELD)
    return [_image(item, vision, f"{FIELD}[{k}]") for k, item in enumerate(items)]


def _image(item: object, vision: VisionConfig, field: str) -> PreparedImage:
    try:
        shape = [int(n) for n in item["shape"]]
        dtype = _DTYPES[item["dtype"]]
        num_tokens, content_hash = int(item["num_tokens"]), int(item["content_hash"])
        data = base64.b64decode(item["data"], validate=True)
    except (KeyError, TypeError, ValueError) as e:
        raise RequestError(f"malformed image ({e!r}); expected shape, dtype ({'/'.join(_DTYPES)}), num_tokens, "
                           "content_hash, data (base64)", field=field) from None
    if len(shape) != 3 or shape[0] != 3 or min(shape) < 1:
        raise RequestError(f"shape {shape}: expected [3, H, W]", field=field)
    expect = shape[0] * shape[1] * shape[2] * dtype.itemsize
    if len(data) != expect:
        raise RequestError(f"{len(data)} bytes of pixels, expected {expect} for {shape} {item['dtype']}", field=field)
    if num_tokens != image_token_count(vision, shape[1], shape[2]) or num_tokens < 1:
        raise RequestError(f"num_tokens {num_tokens} does not match a {shape[1]} x {shape[2]} image "
                           f"({image_token_count(vision, shape[1], shape[2])})", field=field)
    pixels = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).view(shape)
    return PreparedImage(pixels, num_tokens, content_hash)

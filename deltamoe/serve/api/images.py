"""OpenAI `image_url` content parts -> prepared images + chat messages with image marks.

A message's content list may hold `{"type": "image_url", "image_url": {"url": ...}}` parts (or
`"image_url": "..."`). `data:` URLs with base64 payloads are always accepted; http(s) URLs only
when the server was started with `--allow-image-urls` (`ImageOptions.allow_urls`), and then
with a byte limit and a time limit per download. The part becomes IMAGE_MARK in the message
text, which `ChatTemplate.encode` expands to the image's placeholder tokens. Every failure is
a RequestError naming the part (`messages[i].content[j].image_url`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from dataclasses import dataclass, field
from collections.abc import Callable, Iterator
from typing import Any

from deltamoe.config import ModelConfig
from deltamoe.errors import RequestError
from deltamoe.vision.preprocess import ImageLimits, PreparedImage, decode_image, prepare_image

IMAGE_MARK = "\x00image\x00"  # where an image's placeholder tokens go in a message's text


@dataclass(frozen=True)
class ImageOptions:
    """What the server accepts as images. URLs are fetched only when allow_urls (a server flag)."""

    allow_urls: bool = False
    fetch_timeout_s: float = 10.0
    limits: ImageLimits = field(default_factory=ImageLimits)
    max_images: int = 8  # per request


@dataclass(frozen=True)
class ImageRef:
    url: str
    field: str


def extract_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[ImageRef]]:
    """Messages with each image part replaced by a text part IMAGE_MARK, and the images in order."""
    refs: list[ImageRef] = []
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str) and IMAGE_MARK in content:
            raise RequestError("text must not contain NUL characters around 'image'", field=f"messages[{i}].content")
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            if isinstance(part, dict) and part.get("type") == "text" and IMAGE_MARK in str(part.get("text")):
                raise RequestError("text must not contain NUL characters around 'image'", field=f"{where}.text")
            if not (isinstance(part, dict) and part.get("type") == "image_url"):
                parts.append(part)
                continue
            spec = part.get("image_url")
            url = spec.get("url") if isinstance(spec, dict) else spec
            if not isinstance(url, str) or not url:
                raise RequestError("expected an object with a 'url' string", field=f"{where}.image_url")
            refs.append(ImageRef(url, f"{where}.image_url"))
            parts.append({"type": "text", "text": IMAGE_MARK})
        out.append({**m, "content": parts})
    return out, refs


def expand_images(encode: Callable[[str], list[int]], text: str, images: Iterator[list[int]]) -> list[int]:
    """Encode text whose IMAGE_MARKs become the next image's tokens from `images`."""
    if IMAGE_MARK not in text:
        return encode(text)
    pieces = text.split(IMAGE_MARK)
    ids = encode(pieces[0]) if pieces[0] else []
    for piece in pieces[1:]:
        tokens = next(images, None)
        if tokens is None:
            raise RequestError("an image part has no image", field="messages")
        ids += tokens + (encode(piece) if piece else [])
    return ids


async def load_images(refs: list[ImageRef], config: ModelConfig, options: ImageOptions) -> list[PreparedImage]:
    """Download (if allowed) / decode / prepare each image; decoding runs off the event loop."""
    if refs and config.vision is None:
        raise RequestError("this model has no vision tower; send text only", field=refs[0].field)
    if len(refs) > options.max_images:
        raise RequestError(f"{len(refs)} images, over the limit of {options.max_images} per request "
                           "(the server's --image-max-count)",
                           field=refs[options.max_images].field)
    out = []
    for ref in refs:
        data = await _image_bytes(ref, options)
        img = await asyncio.to_thread(lambda d=data, f=ref.field: prepare_image(
            decode_image(d, options.limits, f), config.vision, options.limits, f))
        out.append(img)
    return out


def forgiving_base64(payload: str) -> bytes:
    """A data URL's payload as browsers read it (WHATWG "forgiving-base64"): ASCII whitespace
    dropped (`base64` wraps its output at 76 columns) and the `=` padding optional."""
    compact = "".join(payload.split())
    if len(compact) % 4 == 1:
        raise ValueError("a base64 payload cannot be 1 character past a multiple of 4")
    return base64.b64decode(compact + "=" * (-len(compact) % 4), validate=True)


async def _image_bytes(ref: ImageRef, options: ImageOptions) -> bytes:
    url = ref.url
    scheme = url.partition(":")[0].lower()  # URL schemes are case-insensitive
    if scheme == "data":
        header, sep, payload = url.partition(",")
        if not sep or not header.lower().endswith(";base64"):
            raise RequestError("expected a data URL of the form data:image/<type>;base64,<data>", field=ref.field)
        if len(payload) > (options.limits.max_bytes * 4 // 3 + 4) * 78 // 76:  # wrapped base64 too (CRLF every 76)
            raise RequestError(f"the image is over the limit of {options.limits.max_bytes} bytes", field=ref.field)
        try:
            return forgiving_base64(payload)
        except (binascii.Error, ValueError):
            raise RequestError("the data URL's payload is not valid base64", field=ref.field) from None
    if scheme in ("http", "https"):
        if not options.allow_urls:
            raise RequestError("image URLs are not fetched by this server; send a data: URL (base64), or start "
                               "the server with --allow-image-urls", field=ref.field)
        return await _download(url, ref.field, options)
    raise RequestError("expected a data: URL (or http(s) when the server allows image URLs)", field=ref.field)


async def _download(url: str, where: str, options: ImageOptions) -> bytes:
    import httpx

    limit = options.limits.max_bytes

    async def fetch() -> bytes:
        async with httpx.AsyncClient(timeout=options.fetch_timeout_s, follow_redirects=False) as client:
            async with client.stream("GET", url) as resp:
                if resp.status_code != 200:
                    raise RequestError(f"fetching the image gave HTTP {resp.status_code}", field=where)
                body = bytearray()
                async for chunk in resp.aiter_bytes():
                    body += chunk
                    if len(body) > limit:
                        raise RequestError(f"the image is over the limit of {limit} bytes", field=where)
                return bytes(body)

    try:
        return await asyncio.wait_for(fetch(), options.fetch_timeout_s)
    except RequestError:
        raise
    except (asyncio.TimeoutError, httpx.TimeoutException):
        raise RequestError(f"fetching the image took longer than {options.fetch_timeout_s:g} s", field=where) from None
    except httpx.HTTPError as e:
        raise RequestError(f"cannot fetch the image: {e}", field=where) from None

"""Pillow preprocessing: sizes on the patch grid within the token budget, RGB + normalisation, and a
clear error for every kind of bad image."""

import io
import struct
import zlib

import pytest
import torch
from PIL import Image

from deltamoe.config import load_preset
from deltamoe.errors import RequestError
from deltamoe.vision.preprocess import IMAGE_MEAN, IMAGE_STD, ImageLimits, load_image, target_size

V = load_preset("tiny-vision").vision  # patch 8, merge 2x2: one token per 16x16 cell


def png(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def test_sizes_keep_aspect_and_fit_the_budget():
    assert target_size(64, 64, V, 1024) == (64, 64)  # already on the grid: unchanged
    assert target_size(20, 70, V, 1024) == (16, 64)  # snapped to 16-pixel cells, never scaled up
    assert target_size(4, 4, V, 1024) == (16, 16)  # at least one cell
    h, w = target_size(3000, 1000, V, 64)
    assert (h // 16) * (w // 16) <= 64 and 2.5 <= h / w <= 3.5
    for hh, ww, budget in ((999, 17, 5), (640, 480, 12), (1, 5000, 3)):
        h, w = target_size(hh, ww, V, budget)
        assert h % 16 == 0 and w % 16 == 0 and (h // 16) * (w // 16) <= budget


def test_pixels_are_rgb_normalised_and_hashed():
    red = Image.new("RGB", (32, 48), (255, 0, 0))
    img = load_image(png(red), V)
    assert img.pixels.shape == (3, 48, 32) and img.num_tokens == 3 * 2
    want = [(1.0 - IMAGE_MEAN[0]) / IMAGE_STD[0], -IMAGE_MEAN[1] / IMAGE_STD[1], -IMAGE_MEAN[2] / IMAGE_STD[2]]
    torch.testing.assert_close(img.pixels[:, 0, 0], torch.tensor(want))
    grey = load_image(png(Image.new("L", (32, 48), 255)), V)  # grey -> RGB
    assert grey.pixels.shape == (3, 48, 32)
    clear = load_image(png(Image.new("RGBA", (32, 48), (0, 0, 0, 0))), V)  # alpha on white
    torch.testing.assert_close(clear.pixels, load_image(png(Image.new("RGB", (32, 48), "white")), V).pixels)
    assert load_image(png(red, "JPEG"), V).pixels.shape == (3, 48, 32)
    assert load_image(png(red), V).content_hash == img.content_hash != grey.content_hash


@pytest.mark.parametrize("data, words", [
    (b"", "empty"),
    (b"hello, not an image", "not an image"),
    (png(Image.new("RGB", (40, 40), "blue"))[:60], "truncated"),
    (png(Image.new("RGB", (40, 40), "blue"), "ICO"), "unsupported image format ICO"),
])
def test_bad_images_say_what_is_wrong(data, words):
    with pytest.raises(RequestError, match=words) as e:
        load_image(data, V, field="messages[0].content[1]")
    assert e.value.field == "messages[0].content[1]"


def test_corrupt_pixel_data():
    data = bytearray(png(Image.effect_noise((64, 64), 50).convert("RGB")))
    data[100:160] = bytes(60)  # zeroed compressed stream inside IDAT
    with pytest.raises(RequestError, match="corrupt or truncated"):
        load_image(bytes(data), V)


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares width x height pixels and carries none: decoding must stop at the header."""
    ihdr = b"IHDR" + struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + ihdr + struct.pack(">I", zlib.crc32(ihdr))
            + struct.pack(">I", 0) + b"IEND" + struct.pack(">I", zlib.crc32(b"IEND")))


def test_decompression_bomb_is_refused_before_decoding():
    with pytest.raises(RequestError, match="2000x2000 = 4000000 pixels, over the limit of 1000000"):
        load_image(png_header(2000, 2000), V, ImageLimits(max_pixels=1_000_000))
    with pytest.raises(RequestError, match="over the limit of 40000000"):
        load_image(png_header(8000, 8000), V)
    # Past 89 M pixels Pillow's own guard stops it in Image.open, before ours: the message still
    # names the limit that holds (it named Pillow's 89478485 or 178956970, whatever ours said).
    with pytest.raises(RequestError, match="is 400000000 pixels, over the limit of 40000000"):
        load_image(png_header(20_000, 20_000), V)
    with pytest.raises(RequestError, match="is 10000000000 pixels, over the limit of 89478485"):
        load_image(png_header(100_000, 100_000), V, ImageLimits(max_pixels=10**12))
    with pytest.raises(RequestError, match="bytes, over the limit of 10"):
        load_image(png_header(20, 20), V, ImageLimits(max_bytes=10))


def test_zero_size_and_missing_file(tmp_path):
    # a GIF header declaring a 0 x 0 screen
    gif = b"GIF89a" + (0).to_bytes(2, "little") + (0).to_bytes(2, "little") + b"\x00\x00\x00;"
    with pytest.raises(RequestError, match="zero size|corrupt|not an image"):
        load_image(gif, V)
    with pytest.raises(RequestError, match="cannot read"):
        load_image(tmp_path / "missing.png", V)

"""Image decoding, validation and resizing (engine/vision/image.py): formats, EXIF orientation, GIF first
frame, transparency, refusals with clear messages, Qwen's smart resize and Gemma's letterbox."""
from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from engine.vision import ImageError, image_hash, letterbox, load_image, smart_resize


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def pattern(w=40, h=30) -> Image.Image:
    """Distinct quadrants, so orientation mistakes show."""
    a = np.zeros((h, w, 3), np.uint8)
    a[: h // 2, : w // 2] = (255, 0, 0)
    a[: h // 2, w // 2:] = (0, 255, 0)
    a[h // 2:, : w // 2] = (0, 0, 255)
    a[h // 2:, w // 2:] = (255, 255, 0)
    return Image.fromarray(a)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_accepted_formats(fmt, tmp_path):
    src = pattern()
    data = encode(src, fmt, **({"quality": 95} if fmt == "JPEG" else {"lossless": True} if fmt == "WEBP" else {}))
    for given in (data, "data:image/x;base64," + base64.b64encode(data).decode(), tmp_path / f"x.{fmt.lower()}"):
        if not isinstance(given, (bytes, str)):
            given.write_bytes(data)
        img = load_image(given)
        assert img.mode == "RGB" and img.size == (40, 30)
        assert np.abs(np.asarray(img, np.int16)[5, 5] - (255, 0, 0)).max() < 40   # top-left stays red
    if fmt in ("PNG", "BMP", "WEBP"):
        assert image_hash(load_image(data)) == image_hash(src)   # lossless: same pixels, same hash


def test_exif_orientation_applied():
    src = pattern(40, 30)
    exif = Image.Exif()
    exif[0x0112] = 6          # "rotate 90 CW to view"
    img = load_image(encode(src, "JPEG", quality=95, exif=exif.tobytes()))
    assert img.size == (30, 40)
    # rotated clockwise: the old bottom-left (blue) quadrant is now top-left
    assert np.abs(np.asarray(img, np.int16)[5, 5] - (0, 0, 255)).max() < 40


def test_gif_first_frame():
    frames = [Image.new("RGB", (16, 16), c) for c in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    img = load_image(buf.getvalue())
    assert img.getpixel((8, 8)) == (255, 0, 0)


def test_transparency_over_white():
    rgba = Image.new("RGBA", (8, 8), (0, 0, 0, 0))
    rgba.putpixel((0, 0), (10, 20, 30, 255))
    img = load_image(encode(rgba, "PNG"))
    assert img.getpixel((4, 4)) == (255, 255, 255) and img.getpixel((0, 0)) == (10, 20, 30)
    gray16 = Image.fromarray(np.full((4, 4), 65535, np.uint16))
    assert load_image(encode(gray16, "PNG")).getpixel((0, 0)) == (255, 255, 255)


def _png_claiming(w: int, h: int) -> bytes:
    """A tiny PNG whose header claims w x h pixels (valid CRC; no data to back it)."""
    data = encode(Image.new("RGB", (1, 1)), "PNG")
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return data[:8] + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk)) + data[33:]


@pytest.mark.parametrize("data, message", [
    (b"", "empty"),
    (b"hello, this is not an image at all", "not a PNG, JPEG, WebP, GIF or BMP"),
    (encode(pattern(), "TIFF"), "TIFF image; accepted formats"),
    (encode(pattern(), "PNG")[:60], "damaged"),
    (encode(pattern(), "JPEG")[:300], "damaged"),
    (_png_claiming(20000, 20000), "400.0 megapixels"),
    (_png_claiming(9000, 9000), "81.0 megapixels"),
    ("data:image/png;base64,@@@", "base64"),
    ("data:image/png,rawdata", "base64"),
    ("https://example.com/cat.png", "not fetched"),
    ("/no/such/file.png", "not found"),
    (12345, "must be bytes"),
])
def test_refused_with_clear_messages(data, message):
    with pytest.raises(ImageError, match=message):
        load_image(data)
    assert issubclass(ImageError, ValueError)


def test_limits_are_parameters():
    data = encode(pattern(100, 100), "PNG")
    with pytest.raises(ImageError, match="limit is 0.0 MB"):
        load_image(data, max_bytes=10)
    with pytest.raises(ImageError, match="100x100 pixels"):
        load_image(data, max_pixels=5000)
    assert load_image(data, max_pixels=10000).size == (100, 100)


def test_smart_resize_matches_transformers():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize
    lo, hi = 65536, 16384 * 1024
    for h, w in [(768, 1024), (1080, 1920), (37, 50), (4000, 3000), (32, 32), (10000, 100), (333, 777)]:
        ours = smart_resize(h, w, 32, lo, hi)
        assert ours == tuple(hf_smart_resize(h, w, factor=32, min_pixels=lo, max_pixels=hi)), (h, w)
        assert ours[0] % 32 == 0 and ours[1] % 32 == 0 and lo <= ours[0] * ours[1] <= hi
    assert smart_resize(768, 1024, 32, 65536, 4096 * 1024) == (768, 1024)   # 24 x 32 tokens of 2x2 patches
    with pytest.raises(ImageError, match="ratio"):
        smart_resize(10, 5000, 32, lo, hi)


def test_letterbox():
    out = letterbox(pattern(200, 100), 64)
    a = np.asarray(out)
    assert out.size == (64, 64)
    assert (a[:16] == 0).all() and (a[48:] == 0).all()          # black bars above and below
    assert tuple(a[20, 5]) == (255, 0, 0) and tuple(a[40, 60]) == (255, 255, 0)
    assert letterbox(pattern(64, 64), 64).size == (64, 64)

"""Image input: decoding and validation (`load_image`), content hashing, and the two resize schemes
the supported projectors use. Everything here runs before any model work, so a bad image is refused
with a clear message (`ImageError`, a ValueError: HTTP 400) in the caller's thread.

Accepted formats: PNG, JPEG (including the MPO multi-picture JPEGs phones write), WebP, GIF (first
frame) and BMP. EXIF orientation is applied; transparency is composited over white (as Qwen's own
image utilities do); the result is always an 8-bit RGB `PIL.Image`, fully decoded.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import os
import re
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

try:
    from PIL import Image, ImageOps, UnidentifiedImageError
except ImportError:  # pragma: no cover - Pillow is a main dependency
    Image = None

DEFAULT_MAX_BYTES = 20 * 1024 * 1024        # encoded size (a 4K PNG screenshot is ~10 MB)
DEFAULT_MAX_PIXELS = 50_000_000             # decoded size, checked from the header before decoding
MAX_ASPECT_RATIO = 200                      # Qwen's processor refuses more extreme shapes

ACCEPTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")   # JPEG also opens MPO (multi-picture) files
_ACCEPTED_TEXT = "PNG, JPEG, WebP, GIF or BMP"


class ImageError(ValueError):
    """An image that cannot be used: unreadable, of a format we do not take, damaged, or too large.
    The message says which, in words a person can act on."""


def _require_pillow() -> None:
    if Image is None:  # pragma: no cover
        raise ImageError("image input needs the Pillow package (pip install Pillow)")


def _mb(n: int) -> str:
    return f"{n / (1024 * 1024):.1f} MB"


def _decode_data_url(url: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep:
        raise ImageError("a data: URL needs a comma before its data (data:image/png;base64,...)")
    if ";base64" not in head:
        raise ImageError("data: URLs must be base64-encoded (data:image/png;base64,...)")
    try:
        return base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the data: URL's base64 data is not valid") from None


def _read_source(data: Any, max_bytes: int) -> tuple[bytes | None, "Image.Image | None", str]:
    """(encoded bytes or None, an already-open PIL image or None, a short description for messages)."""
    if Image is not None and isinstance(data, Image.Image):
        return None, data, "image"
    if isinstance(data, (bytes, bytearray, memoryview)):
        raw = bytes(data)
        where = "image"
    elif isinstance(data, str) and data.startswith("data:"):
        # reject obviously oversized payloads before decoding the base64 (4 chars per 3 bytes)
        if len(data) > max_bytes * 4 // 3 + 1024:
            raise ImageError(f"image is about {_mb(len(data) * 3 // 4)}; the limit is {_mb(max_bytes)}")
        raw = _decode_data_url(data)
        where = "image"
    elif isinstance(data, str) and data.split(":", 1)[0].lower() in ("http", "https", "ftp", "file"):
        raise ImageError("image URLs are not fetched by the engine; pass the image bytes, a data: URL or a file path")
    elif isinstance(data, (str, os.PathLike)):
        p = Path(data)
        where = f"image file {p.name!r}"
        try:
            size = p.stat().st_size
        except OSError:
            raise ImageError(f"{where} was not found") from None
        if not p.is_file():
            raise ImageError(f"{where} is not a file")
        if size > max_bytes:
            raise ImageError(f"{where} is {_mb(size)}; the limit is {_mb(max_bytes)}")
        try:
            raw = p.read_bytes()
        except OSError as e:
            raise ImageError(f"{where} cannot be read ({e.strerror or e})") from None
    else:
        raise ImageError(f"an image must be bytes, a file path, a data: URL or a PIL image, not {type(data).__name__}")
    if not raw:
        raise ImageError(f"{where} is empty (0 bytes)")
    if len(raw) > max_bytes:
        raise ImageError(f"{where} is {_mb(len(raw))}; the limit is {_mb(max_bytes)}")
    return raw, None, where


def _open(raw: bytes, where: str) -> "Image.Image":
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(raw), formats=ACCEPTED_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        m = re.search(r"\((\d+) pixels\)", str(e))
        size = f" ({int(m.group(1)) / 1e6:.1f} megapixels)" if m else ""
        raise ImageError(f"{where} is too large to decode safely{size}") from None
    except UnidentifiedImageError:
        pass
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise ImageError(f"{where} is damaged and cannot be read ({e})") from None
    # Not one of ours: say which format it is when Pillow knows it (header only, nothing decoded).
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fmt = Image.open(io.BytesIO(raw)).format
    except Exception:  # noqa: BLE001 - any failure just means "unknown"
        fmt = None
    if fmt:
        raise ImageError(f"{where} is a {fmt} image; accepted formats are {_ACCEPTED_TEXT}")
    raise ImageError(f"{where} is not a {_ACCEPTED_TEXT} image, or it is damaged")


def _to_rgb(img: "Image.Image") -> "Image.Image":
    mode = img.mode
    if mode == "RGB":
        return img
    if mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        a = np.asarray(img, dtype=np.float64)
        top = 65535.0 if mode.startswith("I;16") else max(float(a.max()), 1.0)
        return Image.fromarray(np.clip(a * (255.0 / top), 0, 255).astype(np.uint8), "L").convert("RGB")
    if mode == "P":
        img = img.convert("RGBA" if "transparency" in img.info else "RGB")
        mode = img.mode
    if mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        out = Image.new("RGB", rgba.size, (255, 255, 255))
        out.paste(rgba, mask=rgba.getchannel("A"))
        return out
    return img.convert("RGB")


def load_image(data: "bytes | str | os.PathLike | Image.Image", max_bytes: int = DEFAULT_MAX_BYTES,
               max_pixels: int = DEFAULT_MAX_PIXELS) -> "Image.Image":
    """Decode and validate one image; returns a fully loaded 8-bit RGB `PIL.Image`.

    `data`: the encoded bytes, a `data:` URL (base64), a file path, or a PIL image. Refused with an
    `ImageError` (a ValueError) naming the problem: empty, over `max_bytes` encoded, a format other
    than PNG/JPEG/WebP/GIF/BMP, over `max_pixels` decoded (checked from the header, before decoding),
    damaged or truncated data. Applies EXIF orientation; an animated GIF/WebP gives its first frame;
    transparency is composited over white. URLs (http, https, file) are not fetched here."""
    _require_pillow()
    raw, img, where = _read_source(data, max_bytes)
    if img is None:
        img = _open(raw, where)
    w, h = img.size
    if w <= 0 or h <= 0:
        raise ImageError(f"{where} has no pixels ({w}x{h})")
    if w * h > max_pixels:
        raise ImageError(f"{where} is {w}x{h} pixels ({w * h / 1e6:.1f} megapixels); "
                         f"the limit is {max_pixels / 1e6:.1f} megapixels")
    try:
        if getattr(img, "n_frames", 1) > 1:
            img.seek(0)              # animated GIF / WebP: the first frame
        img.load()
    except (OSError, ValueError, SyntaxError, EOFError, IndexError, struct.error) as e:
        raise ImageError(f"{where} is damaged or truncated and cannot be decoded ({e})") from None
    try:
        img = ImageOps.exif_transpose(img) or img
    except Exception:  # noqa: BLE001 - unreadable EXIF: keep the pixels as stored
        pass
    return _to_rgb(img)


def image_hash(img: "Image.Image") -> str:
    """sha256 of the decoded pixels (width, height, RGB bytes): the same picture gives the same hash
    whatever file format or metadata carried it. Keys the embedding cache and, later, the prefix cache."""
    h = hashlib.sha256()
    h.update(f"{img.width}x{img.height}:{img.mode}:".encode())
    h.update(img.tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# resizing

def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen's aspect-preserving target size (transformers' qwen2_vl smart_resize): both sides a
    multiple of `factor` (patch size x merge size), the area within [min_pixels, max_pixels].
    Returns (height, width)."""
    if height <= 0 or width <= 0:
        raise ImageError(f"image has no pixels ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(f"image is {width}x{height} pixels: a side ratio over {MAX_ASPECT_RATIO}:1 is not supported")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def letterbox(img: "Image.Image", size: int, resample=None, fill=(0, 0, 0)) -> "Image.Image":
    """Fit the image into a size x size square keeping its aspect ratio, centred on a `fill`
    background (llama.cpp's resize-with-padding: new side = ceil(side * scale), offsets halved)."""
    resample = Image.BILINEAR if resample is None else resample
    w, h = img.size
    if (w, h) == (size, size):
        return img
    scale = min(size / w, size / h)
    nw, nh = min(math.ceil(w * scale), size), min(math.ceil(h * scale), size)
    resized = img.resize((max(nw, 1), max(nh, 1)), resample)
    out = Image.new("RGB", (size, size), tuple(fill))
    out.paste(resized, ((size - resized.width) // 2, (size - resized.height) // 2))
    return out


def to_tensor(img: "Image.Image", mean, std) -> torch.Tensor:
    """8-bit RGB -> float32 [3, H, W], (x / 255 - mean) / std per channel."""
    a = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1).float() / 255.0
    m = torch.tensor(list(mean), dtype=torch.float32)[:, None, None]
    s = torch.tensor(list(std), dtype=torch.float32)[:, None, None]
    return (a - m) / s


@dataclass
class PreparedImage:
    """An image resized and normalized for one encoder, with what the prompt needs to know."""

    pixels: torch.Tensor         # float32 [3, H, W]
    rows: int                    # output token grid (after merging / pooling)
    cols: int
    sha256: str                  # of the decoded source pixels (see image_hash)
    source_size: tuple[int, int]  # (width, height) before resizing

    @property
    def n_tokens(self) -> int:
        return self.rows * self.cols

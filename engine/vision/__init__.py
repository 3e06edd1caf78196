"""Image input: vision projectors (mmproj GGUF) and image preprocessing.

For callers above the engine (the API server, the GUI):
- `load_image(data, max_bytes=..., max_pixels=...) -> PIL.Image` decodes and validates one image
  (bytes, data: URL, file path or PIL image) and raises `ImageError` (a ValueError: HTTP 400) with a
  message a person can act on. The engine calls it too, on everything in `Request.images` and on
  image parts that carry their own data.
- `find_mmproj(model_path)` finds the projector beside a model file; `mmproj_info(path)` sizes it.

Inside the engine: `open_mmproj(path, device)` gives a `VisionEncoder` (`prepare` an image, `encode`
it to embeddings); `engine.vision.prompt` places image tokens in prompts.
"""
from engine.vision.encoders import Gemma3Encoder, MmprojError, Qwen3VLEncoder, VisionEncoder
from engine.vision.image import (ACCEPTED_FORMATS, DEFAULT_MAX_BYTES, DEFAULT_MAX_PIXELS, ImageError, PreparedImage,
                                 image_hash, letterbox, load_image, smart_resize)
from engine.vision.mmproj import ENCODERS, check_pair, find_mmproj, mmproj_info, open_mmproj

__all__ = [
    "ACCEPTED_FORMATS", "DEFAULT_MAX_BYTES", "DEFAULT_MAX_PIXELS", "ENCODERS", "Gemma3Encoder", "ImageError",
    "MmprojError", "PreparedImage", "Qwen3VLEncoder", "VisionEncoder", "check_pair", "find_mmproj", "image_hash",
    "letterbox", "load_image", "mmproj_info", "open_mmproj", "smart_resize",
]

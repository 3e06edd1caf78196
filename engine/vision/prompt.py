"""Where image tokens go in a prompt, and what the language model needs to read them.

The chat template marks each image (Qwen: `<|vision_start|><|image_pad|><|vision_end|>`, Gemma 3:
`<start_of_image>`); after tokenizing, each mark is expanded to the image's tokens as the HF
processors do:
- Qwen3.5 / Qwen3-VL: `<|vision_start|>` + rows x cols `<|image_pad|>` + `<|vision_end|>`. The image
  tokens get M-RoPE positions (t, h, w) = (p, p + row, p + col) where p is the position after the
  text before them; the text after the image continues at p + max(rows, cols) (HF's get_rope_index).
  So positions run behind token indices: `pos_delta` (<= 0) maps later indices to positions.
- Gemma 3: `\\n\\n<start_of_image>` + 256 `<image_soft_token>` + `<end_of_image>\\n\\n`; plain
  positions; the soft tokens of one image attend to each other in both directions (`bidirectional`),
  so an image's tokens are never split across two prefill chunks (`chunk_end`).

The rows of image tokens take the encoder's embeddings instead of the token embedding table
(`chunk_inputs`); their token ids are placeholders.
"""
from __future__ import annotations

import copy
import functools
import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.vision.image import ImageError, PreparedImage

IMAGE_PART_TYPES = ("image", "image_url", "input_image")


class ImageFormat:
    """How one family writes images into its prompts."""

    name = ""
    placeholder = ""          # what a template writes for one image; what users put in raw prompts
    mark = ""                 # the token counted (one per image) in the rendered text
    mrope = False
    bidirectional = False
    required_tokens: tuple[str, ...] = ()

    def __init__(self, tokenizer):
        self.tok = tokenizer
        missing = [t for t in self.required_tokens if tokenizer.token_to_id(t) is None]
        if missing:
            raise ValueError(f"the model's vocabulary has no {', '.join(missing)} token(s), which "
                             f"{self.name} image prompts need")
        self.mark_id = tokenizer.token_to_id(self.mark)

    def count(self, text: str) -> int:
        return text.count(self.mark)

    def before_tokenize(self, text: str) -> str:
        return text

    def expand(self, ids: list[int], images: list[PreparedImage]) -> tuple[list[int], list[tuple[int, int]]]:
        raise NotImplementedError


class QwenFormat(ImageFormat):
    name = "Qwen"
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    mark = "<|image_pad|>"
    mrope = True
    required_tokens = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")

    def expand(self, ids, images):
        out, spans, k = [], [], 0
        for t in ids:
            if t == self.mark_id:
                if k >= len(images):
                    raise ImageError(f"the prompt holds more {self.mark} marks than the {len(images)} image(s) given")
                spans.append((len(out), images[k].n_tokens))
                out.extend([t] * images[k].n_tokens)
                k += 1
            else:
                out.append(t)
        return out, spans


class GemmaFormat(ImageFormat):
    name = "Gemma 3"
    placeholder = "<start_of_image>"
    mark = "<start_of_image>"
    bidirectional = True
    required_tokens = ("<start_of_image>", "<end_of_image>")

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        soft = tokenizer.token_to_id("<image_soft_token>")
        # the id only marks the rows (their embeddings come from the encoder); any id will do, and
        # text-only Gemma 3 vocabularies (270m) have no soft token
        if soft is None:
            soft = tokenizer.pad_id if tokenizer.pad_id is not None else self.mark_id
        self.soft_id = soft

    def before_tokenize(self, text):
        # transformers' Gemma3Processor: boi -> "\n\n<boi>" + soft tokens + "<eoi>\n\n"
        return text.replace(self.mark, "\n\n<start_of_image><end_of_image>\n\n")

    def expand(self, ids, images):
        out, spans, k = [], [], 0
        for t in ids:
            out.append(t)
            if t == self.mark_id:
                if k >= len(images):
                    raise ImageError(f"the prompt holds more {self.mark} marks than the {len(images)} image(s) given")
                spans.append((len(out), images[k].n_tokens))
                out.extend([self.soft_id] * images[k].n_tokens)
                k += 1
        return out, spans


FORMATS = {"qwen3vl_merger": QwenFormat, "gemma3": GemmaFormat}


@dataclass
class ImageSpan:
    start: int                 # index of the image's first token in the prompt
    n_tokens: int
    rows: int
    cols: int
    sha256: str
    image: PreparedImage | None = None

    @property
    def end(self) -> int:
        return self.start + self.n_tokens

    @functools.cached_property
    def key_base(self) -> int:
        """40 bits of a hash of the image's content and size: its tokens' prefix keys (VisionPrompt.prefix_keys)."""
        return int.from_bytes(hashlib.sha256(f"{self.sha256}:{self.rows}x{self.cols}".encode()).digest()[:5], "big")


@dataclass
class VisionPrompt:
    """The image side of one tokenized prompt (recorded on the engine's sequence)."""

    spans: list[ImageSpan]
    n_prompt: int
    positions: torch.Tensor | None = None     # [n_prompt, 3] M-RoPE (t, h, w); None: plain positions
    pos_delta: int = 0                        # for token index i >= n_prompt: position i + pos_delta
    bidirectional: bool = False
    embeds: list[torch.Tensor | None] = field(default_factory=list)   # per span, set by the engine thread
    encode_ms: float = 0.0

    @property
    def encoded(self) -> bool:
        return all(e is not None for e in self.embeds)

    @property
    def hashes(self) -> list[str]:
        return [s.sha256 for s in self.spans]

    def prefix_keys(self, tokens: list[int], start: int = 0) -> list[int]:
        """tokens (this prompt's from index `start` on, maybe with generated ones after) with each image
        token replaced by a negative key made of its image's content hash, size and its index in the image:
        two prompts' keys agree exactly as far as their token ids and images do (the placeholder ids alone
        would make any two images of one size the same)."""
        keys = list(tokens)
        end = start + len(keys)
        for s in self.spans:
            lo, hi = max(s.start, start), min(s.end, end)
            for i in range(lo, hi):
                keys[i - start] = -1 - ((s.key_base << 20) | (i - s.start))     # (< 2**20 tokens an image)
        return keys

    def safe_start(self, n: int) -> int:
        """Where a reused prefix of n tokens must end instead so that the rest starts at no image's inside
        when images are attended both ways (its tokens must be read in one chunk): that image's start."""
        if self.bidirectional:
            for s in self.spans:
                if s.start < n < s.end:
                    return s.start
        return n

    def chunk_end(self, start: int, end: int) -> int:
        """Where a prefill chunk [start, end) should end instead, so that no image with
        bidirectional attention is split: before the image if it starts inside the chunk, after it
        if the chunk starts at it (such a chunk may be longer than asked)."""
        if not self.bidirectional:
            return end
        for s in self.spans:
            if s.start < end < s.end:
                end = s.start if s.start > start else s.end
        return end

    def chunk_inputs(self, start: int, end: int, device=None):
        """(positions [n, 3] or None, embeds (rows, values) or None, bidirectional spans or None)
        for the rows [start, end): prompt rows, and past the prompt the generated tokens a sequence reads
        again after a pre-emption."""
        pos = None
        if self.positions is not None:
            pos = self.positions[start:end]
            if end > self.n_prompt:
                after = self.generated_positions(max(start, self.n_prompt), end)
                pos = torch.cat([pos, after[:, None].expand(-1, pos.shape[1])])
        rows, vals, bidir = [], [], []
        for s, e in zip(self.spans, self.embeds):
            lo, hi = max(s.start, start), min(s.end, end)
            if lo >= hi:
                continue
            if e is None:
                raise RuntimeError("image embeddings are missing (the image was not encoded)")
            rows.append(torch.arange(lo - start, hi - start))
            vals.append(e[lo - s.start:hi - s.start])
            if self.bidirectional:
                bidir.append((lo, hi))
        emb = (torch.cat(rows), torch.cat(vals)) if rows else None
        return pos, emb, (bidir or None)

    def generated_positions(self, start: int, end: int) -> torch.Tensor:
        """Positions of token indices [start, end) at or after the end of the prompt."""
        return torch.arange(start, end) + self.pos_delta


def mrope_positions(n: int, spans: list[ImageSpan]) -> tuple[torch.Tensor, int]:
    """M-RoPE positions [n, 3] of a prompt of n tokens with these image spans (HF Qwen3.5
    get_rope_index), and the delta for the tokens after it."""
    pos = torch.empty(n, 3, dtype=torch.long)
    cur, i = 0, 0
    for s in sorted(spans, key=lambda s: s.start):
        k = s.start - i
        pos[i:s.start] = (torch.arange(k) + cur)[:, None]
        cur += k
        r = torch.arange(s.rows).repeat_interleave(s.cols)
        c = torch.arange(s.cols).repeat(s.rows)
        pos[s.start:s.end, 0] = cur
        pos[s.start:s.end, 1] = cur + r
        pos[s.start:s.end, 2] = cur + c
        cur += max(s.rows, s.cols)
        i = s.end
    pos[i:n] = (torch.arange(n - i) + cur)[:, None]
    cur += n - i
    return pos, cur - n


# ---------------------------------------------------------------------------------------------
# messages

def _part_source(part: dict) -> Any:
    """The image data an image part carries itself, if any (bytes, PIL image, path, data: URL)."""
    for key in ("image", "data"):
        v = part.get(key)
        if v is not None and not isinstance(v, dict):
            return v
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    if url is None and isinstance(part.get("source"), dict):       # Anthropic image block
        src = part["source"]
        if src.get("type") == "base64" and src.get("data"):
            return f"data:{src.get('media_type', 'image/png')};base64,{src['data']}"
        url = src.get("url")
    return url


def split_images(messages: list[dict], images: list) -> tuple[list[dict], list]:
    """Messages for the chat template (every image part as {"type": "image"}) and the image sources
    in prompt order. Images come from `images` (Request.images) when given, one per image part; if
    no message has image parts they go at the start of the last user message. Without `images`,
    each image part must carry its own data ("image", "image_url": {"url": "data:..."}, or an
    Anthropic "source")."""
    msgs = copy.copy(list(messages))
    found: list[tuple[int, int]] = []
    for i, m in enumerate(msgs):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                    found.append((i, j))
    sources: list = []
    if images:
        if not found:
            users = [i for i, m in enumerate(msgs) if isinstance(m, dict) and m.get("role") == "user"]
            if not users:
                raise ImageError("images were given but there is no user message to put them in")
            i = users[-1]
            m = dict(msgs[i])
            content = m.get("content")
            parts = content if isinstance(content, list) else ([{"type": "text", "text": content}] if content else [])
            m["content"] = [{"type": "image"} for _ in images] + list(parts)
            msgs[i] = m
            return msgs, list(images)
        if len(found) != len(images):
            raise ImageError(f"the messages hold {len(found)} image part(s) but {len(images)} image(s) were given")
        sources = list(images)
    else:
        for i, j in found:
            src = _part_source(msgs[i]["content"][j])
            if src is None:
                raise ImageError(f"messages[{i}].content[{j}] is an image part without image data")
            sources.append(src)
    for i in sorted({i for i, _ in found}):
        m = dict(msgs[i])
        m["content"] = [{"type": "image"} if isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES else p
                        for p in m["content"]]
        msgs[i] = m
    return msgs, sources


def flatten_images(messages: list[dict], placeholder: str) -> list[dict]:
    """For templates that know nothing of images: every list content becomes one string, text parts
    joined, each image part replaced by the model's image placeholder."""
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            m = dict(m)
            m["content"] = "".join(placeholder if isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
                                   else (p.get("text", "") if isinstance(p, dict) else "") for p in content)
        out.append(m)
    return out


def has_image_parts(messages) -> bool:
    for m in messages or ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
                                             for p in content):
            return True
    return False

"""Vision encoders read from mmproj GGUF files (llama.cpp's tools/mtmd/clip.cpp tensor names and
clip.* keys), computed in float32 with torch on any device.

- `Qwen3VLEncoder` (projector `qwen3vl_merger`: Qwen3.5 / Qwen3.6 and Qwen3-VL without deepstack),
  as HF transformers' Qwen3_5VisionModel: the Conv3d patch embedding (stored split over its two
  temporal slices, `v.patch_embd.weight` and `.weight.1`: an image is both frames, so they add up),
  the learned position table resized bilinearly (align_corners) to the patch grid, a 2D rotary
  embedding (first half of each head's rotated pairs by row, second half by column), pre-norm
  LayerNorm blocks with a GELU(tanh) MLP, then the merger: LayerNorm per patch (`v.post_ln`), 2x2
  neighbouring patches concatenated, `mm.0` -> GELU -> `mm.2`. Patches are kept in merge-block
  order (block row, block column, row in block, column in block), as HF does, so the output rows
  are the merged tokens in raster order.
- `Gemma3Encoder` (projector `gemma3`): the SigLIP encoder (patch conv + learned positions,
  LayerNorm blocks with biased Q/K/V and a GELU(tanh) MLP, `v.post_ln`), then Gemma3's projector:
  n_merge x n_merge average pooling (64x64 patches -> 16x16 = 256 tokens), RMSNorm with
  `mm.soft_emb_norm` (the file holds 1 + w) and `x @ mm.input_projection`.

Known difference from llama.cpp: the Qwen merger's activation is the exact (erf) GELU here, as in
HF's Qwen3_5VisionPatchMerger (`nn.GELU()`); llama.cpp uses its tanh approximation there.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from engine.gguf.reader import GGUFError, GGUFFile
from engine.vision.image import (ImageError, PreparedImage, image_hash, letterbox, smart_resize, to_tensor)
from kernels.quant import dequantize

try:
    from PIL import Image
except ImportError:  # pragma: no cover
    Image = None


class MmprojError(GGUFError):
    """An mmproj file that cannot be used (names the file and the problem)."""


_DENSE_TORCH = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class MmprojTensor:
    """One mmproj tensor as a torch tensor: F32/F16/BF16 stay a zero-copy view of the mapped file in
    their own type (converted to float32 when used); other (quantized) types are expanded to
    float32 once at load (projectors are small; the largest matrices are a few tens of MB)."""

    def __init__(self, f: GGUFFile, name: str):
        info = f.tensors[name]
        self.name, self.shape = name, tuple(info.shape)
        raw = torch.from_numpy(f.tensor_bytes(name))
        dt = _DENSE_TORCH.get(info.qtype.name)
        if dt is not None:
            self.data = raw.view(dt).view(self.shape)
        else:
            try:
                self.data = dequantize(raw, info.qtype, self.shape)
            except ValueError as e:
                raise MmprojError(f.path, f"tensor {name!r}: {e}") from None

    def to(self, device) -> "MmprojTensor":
        self.data = self.data.to(device)
        return self

    def f32(self) -> torch.Tensor:
        return self.data.float()


class Linear:
    def __init__(self, w: "MmprojTensor", b: "MmprojTensor | None"):
        self.w, self.b = w, b

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w.f32(), self.b.f32() if self.b is not None else None)


def _act(name: str):
    if name == "gelu":      # ggml_gelu / HF gelu_pytorch_tanh
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "silu":
        return F.silu
    return lambda x: x * torch.sigmoid(1.702 * x)  # gelu_quick (llama.cpp's default without use_gelu/use_silu)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Non-causal attention of all patches of one image: q, k, v [N, H, D] -> [N, H * D]."""
    n, h, d = q.shape
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=scale)
    return o.transpose(0, 1).reshape(n, h * d)


class VisionEncoder:
    """Common interface: `prepare(PIL image) -> PreparedImage` (resize + normalize, may raise
    ImageError) and `encode(PreparedImage) -> float32 [n_tokens, n_embd]` on `self.device`."""

    projector: str = ""
    causal: bool = True           # False: the LLM attends bidirectionally within an image's tokens

    def __init__(self, f: GGUFFile, device: str | torch.device = "cpu"):
        self.file = f
        self.path = f.path
        self.device = torch.device(device)
        md = f.metadata
        self.md = md
        self.n_embd_v = self._u32("clip.vision.embedding_length")
        self.n_head = self._u32("clip.vision.attention.head_count")
        self.n_layer = self._u32("clip.vision.block_count")
        self.n_ff = self._u32("clip.vision.feed_forward_length")
        self.n_embd = self._u32("clip.vision.projection_dim")     # the LLM's embedding size
        self.patch = self._u32("clip.vision.patch_size")
        self.image_size = int(md.get("clip.vision.image_size", 0))
        self.eps = float(md.get("clip.vision.attention.layer_norm_epsilon", 1e-6))
        mean, std = md.get("clip.vision.image_mean"), md.get("clip.vision.image_std")
        if not (isinstance(mean, list) and len(mean) >= 3 and isinstance(std, list) and len(std) >= 3):
            raise MmprojError(self.path, "missing clip.vision.image_mean / image_std")
        self.mean, self.std = [float(x) for x in mean[:3]], [float(x) for x in std[:3]]
        if self.n_embd_v % self.n_head:
            raise MmprojError(self.path, f"embedding size {self.n_embd_v} is not a multiple of {self.n_head} heads")
        self.head_dim = self.n_embd_v // self.n_head
        gelu, silu = bool(md.get("clip.use_gelu", False)), bool(md.get("clip.use_silu", False))
        if gelu and silu:
            raise MmprojError(self.path, "both clip.use_gelu and clip.use_silu are set")
        self.act = _act("gelu" if gelu else "silu" if silu else "gelu_quick")
        self._tensors: list[MmprojTensor] = []

    # ----- loading helpers
    def _u32(self, key: str) -> int:
        v = self.md.get(key)
        if not isinstance(v, int) or v <= 0:
            raise MmprojError(self.path, f"missing or bad metadata key {key!r}")
        return v

    def _t(self, name: str, shape: tuple[int, ...] | None = None, required: bool = True) -> MmprojTensor | None:
        if name not in self.file.tensors:
            if required:
                raise MmprojError(self.path, f"missing tensor {name!r}")
            return None
        t = MmprojTensor(self.file, name)
        if shape is not None and t.shape != tuple(shape):
            raise MmprojError(self.path, f"tensor {name!r} has shape {t.shape}, expected {tuple(shape)}")
        self._tensors.append(t.to(self.device))
        return t

    def _lin(self, prefix: str, n_out: int, n_in: int) -> Linear:
        return Linear(self._t(prefix + ".weight", (n_out, n_in)), self._t(prefix + ".bias", (n_out,), required=False))

    def _norm(self, prefix: str, n: int) -> tuple[MmprojTensor, MmprojTensor | None]:
        return self._t(prefix + ".weight", (n,)), self._t(prefix + ".bias", (n,), required=False)

    def _layer_norm(self, x: torch.Tensor, wb) -> torch.Tensor:
        w, b = wb
        return F.layer_norm(x, (x.shape[-1],), w.f32(), b.f32() if b is not None else None, self.eps)

    def _blocks(self) -> list[dict]:
        E, FF = self.n_embd_v, self.n_ff
        layers = []
        for il in range(self.n_layer):
            p = f"v.blk.{il}."
            L = dict(ln1=self._norm(p + "ln1", E), ln2=self._norm(p + "ln2", E),
                     o=self._lin(p + "attn_out", E, E),
                     up=self._lin(p + "ffn_up", FF, E), down=self._lin(p + "ffn_down", E, FF))
            if p + "attn_qkv.weight" in self.file.tensors:
                L["qkv"] = self._lin(p + "attn_qkv", 3 * E, E)
            else:
                L["q"], L["k"], L["v"] = (self._lin(p + f"attn_{x}", E, E) for x in "qkv")
            if p + "ffn_gate.weight" in self.file.tensors:
                raise MmprojError(self.path, "gated vision MLPs (ffn_gate) are not supported for this projector")
            layers.append(L)
        return layers

    @property
    def n_params(self) -> int:
        return sum(math.prod(t.shape) for t in self._tensors)

    # ----- running
    def _patchify(self, pixels: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """[3, H, W] -> raster-order patches [gh * gw, 3 * p * p] (channel, row, column within a
        patch: the layout of a conv kernel [out, 3, p, p])."""
        p = self.patch
        c, H, W = pixels.shape
        gh, gw = H // p, W // p
        x = pixels.reshape(c, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(gh * gw, c * p * p)
        return x, gh, gw

    def _block(self, L: dict, x: torch.Tensor, rope=None) -> torch.Tensor:
        n, H, D = x.shape[0], self.n_head, self.head_dim
        h = self._layer_norm(x, L["ln1"])
        if "qkv" in L:
            q, k, v = L["qkv"](h).view(n, 3, H, D).unbind(1)
        else:
            q, k, v = (L[t](h).view(n, H, D) for t in "qkv")
        if rope is not None:
            q, k = rope(q), rope(k)
        x = x + L["o"](_attention(q, k, v, D ** -0.5))
        h = self._layer_norm(x, L["ln2"])
        return x + L["down"](self.act(L["up"](h)))

    def prepare(self, img) -> PreparedImage:
        raise NotImplementedError

    def encode(self, prep: PreparedImage) -> torch.Tensor:
        raise NotImplementedError

    @functools.cached_property
    def facts(self) -> dict:
        """engine/vision/mmproj.py mmproj_info's facts of this projector, from its header (kept in memory:
        the file is not read again, even after close)."""
        return mmproj_facts(self.file)

    def close(self) -> None:
        self._tensors = []
        self.file.close()


# =============================================================================================
# Qwen3-VL / Qwen3.5 / Qwen3.6: qwen3vl_merger

class Qwen3VLEncoder(VisionEncoder):
    projector = "qwen3vl_merger"
    causal = True
    DEFAULT_MIN_TOKENS = 64       # HF Qwen3.5/Qwen3-VL preprocessor: shortest_edge 65536 px = 64 tokens of 32x32
    DEFAULT_MAX_TOKENS = 4096     # llama.cpp's limit (HF allows 16384)

    def __init__(self, f: GGUFFile, device="cpu"):
        super().__init__(f, device)
        md, E, p = self.md, self.n_embd_v, self.patch
        self.merge = int(md.get("clip.vision.spatial_merge_size", 2))
        if self.merge != 2:
            raise MmprojError(self.path, f"spatial merge size {self.merge} is not supported (only 2)")
        if any(k.startswith("v.deepstack.") for k in f.tensors) or any(md.get("clip.vision.is_deepstack_layers") or []):
            raise MmprojError(self.path, "Qwen3-VL deepstack projectors are not supported yet "
                                         "(Qwen3.5 / Qwen3.6 projectors are)")
        if self.head_dim % 4:
            raise MmprojError(self.path, f"head size {self.head_dim} is not a multiple of 4 (2D rope)")
        self.patch0 = self._t("v.patch_embd.weight", (E, 3, p, p))
        self.patch1 = self._t("v.patch_embd.weight.1", (E, 3, p, p), required=False)
        self.patch_b = self._t("v.patch_embd.bias", (E,))
        pos = self._t("v.position_embd.weight")
        if pos.shape[1:] != (E,):
            raise MmprojError(self.path, f"v.position_embd.weight has shape {pos.shape}, expected (n, {E})")
        self.pos_side = int(round(math.sqrt(pos.shape[0])))
        if self.pos_side ** 2 != pos.shape[0]:
            raise MmprojError(self.path, f"position table of {pos.shape[0]} rows is not a square grid")
        self.pos = pos
        self.pre_ln = self._norm("v.pre_ln", E) if "v.pre_ln.weight" in f.tensors else None
        self.layers = self._blocks()
        self.post_ln = self._norm("v.post_ln", E)
        M = E * self.merge * self.merge
        self.mm0 = self._lin("mm.0", M, M)
        self.mm2 = self._lin("mm.2", self.n_embd, M)
        self.rope_theta = 10000.0
        dim = self.head_dim // 2
        self.inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        factor = p * self.merge
        area = factor * factor
        self.min_pixels = int(md.get("clip.vision.image_min_pixels", 0)) or self.DEFAULT_MIN_TOKENS * area
        self.max_pixels = int(md.get("clip.vision.image_max_pixels", 0)) or self.DEFAULT_MAX_TOKENS * area

    def prepare(self, img) -> PreparedImage:
        factor = self.patch * self.merge
        h, w = smart_resize(img.height, img.width, factor, self.min_pixels, self.max_pixels)
        src = (img.width, img.height)
        sha = image_hash(img)
        if (w, h) != (img.width, img.height):
            img = img.resize((w, h), Image.BICUBIC)
        return PreparedImage(to_tensor(img, self.mean, self.std), h // factor, w // factor, sha, src)

    def _merge_order(self, gh: int, gw: int) -> torch.Tensor:
        """Raster patch index of each patch in merge-block order."""
        m = self.merge
        br, bc, ir, ic = torch.meshgrid(torch.arange(gh // m), torch.arange(gw // m), torch.arange(m),
                                        torch.arange(m), indexing="ij")
        return ((br * m + ir) * gw + (bc * m + ic)).reshape(-1)

    def _rope(self, rows: torch.Tensor, cols: torch.Tensor):
        inv = self.inv_freq.to(self.device)
        freqs = torch.cat([rows.float()[:, None] * inv, cols.float()[:, None] * inv], dim=-1)   # [N, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]

        def apply(x):
            x1, x2 = x.chunk(2, dim=-1)
            return x * cos + torch.cat([-x2, x1], dim=-1) * sin
        return apply

    @torch.inference_mode()
    def encode(self, prep: PreparedImage) -> torch.Tensor:
        pixels = prep.pixels.to(self.device, torch.float32)
        x, gh, gw = self._patchify(pixels)
        if gh % self.merge or gw % self.merge:
            raise ImageError(f"image of {pixels.shape[2]}x{pixels.shape[1]} pixels is not a multiple of "
                             f"{self.patch * self.merge}")
        E = self.n_embd_v
        w = self.patch0.f32() + (self.patch1.f32() if self.patch1 is not None else 0.0)
        x = F.linear(x, w.reshape(E, -1), self.patch_b.f32())
        order = self._merge_order(gh, gw).to(self.device)
        x = x[order]
        s = self.pos_side
        table = self.pos.f32().T.reshape(1, E, s, s)
        pe = F.interpolate(table, size=(gh, gw), mode="bilinear", align_corners=True)
        x = x + pe.reshape(E, gh * gw).T[order]
        if self.pre_ln is not None:
            x = self._layer_norm(x, self.pre_ln)
        rope = self._rope(order // gw, order % gw)
        for L in self.layers:
            x = self._block(L, x, rope)
        x = self._layer_norm(x, self.post_ln)
        x = x.reshape(-1, E * self.merge * self.merge)
        return self.mm2(F.gelu(self.mm0(x)))


# =============================================================================================
# Gemma 3: SigLIP + average pooling + soft-embedding norm + input projection

class Gemma3Encoder(VisionEncoder):
    projector = "gemma3"
    causal = False   # HF Gemma3: an image's soft tokens attend to each other both ways

    def __init__(self, f: GGUFFile, device="cpu", resize: str = "letterbox"):
        super().__init__(f, device)
        E, p = self.n_embd_v, self.patch
        if self.image_size <= 0 or self.image_size % p:
            raise MmprojError(self.path, f"image size {self.image_size} is not a multiple of the patch size {p}")
        self.side = self.image_size // p
        self.pool = int(self.md.get("clip.vision.projector.scale_factor", 4))
        if self.pool <= 0 or self.side % self.pool:
            raise MmprojError(self.path, f"{self.side} patches per side cannot be pooled by {self.pool}")
        self.patch_w = self._t("v.patch_embd.weight", (E, 3, p, p))
        self.patch_b = self._t("v.patch_embd.bias", (E,), required=False)
        self.pos = self._t("v.position_embd.weight", (self.side * self.side, E))
        self.pre_ln = self._norm("v.pre_ln", E) if "v.pre_ln.weight" in f.tensors else None
        self.layers = self._blocks()
        self.post_ln = self._norm("v.post_ln", E) if "v.post_ln.weight" in f.tensors else None
        self.soft_norm = self._t("mm.soft_emb_norm.weight", (E,))
        self.proj = self._t("mm.input_projection.weight", (E, self.n_embd))
        if resize not in ("letterbox", "stretch"):
            raise ValueError(f"resize must be 'letterbox' or 'stretch', not {resize!r}")
        self.resize = resize

    @property
    def tokens_per_image(self) -> int:
        return (self.side // self.pool) ** 2

    def prepare(self, img) -> PreparedImage:
        src = (img.width, img.height)
        sha = image_hash(img)
        n = self.image_size
        if self.resize == "stretch":   # HF's Gemma3ImageProcessor
            img = img if img.size == (n, n) else img.resize((n, n), Image.BILINEAR)
        else:                          # llama.cpp: keep the aspect ratio, pad with black
            img = letterbox(img, n, Image.BILINEAR)
        k = self.side // self.pool
        return PreparedImage(to_tensor(img, self.mean, self.std), k, k, sha, src)

    @torch.inference_mode()
    def encode(self, prep: PreparedImage) -> torch.Tensor:
        pixels = prep.pixels.to(self.device, torch.float32)
        if tuple(pixels.shape[1:]) != (self.image_size, self.image_size):
            raise ImageError(f"gemma3 images must be {self.image_size}x{self.image_size}, got "
                             f"{pixels.shape[2]}x{pixels.shape[1]}")
        E = self.n_embd_v
        x, gh, gw = self._patchify(pixels)
        x = F.linear(x, self.patch_w.f32().reshape(E, -1), self.patch_b.f32() if self.patch_b is not None else None)
        x = x + self.pos.f32()
        if self.pre_ln is not None:
            x = self._layer_norm(x, self.pre_ln)
        for L in self.layers:
            x = self._block(L, x)
        if self.post_ln is not None:
            x = self._layer_norm(x, self.post_ln)
        g = x.T.reshape(1, E, gh, gw)
        g = F.avg_pool2d(g, self.pool, self.pool)
        x = g.reshape(E, -1).T                                     # [tokens, E], raster order
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.soft_norm.f32()
        return x @ self.proj.f32()


# =============================================================================================
# projector types and their facts

ENCODERS: dict[str, type[VisionEncoder]] = {
    "qwen3vl_merger": Qwen3VLEncoder,
    "gemma3": Gemma3Encoder,
}


def projector_type(f: GGUFFile) -> str:
    md = f.metadata
    arch = md.get("general.architecture")
    if arch != "clip":
        if isinstance(arch, str):
            raise MmprojError(f.path, f"this is a {arch!r} model file, not a vision projector (mmproj) file")
        raise MmprojError(f.path, "not a vision projector (mmproj) file: no general.architecture")
    if not md.get("clip.has_vision_encoder", False):
        raise MmprojError(f.path, "this projector file has no vision encoder (an audio-only mmproj?)")
    proj = md.get("clip.projector_type") or md.get("clip.vision.projector_type")
    if not isinstance(proj, str) or not proj:
        raise MmprojError(f.path, "no clip.projector_type key")
    return proj


def mmproj_facts(f: GGUFFile) -> dict:
    """mmproj_info from a file already open (an encoder's `file`: its header is not read again)."""
    proj = projector_type(f)
    md = f.metadata
    n_params = sum(t.n_elements for t in f.tensors.values())
    n_bytes = sum(t.n_bytes for t in f.tensors.values())
    E = int(md.get("clip.vision.embedding_length", 0))
    FF = int(md.get("clip.vision.feed_forward_length", 0))
    patch = int(md.get("clip.vision.patch_size", 0)) or 1
    if proj == "gemma3":
        size = int(md.get("clip.vision.image_size", 896))
        max_patches = (size // patch) ** 2
        pool = int(md.get("clip.vision.projector.scale_factor", 4))
        max_tokens = max_patches // (pool * pool)
    elif proj == "qwen3vl_merger":
        merge = int(md.get("clip.vision.spatial_merge_size", 2))
        area = (patch * merge) ** 2
        max_pixels = int(md.get("clip.vision.image_max_pixels", 0)) or Qwen3VLEncoder.DEFAULT_MAX_TOKENS * area
        max_tokens = max_pixels // area
        max_patches = max_tokens * merge * merge
    else:
        max_patches = max_tokens = 0
    # residual + normed input + qkv + MLP hidden per patch, x2 for temporaries; attention is
    # computed by SDPA without materializing the full score matrix
    workspace = 2 * 4 * max_patches * (6 * E + FF) if E else 0
    return dict(path=str(f.path), projector=proj, supported=proj in ENCODERS, n_params=n_params,
                n_bytes=n_bytes, n_embd=int(md.get("clip.vision.projection_dim", 0)),
                max_image_tokens=max_tokens, workspace_bytes=workspace)

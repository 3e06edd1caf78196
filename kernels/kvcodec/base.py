"""The codec interface and the plain float cache types (f32, f16, bf16).

A codec turns the K or V rows of a head, x [..., d] float, into bytes [..., row_bytes(d)] and back.
Every cache type stores whole groups of `group` values in `group_bytes` bytes. Rotated codecs
(turbo*) store values in the rotated domain (see rotation.py): `decode_stored` gives those
rotated values ([..., stored_dim(d)]), which attention uses directly (rotated query, un-rotated
output); `decode` gives the original domain back.

Each codec has a torch reference (`*_ref`) and a Triton implementation; `impl="auto"` picks Triton
for CUDA tensors and the reference otherwise; tests pick "triton" explicitly on the CPU, where the
kernels run in Triton's interpreter.
"""
from __future__ import annotations

import torch

from kernels.kvcodec.rotation import Rotation, padded_dim

try:
    import triton  # noqa: F401
    HAVE_TRITON = True
    from kernels._interpreter_compat import apply as _fix_interpreter
    _fix_interpreter()
except ImportError:  # CPU-only installs run the torch references
    HAVE_TRITON = False

_PLACEHOLDERS: dict[str, torch.Tensor] = {}


def placeholder(device) -> torch.Tensor:
    """A 1-element float32 zero on `device`, made once per device: the argument a kernel gets for a table
    or bias it does not read. (Made per call it was a fill kernel, three per attention layer of every
    decode step.)"""
    key = str(torch.device(device))
    t = _PLACEHOLDERS.get(key)
    if t is None:
        t = _PLACEHOLDERS[key] = torch.zeros(1, dtype=torch.float32, device=device)
    return t


# codec ids shared with the Triton kernels (kernels/kvcodec/triton_decode.py, kernels/attention)
F32, F16, BF16, Q8_0, TURBO4, TURBO3, TURBO2, TCQ3, TCQ2 = range(9)


def _want_triton(t: torch.Tensor, impl: str) -> bool:
    if impl == "ref":
        return False
    if impl == "triton":
        if not HAVE_TRITON:
            raise RuntimeError("Triton is not installed")
        return True
    if impl != "auto":
        raise ValueError(f"impl must be 'auto', 'ref' or 'triton', not {impl!r}")
    return HAVE_TRITON and t.is_cuda


class KVCodec:
    name: str = ""
    codec_id: int = -1
    group: int = 1            # values per encoded group
    group_bytes: int = 4      # bytes per encoded group
    rotated: bool = False     # values stored in the rotated domain (turbo*)
    rotation: Rotation | None = None

    @property
    def bits_per_value(self) -> float:
        return 8.0 * self.group_bytes / self.group

    def stored_dim(self, d: int) -> int:
        """Values stored per head of size d (padded to 128 for rotated codecs)."""
        if self.rotated:
            return padded_dim(d)
        if d % self.group:
            raise ValueError(f"cache type {self.name} needs head sizes that are a multiple of {self.group}, got {d}")
        return d

    def row_bytes(self, d: int) -> int:
        return self.stored_dim(d) // self.group * self.group_bytes

    def bits_per_head_value(self, d: int) -> float:
        """Bits per value of a head of size d, padding included (turbo on 64-dim heads: twice the nominal)."""
        return 8.0 * self.row_bytes(d) / d

    def codebook(self, device="cpu") -> torch.Tensor:
        """The value table the decoder indexes (float32); a 1-element placeholder for table-free codecs."""
        return placeholder(device)

    # ----- domains -----
    def to_stored(self, x: torch.Tensor) -> torch.Tensor:
        """Original-domain rows [..., d] -> the domain values are stored in (float32 [..., stored_dim])."""
        if self.rotated:
            return self.rotation.rotate(x)
        self.stored_dim(x.shape[-1])
        return x.float()

    def from_stored(self, y: torch.Tensor, d: int) -> torch.Tensor:
        return self.rotation.unrotate(y, d) if self.rotated else y[..., :d]

    # ----- encode / decode -----
    def encode(self, x: torch.Tensor, impl: str = "auto") -> torch.Tensor:
        """x [..., d] float -> uint8 [..., row_bytes(d)]."""
        lead, d = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, d)
        if _want_triton(x2, impl):
            out = self._encode_triton(x2.contiguous())
        else:
            out = self._encode_ref(x2)
        return out.reshape(*lead, self.row_bytes(d))

    def decode_stored(self, packed: torch.Tensor, impl: str = "auto") -> torch.Tensor:
        """uint8 [..., row_bytes] -> float32 [..., stored values] (rotated domain for turbo*)."""
        lead, rb = packed.shape[:-1], packed.shape[-1]
        if rb % self.group_bytes:
            raise ValueError(f"{self.name}: a row of {rb} bytes is not a whole number of {self.group_bytes}-byte groups")
        p2 = packed.reshape(-1, rb)
        if _want_triton(p2, impl):
            from kernels.kvcodec.triton_decode import decode_rows_triton
            out = decode_rows_triton(p2.contiguous(), self)
        else:
            out = self._decode_ref(p2)
        return out.reshape(*lead, rb // self.group_bytes * self.group)

    def decode(self, packed: torch.Tensor, d: int, impl: str = "auto") -> torch.Tensor:
        """uint8 [..., row_bytes(d)] -> float32 [..., d] in the original domain."""
        return self.from_stored(self.decode_stored(packed, impl), d)

    def roundtrip(self, x: torch.Tensor, impl: str = "auto") -> torch.Tensor:
        return self.decode(self.encode(x, impl), x.shape[-1], impl)

    # implemented per codec: x2 [N, d] -> [N, row_bytes]; p2 [N, row_bytes] -> [N, stored]
    def _encode_ref(self, x2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _decode_ref(self, p2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _encode_triton(self, x2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<KVCodec {self.name}: {self.group} values in {self.group_bytes} bytes>"


class FloatCodec(KVCodec):
    """f32 / f16 / bf16: the values themselves (f16 is llama.cpp's default cache type)."""

    def __init__(self, name: str, dtype: torch.dtype, codec_id: int):
        self.name, self.dtype, self.codec_id = name, dtype, codec_id
        self.group = 1
        self.group_bytes = torch.tensor([], dtype=dtype).element_size()

    def _encode_ref(self, x2):
        return x2.to(self.dtype).contiguous().view(torch.uint8)

    def _decode_ref(self, p2):
        return p2.contiguous().view(self.dtype).float()

    def _encode_triton(self, x2):  # a dtype conversion needs no kernel
        return self._encode_ref(x2)

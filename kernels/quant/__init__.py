"""Dequantization of GGUF weight types in torch (bit-exact with gguf-py's numpy reference)."""
from kernels.quant.ref import (
    SUPPORTED_TYPES,
    UnsupportedTypeError,
    check_supported,
    dequantize,
    dequantize_rows,
    dequantized_tiles,
    matmul_row_invariant,
    matmul_tiles,
    quantized_matmul_ref,
    activations_like_llamacpp,
    block_mins,
    row_bytes,
)

__all__ = [
    "SUPPORTED_TYPES", "UnsupportedTypeError", "check_supported", "row_bytes",
    "dequantize", "dequantize_rows", "dequantized_tiles", "matmul_tiles", "quantized_matmul_ref", "matmul_row_invariant", "activations_like_llamacpp", "block_mins",
]

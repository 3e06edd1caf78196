"""Qwen3.5's Gated DeltaNet decode step: a torch reference and a Triton kernel (recurrent.py).
`gdn_decode` runs Triton on CUDA tensors and the reference otherwise."""
from kernels.gdn.recurrent import gdn_decode, gdn_decode_triton, gdn_gates, ref_gdn_decode

__all__ = ["gdn_decode", "gdn_decode_triton", "gdn_gates", "ref_gdn_decode"]

"""Attention over the paged KV cache: torch references (ref.py) and Triton kernels (paged.py):
decode (split-K, GQA heads grouped) and chunked prefill, every KV cache type, sliding window,
qwen35's output gate."""
from kernels.attention.ref import causal_attention, gather_blocks, ref_paged_attention, ref_paged_decode

__all__ = ["causal_attention", "gather_blocks", "ref_paged_attention", "ref_paged_decode"]

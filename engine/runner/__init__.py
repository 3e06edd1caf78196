"""The runner: executes a step's rows over slots of one paged KV pool on the CPU or a GPU (engine/runner/runner.py),
with its parts: the step's data (batch.py), attention over the pool (attention.py), key preconditioning of rotated K
caches (keyprep.py), prompt chunks as padded CUDA-graph passes (prefill.py), recurrent-state checkpoints
(checkpoints.py) and the memory it takes per slot and token (sizes.py)."""
from engine.runner.batch import DecodeGraph, PrefixMatch, PromptInputs, SlotBatch, capture_guard
from engine.runner.runner import (BUCKETS, HOST_CHECKPOINT_STRIDE, PIECE_PASS_ROWS, Runner,
                                  chunk_rows, prefix_digests, prompt_pieces_per_pass)
from engine.runner.sizes import (attn_layers, preconditions_keys, slot_bytes_per_token, slot_fixed_bytes,
                                 slot_prep_bytes, state_checkpoint_bytes)

__all__ = ["BUCKETS", "HOST_CHECKPOINT_STRIDE", "PIECE_PASS_ROWS", "DecodeGraph", "PrefixMatch",
           "PromptInputs", "Runner", "SlotBatch", "attn_layers", "capture_guard", "chunk_rows", "preconditions_keys",
           "prefix_digests", "prompt_pieces_per_pass", "slot_bytes_per_token", "slot_fixed_bytes", "slot_prep_bytes",
           "state_checkpoint_bytes"]

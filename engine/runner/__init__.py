"""The runner: executes a step's rows over slots of one paged KV pool on the CPU or a GPU (engine/runner/runner.py),
with its parts: the step's data (batch.py), attention over the pool (attention.py), the recurrent layers' states
(recurrent.py), key preconditioning of rotated K caches (keyprep.py), prompt chunks as padded CUDA-graph passes
(prefill.py), the decode steps as CUDA graphs (graphs.py), the MTP block over the slots (mtp.py), recurrent-state checkpoints (checkpoints.py), which prefixes slots can share (prefixes.py) and the
memory it takes per slot and token (sizes.py); its block tables are engine/kv/tables.py's."""
from engine.runner.batch import PromptInputs, SlotBatch
from engine.runner.graphs import DecodeGraph, capture_guard
from engine.runner.prefixes import HOST_CHECKPOINT_STRIDE, PrefixMatch, prefix_digests
from engine.runner.runner import BUCKETS, PIECE_PASS_ROWS, Runner, chunk_rows, prompt_pieces_per_pass
from engine.runner.sizes import (attn_layers, preconditions_keys, slot_bytes_per_token, slot_fixed_bytes,
                                 slot_prep_bytes, state_checkpoint_bytes)

__all__ = ["BUCKETS", "HOST_CHECKPOINT_STRIDE", "PIECE_PASS_ROWS", "DecodeGraph", "PrefixMatch",
           "PromptInputs", "Runner", "SlotBatch", "attn_layers", "capture_guard", "chunk_rows", "preconditions_keys",
           "prefix_digests", "prompt_pieces_per_pass", "slot_bytes_per_token", "slot_fixed_bytes", "slot_prep_bytes",
           "state_checkpoint_bytes"]

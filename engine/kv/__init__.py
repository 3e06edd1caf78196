"""The paged KV cache: one pool of fixed-size blocks for all sequences (pool.py) and each
sequence's block tables and recurrent states (sequence.py)."""
from engine.kv.pool import DEFAULT_BLOCK_SIZE, KVPool, LayerGroup, LayerKV, PoolFullError, rope_key_pairs
from engine.kv.sequence import BlockTable, SequenceKV

__all__ = ["DEFAULT_BLOCK_SIZE", "BlockTable", "KVPool", "LayerGroup", "LayerKV", "PoolFullError", "SequenceKV", "rope_key_pairs"]

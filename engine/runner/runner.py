"""Runs a model on a device over slots: the GPU path of a step.

A `Runner` owns, for up to `n_slots` sequences, everything a step touches:
- the attention layers' K and V in the paged layout of kernels/attention ([blocks, block_size, Hkv,
  row_bytes]) in any cache type, K and V types chosen separately (llama.cpp's -ctk / -ctv): ONE pool
  of `n_blocks` blocks shared by all slots (every attention layer uses the same block ids). A slot
  holds only the blocks its positions need, handed out by a host-side allocator (engine/kv/blocks.py)
  before a step writes there; its block table is a row of a device tensor [slots + 1,
  max_blocks], so the CUDA graphs read the current table without being captured again. A slot
  may reach `max_ctx` positions (up to the whole pool). Slots with a common prefix reference the same
  blocks (copy_prefix); a shared block is copied before it is written (copy-on-write).
- for rotated K types (turbo*), each slot's key preconditioning per attention layer
  (engine/runner/keyprep.py), as engine/kv/sequence.py does it on the CPU path: channel smoothing
  weights w [Hkv, D] made from the slot's first chunk, a center per SEGMENT (256) positions [n_seg,
  Hkv, D], and how many segments have a center. The codec stores (k - c_seg) / w; the query is
  multiplied by w and the score of a key of segment s gets q . c_s added (`seg_bias` of the attention
  kernels), so q . k is unchanged.
- qwen35's Gated DeltaNet states per slot: conv windows [slots, K-1, conv_dim] and S [slots, Hv, D, D].
One extra scratch slot takes the padding rows of a bucket: its table points only at one private
block outside the pool (padding rows write and read position 0 only), so they never touch a
sequence's KV.

So a decode step over B rows (one token per sequence) is a pure function of three small device
buffers (tokens, positions, slots), the block tables and the slots' state. On CUDA it is captured
once per row-count bucket (1, 2, 4, .., 64) as a CUDA graph and replayed (engine/runner/graphs.py): one launch
per step instead of ~20 per layer. Everything a decode step decides per row (the new segment center of a row that is
the first of a segment, the row's center and weights) is computed on the device with torch.where /
index_put, never by the host. Prefill (a chunk of one sequence) runs through the same model code, on
CUDA as graphs between its attention layers (engine/runner/prefill.py). On the CPU the same code runs
with the torch references (no graphs), which is how the tests check the slot logic without a GPU.

Every kernel of a step reduces in an order fixed by the weights' shapes and the row's own position,
so a row's logits do not depend on the bucket or on the other rows (tests/engine/test_runner.py).

Prefix sharing (find_prefix, copy_prefix, share_prefix): a slot can start from the first positions of
another, its whole blocks referenced (a partial last block copied), plus recurrent states from a
checkpoint (enable_checkpoints); the result is bit for bit a cold run's (tests/engine/test_runner_prefix.py).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from engine.kv.tables import SlotTables
from engine.models.common import PREFILL_ROWS, DecoderModel, rms_norm
from engine.runner.attention import SlotAttention
from engine.runner.batch import PromptInputs, SlotBatch
from engine.runner.graphs import BUCKETS, DecodeGraphs, capture_guard
from engine.runner.checkpoints import StateCheckpoints
from engine.runner.prefixes import PrefixMatch, SlotPrefixes
from engine.runner.recurrent import RecurrentSlots
from engine.runner.sizes import (attn_layers, preconditions_keys, slot_bytes_per_token, slot_fixed_bytes,  # noqa: F401
                                 slot_prep_bytes, state_checkpoint_bytes)
from engine.runner.keyprep import KeyPreconditioner
from kernels.gdn.verify import draft_layout
from kernels.attention.flash import flash_lse_works, flash_supported
from kernels.attention.paged import decode_config
from kernels.family import device_family
from kernels.kvcodec import cache_type_name, get_codec
from kernels.quant import packed

log = logging.getLogger("hivejet.engine")

if TYPE_CHECKING:
    from engine.runner.prefill import PrefillGraph

# Several slots' short prompt pieces in one padded pass (Runner.prefill_pieces: the arriving requests of several
# agents read the weights once, not once each). On by default: each piece gets the bits its prompt gets alone,
# and 16 agents make 1420 tok/s instead of 1191 (H200, 27B, docs/decisions/shared-prompt-passes.md): always, unless
# the user's EngineConfig.shared_prompt_passes (`serve --no-shared-passes`) is off. For qwen35 on a GPU the pass
# runs the pieces' delta-rule kernel (kernels/gdn/rows.py).
# the most rows such a pass has (its matmuls cost about one small chunk's per 64 rows, the rest of the pass is
# paid once: longer passes gain little more, and each size is a graph of its own)
PIECE_PASS_ROWS = 256


def chunk_rows(n: int, chunk: int) -> int:
    """The rows a prompt piece of n tokens (cut at multiples of `chunk`) runs as: padded to `chunk`, or,
    when it fits a small prompt chunk (a short request, a follow-up's new tokens, a prompt's tail), to
    SMALL_PROMPT_ROWS, whose matmuls take the packed kernel instead of dequantize + cuBLAS
    (kernels/quant/packed.py)."""
    small = packed.SMALL_PROMPT_ROWS   # (read here: kernels/quant/packed.py holds the one setting)
    return small if packed.small_prompt_rows(n) and small < chunk else chunk


def prompt_pieces_per_pass(n_slots: int, padded_prefill: bool, shared: bool = True) -> int:
    """How many slots' short prompt pieces one padded pass may hold (Runner.prefill_pieces; 1: each its own
    pass): all slots of a padded prefill unless `shared` is off (EngineConfig.shared_prompt_passes)."""
    return n_slots if shared and padded_prefill else 1




class Runner:
    """cache_type sets K and V; cache_type_k / cache_type_v set each (f16 when neither is given).
    prefill_dot: the input precision of the Triton prefill attention's dot products on CUDA ("tf32":
    tensor cores, 10-bit mantissa, what the f16 cache's fused attention uses too; "ieee": full fp32,
    several times slower at long context); decode takes kernels/attention/paged.py's decode_config.
    triton: use the Triton kernels (default: on CUDA; on the CPU they run in Triton's interpreter, which
    is how tests check them without a GPU).
    n_blocks: the shared KV pool's size in blocks of `block_size` tokens (default: n_slots * max_ctx
    tokens); max_ctx: the most positions one slot may reach (at most the pool).
    rope_offsets: each slot's decode rows take RoPE position = position + the slot's rope delta (set by a
    prefill with PromptInputs: an M-RoPE model's tokens after images run behind their indices); off, the
    decode step is the text-only one."""

    def __init__(self, model: DecoderModel, device: str | torch.device = "cuda", n_slots: int = 16,
                 max_ctx: int = 4096, cache_type: str | None = None, block_size: int = 16,
                 graphs: bool | None = None, n_split: int | None = None, *, cache_type_k: str | None = None,
                 cache_type_v: str | None = None, prefill_dot: str = "tf32", triton: bool | None = None,
                 n_blocks: int | None = None, padded_prefill: bool | None = None, rope_offsets: bool = False,
                 shared_prompt_passes: bool = True):
        kt = cache_type_name(cache_type_k or cache_type or "f16")
        vt = cache_type_name(cache_type_v or cache_type or "f16")
        self.model, self.spec = model, model.spec
        s = self.spec
        self.codec_k, self.codec_v = get_codec(kt), get_codec(vt)
        self.cache_type_k, self.cache_type_v = kt, vt
        self.codec_k.stored_dim(s.head_dim)          # validates the head sizes for the cache types
        self.codec_v.stored_dim(s.head_dim_v)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        model.to_device(self.device)
        self.n_slots, self.block_size = n_slots, block_size
        max_blocks = -(-max_ctx // block_size)
        self.n_blocks = n_slots * max_blocks if n_blocks is None else n_blocks
        if self.n_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.max_blocks = min(max_blocks, self.n_blocks)     # one slot may use the whole pool, not more
        self.max_ctx = self.max_blocks * block_size
        self.scratch = n_slots  # the padding rows' slot
        self.triton = self.device.type == "cuda" if triton is None else triton
        self._impl = "triton" if self.triton else "auto"
        dev = self.device
        total_slots = n_slots + 1
        self.k, self.v = self._kv_pool()
        self.extra_caches: list[torch.Tensor] = []   # other caches in the pool's block layout (engine/runner/mtp.py)
        # block tables (engine/kv/tables.py): the host's lists are the truth; the device rows follow before each step
        self.tables = SlotTables(n_slots, self.n_blocks, self.max_blocks, block_size, dev, self._copy_block)
        self.block_table = self.tables.table     # (the device table the graphs and kernels read)
        # key preconditioning of rotated K types (engine/runner/keyprep.py)
        self.keys = KeyPreconditioner(model, list(self.k), total_slots, self.max_ctx, block_size,
                                      self.codec_k.rotated, self.triton, self._read_keys, dev)
        self.kprep = self.keys.layers            # (attention layer -> KeyPrep; empty without preconditioning)
        # per slot (and the scratch slot, 0), what its decode rows add to their positions for RoPE
        self.rope_delta = torch.zeros(total_slots, dtype=torch.long, device=dev) if rope_offsets else None
        # qwen35's recurrent states per slot and a drafting step's rollback (engine/runner/recurrent.py)
        self.recurrent = RecurrentSlots(model, n_slots, dev, BUCKETS[-1])
        self.conv_state, self.ssm_state = self.recurrent.conv, self.recurrent.ssm
        self.attention = self._slot_attention(prefill_dot, n_split)
        # recurrent-state checkpoints (enable_checkpoints) and which prefixes other slots can take
        # (engine/runner/prefixes.py: find_prefix / copy_prefix)
        self.checkpoints = StateCheckpoints(self.conv_state, self.ssm_state, dev)
        self.prefixes = SlotPrefixes(n_slots, self.checkpoints, bool(self.recurrent), block_size)
        self._init_graphs(graphs, padded_prefill, shared_prompt_passes)

    def _kv_pool(self) -> tuple[dict, dict]:
        """The attention layers' K and V, per layer: the pool's blocks, then the scratch slot's one block."""
        s, dev, shape = self.spec, self.device, (self.n_blocks + 1, self.block_size, self.spec.n_head_kv)
        k, v = {}, {}
        for il in attn_layers(s):
            k[il] = torch.zeros(shape + (self.codec_k.row_bytes(s.head_dim),), dtype=torch.uint8, device=dev)
            v[il] = torch.zeros(shape + (self.codec_v.row_bytes(s.head_dim_v),), dtype=torch.uint8, device=dev)
        return k, v

    def _init_graphs(self, graphs: bool | None, padded_prefill: bool | None, shared_prompt_passes: bool) -> None:
        """The decode graphs (captured per rows bucket, drafting or not and centers), the padded prompt passes and their
        graphs, and the step outputs they leave."""
        self.graphs_enabled = (self.device.type == "cuda") if graphs is None else graphs
        self.decode_graphs = DecodeGraphs(self)        # (rows bucket, drafting, centers) -> decode graph
        self.hidden: torch.Tensor | None = None        # the last step's output-normed hidden rows (decode, prefill)
        self.features: torch.Tensor | None = None      # and its rows at the model's capture_layers (DFlash)
        self._step_hidden: torch.Tensor | None = None
        self._step_features: torch.Tensor | None = None
        # prompt chunks padded to the chunk size and, with graphs, captured between attention layers
        # (engine/runner/prefill.py); default: with the decode graphs
        self.padded_prefill = self.graphs_enabled if padded_prefill is None else padded_prefill
        self._prefill_graphs: dict[int, PrefillGraph] = {}   # chunk size -> its graphs
        # how many slots' short pieces one padded pass may hold (prefill_pieces; 1: each its own pass): all
        # slots unless shared_prompt_passes is off
        self.prompt_pieces = prompt_pieces_per_pass(self.n_slots, self.padded_prefill, shared_prompt_passes)
        self._pass_graphs: dict[int, PrefillGraph] = {}      # rows -> a pass of several slots' pieces
        self.shared_passes = 0                               # passes that held several slots' pieces

    def _slot_attention(self, prefill_dot: str, n_split: int | None) -> SlotAttention:
        """The attention over this runner's pool, its kernels' settings fixed for the runner's life."""
        s, dev = self.spec, self.device
        # split-K of decode attention: fixed per runner (a row's reduction order must not depend on
        # others), about 512 keys per program at full context so one long sequence fills the GPU
        # split-K programs per decode row and KV head at most (a row uses one per min_keys keys up to
        # this many; fixed for the runner's life, as it decides how each row's keys are split)
        cfg = decode_config(self.codec_k, self.codec_v, device_family(dev) if dev.type == "cuda" else None)
        n_split = n_split or max(1, min(cfg["max_split"], -(-self.max_ctx // cfg["min_keys"])))
        # prompt chunks over compressed caches: decoded pieces through FlashAttention (_prefill_decoded)
        # where torch has it for these head sizes, else the paged Triton kernel
        decoded = s.head_dim == s.head_dim_v and flash_supported(dev, s.head_dim) and flash_lse_works(dev)
        return SlotAttention(s, self.k, self.v, self.codec_k, self.codec_v, self.block_table, self.block_size,
                             self.keys, self._read_rows, triton=self.triton, prefill_dot=prefill_dot,
                             decoded_prefill=decoded, n_split=n_split,
                             decode_dot=self.decode_dot(self.codec_k, self.codec_v))

    def decode_dot(self, codec_k, codec_v) -> str:
        """The decode attention's dot precision over caches of these codecs: an f32 cache asks for full precision;
        tensor cores otherwise (the interpreter computes in fp32)."""
        dev = self.device
        if dev.type != "cuda" or "f32" in (codec_k.name, codec_v.name):
            return "ieee"
        return decode_config(codec_k, codec_v, device_family(dev))["dot"]

    # ----- memory -----
    def kv_bytes(self) -> int:
        return sum(t.numel() for t in list(self.k.values()) + list(self.v.values()))

    def state_bytes(self) -> int:
        """Recurrent states and key preconditioning buffers (all slots and the scratch slot)."""
        ts = self.recurrent.tensors()
        ts += self.keys.tensors()
        return sum(t.numel() * t.element_size() for t in ts)

    def checkpoint_bytes(self, host: bool = False) -> int:
        """The recurrent-state checkpoint buffers (enable_checkpoints) on the device (host: those in host
        memory instead, allocated as they are first used)."""
        return self.checkpoints.bytes(host)

    def device_bytes(self) -> int:
        """Everything the runner allocated besides the model's weights."""
        return self.kv_bytes() + self.state_bytes() + self.checkpoint_bytes() + self.block_table.numel() * 4

    def reset(self, slot: int) -> None:
        """Start slot over at position 0: give its blocks back and forget its recurrent state and key
        preconditioning."""
        self.release(slot)
        self.recurrent.reset(slot)
        self.keys.reset(slot)
        self.prefixes.start_over(slot)

    # ----- the shared block pool (engine/kv/tables.py) -----
    @property
    def pool(self):
        """The pool's allocator (free blocks, reference counts)."""
        return self.tables.pool

    def held(self, slot: int) -> int:
        """Blocks slot references (shared ones included)."""
        return self.tables.held(slot)

    def held_alone(self, slot: int) -> int:
        """Blocks only slot references: what releasing it frees."""
        return self.tables.held_alone(slot)

    def blocks_needed(self, slot: int, start: int, end: int) -> int:
        """New blocks a write of positions [start, end) into slot takes: blocks up to `end` it does not hold
        yet (from position 0 when start is 0: the slot starts over) and copies of shared blocks it writes."""
        if start == 0:
            return -(-end // self.block_size)
        return self.tables.needed(slot, start, end)

    def close(self) -> None:
        """Free the device memory the runner holds (KV pool, slot states, checkpoints, graphs and their
        buffers) and hand it back to the driver, and host checkpoints' pinned memory to the OS; the runner
        is unusable after this."""
        self.decode_graphs.clear()
        for d in (self._prefill_graphs, self._pass_graphs, self.k, self.v, self.kprep):
            d.clear()
        self.extra_caches.clear()
        self.recurrent.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.checkpoints.close()

    def release(self, slot: int) -> None:
        """Give back all of slot's blocks (a dropped or evicted conversation, or a restart)."""
        self.truncate(slot, 0)
        self.prefixes.forget(slot)
        if self.rope_delta is not None:
            self.rope_delta[slot] = 0

    def truncate(self, slot: int, n: int) -> None:
        """Keep only the blocks slot's first n positions need (a follow-up that diverges at n)."""
        self.tables.truncate(slot, n)

    def reserve(self, slot: int, end: int, start: int | None = None) -> None:
        """Make slot hold private blocks for writing positions [start, end) (start: end - 1 if not given)
        and blocks for every position before (what a caller that fills the cache itself, a benchmark,
        needs). Raises PoolFullError, with nothing changed, when the free blocks do not suffice."""
        self._check_slot(slot)
        if end > self.max_ctx:
            raise ValueError(f"{end} tokens do not fit the runner's context of {self.max_ctx}")
        self.tables.reserve(slot, max(0, end - 1) if start is None else start, end)

    def sync_tables(self) -> None:
        """Copy the table entries that changed on the host to the device (queued on the stream before the
        step that reads them). prefill and decode do it; a caller that replays a graph itself calls it after
        reserve()."""
        self.tables.sync()

    def pool_stats(self) -> dict:
        """The pool's blocks: in use, free, referenced by more than one slot; and its size in tokens."""
        return self.tables.stats()

    def _read_keys(self, kc, slots, pos: torch.Tensor) -> torch.Tensor:
        """The stored keys at (slot, position) pairs, decoded as stored: [..., Hkv, D]."""
        return self._read_rows(kc, self.codec_k, self.spec.head_dim, slots, pos)

    def _read_rows(self, cache: torch.Tensor, codec, d: int, slots, pos: torch.Tensor) -> torch.Tensor:
        """The values stored at (slot, position) pairs of one layer's cache, decoded: [..., Hkv, d] in the
        original domain (slots: an int or a tensor broadcastable with pos)."""
        hkv, rb = cache.shape[2], cache.shape[3]
        return codec.decode(cache.view(-1, hkv, rb)[self.tables.rows(slots, pos)], d, self._impl)

    # ----- prefix sharing between slots (engine/runner/prefixes.py) -----
    def exact_length(self, slot: int, chunk: int | None = None) -> int:
        """How many of slot's first positions a cold prefill in chunks of `chunk` would write the same way
        (SlotPrefixes.exact_length)."""
        return self.prefixes.exact_length(slot, chunk)

    def enable_checkpoints(self, count: int, host: bool = False) -> None:
        """Keep up to `count` snapshots of recurrent states (qwen35; nothing for other models), taken after
        each prefill chunk that extends a slot's exact prefix and kept by (digest of the prefix, length,
        chunk), least recently used out first. A slot's live states are valid only at its own length, so a
        request sharing a shorter prefix of it needs one of these. Each costs state_checkpoint_bytes: of
        device memory, allocated now; with `host` on a GPU, of pinned host memory instead, allocated as
        each is first used (a save or a restore is then a copy over PCIe: ~6 ms for the 27B's 150 MB)."""
        self.checkpoints.enable(count, host)

    @property
    def n_checkpoints(self) -> int:
        return self.checkpoints.max

    @property
    def checkpoints_on_host(self) -> bool:
        return self.checkpoints.on_host

    def checkpoint_stats(self) -> dict | None:
        """The recurrent-state checkpoints (None without): how many are kept of how many, where, and the
        bytes their buffers take (host ones as allocated so far), evictions so far."""
        return self.checkpoints.stats()

    def checkpoint_lengths(self) -> list[int]:
        """The lengths the checkpoints were taken at, least recently used first."""
        return self.checkpoints.lengths()

    def find_prefix(self, prompt: list[int], donors: dict[int, list[int]], chunk: int) -> PrefixMatch | None:
        """The longest prefix of `prompt` another slot can give (copy_prefix) with the result a cold run in
        chunks of `chunk` gives (SlotPrefixes.find); donors: slot -> the tokens whose KV it holds."""
        return self.prefixes.find(prompt, donors, chunk)

    @torch.inference_mode()
    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Give slot dst slot src's first n positions: the K/V of every attention layer, by reference (dst's
        table points at src's blocks, whose counts go up; a partial last block is copied into a block of
        dst's own) and, for rotated K types, the smoothing weights and the centers of the segments those
        rows reach (later segments' centers are cleared: dst makes its own from its own keys, as a cold run
        would). Device copies only, no host sync; src is only read, so a running donor is not disturbed
        (neither writes into a shared block: copy-on-write). Recurrent states are not copied (a slot's are
        those at its own length): share_prefix. src == dst cuts the slot back to n positions, giving back
        the blocks after them."""
        self._check_slot(src)
        self._check_slot(dst)
        if not 0 < n <= self.max_ctx:
            raise ValueError(f"a prefix of {n} positions does not fit the runner's context of {self.max_ctx}")
        if n > self.held(src) * self.block_size:
            raise ValueError(f"slot {src} holds {self.held(src) * self.block_size} positions, not {n}")
        if src != dst:
            self.tables.check_free(1 if n % self.block_size else 0)
            self.release(dst)
            self.tables.share(src, dst, n)
        else:
            self.truncate(dst, n)
        self.keys.copy_prefix(src, dst, n)
        self.prefixes.copy(src, dst, n)

    def _copy_block(self, a: int, b: int) -> None:
        for cache in list(self.k.values()) + list(self.v.values()) + self.extra_caches:
            cache[b].copy_(cache[a])

    @torch.inference_mode()
    def share_prefix(self, match: PrefixMatch, dst: int) -> None:
        """Start slot dst from what find_prefix found: the prefix's rows and key preconditioning, and the
        recurrent states after it (from the slot that has them, or the checkpoint; that checkpoint becomes
        the most recently used)."""
        self.copy_prefix(match.src, dst, match.n)
        if not self.conv_state:
            return
        self.checkpoints.new_chain(dst)   # what dst saves next does not supersede the shared prefix's checkpoint
        if isinstance(match.state, int):
            if match.state != dst:
                self.recurrent.copy_slot(match.state, dst)
        else:
            self.checkpoints.restore(match.state, dst)
        self.prefixes.live[dst] = match.n

    # ----- steps -----
    def _hidden(self, tokens: torch.Tensor, b: SlotBatch) -> torch.Tensor:
        """The rows' last hidden states; their states after the model's capture_layers (a DFlash
        drafter's context) go to `_step_features` (inside a capture: the graph's buffer)."""
        m = self.model
        x = m.embed(tokens)
        if b.embeds is not None:   # image rows: the encoder's embeddings (not scaled, as embed_batch does)
            rows, vals = b.embeds
            x[rows.to(x.device)] = vals.to(device=x.device, dtype=x.dtype)
        m.prepare(b)
        taken = {}
        for il in range(self.spec.n_layer):
            x = m.layer(il, x, b)
            if il in m.capture_layers:
                taken[il] = x
        self._step_features = m.features_of(taken) if taken else None
        return x

    def _normed(self, x: torch.Tensor) -> torch.Tensor:
        """The rows' output-normed hidden states: what the LM head reads, and the MTP block too."""
        return rms_norm(x, self.model.output_norm.dense, self.spec.rms_eps)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self._normed(x))

    def _decode_eager(self, tokens, positions, slots, layout=None, centers: bool = True) -> torch.Tensor:
        """A decode step's logits; its output-normed hidden rows are left in `_step_hidden` (inside a
        capture: the graph's buffer, kept with it). layout: a drafting step's rows (kernels/gdn/verify.py)."""
        b = SlotBatch(self, positions, slots, decode=True)
        b.layout, b.centers = layout, centers
        b.rope_positions = self.rope_positions(positions, slots)
        self._step_hidden = h = self._normed(self._hidden(tokens, b))
        return self.model.lm_head(h)

    def rope_positions(self, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor | None:
        """Rows' RoPE positions where they are not their positions: each plus its slot's rope delta (M-RoPE
        after images: decode rows, and the padded prompt pass's text rows); None without rope offsets."""
        return None if self.rope_delta is None else positions + self.rope_delta.index_select(0, slots)

    def draft_room(self, pos: int) -> int:
        """How many draft rows may follow a slot's row at `pos` in one decode step and still give the logits
        of one-row steps. With key preconditioning, the rows must stay inside one segment that already has
        its center (a row at a segment's first position makes the center from the keys before it, which the
        rows of its own step have not written yet): none when pos starts a segment, else up to its end.
        Otherwise as many as a graph bucket holds."""
        return self.keys.draft_room(pos, BUCKETS[-1])

    @torch.inference_mode()
    def cut_back(self, slot: int, n: int) -> None:
        """After a decode step that gave `slot` several rows (a token and its drafts): keep its first n
        positions (the rows verification accepted). Its KV blocks after them go back to the pool; a
        recurrent model's states, left as they were by the step, take the kept rows from the inputs the
        step recorded (engine/runner/recurrent.py: commit; the states successive one-row steps would have
        left). Every drafting step's slots are cut back before the next step (else all their rows count)."""
        self.truncate(slot, n)
        if self.recurrent.commit(slot, n):
            self.prefixes.live[slot] = n

    @torch.inference_mode()
    def prefill(self, slot: int, tokens, start: int = 0, chunk: int = 512, all_logits: bool = False,
                hidden: bool = False, inputs: PromptInputs | None = None, prompt_end: int = 0) -> torch.Tensor:
        """Feed one slot's tokens at positions start.. in chunks; returns the last row's logits [1, vocab]
        (all rows' with all_logits). start == 0 starts the slot over (reset). Takes the blocks the
        positions need first (PoolFullError when the pool cannot give them, before anything is written).
        hidden: every row's output-normed hidden state [n, n_embd] goes to `self.hidden` (the MTP block's
        input, engine/spec/mtp.py), its states at the model's capture_layers to `self.features` (DFlash).
        inputs: the tokens belong to a prompt with images (PromptInputs for all of them): rows holding an image
        run eagerly as one chunk (an image attended both ways is never cut; M-RoPE positions are not start..);
        rows of text alone (no image rows, positions start.. plus one rope delta: _text_rope_delta) run as
        text prompts do, through the padded pass's graphs, with the slot's rope delta; either way the prefix
        grid hashes inputs.keys instead of the token ids (image placeholders do not say what the rows hold),
        or without keys the slot leaves the grid. prompt_end: where this slot's prompt ends (0: unknown), so that host
        checkpoints skip the chunk ends a re-sent prompt cannot use (SlotPrefixes.grid_step)."""
        self._check_slot(slot)
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        n = len(tokens)
        text_delta = None    # a text-only chunk of a prompt with images: its rope delta (the padded pass takes it)
        if inputs is not None:
            self._check_inputs(inputs, n)
            if self.padded_prefill and n <= chunk:
                text_delta = self._text_rope_delta(inputs, start, n)
            if text_delta is None:
                chunk = max(chunk, n)
        if start + n > self.max_ctx:
            raise ValueError(f"{start + n} tokens do not fit the runner's context of {self.max_ctx}")
        self.tables.check_free(self.blocks_needed(slot, start, start + n) - (self.held_alone(slot) if start == 0 else 0))
        if start == 0:
            self.reset(slot)
        outs, normed, feats = [], [], []
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            live = self._begin_piece(slot, start + lo, start + hi)
            self.sync_tables()
            rows = chunk_rows(hi - lo, chunk)
            if self.rope_delta is not None and (inputs is None or text_delta is not None):
                # text after a parked conversation with images: plain positions; text in a prompt with images:
                # its positions' delta (the padded pass adds each slot's: PaddedBatch)
                self.rope_delta[slot] = text_delta or 0
            flag = PREFILL_ROWS.set(rows)      # prompt rows: the prefill matmul, padded to `rows` rows
            try:
                if self.padded_prefill and (inputs is None or text_delta is not None):
                    x = self._prefill_graph(rows).run([(slot, tokens[lo:hi], start + lo)])[0]
                else:
                    pos = torch.arange(start + lo, start + hi, device=self.device)
                    b = SlotBatch(self, pos, torch.full((hi - lo,), slot, dtype=torch.long, device=self.device),
                                  decode=False, slot=slot, start=start + lo)
                    if inputs is not None:
                        self._with_inputs(b, inputs, slot)
                    x = self._hidden(tokens[lo:hi].to(self.device), b)
                if all_logits:
                    outs.append(self._head(x))
                if hidden:
                    normed.append(self._normed(x))
                    if self._step_features is not None:   # (a static buffer when replayed: copied)
                        feats.append(self._step_features[:hi - lo].clone())
            finally:
                PREFILL_ROWS.reset(flag)
            if inputs is None:
                self.prefixes.grid_step(slot, start + lo, start + hi, tokens[lo:hi], chunk, live, prompt_end)
            elif inputs.keys is not None:
                self.prefixes.grid_step(slot, start + lo, start + hi, torch.as_tensor(inputs.keys[lo:hi]), chunk, live,
                                prompt_end)
            else:
                self.prefixes.off_grid(slot, start + hi)
            if hi == n and not all_logits:
                # the last row only, with the decode rows' matmul: the prefill matmul would first make an
                # fp16 copy of the whole output matrix (2.5 GB for a 248K vocabulary)
                outs.append(self._head(x[-1:]))
        if hidden:
            self.hidden = normed[0] if len(normed) == 1 else torch.cat(normed)
            self.features = (feats[0] if len(feats) == 1 else torch.cat(feats)) if feats else None
        return torch.cat(outs)

    def _text_rope_delta(self, inputs: PromptInputs, start: int, n: int) -> int | None:
        """For n rows at start of a prompt with images that hold no image (no image rows, none attended both
        ways, RoPE positions start.. plus one delta on every axis): that delta, which the padded pass can add
        (0 where there are no M-RoPE positions). None for rows that must run eagerly."""
        if inputs.embeds is not None or inputs.bidirectional:
            return None
        p = inputs.positions
        if p is None:
            return 0
        plain = torch.arange(start, start + n)
        p = p.reshape(n, -1).to(torch.long).cpu()
        delta = int(p[0, 0]) - start
        if (delta and self.rope_delta is None) or not torch.equal(p, (plain + delta)[:, None].expand_as(p)):
            return None
        return delta

    def _check_inputs(self, inputs: PromptInputs, n: int) -> None:
        p, e = inputs.positions, inputs.embeds
        if p is not None and (p.shape[0] != n or p.dim() not in (1, 2)):
            raise ValueError(f"{n} tokens with RoPE positions of shape {tuple(p.shape)}")
        if e is not None and (e[0].shape[0] != e[1].shape[0] or e[1].shape[-1] != self.spec.n_embd
                              or (e[0].numel() and not 0 <= int(e[0].min()) <= int(e[0].max()) < n)):
            raise ValueError(f"image embeddings {tuple(e[1].shape)} at rows outside the {n} tokens or not "
                             f"{self.spec.n_embd} wide")
        if inputs.rope_delta and self.rope_delta is None:
            raise ValueError("a rope delta needs a runner made with rope_offsets=True")
        if inputs.keys is not None and len(inputs.keys) != n:
            raise ValueError(f"{len(inputs.keys)} prefix keys for {n} tokens")

    def _with_inputs(self, b: SlotBatch, inputs: PromptInputs, slot: int) -> None:
        """b (one chunk of slot's prompt) takes inputs' positions, image rows and two-way spans."""
        if inputs.positions is not None:
            b.rope_positions = inputs.positions.to(self.device)
        b.embeds = inputs.embeds
        b.bidirectional = inputs.bidirectional
        if self.rope_delta is not None:
            self.rope_delta[slot] = inputs.rope_delta

    def _begin_piece(self, slot: int, lo: int, hi: int) -> int:
        """Before a slot's prompt rows [lo, hi) run: their blocks taken, the exact prefix cut at lo, the
        states' position unknown until the rows are in (SlotPrefixes.grid_step). Returns where the states were."""
        self.reserve(slot, hi, lo)
        return self.prefixes.begin_rows(slot, lo)

    def _prefill_graph(self, chunk: int) -> PrefillGraph:
        """The padded chunk of `chunk` rows (small ones hold several slots' pieces when prompt_pieces is on)."""
        many = self.prompt_pieces if packed.small_prompt_rows(chunk) else 1
        return self._graph_of(self._prefill_graphs, chunk, many)

    def _pass_graph(self, rows: int) -> PrefillGraph:
        """The padded pass of `rows` rows that holds several slots' small pieces (more rows than a small
        prompt chunk: kept apart from the chunk graphs, whose matmuls take the prefill product)."""
        if rows <= packed.SMALL_PROMPT_ROWS:
            return self._prefill_graph(rows)
        return self._graph_of(self._pass_graphs, rows, self.prompt_pieces)

    def _graph_of(self, graphs: dict, rows: int, max_pieces: int) -> PrefillGraph:
        from engine.runner.prefill import PrefillGraph   # (it builds on SlotBatch, from this module)
        g = graphs.get(rows)
        if g is None:
            g = graphs[rows] = PrefillGraph(self, rows, capture=self.graphs_enabled, max_pieces=max_pieces)
        return g

    def piece_passes(self, lengths: list[int], chunk: int) -> list[list[int]]:
        """How prefill_pieces groups pieces of these lengths (indexes): the small ones (at most
        SMALL_PROMPT_ROWS tokens, chunks longer than that) in order, as many to a pass as fit PIECE_PASS_ROWS
        rows (and the chunk's) at PIECE_ALIGN and prompt_pieces; every other piece alone (all of them alone
        when the pieces are off)."""
        from engine.runner.prefill import piece_rows
        small = packed.SMALL_PROMPT_ROWS
        on = self.prompt_pieces > 1 and 0 < small < chunk
        top = min(PIECE_PASS_ROWS, chunk)   # (the step's workspace is planned for a chunk's rows)
        passes, alone, rows = [], [], 0
        for i, n in enumerate(lengths):
            if not (on and 0 < n <= small):
                alone.append([i])
                continue
            if passes and rows + n <= top and len(passes[-1]) < self.prompt_pieces:
                passes[-1].append(i)
            else:
                passes.append([i])
                rows = 0
            rows += piece_rows(n)
        return passes + alone

    @torch.inference_mode()
    def prefill_pieces(self, pieces: list[tuple[int, list[int], int]], chunk: int = 512) -> torch.Tensor:
        """Several slots' prompt pieces (slot, tokens, start; one per slot): each piece's last row's logits
        [len(pieces), vocab], the bits prefill(slot, tokens, start, chunk) gives it. Short pieces inside one
        chunk (not across a multiple of `chunk`) go through padded passes of several slots (piece_passes;
        prompt_pieces on): the weights are read once for all of them. The blocks of every piece are taken
        first (PoolFullError before anything is written)."""
        pieces = [(sl, torch.as_tensor(t, dtype=torch.long), st) for sl, t, st in pieces]
        if len({sl for sl, _, _ in pieces}) != len(pieces):
            raise ValueError("prefill_pieces: one piece per slot")
        need = 0
        for sl, t, st in pieces:
            self._check_slot(sl)
            if not 0 < len(t) or st + len(t) > self.max_ctx:
                raise ValueError(f"a piece of {len(t)} tokens at {st} for the runner's context of {self.max_ctx}")
            need += self.blocks_needed(sl, st, st + len(t)) - (self.held_alone(sl) if st == 0 else 0)
        self.tables.check_free(need)
        out: list = [None] * len(pieces)
        for g in self.piece_passes([len(t) for _, t, _ in pieces], chunk):
            part = [pieces[i] for i in g]
            if len(part) > 1 and not any(st // chunk != (st + len(t) - 1) // chunk for _, t, st in part):
                for i, lg in zip(g, self._piece_pass(part, chunk)):
                    out[i] = lg
            else:
                for i, (sl, t, st) in zip(g, part):
                    out[i] = self.prefill(sl, t, start=st, chunk=chunk)
        return torch.cat(out)

    def _piece_pass(self, pieces: list[tuple[int, torch.Tensor, int]], chunk: int) -> list[torch.Tensor]:
        """One padded pass of several slots' pieces (piece_passes made them fit): the last rows' logits."""
        from engine.runner.prefill import piece_rows
        lives = {}
        for sl, t, st in pieces:
            if st == 0:
                self.reset(sl)
            lives[sl] = self._begin_piece(sl, st, st + len(t))
        self.sync_tables()
        aligned = sum(piece_rows(len(t)) for _, t, _ in pieces)
        rows = max(packed.SMALL_PROMPT_ROWS, 1 << (aligned - 1).bit_length())
        flag = PREFILL_ROWS.set(packed.SMALL_PROMPT_ROWS)   # every row through the small chunk's matmul settings
        try:
            xs = self._pass_graph(rows).run(pieces)
        finally:
            PREFILL_ROWS.reset(flag)
        for sl, t, st in pieces:
            self.prefixes.grid_step(sl, st, st + len(t), t, chunk, lives[sl])
        self.shared_passes += 1
        last = torch.cat([x[-1:] for x in xs])
        if not last.is_cuda:   # (the CPU's matmul: a row's result depends on its place in a 16-row block)
            return [self._head(r[None]) for r in last]
        return list(self._head(last).split(1))

    @torch.inference_mode()
    def capture_prefill(self, chunk: int = 512) -> None:
        """Run and capture the padded prompt chunks of `chunk` tokens and of a small prompt chunk's rows
        (chunk_rows), and with prompt_pieces the wider passes of several slots' pieces, now (on free slots,
        released after), so that no request pays for compiling and capturing them; skipped when the pool is
        too small."""
        sizes = [r for r in sorted({chunk, chunk_rows(1, chunk)}, reverse=True) if r not in self._prefill_graphs]
        small = packed.SMALL_PROMPT_ROWS
        passes = [small << i for i in range(1, 8) if self.prompt_pieces > 1 and 0 < small < chunk
                  and small << i <= min(PIECE_PASS_ROWS, chunk) and small << i not in self._pass_graphs]
        free = [s for s in range(self.n_slots) if not self.tables.blocks[s]]
        if not self.padded_prefill or not (sizes or passes) or not free or chunk > self.max_ctx \
                or self.blocks_needed(free[0], 0, chunk) > self.pool.n_free:
            return
        n_ckpt, self.checkpoints.max = self.checkpoints.max, 0     # (no checkpoint of the dummy prompt)
        try:
            with capture_guard():
                for rows in sizes:
                    self.prefill(free[0], [0] * rows, chunk=chunk)
                self.reset(free[0])
                # the passes of several slots' pieces (prefill_pieces): k pieces of a small chunk's rows fill
                # the pass of `rows` rows past its half
                for rows in passes:
                    k = rows // small // 2 + 1
                    if k > min(len(free), self.prompt_pieces) \
                            or k * self.blocks_needed(free[0], 0, small) > self.pool.n_free:
                        break
                    try:
                        self.prefill_pieces([(free[i], [0] * small, 0) for i in range(k)], chunk=chunk)
                    finally:
                        for i in range(k):
                            self.reset(free[i])
        finally:
            self.checkpoints.max = n_ckpt
            self.reset(free[0])

    @torch.inference_mode()
    def decode(self, slots, tokens, positions) -> torch.Tensor:
        """One step: slots[r]'s token tokens[r] at positions[r] (lists or device tensors), each
        sequence one row. Returns logits [len(slots), vocab] (a view of the graph's output buffer on
        CUDA: read it before the next step); the rows' output-normed hidden states are in `self.hidden`,
        their states at the model's capture_layers in `self.features` (likewise views)."""
        n = len(slots)
        if n == 0:
            return torch.zeros(0, self.spec.vocab_size, device=self.device)
        if isinstance(slots, torch.Tensor) or isinstance(positions, torch.Tensor):
            slots, positions = torch.as_tensor(slots).tolist(), torch.as_tensor(positions).tolist()   # (a sync)
        lay = draft_layout(slots, self.scratch) if self.recurrent else None   # (bad rows: ValueError, nothing done)
        self._reserve_rows(slots, positions)
        self.sync_tables()
        self._decode_rows(slots, positions)
        B = n if not self.graphs_enabled or n > BUCKETS[-1] else next(bk for bk in BUCKETS if bk >= n)
        drafting = bool(self.recurrent) and self.recurrent.begin_step(lay, positions, B)
        try:
            return self._decode_step(B, slots, tokens, positions, lay, drafting)
        except BaseException:
            self.recurrent.pending.clear()   # (the step did not run: its drafting slots' states are as before it)
            raise

    def _decode_step(self, B: int, slots, tokens, positions, lay, drafting: bool) -> torch.Tensor:
        """decode's step itself: eagerly (B, its rows), or rows bucket B's graph replayed."""
        n = len(slots)
        centers = self._needs_centers(slots, positions)
        if not self.graphs_enabled or n > BUCKETS[-1]:
            dev = self.device
            logits = self._decode_eager(torch.as_tensor(tokens, device=dev).long(),
                                        torch.as_tensor(positions, device=dev).long(),
                                        torch.as_tensor(slots, device=dev).long(),
                                        torch.tensor(lay, device=dev) if drafting else None, centers)
            self.hidden, self.features = self._step_hidden, self._step_features
            return logits
        g = self.decode_graphs.get(B, drafting, centers)
        self.decode_graphs.fill(B, slots, tokens, positions, drafting, centers)
        g.graph.replay()
        self.hidden = g.hidden[:n]
        self.features = g.features[:n] if g.features is not None else None
        return g.logits[:n]

    def _needs_centers(self, slots: list[int], positions: list[int]) -> bool:
        """Whether a decode step makes key centers (KeyPreconditioner.needs_centers)."""
        return self.keys.needs_centers(slots, positions, self.n_slots)

    def _reserve_rows(self, slots: list[int], positions: list[int]) -> None:
        """The blocks a decode step's rows write into: all of them, or none and PoolFullError."""
        span: dict[int, list[int]] = {}   # slot -> [first, last] position (a sequence with drafts has several rows)
        for s, p in zip(slots, positions):
            if s == self.scratch:
                continue
            self._check_slot(s)
            if p >= self.max_ctx:
                raise ValueError(f"position {p} is outside the runner's context of {self.max_ctx}")
            lo_hi = span.setdefault(s, [p, p])
            lo_hi[0], lo_hi[1] = min(lo_hi[0], p), max(lo_hi[1], p)
        self.tables.check_free(sum(self.tables.needed(s, lo, hi + 1) for s, (lo, hi) in span.items()))
        for s, (lo, hi) in span.items():
            self.reserve(s, hi + 1, lo)

    def _decode_rows(self, slots, positions) -> None:
        """Prefix bookkeeping of a decode step: a row below a slot's exact prefix cuts it there, and the
        states move one position on."""
        for slot, p in zip(slots, positions):
            if 0 <= slot < self.n_slots:
                self.prefixes.decode_row(slot, p)

    def capture(self, buckets=BUCKETS) -> None:
        """Capture the decode graphs ahead of time (engine/runner/graphs.py: DecodeGraphs.capture)."""
        self.decode_graphs.capture(buckets)

    def capture_drafting(self, max_rows: int) -> None:
        """Capture a recurrent model's drafting-step graphs ahead of time (DecodeGraphs.capture_drafting)."""
        self.decode_graphs.capture_drafting(max_rows)

    def graph_pool(self):
        """The memory pool the runner's CUDA graphs share (decode, prompt chunks, the MTP block's)."""
        return self.decode_graphs.pool()

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"slot {slot} is outside 0..{self.n_slots - 1}")

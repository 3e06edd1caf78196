"""Runs a model on a device over static slots: the GPU path of a step.

A `Runner` owns, for up to `n_slots` sequences, everything a step touches, at fixed addresses:
- the attention layers' K and V in the paged layout of kernels/attention ([blocks, block_size, Hkv,
  row_bytes], any KV codec without per-sequence preconditioning: f16, bf16, f32, q8_0). Slot s owns
  blocks s*max_blocks .. (s+1)*max_blocks - 1: a static block table. (The shared, content-addressed
  pool of the multi-agent runtime only changes the table's contents, not the kernels.)
- qwen35's Gated DeltaNet states per slot: conv windows [slots, K-1, conv_dim] and S [slots, Hv, D, D].
One extra scratch slot takes the padding rows of a bucket.

So a decode step over B rows (one token per sequence) is a pure function of three small device
buffers (tokens, positions, slots). On CUDA it is captured once per row-count bucket (1, 2, 4, ..,
64) as a CUDA graph and replayed: one launch per step instead of ~20 per layer. Prefill (a chunk of
one sequence) runs eagerly through the same model code. On the CPU the same code runs with the
torch references (no graphs), which is how the tests check the slot logic without a GPU.

Every kernel of a step reduces in an order fixed by the weights' shapes and the row's own position,
so a row's logits do not depend on the bucket or on the other rows (tests/engine/test_runner.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.common import PREFILL_ROWS, DecoderModel, rms_norm
from kernels.attention.ref import ref_paged_attention, ref_paged_decode
from kernels.kvcodec import get_codec

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
SLOT_CACHE_TYPES = ("f16", "bf16", "f32", "q8_0")  # codecs whose stored keys need no per-sequence state


def slot_bytes_per_token(model: DecoderModel, cache_type: str) -> int:
    """KV bytes one token of one slot takes (all attention layers, K and V)."""
    s, codec = model.spec, get_codec(cache_type)
    n_attn = sum(1 for il in range(s.n_layer) if not s.is_recurrent(il))
    return n_attn * s.n_head_kv * (codec.row_bytes(s.head_dim) + codec.row_bytes(s.head_dim_v))


class SlotBatch:
    """Stands in for engine.models.common.Batch in a runner step: rows live in runner slots.
    decode: row r is slot slots[r]'s next token at positions[r]. prefill: all rows are one slot's
    chunk at positions start.. (the slot and start given as Python ints)."""

    chunks = ()

    def __init__(self, runner: "Runner", positions: torch.Tensor, slots: torch.Tensor, decode: bool,
                 slot: int = -1, start: int = 0):
        self.runner, self.positions, self.slots, self.decode = runner, positions, slots, decode
        self.slot, self.start = slot, start
        self.rope: dict = {}

    def attend(self, il, q, k, v, scale, window):
        return self.runner._attend(self, il, q, k, v, scale, window)

    def delta_net(self, il, model, L, qkv, g, beta):
        return self.runner._delta_net(self, il, model, L, qkv, g, beta)


class Runner:
    def __init__(self, model: DecoderModel, device: str | torch.device = "cuda", n_slots: int = 16,
                 max_ctx: int = 4096, cache_type: str = "f16", block_size: int = 16, graphs: bool | None = None,
                 n_split: int | None = None):
        if cache_type not in SLOT_CACHE_TYPES:
            raise ValueError(f"the runner's KV cache types are {', '.join(SLOT_CACHE_TYPES)} for now, not {cache_type!r}")
        self.model, self.spec = model, model.spec
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        model.to_device(self.device)
        self.n_slots, self.block_size = n_slots, block_size
        self.max_ctx = -(-max_ctx // block_size) * block_size
        self.max_blocks = self.max_ctx // block_size
        self.scratch = n_slots  # the padding rows' slot
        self.codec = get_codec(cache_type)
        self.cache_type = cache_type
        s, dev = self.spec, self.device
        total_slots = n_slots + 1
        # attention layers' K/V, per layer
        self.k, self.v = {}, {}
        for il in range(s.n_layer):
            if s.is_recurrent(il):
                continue
            shape = (total_slots * self.max_blocks, block_size, s.n_head_kv)
            self.k[il] = torch.zeros(shape + (self.codec.row_bytes(s.head_dim),), dtype=torch.uint8, device=dev)
            self.v[il] = torch.zeros(shape + (self.codec.row_bytes(s.head_dim_v),), dtype=torch.uint8, device=dev)
        self.block_table = torch.arange(total_slots * self.max_blocks, dtype=torch.int32,
                                        device=dev).view(total_slots, self.max_blocks)
        # qwen35 recurrent states, per recurrent layer
        self.conv_state, self.ssm_state = {}, {}
        for il in range(s.n_layer):
            if s.is_recurrent(il):
                K, C = s.ssm_d_conv, model.conv_dim
                self.conv_state[il] = torch.zeros(total_slots, K - 1, C, dtype=torch.float32, device=dev)
                self.ssm_state[il] = torch.zeros(total_slots, model.n_v_heads, model.d_state, model.d_state,
                                                 dtype=torch.float32, device=dev)
        # split-K of decode attention: fixed per runner (a row's reduction order must not depend on
        # others), about 512 keys per program at full context so one long sequence fills the GPU
        self.n_split = n_split or max(1, min(64, -(-self.max_ctx // 512)))
        self.graphs_enabled = (self.device.type == "cuda") if graphs is None else graphs
        self._graphs: dict[int, tuple] = {}
        self._graph_pool = None

    # ----- memory -----
    def kv_bytes(self) -> int:
        return sum(t.numel() for t in list(self.k.values()) + list(self.v.values()))

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in list(self.conv_state.values()) + list(self.ssm_state.values()))

    def reset(self, slot: int) -> None:
        """Forget slot's recurrent state (its KV needs nothing: lengths come with each step)."""
        for t in list(self.conv_state.values()) + list(self.ssm_state.values()):
            t[slot].zero_()

    # ----- the pieces the model calls back into -----
    def _attend(self, b: SlotBatch, il, q, k, v, scale, window):
        s = self.spec
        kc, vc = self.k[il], self.v[il]
        flat = b.slots.long() * self.max_ctx + b.positions.long()     # each row's token index in the cache
        kc.view(-1, s.n_head_kv, kc.shape[-1]).index_copy_(0, flat, self.codec.encode(k))
        vc.view(-1, s.n_head_kv, vc.shape[-1]).index_copy_(0, flat, self.codec.encode(v))
        cuda = q.is_cuda
        if b.decode:
            bt = self.block_table.index_select(0, b.slots.long())
            lens = (b.positions + 1).to(torch.int32)
            if cuda:
                from kernels.attention.paged import paged_decode_attention
                return paged_decode_attention(q, kc, vc, bt, lens, self.codec, self.codec, scale, s.head_dim_v,
                                              window, n_split=self.n_split)
            return ref_paged_decode(q, kc, vc, bt, lens, self.codec, self.codec, scale, s.head_dim_v, window)
        bt = self.block_table[b.slot]
        if cuda and self.codec.name in ("f16", "bf16"):
            return self._prefill_sdpa(b, kc, vc, q, scale, window)
        if cuda:
            from kernels.attention.paged import paged_prefill_attention
            n = q.shape[0]
            cu = torch.tensor([0, n], dtype=torch.int32)
            starts = torch.tensor([b.start], dtype=torch.int32)
            return paged_prefill_attention(q, kc, vc, bt[None], cu, starts, self.codec, self.codec, scale,
                                           s.head_dim_v, window)
        return ref_paged_attention(q, kc, vc, bt, b.start, self.codec, self.codec, scale, s.head_dim_v, window)

    def _prefill_sdpa(self, b: SlotBatch, kc, vc, q, scale, window):
        """A chunk's queries over its slot's float KV, read in place (a slot's cache is contiguous),
        with torch's fused attention (cuDNN / memory-efficient kernels)."""
        s, T = self.spec, q.shape[0]
        end = b.start + T
        dt = self.codec.dtype
        K = kc.view(self.n_slots + 1, self.max_ctx, s.n_head_kv, -1)[b.slot, :end].view(dt)
        V = vc.view(self.n_slots + 1, self.max_ctx, s.n_head_kv, -1)[b.slot, :end].view(dt)
        G = s.n_head // s.n_head_kv
        qpos = torch.arange(b.start, end, device=q.device)[:, None]
        kpos = torch.arange(end, device=q.device)[None, :]
        mask = kpos <= qpos
        if window:
            mask &= qpos - kpos < window
        out = F.scaled_dot_product_attention(
            q.to(dt).transpose(0, 1)[None], K.repeat_interleave(G, 1).transpose(0, 1)[None],
            V.repeat_interleave(G, 1).transpose(0, 1)[None], attn_mask=mask, scale=scale)
        return out[0].transpose(0, 1).float()

    def _delta_net(self, b: SlotBatch, il, model, L, qkv, g, beta):
        cs, S = self.conv_state[il], self.ssm_state[il]
        if b.decode:
            from kernels.gdn import gdn_decode
            slots = torch.where(b.slots == self.scratch, -1, b.slots)   # padding rows: no state update
            return gdn_decode(qkv, L["conv"], cs, S, slots, g, beta, model.n_k_heads, model.d_state,
                              self.spec.rms_eps)
        state = (cs[b.slot], S[b.slot]) if b.start > 0 else None
        o, (c_new, S_new) = model.delta_net_rows(L, qkv, g, beta, state)
        cs[b.slot].copy_(c_new)
        S[b.slot].copy_(S_new)
        return o

    # ----- steps -----
    def _forward(self, tokens: torch.Tensor, b: SlotBatch, logit_rows: slice | None) -> torch.Tensor:
        m = self.model
        x = m.embed(tokens)
        m.prepare(b)
        for il in range(self.spec.n_layer):
            x = m.layer(il, x, b)
        if logit_rows is not None:
            x = x[logit_rows]
        return m.lm_head(rms_norm(x, m.output_norm.dense, self.spec.rms_eps))

    def _decode_eager(self, tokens, positions, slots) -> torch.Tensor:
        return self._forward(tokens, SlotBatch(self, positions, slots, decode=True), None)

    @torch.inference_mode()
    def prefill(self, slot: int, tokens, start: int = 0, chunk: int = 512, all_logits: bool = False) -> torch.Tensor:
        """Feed one slot's tokens at positions start.. in chunks; returns the last row's logits [1, vocab]
        (all rows' with all_logits)."""
        self._check_slot(slot)
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        n = len(tokens)
        if start + n > self.max_ctx:
            raise ValueError(f"{start + n} tokens do not fit the runner's context of {self.max_ctx}")
        if start == 0:
            self.reset(slot)
        outs = []
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            t = tokens[lo:hi].to(self.device)
            pos = torch.arange(start + lo, start + hi, device=self.device)
            b = SlotBatch(self, pos, torch.full((hi - lo,), slot, dtype=torch.long, device=self.device),
                          decode=False, slot=slot, start=start + lo)
            rows = None if all_logits else (slice(hi - lo - 1, hi - lo) if hi == n else slice(0, 0))
            flag = PREFILL_ROWS.set(True)
            try:
                out = self._forward(t, b, rows)
            finally:
                PREFILL_ROWS.reset(flag)
            if all_logits or hi == n:
                outs.append(out)
        return torch.cat(outs)

    @torch.inference_mode()
    def decode(self, slots, tokens, positions) -> torch.Tensor:
        """One step: slots[r]'s token tokens[r] at positions[r] (lists or device tensors), each
        sequence one row. Returns logits [len(slots), vocab] (a view of the graph's output buffer on
        CUDA: read it before the next step)."""
        n = len(slots)
        if n == 0:
            return torch.zeros(0, self.spec.vocab_size, device=self.device)
        if not self.graphs_enabled or n > BUCKETS[-1]:
            dev = self.device
            return self._decode_eager(torch.as_tensor(tokens, device=dev).long(),
                                      torch.as_tensor(positions, device=dev).long(),
                                      torch.as_tensor(slots, device=dev).long())
        B = next(bk for bk in BUCKETS if bk >= n)
        graph, tok, pos, sl, out = self._graph(B)
        self.fill(B, slots, tokens, positions)
        graph.replay()
        return out[:n]

    def fill(self, B: int, slots, tokens, positions) -> None:
        """Write a step's rows into bucket B's input buffers (padding rows go to the scratch slot)."""
        _, tok, pos, sl, _ = self._graphs[B]
        n = len(slots)
        tok[:n].copy_(torch.as_tensor(tokens), non_blocking=True)
        pos[:n].copy_(torch.as_tensor(positions), non_blocking=True)
        sl[:n].copy_(torch.as_tensor(slots), non_blocking=True)
        if n < B:
            tok[n:].zero_()
            pos[n:].zero_()
            sl[n:].fill_(self.scratch)

    def _graph(self, B: int) -> tuple:
        g = self._graphs.get(B)
        if g is not None:
            return g
        dev = self.device
        tok = torch.zeros(B, dtype=torch.long, device=dev)
        pos = torch.zeros(B, dtype=torch.long, device=dev)
        sl = torch.full((B,), self.scratch, dtype=torch.long, device=dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side), torch.inference_mode():   # compile the Triton kernels, warm allocators
            for _ in range(2):
                self._decode_eager(tok, pos, sl)
        torch.cuda.current_stream(dev).wait_stream(side)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool), torch.inference_mode():
            out = self._decode_eager(tok, pos, sl)
        g = self._graphs[B] = (graph, tok, pos, sl, out)
        return g

    def capture(self, buckets=BUCKETS) -> None:
        """Capture the decode graphs ahead of time (largest first, so smaller ones reuse its memory)."""
        if self.graphs_enabled:
            for B in sorted(buckets, reverse=True):
                self._graph(B)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"slot {slot} is outside 0..{self.n_slots - 1}")

"""The MTP block's rows over a runner's slots (the GPU path's MTP drafting; engine/spec/mtp.py decides which rows).

The block's one attention layer keeps its K/V in a cache of its own laid out as the runner's pool ([blocks,
block_size, Hkv, row_bytes], the same block ids): a slot's MTP row of position p sits in the block that holds the
slot's main rows of p, read through the same block tables. So what the runner does with a slot's blocks carries the
MTP rows along: a parked conversation keeps them, a shared prefix references them, a copied block copies them
(Runner.extra_caches), a released slot frees them. Rows past the slot's main positions (the chained drafts') take
blocks of the pool before they are written (`room`) and give them back once the drafts are made (`done`).

A pass runs rows of several slots at once (row r: token, hidden input h_{p-1}, position, slot) and returns, for the
rows asked for, the block's argmax token and its output row (the hidden input of a further draft). On CUDA a pass of
up to 64 rows replays CUDA graphs captured per rows bucket (as the runner's decode steps do): the block's over all
rows, then the head's over the drafting rows only; longer passes (a prompt chunk's catch-up) run eagerly. Padding
rows go to the runner's scratch slot.
"""
from __future__ import annotations

import torch

from engine.kv.blocks import PoolFullError
from engine.runner.attention import SlotAttention
from engine.runner.batch import SlotBatch
from engine.runner.graphs import BUCKETS, capture_graph, capture_guard, fill_rows
from engine.runner.keyprep import KeyPreconditioner
from kernels.kvcodec import get_codec

# eager passes' (rows, rows asked for) whose kernels compile apart: Triton specializes an integer of 1 and multiples
# of 16 (warm_up)
EAGER_WARM = ((96, 1), (97, 2), (96, 16))


class MtpSlots:
    """The MTP block of runner's model over runner's slots, its K/V in cache type `cache_type` (f16 or q8_0:
    engine/planner.py mtp_cache_type)."""

    def __init__(self, runner, cache_type: str):
        r, s = runner, runner.spec
        self.runner, self.model = r, r.model
        codec = get_codec(cache_type)
        self.cache_type = codec.name
        shape = (r.n_blocks + 1, r.block_size, s.n_head_kv)   # (the pool's blocks, then the scratch block)
        dev = r.device
        self.k = {0: torch.zeros(shape + (codec.row_bytes(s.head_dim),), dtype=torch.uint8, device=dev)}
        self.v = {0: torch.zeros(shape + (codec.row_bytes(s.head_dim_v),), dtype=torch.uint8, device=dev)}
        r.extra_caches.extend((self.k[0], self.v[0]))
        keys = KeyPreconditioner(r.model, [], r.n_slots + 1, r.max_ctx, r.block_size, False, r.triton, None, dev)
        self.attention = SlotAttention(s, self.k, self.v, codec, codec, r.block_table, r.block_size, keys,
                                       r._read_rows, triton=r.triton, prefill_dot=r.attention.prefill_dot,
                                       decoded_prefill=False, n_split=r.attention.n_split,
                                       decode_dot=r.decode_dot(codec, codec))
        self._blocks: dict[int, tuple] = {}   # rows bucket -> the block's graph (_block_graph)
        self._heads: dict[int, tuple] = {}    # drafting rows bucket -> the head's graph (_head_graph)
        self._before: dict[int, int] = {}     # slot -> positions its blocks held before room() took more

    def nbytes(self) -> int:
        return self.k[0].numel() + self.v[0].numel()

    def close(self) -> None:
        r = self.runner
        r.extra_caches[:] = [c for c in r.extra_caches if c is not self.k[0] and c is not self.v[0]]
        self._blocks.clear()
        self._heads.clear()
        self.k.clear()
        self.v.clear()

    # ----- engine/spec/mtp.py's catch_up: room, rewind, run, done -----
    def room(self, st, start: int, end: int) -> int:
        """Let the MTP rows of positions [start, end) of st's slot be written: blocks taken for positions the slot
        holds no block for yet (a block it shares with another slot is written in place: the rows of positions
        both conversations have are the same). Returns the end that has room (end, or less when the pool is
        full, or the slot's context ends)."""
        t = self.runner.tables
        end = min(end, self.runner.max_ctx)     # (no rows past the slot's context)
        have = t.held(st.slot) * t.block_size
        if end <= have:
            return end
        try:
            t.reserve(st.slot, max(start, have), end)
        except PoolFullError:
            return have
        self._before.setdefault(st.slot, have)
        return end

    def rewind(self, st, p0: int) -> None:
        """(Rows are written in place: nothing to cut.)"""

    def done(self, st) -> None:
        """st's pass is over: the blocks only its chained rows took go back to the pool (their rows are written
        again by the next catch-up; the next step reserves its own)."""
        have = self._before.pop(st.slot, None)
        if have is not None:
            self.runner.tables.truncate(st.slot, max(have, st.valid))

    def run(self, groups: list, tokens: torch.Tensor, hidden: torch.Tensor,
            want: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass of MTP states' rows: groups (state, first position, rows); see run_slots."""
        return self.run_slots([(st.slot, p0, m) for st, p0, m in groups], tokens, hidden, want)

    @torch.inference_mode()
    def run_slots(self, groups: list, tokens: torch.Tensor, hidden: torch.Tensor,
                  want: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass. groups: (slot, first position, rows) per sequence, its rows in order in tokens [R] and hidden
        [R, n_embd]; want: whether a group's last row drafts. Returns the drafting rows' tokens [n] and output rows
        [n, n_embd] (device tensors of their own)."""
        slots, pos, sel = [], [], []
        for (slot, p0, m), w in zip(groups, want):
            slots += [slot] * m
            pos.extend(range(p0, p0 + m))
            if w:
                sel.append(len(pos) - 1)
        R, S = len(pos), len(sel)
        r = self.runner
        r.sync_tables()
        dev = r.device
        graphs = r.graphs_enabled and R <= BUCKETS[-1]
        if graphs:
            graph, tok, hid, ps, sl, out = self._block_graph(next(b for b in BUCKETS if b >= R))
            fill_rows(tok, ps, sl, tokens, pos, slots, r.scratch)
            hid[:R].copy_(hidden, non_blocking=True)
            graph.replay()
        else:
            out = self._block(tokens.to(dev), hidden, torch.tensor(pos, device=dev), torch.tensor(slots, device=dev))
        if not sel:   # (rows only: no head)
            return torch.zeros(0, dtype=torch.long, device=dev), out[:0]
        rows = out.index_select(0, torch.tensor(sel).to(dev, non_blocking=True))
        if not graphs:
            return self._head(rows), rows
        graph, inp, ids = self._head_graph(next(b for b in BUCKETS if b >= S))
        inp[:S].copy_(rows)
        graph.replay()
        return ids[:S].clone(), rows

    def _block(self, tokens, hidden, positions, slots) -> torch.Tensor:
        b = SlotBatch(self.runner, positions, slots, decode=True, attention=self.attention)
        return self.model.mtp_block(tokens, hidden, b)

    def _head(self, rows: torch.Tensor) -> torch.Tensor:
        return self.model.mtp_head(rows).argmax(-1)

    def _block_graph(self, B: int) -> tuple:
        """Rows bucket B's captured block (at first use, or by warm_up): (graph, tokens, hidden, positions, slots,
        output rows)."""
        g = self._blocks.get(B)
        if g is None:
            r, dev = self.runner, self.runner.device
            ins = (torch.zeros(B, dtype=torch.long, device=dev),
                   torch.zeros(B, r.spec.n_embd, dtype=torch.float32, device=dev),
                   torch.zeros(B, dtype=torch.long, device=dev),
                   torch.full((B,), r.scratch, dtype=torch.long, device=dev))
            g = self._blocks[B] = self._capture(self._block, ins)
        return g

    def _head_graph(self, S: int) -> tuple:
        """The head's captured argmax over S rows: (graph, rows, tokens). Apart from the block's graphs, so that a
        pass's head reads only the rows that draft (over 64 padded rows it cost the 27B's 16 x 3 drafts 7.1 ms
        against 5.7 ms for 16 x 4 eagerly, on the H100)."""
        g = self._heads.get(S)
        if g is None:
            r = self.runner
            g = self._heads[S] = self._capture(self._head, (torch.zeros(S, r.spec.n_embd, device=r.device),))
        return g

    def _capture(self, fn, ins: tuple) -> tuple:
        """fn(*ins) as a CUDA graph in the runner's graph pool: (graph, *ins, its output)."""
        graph, out = capture_graph(fn, ins, self.runner.graph_pool(), self.runner.device)
        return (graph, *ins, out)

    def warm_up(self) -> None:
        """Before the first requests: on CUDA the passes' graphs captured (largest first, so smaller ones reuse its
        memory) and the eager passes' kernels compiled (EAGER_WARM), all on the scratch slot; on the CPU nothing
        (no compiling)."""
        r = self.runner
        if r.device.type != "cuda":
            return
        if r.graphs_enabled:
            with capture_guard():
                for B in sorted(BUCKETS, reverse=True):
                    self._block_graph(B)
                    self._head_graph(B)
        E = r.spec.n_embd
        for R, S in EAGER_WARM:
            self.run_slots([(r.scratch, 0, R - S + 1)] + [(r.scratch, 0, 1)] * (S - 1),
                           torch.zeros(R, dtype=torch.long, device=r.device),
                           torch.zeros(R, E, device=r.device), [True] * S)
        torch.cuda.synchronize(r.device)

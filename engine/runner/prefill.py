"""A prompt chunk on the GPU as CUDA graphs between its attention layers (piecewise graphs).

A 512-token chunk of the 27B launches ~8,500 kernels; run eagerly the host needs ~190 ms to launch what
the GPU runs in ~110 ms (docs/PERFORMANCE.md), so an eager prompt chunk is bound by the host.
Everything in a chunk has shapes fixed by the chunk size except attention, whose keys grow with the
slot's depth: so the chunk is captured as one graph per stretch between two attention layers and the
attention runs eagerly in between (from the graph's static q, k, v into a static output), ~17 replays
and 16 attention calls instead of ~8,500 launches.

To replay for any chunk of at most `chunk` tokens, every chunk runs padded to `chunk` rows (the prefill
matmuls already pad to it: PREFILL_ROWS): padding rows take token 0 at the last real position, their
gates zero (log decay 0, beta 0) so the delta rule's state passes them unchanged, and the conv window
kept is the last real rows'. The slot's recurrent state is read and written through a device index (one
graph serves every slot). The first chunk of a size runs this padded path eagerly (compiling and warming
everything), then it is captured; replays run the same kernels on the same shapes, so the first chunk's
result is the replays' bit for bit. Capture failing leaves the padded path eager (a warning), nothing else.

A small pass (at most SMALL_PROMPT_ROWS rows per piece: a short request, a follow-up's new tokens) may hold
several slots' pieces at once (Runner.prefill_pieces, when `prompt_pieces` is on): the pieces lie one after
another at multiples of PIECE_ALIGN rows, each with its own positions and slot; attention runs per piece
between the segments; the recurrent layers take each piece's conv window and state through fixed-size device
buffers (PromptPieces: a captured pass serves every layout) and the delta rule for all pieces in one launch
(kernels/gdn/rows.py: delta_rule_pieces). Its matmuls run every row through the small chunk's packed kernel
settings in blocks of SMALL_PROMPT_ROWS rows, where a row's result does not depend on the rows beside it: each
piece gets the bits its own pass gives it.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from engine.runner.batch import SlotBatch
from engine.runner.graphs import capture_guard

if TYPE_CHECKING:
    from engine.runner.runner import Runner

log = logging.getLogger(__name__)


PIECE_ALIGN = 16   # pieces start at multiples of this many rows (the CPU's matmuls: a row's result depends
                   # on its place in a 16-row block; the GPU's do not)


def piece_rows(n: int) -> int:
    """The rows a piece of n tokens takes in a pass: n up to the next multiple of PIECE_ALIGN."""
    return -(-n // PIECE_ALIGN) * PIECE_ALIGN


class PromptPieces:
    """The layout of a pass's pieces as fixed-size device buffers (kernels/gdn/block.py: conv_rule_pieces reads them):
    each piece's slot (unused pieces repeat piece 0: they write what it writes), row boundaries `cu` (a piece
    owns its alignment padding; the last real piece the pass's tail), and for the conv: `gather` lays out
    [window; rows] of every piece one after another (indexes into [the pieces' windows; the pass's rows]),
    `sel` picks each row's conv window from that, `keep` each piece's new window. `bounds`: (slot, first
    row, end of the real rows) per piece, on the CPU only (its eager loop; a captured pass must not read
    the host's layout). Made for passes that may hold several pieces, and on the CPU for every pass."""

    def __init__(self, runner: Runner, rows: int, max_pieces: int):
        dev = runner.device
        self.k = runner.spec.ssm_d_conv - 1 if runner.conv_state else 0
        self.rows, self.max_pieces = rows, max_pieces
        self.slots = torch.zeros(max_pieces, dtype=torch.long, device=dev)
        self.cu = torch.zeros(max_pieces + 1, dtype=torch.int32, device=dev)
        self.gather = torch.zeros(max_pieces * self.k + rows, dtype=torch.long, device=dev)
        self.sel = torch.zeros(rows, dtype=torch.long, device=dev)
        self.keep = torch.zeros(max_pieces, self.k, dtype=torch.long, device=dev)
        self.bounds: list[tuple[int, int, int]] | None = None

    def fill(self, layout: list[tuple[int, int, int]]) -> None:
        """layout: (slot, first row, real rows) per piece, in row order from row 0."""
        P, k, N = self.max_pieces, self.k, self.rows
        ends = [lo for _, lo, _ in layout[1:]] + [N]
        slots = [sl for sl, _, _ in layout] + [layout[0][0]] * (P - len(layout))
        cu = [0] + ends + [N] * (P - len(layout))
        gather, sel, keep = [], torch.zeros(N, dtype=torch.long), []
        for p in range(P):
            lo, hi = cu[p], cu[p + 1]
            gather += list(range(p * k, (p + 1) * k)) + list(range(P * k + lo, P * k + hi))
            sel[lo:hi] = torch.arange(lo, hi) + p * k
            if p < len(layout):
                end = layout[p][1] + layout[p][2]   # the piece's last real row + 1
                keep.append(list(range(p * k + end, p * k + end + k)))
            else:
                keep.append(keep[0])
        for dst, src in ((self.slots, torch.tensor(slots)), (self.cu, torch.tensor(cu, dtype=torch.int32)),
                         (self.gather, torch.tensor(gather, dtype=torch.long)), (self.sel, sel),
                         (self.keep, torch.tensor(keep, dtype=torch.long).view(P, k))):
            dst.copy_(src, non_blocking=True)
        self.bounds = [(sl, lo, lo + n) for sl, lo, n in layout] if self.slots.device.type == "cpu" else None


class _Inputs:
    """A pass's static device inputs: tokens, positions, every row's slot, which rows are real, the conv-window
    rows to keep (one piece), and the pieces' layout (PromptPieces)."""

    def __init__(self, runner: Runner, chunk: int, max_pieces: int = 1):
        dev = runner.device
        self.chunk = chunk
        self.tokens = torch.zeros(chunk, dtype=torch.long, device=dev)
        self.positions = torch.zeros(chunk, dtype=torch.long, device=dev)
        self.slots = torch.zeros(chunk, dtype=torch.long, device=dev)
        self.valid = torch.zeros(chunk, dtype=torch.float32, device=dev)
        k = runner.spec.ssm_d_conv - 1 if runner.conv_state else 0
        self.keep = torch.zeros(k, dtype=torch.long, device=dev)
        # the layout's buffers where something reads them: the CPU's delta rule, passes of several pieces (a
        # GPU pass of one slot reads the state through `slots`, not through a layout remade every chunk)
        many = max_pieces > 1 or runner.device.type == "cpu"
        self.pieces = PromptPieces(runner, chunk, max_pieces) if many else None
        self.layout: list[tuple[int, int, int]] = []   # (slot, first row, real rows) per piece

    def fill(self, pieces: list[tuple[int, torch.Tensor, int]]) -> None:
        """The pieces' rows (slot, tokens, start) at multiples of PIECE_ALIGN, padding between and after them:
        token 0 at the piece's last position, in its slot (copies queued on the stream, no host sync)."""
        c = self.chunk
        tok = torch.zeros(c, dtype=torch.long)
        pos = torch.zeros(c, dtype=torch.long)
        slots = torch.zeros(c, dtype=torch.long)
        valid = torch.zeros(c)
        layout, lo = [], 0
        for i, (slot, tokens, start) in enumerate(pieces):
            n = len(tokens)
            hi = c if i == len(pieces) - 1 else lo + piece_rows(n)
            if lo + n > c:
                raise ValueError(f"pieces of {[len(t) for _, t, _ in pieces]} tokens do not fit a pass of {c} rows")
            tok[lo:lo + n] = tokens.cpu()
            pos[lo:hi] = start + n - 1
            pos[lo:lo + n] = torch.arange(start, start + n)
            slots[lo:hi] = slot
            valid[lo:lo + n] = 1.0
            layout.append((slot, lo, n))
            lo = hi
        n0 = layout[0][2]
        for dst, src in ((self.tokens, tok), (self.positions, pos), (self.valid, valid), (self.slots, slots),
                         (self.keep, torch.arange(n0, n0 + len(self.keep)))):
            dst.copy_(src, non_blocking=True)
        if self.pieces is not None:
            self.pieces.fill(layout)
        self.layout = layout


class PaddedBatch(SlotBatch):
    """The model's batch in a padded pass: the static inputs, and attention handed to the PrefillGraph (a
    split point); the runner's delta rule masks the padding rows (valid, and keep or the pieces' layout)."""

    def __init__(self, graph: "PrefillGraph"):
        inp = graph.inp
        super().__init__(graph.runner, inp.positions, inp.slots, decode=False)
        self.graph, self.valid, self.keep, self.pieces = graph, inp.valid, inp.keep, inp.pieces
        self.rope_positions = graph.runner.rope_positions(inp.positions, inp.slots)

    def attend(self, il, q, k, v, scale, window):
        return self.graph.split(il, q, k, v, scale, window)


class PrefillGraph:
    """One size's padded pass: run eagerly the first time, then as captured segments. max_pieces: how many
    slots' pieces a pass may hold (1: one slot's chunk)."""

    def __init__(self, runner: Runner, chunk: int, capture: bool, max_pieces: int = 1):
        self.runner, self.chunk, self.capture_ok = runner, chunk, capture
        self.max_pieces = max_pieces
        self.inp = _Inputs(runner, chunk, max_pieces)
        self.segments: list[torch.cuda.CUDAGraph] = []
        self.splits: list[tuple] = []       # per attention layer: (il, scale, window)
        self.qkv: dict[int, tuple] = {}     # attention layer -> its static q, k, v (a view of shared buffers)
        self.out: torch.Tensor | None = None    # the attention output all layers share (static)
        self.x: torch.Tensor | None = None      # the last segment's hidden rows (static)
        self.features: torch.Tensor | None = None   # and their states at the model's capture_layers
        self._capturing: torch.cuda.CUDAGraph | None = None
        self._shared: dict[tuple, torch.Tensor] = {}   # (role, shape, dtype) -> a q, k or v buffer
        self._real: list[tuple[SlotBatch, int, int]] = []   # the running pass's pieces: (batch, first row, end)

    def run(self, pieces: list[tuple[int, torch.Tensor, int]]) -> list[torch.Tensor]:
        """Each piece's (slot, tokens, start) hidden rows [n, n_embd] (views of a static buffer when replayed:
        use them before the next pass)."""
        n = sum(len(t) for _, t, _ in pieces)
        if not pieces or len(pieces) > self.max_pieces or not all(len(t) for _, t, _ in pieces) or n > self.chunk:
            raise ValueError(f"pieces of {[len(t) for _, t, _ in pieces]} tokens for a pass of {self.chunk} rows "
                             f"and at most {self.max_pieces} pieces")
        r, inp = self.runner, self.inp
        inp.fill(pieces)
        self._real = [(SlotBatch(r, inp.positions[lo:lo + m], inp.slots[lo:lo + m], decode=False, slot=slot,
                                 start=start), lo, lo + m)
                      for (slot, _, start), (_, lo, m) in zip(pieces, inp.layout)]
        try:
            if self.segments:
                for i, g in enumerate(self.segments):
                    g.replay()
                    if i < len(self.splits):
                        self._attend(*self.splits[i])
                r._step_features = self.features
                x = self.x
            else:
                x = r._hidden(inp.tokens, PaddedBatch(self))
                feats = r._step_features
                if self.capture_ok:
                    self._capture()
                r._step_features = feats   # (this pass's, not the capture's buffer: nothing ran in it yet)
            return [x[lo:hi] for _, lo, hi in self._real]
        finally:
            self._real = []

    # ----- the split points -----
    def split(self, il, q, k, v, scale, window):
        """An attention layer in the padded chunk: q, k, v into the shared static buffers, then (eager) the
        attention of the real rows, or (capturing) the end of one segment and the start of the next."""
        bufs = self._buffers(il, q, k, v)
        for b, t in zip(bufs, (q, k, v)):
            b.copy_(t)
        if self._capturing is not None:
            self.splits.append((il, scale, window))
            self._capturing.capture_end()
            self.segments.append(self._capturing)
            self._capturing = self._begin()
        else:
            self._attend(il, scale, window)
        return self.out[:q.shape[0]]

    def _attend(self, il, scale, window) -> None:
        """Each piece's rows over its own slot (eagerly: the keys grow with the slot's depth)."""
        q, k, v = self.qkv[il]
        if not self.out.is_cuda:   # (the CPU: padding rows share 16-row matmul blocks with real rows, so they
            self.out.zero_()      # hold the same zeros in every pass, whatever ran before)
        for b, lo, hi in self._real:
            self.out[lo:hi].copy_(self.runner.attention.attend(b, il, q[lo:hi], k[lo:hi], v[lo:hi], scale, window))

    def _buffers(self, il, q, k, v) -> tuple:
        """Layer il's static q, k, v: views of buffers all attention layers share (they run one after
        another), made at the first chunk; the attention output likewise."""
        if il not in self.qkv:
            shared = self._shared
            views = []
            for role, t in enumerate((q, k, v)):
                key = (role, tuple(t.shape), t.dtype)
                if key not in shared:
                    shared[key] = torch.zeros(t.shape, dtype=t.dtype, device=t.device)
                views.append(shared[key])
            self.qkv[il] = tuple(views)
            if self.out is None:
                s = self.runner.spec
                self.out = torch.zeros((q.shape[0], q.shape[1], s.head_dim_v), dtype=torch.float32,
                                       device=q.device)
        return self.qkv[il]

    # ----- capture -----
    def _begin(self) -> torch.cuda.CUDAGraph:
        g = torch.cuda.CUDAGraph()
        g.capture_begin(pool=self.runner.graph_pool())
        return g

    def _capture(self) -> None:
        """Capture the padded chunk as segments between attention layers (nothing runs: the buffers hold
        the eager chunk's inputs). On failure the chunk size stays eager."""
        r, dev = self.runner, self.runner.device
        torch.cuda.synchronize(dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        try:
            with capture_guard(), torch.cuda.stream(side), torch.inference_mode():
                self._capturing = self._begin()
                x = r._hidden(self.inp.tokens, PaddedBatch(self))
                self._capturing.capture_end()
                self.segments.append(self._capturing)
                self.x, self.features = x, r._step_features
        except Exception as e:   # (a kernel that cannot be captured: the eager path works the same)
            if self._capturing is not None:
                try:
                    self._capturing.capture_end()
                except Exception:
                    pass
            log.warning("prompt chunks of %d tokens stay eager: capturing them failed (%s)", self.chunk, e)
            self.segments, self.splits, self.x, self.features, self.capture_ok = [], [], None, None, False
        finally:
            self._capturing = None
            torch.cuda.current_stream(dev).wait_stream(side)
            # the eager first chunk's temporaries stay cached by torch's allocator beside the graphs' own
            # pool (~0.6 GB more reserved on the 27B, 200K turbo3_tcq run): hand them back
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()

"""A runner's decode steps as CUDA graphs: one per rows bucket (1, 2, 4, .., 64), and apart for drafting steps of
recurrent models (their rows' layout an input of its own, kernels/gdn/verify.py) and for steps that make a key
center (rotated K types, a row at a new segment). A graph is the runner's eager decode step (Runner._decode_eager)
captured over static input buffers (tokens, positions, slots; padding rows in the scratch slot): `fill` writes a
step's rows into them, the runner replays it. Captured at first use or ahead of time (capture, capture_drafting);
all of a runner's graphs share one memory pool (`pool`). Also what every capture of the runner's uses: the guard
around it (capture_guard), the capture itself (capture_graph) and a graph's row inputs (fill_rows).
"""
from __future__ import annotations

import contextlib
import gc
from typing import NamedTuple

import torch

from kernels.gdn.verify import draft_layout

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class DecodeGraph(NamedTuple):
    """A captured decode step: its static inputs (tokens, positions, slots) and outputs (logits, the rows'
    output-normed hidden states, and their hidden states at the model's capture_layers or None)."""
    graph: object
    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    logits: torch.Tensor
    hidden: torch.Tensor
    features: torch.Tensor | None


@contextlib.contextmanager
def capture_guard():
    """Around a CUDA graph's capture: CUDA graphs left in dead reference cycles (a closed runner's, a
    failed request's traceback) are destroyed when Python's garbage collector reaches them, and one
    destroyed while another graph is being captured invalidates that capture
    (cudaErrorStreamCaptureInvalidated: torch 2.11 no longer collects before capturing). So collect
    first and keep the collector off until the capture has ended. Nested in another guard (a batch of
    captures: Runner.capture, capture_drafting, capture_prefill) it does not collect again: one collect
    per batch (each takes a full pass over the heap)."""
    was_on = gc.isenabled()
    if was_on:
        gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def capture_graph(fn, args: tuple, pool, device: torch.device):
    """fn(*args) captured as a CUDA graph in memory pool `pool`, after two runs on a side stream (they compile the
    Triton kernels and warm the allocator): (graph, fn's output, whose buffers the replays write)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), torch.inference_mode():
        for _ in range(2):
            fn(*args)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with capture_guard(), torch.cuda.graph(graph, pool=pool), torch.inference_mode():
        out = fn(*args)
    return graph, out


def fill_rows(tok: torch.Tensor, pos: torch.Tensor, sl: torch.Tensor, tokens, positions, slots, scratch: int) -> None:
    """A graph's row inputs [B] set to a step's n rows (tokens may be on the device); the rows after them are
    padding: token 0 at position 0 of the scratch slot."""
    n, B = len(slots), tok.shape[0]
    tok[:n].copy_(torch.as_tensor(tokens), non_blocking=True)
    pos[:n].copy_(torch.as_tensor(positions), non_blocking=True)
    sl[:n].copy_(torch.as_tensor(slots), non_blocking=True)
    if n < B:
        tok[n:].zero_()
        pos[n:].zero_()
        sl[n:].fill_(scratch)


class DecodeGraphs:
    """The decode graphs of `runner` (engine/runner/runner.py)."""

    def __init__(self, runner):
        self.runner = runner
        self.graphs: dict[tuple, DecodeGraph] = {}      # (rows bucket, drafting, centers) -> decode graph
        self.layout: dict[tuple, torch.Tensor] = {}     # a drafting graph's rows layout (kernels/gdn/verify.py)
        self._pool = None

    def pool(self):
        """The memory pool the runner's graphs share."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def clear(self) -> None:
        self.graphs.clear()
        self.layout.clear()

    def fill(self, B: int, slots, tokens, positions, drafting: bool = False, centers: bool = False) -> None:
        """Write a step's rows into bucket B's input buffers (padding rows go to the scratch slot), and a
        drafting step's layout of them."""
        key = (B, drafting, centers)
        g, scratch = self.graphs[key], self.runner.scratch
        fill_rows(g.tokens, g.positions, g.slots, tokens, positions, slots, scratch)
        n = len(slots)
        if drafting:
            lay = draft_layout(list(slots) + [scratch] * (B - n), scratch, always=True)
            self.layout[key].copy_(torch.tensor(lay, dtype=torch.long), non_blocking=True)

    def get(self, B: int, drafting: bool = False, centers: bool = False) -> DecodeGraph:
        """Bucket B's decode graph; drafting: the one for steps with draft rows of recurrent models (its
        rows layout in `layout`); centers: the one for steps that make a key center (rotated K types,
        a row at a new segment). Captured at first use."""
        key = (B, bool(drafting), centers)
        g = self.graphs.get(key)
        if g is not None:
            return g
        r = self.runner
        dev = r.device
        tok = torch.zeros(B, dtype=torch.long, device=dev)
        pos = torch.zeros(B, dtype=torch.long, device=dev)
        sl = torch.full((B,), r.scratch, dtype=torch.long, device=dev)
        lay = None
        if drafting:   # (a layout of B padding rows until filled; the graphs' kept-input buffers)
            lay = torch.tensor(draft_layout([r.scratch] * B, r.scratch, always=True), device=dev)
            r.recurrent.use_graph_buffers()
        graph, out = capture_graph(r._decode_eager, (tok, pos, sl, lay, centers), self.pool(), dev)
        if drafting:
            self.layout[key] = lay
        g = self.graphs[key] = DecodeGraph(graph, tok, pos, sl, out, r._step_hidden, r._step_features)
        return g

    def capture(self, buckets=BUCKETS) -> None:
        """Capture the decode graphs ahead of time (largest first, so smaller ones reuse its memory)."""
        if self.runner.graphs_enabled:
            with capture_guard():
                for B in sorted(buckets, reverse=True):
                    self.get(B)

    def capture_drafting(self, max_rows: int) -> None:
        """Capture ahead of time a recurrent model's drafting-step graphs of up to max_rows rows (a bucket of
        2, 4, .. rows each; the engine asks for every sequence drafting at once). Steps whose bucket was not
        captured capture it at first use: a 4-agent drafting run on the 27B went at 94.9 tok/s against 569.1 once
        its buckets were captured (H100, docs/decisions/drafting-graphs-for-every-agent.md)."""
        r = self.runner
        if r.conv_state:
            r.recurrent.kept_buffers()   # (their memory before the graphs')
            r.recurrent.warm_up(list(BUCKETS))
        if r.graphs_enabled and r.conv_state:
            top = min(1 << (max(max_rows, 2) - 1).bit_length(), BUCKETS[-1])
            with capture_guard():
                for B in (w for w in sorted(BUCKETS, reverse=True) if 2 <= w <= top):
                    self.get(B, True)

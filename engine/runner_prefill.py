"""A prompt chunk on the GPU as CUDA graphs between its attention layers (piecewise graphs).

A 512-token chunk of the 27B launches ~8,500 kernels; run eagerly the host needs ~190 ms to launch what
the GPU runs in ~110 ms (docs/PERFORMANCE.md, seventh session), so a prompt chunk was bound by the host.
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
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from engine.runner import SlotBatch, capture_guard

if TYPE_CHECKING:
    from engine.runner import Runner

log = logging.getLogger(__name__)


class _Inputs:
    """A chunk size's static device inputs: tokens, positions, every row's slot, which rows are real,
    and the conv-window rows to keep."""

    def __init__(self, runner: Runner, chunk: int):
        dev = runner.device
        self.chunk = chunk
        self.tokens = torch.zeros(chunk, dtype=torch.long, device=dev)
        self.positions = torch.zeros(chunk, dtype=torch.long, device=dev)
        self.slots = torch.zeros(chunk, dtype=torch.long, device=dev)
        self.valid = torch.zeros(chunk, dtype=torch.float32, device=dev)
        k = runner.spec.ssm_d_conv - 1 if runner.conv_state else 0
        self.keep = torch.zeros(k, dtype=torch.long, device=dev)

    def fill(self, tokens: torch.Tensor, start: int, slot: int) -> None:
        """One chunk's rows (n <= chunk), the rest padding (copies queued on the stream, no host sync)."""
        n, c = len(tokens), self.chunk
        pos = torch.arange(start, start + c)
        pos[n:] = start + n - 1
        valid = torch.zeros(c)
        valid[:n] = 1.0
        tok = torch.zeros(c, dtype=torch.long)
        tok[:n] = tokens.cpu()
        for dst, src in ((self.tokens, tok), (self.positions, pos), (self.valid, valid),
                         (self.keep, torch.arange(n, n + len(self.keep)))):
            dst.copy_(src, non_blocking=True)
        self.slots.fill_(slot)


class PaddedBatch(SlotBatch):
    """The model's batch in a padded prompt chunk: the static inputs, and attention handed to the
    PrefillGraph (a split point); the runner's delta rule masks the padding rows (valid, keep)."""

    def __init__(self, graph: "PrefillGraph"):
        inp = graph.inp
        super().__init__(graph.runner, inp.positions, inp.slots, decode=False)
        self.graph, self.valid, self.keep = graph, inp.valid, inp.keep

    def attend(self, il, q, k, v, scale, window):
        return self.graph.split(il, q, k, v, scale, window)


class PrefillGraph:
    """One chunk size's padded prompt chunk: run eagerly the first time, then as captured segments."""

    def __init__(self, runner: Runner, chunk: int, capture: bool):
        self.runner, self.chunk, self.capture_ok = runner, chunk, capture
        self.inp = _Inputs(runner, chunk)
        self.segments: list[torch.cuda.CUDAGraph] = []
        self.splits: list[tuple] = []       # per attention layer: (il, scale, window)
        self.qkv: dict[int, tuple] = {}     # attention layer -> its static q, k, v (a view of shared buffers)
        self.out: torch.Tensor | None = None    # the attention output all layers share (static)
        self.x: torch.Tensor | None = None      # the last segment's hidden rows (static)
        self.features: torch.Tensor | None = None   # and their states at the model's capture_layers
        self._capturing: torch.cuda.CUDAGraph | None = None
        self._shared: dict[tuple, torch.Tensor] = {}   # (role, shape, dtype) -> a q, k or v buffer
        self._real = None                   # the running chunk's SlotBatch (eager attention)
        self._n = 0                         # and its real rows

    def run(self, tokens: torch.Tensor, start: int, slot: int) -> torch.Tensor:
        """The chunk's hidden rows [n, n_embd] (a view of a static buffer when replayed: use it before the
        next chunk)."""
        n = len(tokens)
        if not 0 < n <= self.chunk:
            raise ValueError(f"a chunk of {n} tokens for graphs of {self.chunk}")
        r, inp = self.runner, self.inp
        inp.fill(tokens, start, slot)
        self._real = SlotBatch(r, inp.positions[:n], inp.slots[:n], decode=False, slot=slot, start=start)
        self._n = n
        try:
            if self.segments:
                for i, g in enumerate(self.segments):
                    g.replay()
                    if i < len(self.splits):
                        self._attend(*self.splits[i])
                r._step_features = self.features
                return self.x[:n]
            x = r._hidden(inp.tokens, PaddedBatch(self))
            feats = r._step_features
            if self.capture_ok:
                self._capture()
            r._step_features = feats   # (this chunk's, not the capture's buffer: nothing ran in it yet)
            return x[:n]
        finally:
            self._real = None

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
        q, k, v = self.qkv[il]
        n = self._n
        self.out[:n].copy_(self.runner._attend(self._real, il, q[:n], k[:n], v[:n], scale, window))

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
        g.capture_begin(pool=self.runner._graph_pool)
        return g

    def _capture(self) -> None:
        """Capture the padded chunk as segments between attention layers (nothing runs: the buffers hold
        the eager chunk's inputs). On failure the chunk size stays eager."""
        r, dev = self.runner, self.runner.device
        if r._graph_pool is None:
            r._graph_pool = torch.cuda.graph_pool_handle()
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

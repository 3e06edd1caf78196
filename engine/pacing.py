"""How often a step may take a prompt chunk while other sequences are generating (the GPU path's
scheduler, engine/scheduler.py; the step clock runs in engine/step_runner.py).

A step with a prompt chunk takes several times as long as a decode-only step (H200, 27B: ~60-130 ms
against ~20 ms), so a long prompt fed one chunk per step slows every generating agent to a fraction of
its speed (llama-server: 29 -> 1.4 tok/s). The pacer lets a long prompt take at most `share` of the
generating sequences' speed: a chunk step (time T_c, one token for each generating sequence) is followed
by decode-only steps (time t_d each) until their time reaches ((1 - share) T_c - t_d) / share, which
keeps each generating sequence at >= (1 - share) of its decode-only speed. share 0.5: they keep at least
half their speed and a long prompt takes up to about twice its time alone; 1: no pacing. A sequence's
first chunk of a request is never held back (a short prompt or a follow-up's new tokens: one chunk,
answered at once); only the chunks after it are paced. Step times are the device's (CUDA events, read
once they have completed: with overlapped steps the host's intervals belong to the step before), the
host's on the CPU.
"""
from __future__ import annotations

import collections
import time

import torch


class PrefillPacer:
    """The decision (`allow`) from the steps' measured times (`planned`, then `finished`)."""

    def __init__(self, share: float = 0.5):
        if not 0 < share <= 1:
            raise ValueError(f"prefill_share must be in (0, 1], got {share}")
        self.share = share
        self.decode_s: float | None = None   # a decode-only step's time (moving average)
        self.chunk_s: float | None = None    # a step with prompt chunks
        self.bank = 0.0                      # time of decode-only steps planned since the last chunk step
        self._steps = 0                      # steps planned so far
        self._last_chunk = -1                # the number of the last step with chunks
        self._running: set[int] = set()      # decode-only steps planned after it, not finished yet
        self.held = 0                        # times a chunk was held back (stats)

    def planned(self, chunks: bool) -> int:
        """A step is planned (with prompt chunks or not); returns its number for `finished`."""
        n = self._steps
        self._steps += 1
        if chunks:
            self._last_chunk, self.bank = n, 0.0
            self._running.clear()
        else:
            self._running.add(n)
        return n

    def finished(self, step: int, seconds: float, chunks: bool) -> None:
        """Step number `step` took `seconds` on the device."""
        if chunks:
            self.chunk_s = seconds if self.chunk_s is None else 0.5 * (self.chunk_s + seconds)
        else:
            self.decode_s = seconds if self.decode_s is None else 0.5 * (self.decode_s + seconds)
            if step > self._last_chunk:
                self.bank += seconds
                self._running.discard(step)

    def allow(self) -> bool:
        """Whether this step may take a paced chunk (the caller asks only while sequences generate)."""
        if self.share >= 1 or self.chunk_s is None:
            return True
        s, t_d = self.share, self.decode_s or 0.0
        need = max(0.0, (1 - s) * self.chunk_s - t_d) / s
        if self.bank + len(self._running) * t_d >= need:   # (steps still running: at their usual time)
            return True
        self.held += 1
        return False


class StepClock:
    """Each step's device time for a PrefillPacer: CUDA events around the step's launches, read without
    waiting once completed; on the CPU the host's time (the work is done when the call returns)."""

    def __init__(self, pacer: PrefillPacer, device: torch.device):
        self.pacer, self.cuda = pacer, device.type == "cuda"
        self._open: collections.deque = collections.deque()   # (step, start event, end event, chunks)

    def start(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.monotonic()

    def stop(self, t0, chunks: bool) -> None:
        step = self.pacer.planned(chunks)
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self._open.append((step, t0, e, chunks))
        else:
            self.pacer.finished(step, time.monotonic() - t0, chunks)

    def poll(self) -> None:
        while self._open and self._open[0][2].query():
            step, a, b, chunks = self._open.popleft()
            self.pacer.finished(step, a.elapsed_time(b) / 1e3, chunks)

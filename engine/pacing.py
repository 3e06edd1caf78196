"""How often a step may take a prompt chunk while other sequences are generating (the GPU path's
scheduler, engine/scheduler_gpu.py).

A step with a prompt chunk takes several times as long as a decode-only step (H200, 27B: ~60-130 ms
against ~20 ms), so a long prompt fed one chunk per step slows every generating agent to a fraction of
its speed (llama-server: 29 -> 1.4 tok/s). The pacer lets a long prompt take at most `share` of the
generating sequences' speed: a chunk step (time T_c, one token for each generating sequence) is followed
by decode-only steps (time t_d each) until their time reaches ((1 - share) T_c - t_d) / share, which
keeps each generating sequence at >= (1 - share) of its decode-only speed. share 0.5: they keep at least
half their speed and a long prompt takes up to about twice its time alone; 1: no pacing. A sequence's
first chunk of a request is never held back (a short prompt or a follow-up's new tokens: one chunk,
answered at once); only the chunks after it are paced. Times are the host's intervals between step
starts (with overlapped steps, what the GPU takes per step), averaged.
"""
from __future__ import annotations

MAX_INTERVAL = 1.0   # s: a longer gap between steps is idle time, counted as this much


class PrefillPacer:
    def __init__(self, share: float = 0.5):
        if not 0 < share <= 1:
            raise ValueError(f"prefill_share must be in (0, 1], got {share}")
        self.share = share
        self.decode_s: float | None = None   # a decode-only step's time (moving average)
        self.chunk_s: float | None = None    # a step with prompt chunks
        self.bank = 0.0                      # decode-only time since the last chunk step
        self._t_last: float | None = None
        self._last_chunks = False
        self.held = 0                        # chunks held back so far (stats)

    def step_started(self, now: float) -> None:
        """A step starts: the interval since the previous start was the previous step's."""
        if self._t_last is not None:
            dt = min(now - self._t_last, MAX_INTERVAL)
            if self._last_chunks:
                self.chunk_s = dt if self.chunk_s is None else 0.5 * (self.chunk_s + dt)
                self.bank = 0.0
            else:
                self.decode_s = dt if self.decode_s is None else 0.5 * (self.decode_s + dt)
                self.bank += dt
        self._t_last = now

    def planned(self, chunks: bool) -> None:
        """The step that just started takes prompt chunks (or not)."""
        self._last_chunks = chunks

    def idle(self) -> None:
        """No step for a while (nothing to run): the next interval is not a step's."""
        self._t_last = None

    def allow(self) -> bool:
        """Whether this step may take a paced chunk (the caller asks only while sequences generate)."""
        if self.share >= 1 or self.chunk_s is None:
            return True
        s, t_d = self.share, self.decode_s or 0.0
        need = max(0.0, (1 - s) * self.chunk_s - t_d) / s
        if self.bank >= need:
            return True
        self.held += 1
        return False

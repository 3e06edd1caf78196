"""The CPU path's step execution: the Scheduler's plan as one forward over the model's paged pool (every
sequence's rows as a SeqChunk: decode rows with their drafts, then prompt chunks), each sequence's logits
sampled or its drafts verified, recurrent-state checkpoints for prefix reuse, and a sequence's start from
the longest prefix a resident or running conversation holds.
"""
from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.models.common import SeqChunk
from engine.prefix import Entry, add_checkpoint
from kernels.quant.ref import ROW_BLOCK

if TYPE_CHECKING:
    from engine.scheduler import StepPlan
    from engine.sequence import Sequence


class CpuExecutor:
    """Runs the CPU path's steps for one engine. scheduler: engine/scheduler.py; speculator:
    engine/spec/speculator.py; resident: engine/prefix.py ResidentCache; running, totals: the engine's;
    on_logits(s, logits): the engine's sampling and streaming of a sequence's token; encode_images: the
    engine's image encoding before a step (None without a vision projector)."""

    def __init__(self, model, *, scheduler, speculator, resident, running: list, totals: collections.Counter,
                 on_logits: Callable, encode_images: Callable | None):
        self.model, self.spec = model, model.spec
        self.scheduler, self.speculator, self.resident = scheduler, speculator, resident
        self.running, self.totals = running, totals
        self.on_logits, self.encode_images = on_logits, encode_images
        self.last_step = {"rows": 0, "seqs": 0, "ms": 0.0}

    def admit(self, s: Sequence, share: bool = True) -> None:
        """Start s from the longest prefix of its prompt that a resident or running sequence holds."""
        if self.resident.budget <= 0 or s.n_prompt < 2 * ROW_BLOCK:
            return
        # (images compared by content: Sequence.prefix_keys)
        running = [Entry(r.prefix_keys(r.n_computed), r.kv, r.checkpoints) for r in self.running if r.kv is not None]
        n, entry, _ = self.resident.best(s.prefix_keys(s.n_prompt), bool(self.spec.recurrent_layers), running)
        if entry is not None and s.vision is not None:
            n = s.vision.safe_start(n)        # (an image attended both ways is read whole)
            n -= n % ROW_BLOCK
        if entry is None or n <= 0:
            return
        old = s.kv
        s.kv = entry.kv.fork()
        old.release()
        if entry.checkpoints:
            s.kv.restore(entry.checkpoints[n])
        s.kv.truncate(n)
        s.n_computed = s.cached = n
        self.totals["cached_tokens"] += n

    @staticmethod
    def chunks(plan: StepPlan) -> list[tuple[Sequence, SeqChunk]]:
        """The plan's rows as the model's SeqChunks, in row order: decode rows (the last sampled token and
        the drafts after it), then prompt chunks."""
        out = []
        for s in plan.decode:   # generating: feed the last sampled token (and drafts after it)
            lo, hi = s.n_computed, len(s.tokens)
            vp = s.vision
            pos = vp.generated_positions(lo, hi) if vp is not None and vp.positions is not None else None
            toks = s.tokens[lo:hi] + s.drafts
            out.append((s, SeqChunk(torch.tensor(toks), lo, s.kv, "all" if s.drafts else "last", positions=pos,
                                    rowwise=bool(s.drafts))))
        for s, lo, hi in plan.chunks:
            vp = s.vision
            last = hi == s.n_prompt and s.n_generated == 0   # (a recomputed sequence samples nothing here)
            pos = emb = bidir = None
            if vp is not None:
                pos, emb, bidir = vp.chunk_inputs(lo, hi)
            out.append((s, SeqChunk(torch.tensor(s.tokens[lo:hi]), lo, s.kv, "last" if last else "none",
                                    positions=pos, embeds=emb, bidirectional=bidir)))
        return out

    def step(self) -> None:
        t0 = time.monotonic()
        if self.encode_images is not None:
            self.encode_images()
        sp = self.speculator
        sp.draft_s = 0.0
        steps = self.scheduler.schedule_cpu()
        if steps.empty():
            return
        plan = self.chunks(steps)
        chunks = [c for _, c in plan]
        decode = [(s, len(c.tokens), len(s.drafts)) for s, c in plan if s.n_computed >= s.target]   # generating
        mtp = "mtp" in sp.kinds and any(s.mtp is not None for s, _ in plan)
        if mtp:
            logits, hidden = self.model.forward_with_hidden(chunks)
        else:
            logits = self.model.forward(chunks)
        rows = sum(len(c.tokens) for _, c in plan)
        recurrent = bool(self.spec.recurrent_layers) and self.resident.budget > 0
        for (s, c), lg in zip(plan, logits):
            s.n_computed = c.start + len(c.tokens)   # with drafts: set again by Speculator.verify
            if recurrent and s.n_computed <= s.n_prompt:
                add_checkpoint(s.checkpoints, s.kv)   # a later request can resume here
            if s.n_computed == s.n_prompt and s.n_generated == 0:
                self.totals["prompt_tokens"] += s.n_prompt
            if s.drafts:
                sp.verify(s, c.start, lg)
            elif lg.shape[0]:
                self.on_logits(s, lg[-1])
        if sp.kinds:
            sp.adapt_draft_lengths(decode)
        if mtp:
            sp.mtp_catch_up([(s, c.start, h) for (s, c), h in zip(plan, hidden) if s.kv is not None])
        if sp.dflash is not None:
            sp.dflash_step([(s, c.start, c.features) for s, c in plan if s.kv is not None])
        if sp.kinds and decode and len(decode) == len(plan):   # decode rows only: T(rows)
            sp.costs.add_step(rows, time.monotonic() - t0 - sp.draft_s)
        self.last_step = {"rows": rows, "seqs": len(plan), "ms": round(1000 * (time.monotonic() - t0), 2)}
        self.totals["steps"] += 1

"""The Scheduler: which rows the next step runs, as plain data (StepPlan).

Every step stacks the rows of all running sequences into one forward pass: a decode row for each
generating sequence (and its draft rows after it), then the next chunk of each prompt still being read, in
arrival order, within `step_tokens` (a step always has room for one whole chunk beside its decode rows).
Chunks end at multiples of `prefill_chunk`, whatever else runs, so a sequence's numbers do not depend on
its neighbours. Before the step runs, its KV blocks are made free: resident (CPU path) or parked (runner)
conversations are evicted first, least recently used first, then the newest running sequence is
pre-empted (its KV freed, back to the front of the queue, recomputed later); one that cannot fit even alone
stops with reason "length". On the runner, chunks after a request's first are paced while sequences
generate (engine/pacing.py).

The Scheduler reads sequences (tokens, n_computed, target, params, vision, slot) and a block manager; the
drafts come from a Speculator-like `drafts` object (draft_len, take_drafts); pre-empting and stopping go
back to the engine through two callbacks. So it runs without a device (tests/engine/test_scheduler.py).
"""
from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.kv.pool import PoolFullError
from engine.runner import BUCKETS

if TYPE_CHECKING:
    from engine.sequence import Sequence
    from engine.slots import SlotTable

log = logging.getLogger("hivejet.engine")

RUNNER_BLOCK = 16   # tokens per block of the GPU path's KV pool
RUNNER_MAX_ROWS = BUCKETS[-1]   # rows of one decode step that still run as a CUDA graph


@dataclass
class StepPlan:
    """One step's rows. decode: the generating sequences, one row each at position n_computed (their draft
    tokens, `drafts` of them, in s.drafts after it); chunks: (sequence, lo, hi) prompt rows in arrival
    order; preempted / stopped: sequences that were sent back to the queue / stopped with "length" to make
    room; evicted: parked or resident conversations dropped for it."""
    decode: list = field(default_factory=list)
    chunks: list = field(default_factory=list)
    drafts: dict = field(default_factory=dict)      # sequence id -> its draft rows
    preempted: list = field(default_factory=list)
    stopped: list = field(default_factory=list)
    evicted: int = 0

    @property
    def rows(self) -> int:
        return (len(self.decode) + sum(self.drafts.get(s.id, 0) for s in self.decode)
                + sum(hi - lo for _, lo, hi in self.chunks))

    def empty(self) -> bool:
        return not self.decode and not self.chunks

    def drop(self, s: Sequence) -> None:
        """s no longer runs this step (pre-empted)."""
        self.decode = [q for q in self.decode if q is not s]
        self.chunks = [c for c in self.chunks if c[0] is not s]
        self.drafts.pop(s.id, None)


class Scheduler:
    """Plans steps over `running` (the engine's list of running sequences, in arrival order).

    CPU path: `kv_pool` (the model's paged pool, engine/kv/pool.py), `pool_tokens` (its token limit) and
    `resident` (engine/prefix.py ResidentCache); each sequence's KV reserves its blocks (s.kv.reserve).
    Runner: `runner` (blocks_needed, draft_room, pool.n_free), `slots` (engine/slots.py SlotTable), `pacer`
    (engine/pacing.py PrefillPacer)."""

    def __init__(self, running: list, *, step_tokens: int, prefill_chunk: int, ctx_size: int, drafts,
                 preempt: Callable, stop: Callable, totals: collections.Counter | None = None,
                 runner=None, slots: SlotTable | None = None, pacer=None,
                 kv_pool=None, pool_tokens: int | None = None, resident=None):
        self.running = running
        self.step_tokens, self.prefill_chunk, self.ctx_size = step_tokens, prefill_chunk, ctx_size
        self.drafts = drafts
        self.preempt, self.stop = preempt, stop
        self.totals = totals if totals is not None else collections.Counter()
        self.runner, self.slots, self.pacer = runner, slots, pacer
        self.kv_pool, self.pool_tokens, self.resident = kv_pool, pool_tokens, resident

    # ----- admission -----
    def has_room(self, s: Sequence) -> bool:
        """Whether the pool can take all of s's tokens: the free blocks plus those only parked (runner) or
        resident (CPU) conversations hold. A prefix s may share is not counted: it waits rather than push a
        running one out."""
        if self.runner is not None:
            return self.slots.spare_blocks() * self.runner.block_size >= len(s.tokens) + 1
        if self.pool_tokens is None:
            return True
        pool = self.kv_pool
        free = min((g.n_free + (g.limit or g.capacity) - g.capacity) for g in pool.groups) * pool.block_size
        return free + self.resident.n_tokens >= len(s.tokens) + pool.block_size

    # ----- the CPU path -----
    def schedule_cpu(self) -> StepPlan:
        """Decode rows (and drafts) for every generating sequence, then prompt chunks in arrival order, their
        KV blocks reserved (reserve_kv)."""
        return self.reserve_kv(self.plan_cpu())

    def plan_cpu(self) -> StepPlan:
        """The CPU step's rows: decode rows for every generating sequence, then prompt chunks in arrival
        order while the budget lasts (a chunk longer than a whole step still goes as the step's first)."""
        budget = max(self.step_tokens, len(self.running))
        plan = StepPlan()
        for s in self.running:
            if s.n_computed >= s.target:  # generating: feed the last sampled token (and drafts after it)
                lo, hi = s.n_computed, len(s.tokens)
                room = min(self.drafts.draft_len(s), self.ctx_size - hi - 1, s.params.max_tokens - s.n_generated - 1)
                s.drafts, s.draft_q, s.draft_src = self.drafts.take_drafts(s, room)
                plan.decode.append(s)
                plan.drafts[s.id] = len(s.drafts)
                budget -= hi - lo + len(s.drafts)
        budget = max(budget, self.prefill_chunk)   # (room for one whole chunk beside the decode rows)
        for s in self.running:
            if s.n_computed < s.target:
                lo = s.n_computed
                pc = self.prefill_chunk
                hi = min((lo // pc + 1) * pc, s.target)   # chunk ends at fixed positions, even after a reused prefix
                if s.vision is not None:
                    hi = s.vision.chunk_end(lo, hi)  # an image attended both ways is never split
                n = hi - lo
                if n > budget and not plan.empty() and (plan.chunks or n <= self.step_tokens):
                    continue  # waits for a step with room; chunks are never cut differently (a chunk
                    # longer than a whole step, e.g. a large image read in one piece, goes with decode rows)
                plan.chunks.append((s, lo, hi))
                budget -= n
        return plan

    def reserve_kv(self, plan: StepPlan) -> StepPlan:
        """Allocate every row's KV blocks before the forward. When the pool is full: evict resident
        conversations (least recently used first), then pre-empt the newest running sequence; a sequence
        that cannot fit even alone stops with reason "length" (an empty plan then)."""
        while True:
            try:
                for s in plan.decode:
                    s.kv.reserve(s.n_computed, len(s.tokens) + len(s.drafts))
                for s, lo, hi in plan.chunks:
                    s.kv.reserve(lo, hi)
                return plan
            except PoolFullError:
                if self.resident.evict_one():
                    plan.evicted += 1
                    continue
                seqs = plan.decode + [s for s, _, _ in plan.chunks]
                if len(seqs) <= 1 and len(self.running) <= 1:
                    if seqs:
                        self._stop(seqs[0])
                        plan.stopped.append(seqs[0])
                    plan.decode, plan.chunks = [], []
                    return plan
                self._preempt_newest(plan)

    # ----- the runner -----
    def schedule(self, pending: dict | None = None) -> StepPlan | None:
        """The runner step's plan with its KV blocks free (make_room). pending: sequence id -> row of the
        tokens the previous step chose on the device that are not on the host yet (None: all are). None
        when those tokens must be read first: a sequence is to draft (drafts follow the newest token), or
        the step is short of free blocks (evicting and pre-empting need every sequence's tokens)."""
        plan = self.plan(pending)
        if pending is not None and any(plan.drafts.values()):
            return None
        return self.make_room(plan, drain=pending is not None)

    def plan(self, pending: dict | None = None) -> StepPlan:
        """The runner step's rows: the generating sequences (one decode row each, at position n_computed,
        then their drafts while the graphs have room), and (sequence, lo, hi) prompt chunks in arrival order
        while the step's token budget lasts. A sequence back from a pre-emption reads all its tokens but the
        last as prompt chunks again. A sequence whose pending token will end it by max_tokens or the
        context limit gets no row."""
        budget = max(self.step_tokens, len(self.running))
        pc = self.prefill_chunk
        pend = pending or {}
        plan = StepPlan()
        dec = plan.decode
        dec += [s for s in self.running if s.n_computed >= s.target and not (
            s.id in pend and (s.n_generated + 1 >= s.params.max_tokens or len(s.tokens) + 1 >= self.ctx_size))]
        rows = len(dec)
        budget -= rows
        for s in dec:   # drafts (spec_active): rows after the sequence's own, while graphs have room
            s.drafts, s.draft_q, s.draft_src = [], None, ""
            if s.drafter is not None or s.mtp is not None or s.dflash is not None:
                room = min(self.drafts.draft_len(s), self.ctx_size - len(s.tokens) - 1,
                           s.params.max_tokens - s.n_generated - 1, RUNNER_MAX_ROWS - rows, max(0, budget),
                           self.runner.draft_room(s.n_computed))
                s.drafts, s.draft_q, s.draft_src = self.drafts.take_drafts(s, room)
                rows += len(s.drafts)
                budget -= len(s.drafts)
            plan.drafts[s.id] = len(s.drafts)
        budget = max(budget, pc)   # (room for one whole chunk beside the decode rows and drafts)
        paced = None   # whether this step may take chunks after a request's first (engine/pacing.py)
        for s in self.running:
            if s.n_computed < s.target:
                lo = s.n_computed
                hi = min((lo // pc + 1) * pc, s.target)   # chunks end at fixed positions after a reused prefix
                if s.vision is not None:
                    hi = s.vision.chunk_end(lo, hi)       # an image attended both ways is never cut
                if hi - lo > budget and rows and (plan.chunks or hi - lo <= pc):
                    continue   # (a chunk longer than a step's room, a Gemma image read whole, still goes beside
                    # the decode rows as the step's first chunk: else it waits for every other agent to finish)
                if dec and lo > s.cached:
                    paced = self.pacer.allow() if paced is None else paced
                    if not paced:
                        continue
                plan.chunks.append((s, lo, hi))
                budget -= hi - lo
                rows += hi - lo
        return plan

    def make_room(self, plan: StepPlan, drain: bool = False) -> StepPlan | None:
        """Free the KV blocks a runner step needs before it runs: evict parked conversations (least
        recently used first), then pre-empt the newest running sequence (recomputed later); a sequence
        that cannot fit even alone stops with reason "length". Returns the plan without the pre-empted
        sequences; with drain, None instead of evicting anything."""
        r = self.runner
        while True:
            need = sum(r.blocks_needed(s.slot, s.n_computed, s.n_computed + 1 + len(s.drafts)) for s in plan.decode)
            need += sum(r.blocks_needed(s.slot, lo, hi) for s, lo, hi in plan.chunks)
            if need <= r.pool.n_free:
                return plan
            if drain:
                return None
            if self.slots.evict_lru():
                self.totals["parked_evicted"] += 1
                plan.evicted += 1
                continue
            if len(self.running) <= 1:   # (not expected: one sequence's context is at most the pool)
                for s in list(self.running):
                    self._stop(s)
                    plan.stopped.append(s)
                plan.decode, plan.chunks = [], []
                return plan
            self._preempt_newest(plan)

    def _preempt_newest(self, plan: StepPlan) -> None:
        victim = max(self.running, key=lambda q: (q.t_start or 0, q.id))
        self.preempt(victim)
        plan.drop(victim)
        plan.preempted.append(victim)

    def _stop(self, s: Sequence) -> None:
        log.warning("KV pool full: request %d stopped at %d tokens", s.id, len(s.tokens))
        self.totals["pool_full_stops"] += 1
        self.stop(s)

"""The Scheduler (engine/scheduler.py) on plain sequences and a block manager, no model and no device:
decode rows first, prompt chunks at fixed positions within the step's budget, drafts, pre-emption and
eviction when the pool is full, pacing of prompt chunks."""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

import pytest

from engine.kv.blocks import BlockAllocator
from engine.kv.pool import PoolFullError
from engine.pacing import PrefillPacer
from engine.sampling import SamplingParams
from engine.scheduler import RUNNER_MAX_ROWS, Scheduler, StepPlan
from engine.slots import SlotTable

BS = 16   # tokens per block


@dataclass
class Seq:
    """What the Scheduler reads of a running sequence."""
    id: int
    tokens: list
    n_prompt: int
    n_computed: int = 0
    slot: int | None = None
    t_start: float = 0.0
    cached: int = 0
    max_tokens: int = 100
    kv: object = None
    vision: object = None
    drafter: object = None
    mtp: object = None
    dflash: object = None
    drafts: list = field(default_factory=list)
    draft_q: object = None
    draft_src: str = ""

    @property
    def params(self):
        return SamplingParams(max_tokens=self.max_tokens)

    @property
    def n_generated(self):
        return len(self.tokens) - self.n_prompt

    @property
    def target(self):
        return self.n_prompt if self.n_generated == 0 else len(self.tokens) - 1


def generating(i, n_prompt=20, slot=None):
    return Seq(i, list(range(n_prompt + 1)), n_prompt, n_computed=n_prompt, slot=slot, t_start=i)


def prompting(i, n_prompt, done=0, slot=None):
    return Seq(i, list(range(n_prompt)), n_prompt, n_computed=done, cached=done, slot=slot, t_start=i)


class Blocks:
    """The runner's block bookkeeping (engine/runner/runner.py: blocks_needed, held_alone, release) over a
    BlockAllocator, without any tensors."""

    def __init__(self, n_blocks):
        self.pool = BlockAllocator(n_blocks)
        self.block_size = BS
        self.blocks = collections.defaultdict(list)

    def blocks_needed(self, slot, start, end):
        return max(0, -(-end // BS) - (0 if start == 0 else len(self.blocks[slot])))

    def write(self, slot, end):
        while len(self.blocks[slot]) * BS < end:
            self.blocks[slot].append(self.pool.alloc())

    def held_alone(self, slot):
        return sum(1 for b in self.blocks[slot] if self.pool.refs[b] == 1)

    def release(self, slot):
        for b in self.blocks.pop(slot, []):
            self.pool.decref(b)

    def draft_room(self, pos):
        return 64


class Drafts:
    """A drafter that proposes `k` tokens for every sequence (room permitting)."""

    def __init__(self, k=0):
        self.k, self.asked = k, []

    def draft_len(self, s):
        return self.k

    def take_drafts(self, s, room):
        self.asked.append((s.id, room))
        n = max(0, min(self.k, room))
        return [7] * n, None, "ngram" if n else ""


def runner_scheduler(running, n_blocks=64, step_tokens=64, prefill_chunk=16, drafts=None, pacer=None):
    blocks = Blocks(n_blocks)
    slots = SlotTable(blocks, 8)
    for s in running:
        if s.slot is None:
            s.slot = slots.free.pop()
        blocks.write(s.slot, s.n_computed)
    log = collections.defaultdict(list)

    def preempt(s):
        log["preempted"].append(s.id)
        running.remove(s)
        slots.release(s.slot)
        s.slot, s.n_computed = None, 0

    def stop(s):
        log["stopped"].append(s.id)
        running.remove(s)
    sch = Scheduler(running, step_tokens=step_tokens, prefill_chunk=prefill_chunk, ctx_size=4096,
                    drafts=drafts or Drafts(), preempt=preempt, stop=stop, runner=blocks, slots=slots,
                    pacer=pacer or PrefillPacer(1.0))
    return sch, blocks, slots, log


def rows(plan: StepPlan):
    return [s.id for s in plan.decode], [(s.id, lo, hi) for s, lo, hi in plan.chunks]


def test_decode_rows_first_then_chunks_fill_the_step_budget():
    running = [prompting(1, 100), generating(2), prompting(3, 40, done=20), generating(4), prompting(5, 30)]
    sch, *_ = runner_scheduler(running, step_tokens=36)
    plan = sch.schedule()
    # 2 decode rows, then chunks in arrival order while 34 rows are left: [0, 16) and [20, 32) (ends at
    # multiples of the chunk, after a reused prefix too); the third waits for a step with room
    assert rows(plan) == ([2, 4], [(1, 0, 16), (3, 20, 32)])
    assert plan.rows == 2 + 16 + 12 and plan.drafts == {2: 0, 4: 0} and not plan.preempted


def test_a_whole_chunk_always_fits_beside_the_decode_rows():
    running = [generating(1), generating(2), prompting(3, 64)]
    sch, *_ = runner_scheduler(running, step_tokens=4, prefill_chunk=16)
    assert rows(sch.schedule()) == ([1, 2], [(3, 0, 16)])
    cpu = Scheduler(running, step_tokens=4, prefill_chunk=16, ctx_size=4096, drafts=Drafts(), preempt=None,
                    stop=None)
    assert rows(cpu.plan_cpu()) == ([1, 2], [(3, 0, 16)])


def test_drafts_take_the_rows_after_their_sequence_and_wait_for_pending_tokens():
    running = [generating(1), generating(2), prompting(3, 64)]
    for s in running[:2]:
        s.drafter = object()
    drafts = Drafts(k=15)
    sch, *_ = runner_scheduler(running, step_tokens=24, drafts=drafts)
    plan = sch.schedule()
    # 24 rows: 2 decode rows, then drafts while the budget lasts (15, then the 7 left); the chunk still goes
    # (a step has room for one whole chunk)
    assert plan.drafts == {1: 15, 2: 7} and running[1].drafts == [7] * 7
    assert drafts.asked == [(1, 15), (2, 7)]
    assert rows(plan) == ([1, 2], [(3, 0, 16)])
    # a previous step's token not on the host yet: drafts need it first
    assert sch.schedule(pending={}) is None


def test_every_sequence_drafts_within_the_graph_rows():
    """Drafts for every decoding sequence (a recurrent model's too: its drafting slots keep no copies of their
    states), while the step's rows stay within the largest decode graph."""
    running = [generating(i) for i in range(1, 9)]
    for s in running:
        s.mtp = object()
    sch, *_ = runner_scheduler(running, n_blocks=256, step_tokens=512, drafts=Drafts(k=8))
    plan = sch.schedule()
    assert len(plan.decode) + sum(plan.drafts.values()) == RUNNER_MAX_ROWS
    assert [plan.drafts[s.id] for s in running] == [8] * 7 + [0]


def test_a_pending_token_that_ends_a_sequence_gets_no_row():
    a, b = generating(1), generating(2)
    a.max_tokens = 2   # one generated; the pending one is its last
    sch, *_ = runner_scheduler([a, b])
    assert rows(sch.plan(pending={1: 0, 2: 1}))[0] == [2]
    assert rows(sch.plan(pending=None))[0] == [1, 2]


def test_parked_conversations_are_evicted_before_a_running_one_is_preempted():
    running = [generating(1, n_prompt=40), prompting(2, 64)]
    sch, blocks, slots, log = runner_scheduler(running, n_blocks=8, step_tokens=64, prefill_chunk=64)
    parked = slots.free.pop()
    blocks.write(parked, 48)               # 3 blocks held by a finished conversation
    slots.park(parked, list(range(48)))
    assert blocks.pool.n_free == 2         # 8 - 3 (running 1) - 3 (parked)
    plan = sch.schedule()                  # 2's chunk [0, 64) needs 4 blocks
    assert plan.evicted == 1 and not plan.preempted and not log["preempted"]
    assert rows(plan) == ([1], [(2, 0, 64)]) and not slots.parked and parked in slots.free
    assert sch.totals["parked_evicted"] == 1
    # with a previous step's tokens pending, nothing is evicted: the caller reads them first
    slots.free.remove(parked)
    slots.park(parked, [])
    blocks.write(parked, 48)
    assert sch.schedule(pending={}) is None and slots.parked


def test_the_newest_running_sequence_is_preempted_when_the_pool_is_full():
    old, new = generating(1, n_prompt=47), prompting(2, 64, done=32)
    new.t_start = 5
    running = [old, new]
    sch, blocks, _, log = runner_scheduler(running, n_blocks=5, step_tokens=64, prefill_chunk=32)
    assert blocks.pool.n_free == 0         # 3 + 2 blocks held
    plan = sch.schedule()
    # old's decode row at 47 needs no block, new's chunk [32, 64) needs 2: new (the newest) goes back
    assert log["preempted"] == [2] and plan.preempted == [new]
    assert rows(plan) == ([1], []) and running == [old]


def test_a_sequence_that_cannot_fit_alone_stops():
    s = prompting(1, 200)
    sch, _, _, log = runner_scheduler([s], n_blocks=3, prefill_chunk=64)
    plan = sch.schedule()
    assert plan.empty() and plan.stopped == [s] and log["stopped"] == [1]
    assert sch.totals["pool_full_stops"] == 1


def test_admission_counts_blocks_parked_conversations_hold():
    sch, blocks, slots, _ = runner_scheduler([], n_blocks=4)
    waiting = prompting(9, 60)
    assert sch.has_room(waiting)           # 4 free blocks: 64 tokens
    slot = slots.free.pop()
    blocks.write(slot, 64)
    assert not sch.has_room(waiting)
    slots.park(slot, [])
    assert sch.has_room(waiting)           # evictable


def test_paced_chunks_wait_while_sequences_generate():
    pacer = PrefillPacer(0.5)
    pacer.finished(pacer.planned(True), 0.100, True)    # a chunk step took 100 ms
    pacer.finished(pacer.planned(False), 0.020, False)  # a decode-only step 20 ms
    running = [generating(1), prompting(2, 64, done=16), prompting(3, 64)]
    running[1].cached = 0   # 2 read its first chunk itself: the next ones are paced
    sch, *_ = runner_scheduler(running, step_tokens=512, pacer=pacer)
    # 1 decode-only step of 20 ms banked; (1 - 0.5) * 100 - 20 = 30 ms / 0.5 = 60 ms needed: held
    assert rows(sch.schedule()) == ([1], [(3, 0, 16)]) and pacer.held == 1
    for _ in range(3):
        pacer.finished(pacer.planned(False), 0.020, False)
    assert rows(sch.schedule()) == ([1], [(2, 16, 32), (3, 0, 16)])
    # nothing generating: no pacing
    sch.running[:] = running[1:]
    assert rows(sch.schedule()) == ([], [(2, 16, 32), (3, 0, 16)])


class KV:
    """A CPU sequence's KV over a shared token budget (engine/kv/sequence.py reserve)."""

    def __init__(self, pool, n=0):
        self.pool, self.n = pool, n

    def reserve(self, lo, hi):
        more = max(0, hi - self.n)
        if self.pool["free"] < more:
            raise PoolFullError("full")
        self.pool["free"] -= more
        self.n += more


class Resident:
    def __init__(self, pool, sizes):
        self.pool, self.sizes = pool, list(sizes)

    def evict_one(self):
        if not self.sizes:
            return False
        self.pool["free"] += self.sizes.pop(0)
        return True


def test_cpu_path_evicts_resident_conversations_then_preempts_the_newest():
    pool = {"free": 40}
    a, b = generating(1), prompting(2, 64)
    b.t_start = 3
    a.kv, b.kv = KV(pool, 20), KV(pool)
    running = [a, b]
    log = []

    def preempt(s):
        log.append(s.id)
        running.remove(s)
    resident = Resident(pool, [10])
    sch = Scheduler(running, step_tokens=512, prefill_chunk=64, ctx_size=4096, drafts=Drafts(), preempt=preempt,
                    stop=None, resident=resident)
    plan = sch.schedule_cpu()
    # 1 + 64 tokens wanted, 40 free: the resident conversation goes (49 then), then b is pre-empted
    assert plan.evicted == 1 and log == [2] and plan.preempted == [b] and rows(plan) == ([1], [])
    assert not resident.sizes


def test_cpu_path_stops_a_sequence_that_cannot_fit_alone():
    pool = {"free": 10}
    s = prompting(1, 64)
    s.kv = KV(pool)
    stopped = []
    sch = Scheduler([s], step_tokens=512, prefill_chunk=64, ctx_size=4096, drafts=Drafts(), preempt=None,
                    stop=stopped.append, resident=Resident(pool, []))
    plan = sch.schedule_cpu()
    assert plan.empty() and stopped == [s] and plan.stopped == [s]


@pytest.mark.parametrize("k, chunks", [(0, 4), (3, 3)])
def test_cpu_path_decode_rows_and_drafts_come_out_of_the_budget(k, chunks):
    running = [generating(1)] + [prompting(i, 64) for i in range(2, 6)]
    cpu = Scheduler(running, step_tokens=66, prefill_chunk=16, ctx_size=4096, drafts=Drafts(k=k), preempt=None,
                    stop=None)
    plan = cpu.plan_cpu()
    # 66 rows - 1 decode row (- 3 drafts) leave 65 (62): four chunks of 16 (three)
    assert len(plan.chunks) == chunks and plan.drafts == {1: k} and running[0].drafts == [7] * k

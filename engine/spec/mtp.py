"""MTP drafting: Qwen3.5/3.6's own next-token-prediction block (engine/models/qwen35.py: mtp_forward).

The block's row at position p reads token x_p and the main model's hidden state h_{p-1} and predicts
x_{p+1}; it has its own one-layer KV cache, which must hold a row for every position. After each main
step (a prompt chunk, or [last token, drafts] being verified), `catch_up` writes the MTP rows for the
positions whose inputs are now final (tokens accepted, hidden states of the main model known). Its last
row predicts the token after the one just sampled: the first draft. `chain` then feeds the block its
own output as the hidden state for further drafts; those speculative rows are rewritten by the next
catch-up. Drafts are the block's argmax (one-hot q), verified like n-gram drafts: exact at any
temperature. While a sequence's drafting is backed off (engine/spec/adaptive.py) its catch-up can be
deferred: the hidden inputs are kept and the rows written in one batch when drafts are next wanted,
and a catch-up that drafts nothing skips the LM head.

A later request can start from a kept cache (the GPU path's resident conversations and shared prefixes,
engine/slots.py, Speculator.mtp_from): its rows before the first recomputed position n stay, and the row of n is
written again from h_{n-1}, which the state keeps for its newest row (`tail`) and for every multiple of
`mark_every` (where shared prefixes end): `resume_at`, `fork`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.models.common import SeqChunk
from engine.spec.adaptive import MAX_DEFERRED


@dataclass
class MtpState:
    """One sequence's MTP cache: rows of positions < `valid` are final. `deferred`: the hidden inputs
    h_{p-1} of positions p = valid, valid + 1, ... whose rows are not written yet (CatchUp.defer). kv: the CPU
    path's own cache of the block's layer; None on the GPU path, where the rows live in the blocks of runner slot
    `slot` (engine/runner/mtp.py), set while a sequence runs there and kept while its conversation is parked."""
    kv: object
    valid: int = 0
    drafts: list[int] = field(default_factory=list)
    deferred: torch.Tensor | None = None
    mark_every: int = 0                                   # keep h_{p-1} for positions p that are multiples
    marks: dict[int, torch.Tensor] = field(default_factory=dict)   # position -> h_{p-1}
    tail: tuple[int, torch.Tensor] | None = None          # (newest written row's position, its h_{p-1})
    slot: int | None = None

    def input_at(self, p: int) -> torch.Tensor | None:
        """The hidden input h_{p-1} of position p's row, when the state still has it."""
        if self.deferred is not None and self.valid <= p < self.valid + self.deferred.shape[0]:
            return self.deferred[p - self.valid]
        if self.tail is not None and self.tail[0] == p:
            return self.tail[1]
        return self.marks.get(p)

    def resume_at(self, n: int) -> bool:
        """Keep the rows of positions < n for a request whose main KV holds exactly positions < n (the
        row of n is written again: its token may differ). False when h_{n-1} or an input between the last
        written row and n is not kept (the caller drops the state)."""
        lo = min(self.valid, n)
        held = [self.input_at(p) for p in range(lo, n + 1)]
        if any(h is None for h in held):
            return False
        self.deferred = torch.stack(held)
        self.valid = lo
        if self.kv is not None:
            self.kv.truncate(lo)
        self.drafts, self.tail = [], None
        self.marks = {p: h for p, h in self.marks.items() if p <= n}
        return True

    def fork(self, n: int) -> "MtpState | None":
        """A new state sharing this one's rows of positions < n (another conversation with the same first
        n tokens: the same rows), or None when it cannot resume there."""
        # (GPU path: the rows come with the blocks the new slot shares: Runner.share_prefix)
        other = MtpState(self.kv.fork() if self.kv is not None else None, self.valid, mark_every=self.mark_every,
                         marks=dict(self.marks), tail=self.tail, deferred=self.deferred)
        if other.resume_at(n):
            return other
        other.release()
        return None

    def release(self) -> None:
        """Give the cache's blocks back now (GPU path: the slot's blocks are the runner's; the state writes no more
        rows there)."""
        if self.kv is not None:
            self.kv.release()
        self.slot = None
        self.deferred, self.tail, self.marks = None, None, {}


@dataclass
class CatchUp:
    """A sequence after a main step: its tokens (incl. any just sampled), where the step started, the
    main model's output-normed hidden rows for positions start.. and how many of them are final."""
    state: MtpState
    tokens: list[int]
    start: int
    hidden: torch.Tensor          # [rows, n_embd]
    n_final: int                  # positions start .. start + n_final - 1 are final in the main KV
    k: int                        # drafts wanted (0: only keep the cache up to date)
    defer: bool = False           # k = 0 and drafting backed off: keep the hidden rows, write the MTP
                                  # rows in one batch when drafts are next wanted (or MAX_DEFERRED)


class SequenceRows:
    """The MTP passes over each state's own cache (the CPU path: MtpState.kv a SequenceKV of the block's one
    layer); engine/runner/mtp.py's MtpSlots does the same over a runner's slots. Both answer room, rewind and run."""

    def __init__(self, model):
        self.model = model

    def room(self, st: MtpState, start: int, end: int) -> int:
        return end                      # (the state's cache grows as rows are written)

    def rewind(self, st: MtpState, p0: int) -> None:
        st.kv.truncate(p0)              # (rows are appended: the ones from p0 on are written again)

    def done(self, st: MtpState) -> None:
        """st's rows and drafts are made (its chained rows stay until the next catch-up writes over them)."""

    def run(self, groups: list, tokens: torch.Tensor, hidden: torch.Tensor,
            want: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        """groups: (state, first position, rows) per sequence, their rows in order in tokens / hidden; returns the
        argmax token and output row of each wanted group's last row."""
        chunks, hid, i = [], [], 0
        for (st, p0, m), w in zip(groups, want):
            chunks.append(SeqChunk(tokens[i:i + m], p0, st.kv, "last" if w else "none"))
            hid.append(hidden[i:i + m])
            i += m
        logits, h_out = self.model.mtp_forward(chunks, hid)
        ids = [lg[-1:].argmax(-1) for lg, w in zip(logits, want) if w]
        h = [o[-1] for o, w in zip(h_out, want) if w]
        if not ids:
            return tokens[:0], hidden[:0]
        return torch.cat(ids), torch.stack(h)


def _inputs(it: CatchUp) -> tuple[torch.Tensor, bool] | None:
    """The hidden inputs h_{p-1} of positions state.valid .. top (top = it.start + it.n_final: the newest position
    whose h_{p-1} is known): the deferred ones, then zeros for position 0, then the step's rows; and whether they are
    a tensor of their own (else a view of the step's rows, the runner's graph buffers, which the next step writes).
    None when top is below the state's rows."""
    st = it.state
    top, p0 = it.start + it.n_final, st.valid
    if top < p0:
        return None
    held = st.deferred
    parts = [held] if held is not None else []
    lo = p0 + (0 if held is None else held.shape[0])     # the first position whose input comes from this step
    if lo == 0 and top >= 0:
        parts.append(it.hidden.new_zeros(1, it.hidden.shape[1]))   # (llama.cpp: zeros before the first token)
        lo = 1
    if lo <= top:
        if lo - 1 < it.start:
            raise ValueError(f"MTP rows from position {lo} need the hidden state of {lo - 1}, before the step's "
                             f"first row ({it.start})")
        parts.append(it.hidden[lo - 1 - it.start:top - it.start])
    if len(parts) > 1:
        return torch.cat(parts), True
    return parts[0], lo > top     # (one part: the step's rows themselves unless none were taken)


def _prepare(rows_of, it: CatchUp, rows: torch.Tensor, owned: bool):
    """Record it's final rows in its state and return the pass group (first position, tokens, hidden inputs) and the
    drafts it may make, or None when its rows wait (deferred: drafting backed off, the newest token not on the host
    yet, or no room for the rows)."""
    st = it.state
    p0, last = st.valid, min(it.start + it.n_final, len(it.tokens) - 1)    # last: the newest position with x_p known
    kept = (lambda t: t) if owned else torch.Tensor.clone    # (rows that wait for a later step: a tensor of their own)
    if (it.defer and it.k == 0 and rows.shape[0] <= MAX_DEFERRED) or last < p0:
        st.deferred = kept(rows)
        return None
    end = rows_of.room(st, p0, last + max(it.k, 1))      # rows up to last + k - 1
    if end <= last:                                       # (no room in the pool for them now)
        st.deferred = kept(rows)
        return None
    # the rows whose token is not on the host yet (an overlapped step's, engine/step_runner.py) wait
    rows, later = rows[:last + 1 - p0], rows[last + 1 - p0:]
    st.deferred = kept(later) if later.shape[0] else None
    rows_of.rewind(st, p0)
    st.tail = (last, rows[-1].clone())
    if st.mark_every:
        for p in range(-(-p0 // st.mark_every) * st.mark_every, last + 1, st.mark_every):
            st.marks[p] = rows[p - p0].clone()
    st.valid = last + 1
    return (p0, torch.tensor(it.tokens[p0:last + 1]), rows), min(it.k, end - last)


def catch_up(rows_of, items: list[CatchUp], timing: dict | None = None) -> None:
    """Write every final MTP row, then draft up to k tokens per sequence into `state.drafts`. rows_of: the passes'
    executor (SequenceRows, or the runner's MtpSlots: room, rewind, run, done). With `timing`, adds the seconds spent on chained drafts (the
    work beyond the catch-up itself, what a shorter draft saves) to timing["chain_s"] and the sequence-rows they ran
    to timing["chain_rows"]."""
    groups, toks, hids, want, todo = [], [], [], [], []
    for it in items:
        it.state.drafts = []
        inputs = _inputs(it)
        if inputs is None:
            continue
        got = _prepare(rows_of, it, *inputs)
        if got is None:
            continue
        (p0, tok, hid), k = got
        groups.append((it.state, p0, tok.shape[0]))
        toks.append(tok)
        hids.append(hid)
        want.append(k > 0)
        if k > 0:
            todo.append((it.state, k))
    if not groups:
        return
    ids, h = rows_of.run(groups, torch.cat(toks), torch.cat(hids), want)
    # the drafts stay on the device (each the next chained row's token) until one read at the end: no wait for the
    # device between the chained passes
    passes = [(todo, ids)]
    t0, chained, live = time.perf_counter(), 0, todo
    for j in range(1, max((k for _, k in todo), default=0)):   # chain: the block's own output as h
        keep = [i for i, (_, k) in enumerate(live) if k > j]
        if len(keep) < len(live):
            idx = torch.tensor(keep, device=ids.device)
            ids, h, live = ids.index_select(0, idx), h.index_select(0, idx), [live[i] for i in keep]
        ids, h = rows_of.run([(st, st.valid + j - 1, 1) for st, _ in live], ids, h, [True] * len(live))
        passes.append((live, ids))
        chained += len(live)
    flat = torch.cat([t for _, t in passes]).tolist() if todo else []
    for st, _, _ in groups:
        rows_of.done(st)
    i = 0
    for live, t in passes:
        for st, _ in live:
            st.drafts.append(flat[i])
            i += 1
    if timing is not None and chained:   # (the chained passes' time includes the wait for the drafts)
        timing["chain_s"] = timing.get("chain_s", 0.0) + time.perf_counter() - t0
        timing["chain_rows"] = timing.get("chain_rows", 0) + chained

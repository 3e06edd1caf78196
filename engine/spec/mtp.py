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
    h_{p-1} of positions p = valid, valid + 1, ... whose rows are not written yet (CatchUp.defer)."""
    kv: object
    valid: int = 0
    drafts: list[int] = field(default_factory=list)
    deferred: torch.Tensor | None = None
    mark_every: int = 0                                   # keep h_{p-1} for positions p that are multiples
    marks: dict[int, torch.Tensor] = field(default_factory=dict)   # position -> h_{p-1}
    tail: tuple[int, torch.Tensor] | None = None          # (newest written row's position, its h_{p-1})

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
        self.kv.truncate(lo)
        self.drafts, self.tail = [], None
        self.marks = {p: h for p, h in self.marks.items() if p <= n}
        return True

    def fork(self, n: int) -> "MtpState | None":
        """A new state sharing this one's rows of positions < n (another conversation with the same first
        n tokens: the same rows), or None when it cannot resume there."""
        other = MtpState(self.kv.fork(), self.valid, mark_every=self.mark_every, marks=dict(self.marks),
                         tail=self.tail, deferred=self.deferred)
        if other.resume_at(n):
            return other
        other.release()
        return None

    def release(self) -> None:
        """Give the cache's blocks back now."""
        self.kv.release()
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


def catch_up(model, items: list[CatchUp], timing: dict | None = None) -> None:
    """Write every final MTP row, then draft up to k tokens per sequence into `state.drafts`. With
    `timing`, adds the seconds spent on chained drafts (the work beyond the catch-up itself, what a
    shorter draft saves) to timing["chain_s"] and the sequence-rows they ran to timing["chain_rows"]."""
    chunks, hiddens, todo = [], [], []
    for it in items:
        st = it.state
        st.drafts = []
        top = it.start + it.n_final                              # the newest position with h_{p-1} known
        last = min(top, len(it.tokens) - 1)                       # ... and with x_p known
        p0 = st.valid
        if top < p0:
            continue
        held = st.deferred
        st.deferred = None
        rows = list(held) if held is not None else []
        for p in range(p0 + len(rows), top + 1):                  # h_{p-1}: zeros before the first token
            rows.append(it.hidden[p - 1 - it.start] if p > 0 else it.hidden.new_zeros(it.hidden.shape[1]))
        if (it.defer and it.k == 0 and len(rows) <= MAX_DEFERRED) or last < p0:
            st.deferred = torch.stack(rows)
            continue
        # the rows whose token is not on the host yet (an overlapped step's, engine/step_runner.py) wait
        rows, later = rows[:last + 1 - p0], rows[last + 1 - p0:]
        st.deferred = torch.stack(later) if later else None
        st.kv.truncate(p0)
        st.tail = (last, rows[-1].clone())
        if st.mark_every:
            for p in range(-(-p0 // st.mark_every) * st.mark_every, last + 1, st.mark_every):
                st.marks[p] = rows[p - p0].clone()
        # (no drafts wanted: the rows only, no LM head)
        chunks.append(SeqChunk(torch.tensor(it.tokens[p0:last + 1]), p0, st.kv, "last" if it.k > 0 else "none"))
        hiddens.append(torch.stack(rows))
        st.valid = last + 1
        todo.append(it)
    if not chunks:
        return
    logits, h_out = model.mtp_forward(chunks, hiddens)
    # the drafts stay on the device (each the next chained row's token) until one read at the end: no
    # wait for the device between the chained forwards
    picks: dict[int, list[torch.Tensor]] = {}
    live = []
    for it, lg, h in zip(todo, logits, h_out):
        if it.k > 0:
            picks[id(it)] = [lg[-1:].argmax(-1)]
            live.append((it, h[-1]))
    t0, chained = time.perf_counter(), 0
    for _ in range(max((it.k for it, _ in live), default=0) - 1):   # chain: the block's own output as h
        live = [(it, h) for it, h in live if len(picks[id(it)]) < it.k]
        if not live:
            break
        chunks = [SeqChunk(picks[id(it)][-1], it.state.valid + len(picks[id(it)]) - 1, it.state.kv, "last")
                  for it, _ in live]
        logits, h_out = model.mtp_forward(chunks, [h[None] for _, h in live])
        live = [(it, h[-1]) for (it, _), h in zip(live, h_out)]
        for (it, _), lg in zip(live, logits):
            picks[id(it)].append(lg[-1:].argmax(-1))
        chained += len(live)
    if picks:
        flat = torch.cat([t for it in todo if it.k > 0 for t in picks[id(it)]]).tolist()
        i = 0
        for it in todo:
            if it.k > 0:
                n = len(picks[id(it)])
                it.state.drafts = flat[i:i + n]
                i += n
    if timing is not None and chained:   # (the chained forwards' time includes the wait for the drafts)
        timing["chain_s"] = timing.get("chain_s", 0.0) + time.perf_counter() - t0
        timing["chain_rows"] = timing.get("chain_rows", 0) + chained

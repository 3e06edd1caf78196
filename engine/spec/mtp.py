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
        last = min(it.start + it.n_final, len(it.tokens) - 1)      # the newest position with x_p known
        p0 = st.valid
        if last < p0:
            continue
        held = st.deferred
        st.deferred = None
        rows = list(held) if held is not None else []
        for p in range(p0 + len(rows), last + 1):                 # h_{p-1}: zeros before the first token
            rows.append(it.hidden[p - 1 - it.start] if p > 0 else it.hidden.new_zeros(it.hidden.shape[1]))
        if it.defer and it.k == 0 and len(rows) <= MAX_DEFERRED:
            st.deferred = torch.stack(rows)
            continue
        st.kv.truncate(p0)
        # (no drafts wanted: the rows only, no LM head)
        chunks.append(SeqChunk(torch.tensor(it.tokens[p0:last + 1]), p0, st.kv, "last" if it.k > 0 else "none"))
        hiddens.append(torch.stack(rows))
        st.valid = last + 1
        todo.append(it)
    if not chunks:
        return
    logits, h_out = model.mtp_forward(chunks, hiddens)
    live = []
    for it, lg, h in zip(todo, logits, h_out):
        if it.k > 0:
            it.state.drafts.append(int(lg[-1].argmax()))
            live.append((it, h[-1]))
    for _ in range(max((it.k for it, _ in live), default=0) - 1):   # chain: the block's own output as h
        live = [(it, h) for it, h in live if len(it.state.drafts) < it.k]
        if not live:
            break
        t0 = time.perf_counter()
        chunks = [SeqChunk(torch.tensor(it.state.drafts[-1:]), it.state.valid + len(it.state.drafts) - 1,
                           it.state.kv, "last") for it, _ in live]
        logits, h_out = model.mtp_forward(chunks, [h[None] for _, h in live])
        live = [(it, h[-1]) for (it, _), h in zip(live, h_out)]
        for (it, _), lg in zip(live, logits):
            it.state.drafts.append(int(lg[-1].argmax()))
        if timing is not None:
            timing["chain_s"] = timing.get("chain_s", 0.0) + time.perf_counter() - t0
            timing["chain_rows"] = timing.get("chain_rows", 0) + len(live)

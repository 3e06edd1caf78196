"""The Speculator: speculative decoding for the engine's steps (both paths). It owns the drafters (n-gram
lookup with the shared n-gram pool, the MTP block's states and, on the GPU path, the block over the runner's slots, the DFlash
drafter), decides which drafter drafts for a sequence and how many tokens (adaptive lengths,
engine/spec/adaptive.py), hands a step its drafts (take_drafts) and verifies them after the forward
(verify: accepted tokens go to the engine's `emit`), keeps the model drafters up to date after each step
(mtp_catch_up, dflash_step) and keeps a parked conversation's drafter states with its slot (park,
mtp_from, dflash_from, drop_parked). The drafters themselves live beside this module (ngram, mtp, dflash,
adaptive, verify).
"""
from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.gguf.reader import GGUFError
from engine.spec.adaptive import (
    MAX_DEFERRED,
    DraftLength,
    StepCosts,
    choose_k,
    expected_tokens,
)
from engine.spec.dflash import DFlashError, DraftRequest, load_drafter, propose
from engine.spec.mtp import CatchUp, MtpState, SequenceRows, catch_up
from engine.spec.ngram import NgramDrafter, SharedNgramPool
from engine.spec.verify import accept_or_resample
from engine.types import EngineError

if TYPE_CHECKING:
    from engine.sequence import Sequence

log = logging.getLogger("hivejet.engine")

NGRAM_RECHECK = 4   # GPU path: steps between n-gram lookups while they find nothing (3 of 4 steps overlapped)


def acceptance_by_drafter(counts) -> dict:
    """{drafter: {drafted, accepted, acceptance}} from "<drafter>_drafted" / "<drafter>_accepted" counts."""
    out = {}
    for name in ("ngram", "mtp", "dflash"):
        d, a = counts.get(f"{name}_drafted", 0), counts.get(f"{name}_accepted", 0)
        if d:
            out[name] = dict(drafted=d, accepted=a, acceptance=round(a / d, 3))
    return out


class Speculator:
    """Drafts for the running sequences of one engine. kinds: the drafters of its spec mode (ngram, mtp,
    dflash); running, totals: the engine's running list and counters; emit(s, token, logprob): the engine's
    way of streaming a sampled token. The runner (GPU path, set once it is open) verifies drafts as extra
    decode rows of their sequence and keeps the MTP rows in its slots' blocks (open_mtp)."""

    def __init__(self, config, model, kinds: set[str], running: list, totals: collections.Counter,
                 emit: Callable, ctx_size: int):
        self.config, self.model = config, model
        self.kinds = kinds
        self.running, self.totals, self.emit = running, totals, emit
        self.ctx_size = ctx_size
        self.runner = None            # the GPU path's Runner, once open
        self.active = kinds           # the drafters that draft (all of them on either path)
        self.ngram_pool = SharedNgramPool()
        self.dflash = None            # engine/spec/dflash.py: the DFlash drafter
        self.costs = StepCosts()      # engine/spec/adaptive.py: measured step / drafting times
        self.draft_s = 0.0            # avoidable drafting seconds of the current step
        self.mtp_rows = SequenceRows(model)   # the MTP block's passes on the CPU path's own caches
        self.mtp_slots = None         # GPU path: the MTP block over the runner's slots (engine/runner/mtp.py)
        # `hivejet bench spec --accept` (engine/spec/controlled.py: ControlledAcceptance): the drafters'
        # tokens replaced so that they are accepted at given rates; None everywhere else
        self.control = None
        self.parked_mtp: dict[int, object] = {}      # parked slot -> the MTP state of its conversation
        self.parked_dflash: dict[int, object] = {}   # parked slot -> its DFlash context

    def open_dflash(self, drafter: str | None) -> None:
        """Load the DFlash drafter, check it fits the target, and have the target's forward keep the
        hidden states the drafter reads (only now: the capture costs nothing when unset)."""
        if not drafter:
            self.model.close()
            raise EngineError(f"spec={self.config.spec!r} needs a DFlash drafter (spec_drafter / --spec-drafter: "
                              "a directory with config.json + model.safetensors, or its GGUF)")
        try:
            d = load_drafter(drafter)
            d.check_target(self.model)
        except (DFlashError, GGUFError, OSError) as e:
            self.model.close()
            raise EngineError(f"DFlash drafter: {e}") from None
        self.dflash = d
        self.model.capture_layers = d.cfg.target_layer_ids
        log.info("DFlash drafter %s: %d layers, blocks of %d, target layers %s", drafter, d.cfg.n_layer,
                 d.cfg.block_size, list(d.cfg.target_layer_ids))

    def attach(self, s: Sequence) -> None:
        """The drafters of the engine's spec mode for a sequence starting to run. A sequence that starts
        from a reused prefix gets no model drafter on the CPU path: its resident cache keeps no MTP rows
        or DFlash context (n-gram drafts still work); the GPU path keeps MTP rows with its parked
        conversations (mtp_from)."""
        s.spec_k = self.config.spec_max_drafts
        if "ngram" in self.active:
            s.drafter = NgramDrafter(pool=self.ngram_pool)
            s.drafter.extend(s.tokens)
        # (the GPU path's model drafters follow a slot's plain positions: not for prompts with images,
        # whose M-RoPE positions run behind; such sequences take no drafts at all: ok())
        model_drafts = s.cached == 0 and (self.runner is None or s.vision is None)
        if s.mtp is None and model_drafts and "mtp" in self.active:   # (GPU path: SlotTable.take may
            s.mtp = self.new_mtp_state()                                   # have given it a kept one)
        if s.dflash is None and model_drafts and self.dflash is not None:  # (GPU path: may be kept one)
            s.dflash = self.dflash.new_state()
        k_max = self.config.spec_max_drafts
        s.adapt = {name: DraftLength(min(k_max, self.dflash.cfg.block_size - 1) if name == "dflash" else k_max)
                   for name, st in (("ngram", s.drafter), ("mtp", s.mtp), ("dflash", s.dflash)) if st is not None}
        s.spec_src = self.draft_source(s)
        if self.costs.step_time(1) is not None:   # costs known: start from the prior (0: a probe at once)
            n = len(self.running)
            for name, dl in s.adapt.items():
                dl.decide(choose_k(dl.alpha, dl.k_max, self.costs.step_time, n + 1,
                                   lambda k, name=name: self.costs.draft_time(name, k), others_tokens=n))

    def new_mtp_state(self) -> MtpState:
        """An empty MTP cache: the CPU path's in a pool of its own, the GPU path's in its slot's blocks
        (engine/runner/mtp.py), keeping h_{p-1} at every chunk end (where another conversation may share a prefix)."""
        if self.runner is None:
            return MtpState(self.model.new_mtp_kv())
        return MtpState(None, mark_every=self.config.prefill_chunk)

    def mtp_catch_up(self, rows: list) -> None:
        """After a step: the MTP rows of every position that became final, then the next drafts
        (engine/spec/mtp.py: catch_up). rows: (sequence, its first row's position, its rows' output-normed
        hidden states) for the step's sequences; those without an MTP state are skipped. A finished
        sequence whose state stays with its parked slot writes its rows too (held back when few), so a
        follow-up can resume from it."""
        items = []
        for s, start, h in rows:
            if s.mtp is None:
                continue
            if self.mtp_slots is not None:
                if s.slot is not None:
                    s.mtp.slot = s.slot      # (a parked conversation's state keeps its slot)
                elif s.mtp.slot is None:     # (released: its slot is another conversation's now)
                    continue
            k = self.model_drafts_wanted(s)
            dl = s.adapt.get("mtp") if self.config.spec_adaptive else None
            items.append(CatchUp(s.mtp, s.tokens, start, h, s.n_computed - start, k,
                                 defer=(dl is not None and dl.backed_off) or not self.alive(s)))
        timing = {}
        catch_up(self.mtp_slots if self.mtp_slots is not None else self.mtp_rows, items, timing)
        if timing:
            self.costs.add_draft("mtp", timing["chain_s"], timing["chain_rows"])
            self.draft_s += timing["chain_s"]

    def ok(self, s: Sequence) -> bool:
        """Drafts for this sequence: on, no grammar constraint (it must see every token), no
        images. (qwen35's recurrent states take only the accepted rows: engine/runner/recurrent.py.)"""
        return (bool(self.active) and self.config.spec_max_drafts > 0 and s.req.constraint is None
                and s.vision is None)

    def ngram_first(self, s: Sequence) -> bool:
        """Whether s drafts with n-grams this step: it has no model drafter, or (a chain) the end of its
        conversation repeats an earlier span of at least spec_ngram_min_match tokens, where lookup
        predicts better than a model drafter."""
        if s.drafter is None:
            return False
        if s.mtp is None and s.dflash is None:
            return True
        return s.drafter.match_length() >= self.config.spec_ngram_min_match

    def model_drafts_wanted(self, s: Sequence) -> int:
        """Drafts to ask the MTP block / DFlash drafter for after this step: what the next step can
        verify (the draft length, the context and max_tokens left), 0 when s is not generating or
        takes n-gram drafts next."""
        if not self.alive(s) or s.n_computed < s.n_prompt or self.ngram_first(s):
            return 0
        return max(0, min(self.draft_len(s), self.ctx_size - len(s.tokens) - 1,
                          s.params.max_tokens - s.n_generated - 1))

    def draft_source(self, s: Sequence) -> str | None:
        """The drafter s takes its next drafts from (as take_drafts chooses)."""
        if self.ngram_first(s):
            return "ngram"
        return "mtp" if s.mtp is not None else "dflash" if s.dflash is not None else None

    def draft_len(self, s: Sequence) -> int:
        """The draft length of s's next step: its drafter's adaptive k (spec_adaptive), else spec_k."""
        if not self.config.spec_adaptive:
            return s.spec_k
        src = self.draft_source(s)
        if src == "ngram" and s.ngram_wait > 0:   # (no match lately: looked up again in a few steps)
            return 0
        dl = s.adapt.get(src)
        return dl.k if dl is not None else 0

    def adapt_draft_lengths(self, decode: list) -> None:
        """After a step's verification (before the model drafters draft for the next one): the draft
        length of every generating sequence's next drafter, k maximizing the step's expected tokens per
        second (engine/spec/adaptive.py: choose_k) from its acceptance and the measured costs, with the
        other sequences' rows, expected tokens and drafting time as in this step; 0 backs off (probes
        every few steps). decode: (sequence, its rows, its drafts) of this step's generating sequences."""
        live = [(s, n, nd) for s, n, nd in decode if self.alive(s) and s.adapt]
        if not self.config.spec_adaptive or not live:
            return
        for s, _, _ in live:
            s.ngram_wait = max(0, s.ngram_wait - 1)
        costs = self.costs
        mine = {}
        for s, n, nd in live:   # each one's share of the step as it ran: rows, expected tokens, drafting time
            dl = s.adapt.get(s.draft_src) if nd else None
            mine[s.id] = (n, expected_tokens(dl.alpha, nd) if dl else 1.0,
                          costs.draft_time(s.draft_src, nd) if dl else 0.0)
        rows, tokens, draft_s = (sum(v[i] for v in mine.values()) for i in range(3))
        for s, _, _ in live:
            src = self.draft_source(s)
            s.spec_src = src
            dl = s.adapt.get(src)
            if dl is None:
                continue
            r, e, d = mine[s.id]
            k = choose_k(dl.alpha, dl.k_max, costs.step_time, rows - r + 1,
                         lambda k, src=src: costs.draft_time(src, k), others_tokens=tokens - e,
                         others_time=draft_s - d)
            dl.decide(k)

    def length_stats(self, s: Sequence) -> dict:
        """stats() of a running sequence: the draft length of its next step, whether its drafter is
        backed off, and per drafter k, backed_off and the acceptance estimate alpha."""
        if not self.config.spec_adaptive or not s.adapt:
            return dict(spec_k=s.spec_k if s.adapt else 0, spec_backed_off=False)
        dl = s.adapt.get(s.spec_src) or next(iter(s.adapt.values()))
        return dict(spec_k=dl.k, spec_backed_off=dl.backed_off,
                    spec_lengths={name: d.summary() for name, d in s.adapt.items()})

    def take_drafts(self, s: Sequence, room: int) -> tuple[list[int], torch.Tensor | None, str]:
        """This step's drafts for s (at most `room`): (tokens, their drafter distributions or None for
        one-hot drafts, the drafter's name); replaced by `control`'s when it is set."""
        d, q, src = self.propose(s, room)
        if self.control is not None and d:
            d, q = self.control.replace(s.tokens, d), None
        return d, q, src

    def propose(self, s: Sequence, room: int) -> tuple[list[int], torch.Tensor | None, str]:
        """take_drafts: what the sequence's drafter proposes."""
        if room <= 0:
            return [], None, ""
        if self.ngram_first(s):
            t0 = time.perf_counter()
            d = s.drafter.propose(room)
            dt = time.perf_counter() - t0
            if not d and self.runner is not None and self.config.overlap_steps:
                # the GPU path overlaps steps that draft nothing; a lookup needs the newest token on the
                # host, so after one that found no match the next waits a few (overlapped) steps
                s.ngram_wait = NGRAM_RECHECK
            self.costs.add_draft("ngram", dt, 1)
            self.draft_s += dt
            return d, None, "ngram"
        if s.mtp is not None:
            return s.mtp.drafts[:room], None, "mtp"
        st = s.dflash
        if st is not None and st.drafts and st.position == len(s.tokens) - 1:   # drafts follow the last token
            d = st.drafts[:room]
            return d, (st.q[:len(d)] if st.q is not None else None), "dflash"
        return [], None, ""

    def dflash_step(self, rows: list) -> None:
        """After a step: append to each DFlash context the target's hidden states of the positions that
        became final (prompt rows, the fed token and accepted drafts; never rejected drafts), then draft
        the block after the last sampled token of every generating sequence. rows: (sequence, its first
        row's position, its rows' features at the drafter's target layers) for the step's live sequences."""
        grow, reqs = [], []
        for s, start, features in rows:
            st = s.dflash
            if st is None or features is None:
                continue
            held, st.deferred = st.deferred, None      # (rows put off while drafting is backed off)
            n_held = 0 if held is None else held.shape[0]
            lo, hi = st.length + n_held - start, s.n_computed - start   # rows new to the context / still final
            new = features[lo:hi] if 0 <= lo < hi else None
            ctx = new if held is None else held if new is None else torch.cat([held, new])
            if ctx is None:
                continue
            dl = s.adapt.get("dflash") if self.config.spec_adaptive else None
            if (dl is not None and dl.backed_off and self.model_drafts_wanted(s) == 0
                    and ctx.shape[0] <= MAX_DEFERRED):
                st.deferred = ctx.clone() if ctx is new else ctx
                continue
            grow.append((st, ctx))
        self.dflash.extend(grow)
        for s, _, _ in rows:
            st = s.dflash
            if st is None:
                continue
            k = self.model_drafts_wanted(s)
            if k and st.length == s.n_computed == len(s.tokens) - 1:
                reqs.append(DraftRequest(st, s.tokens[-1], k, s.sampler, s.tokens))
            else:
                st.drafts, st.q = [], None
        t0 = time.perf_counter()
        propose(self.dflash, self.model, reqs)
        if reqs:
            dt = time.perf_counter() - t0
            self.costs.add_draft("dflash", dt, len(reqs))
            self.draft_s += dt

    def verify(self, s: Sequence, start: int, lg: torch.Tensor) -> None:
        """Rows of [last token, draft 1..k]: accept drafts as the target would have produced them
        (greedy: while they equal its choice; sampled: with probability min(1, p/q), the first rejection
        drawn from normalize(max(p - q, 0)), q one-hot for n-gram and MTP drafts; engine/spec/verify.py).
        The KV and recurrent states are rolled back to the accepted rows first, then the tokens are
        streamed (which may finish the sequence)."""
        drafts, s.drafts = s.drafts, []
        q, s.draft_q = s.draft_q, None
        p = s.params
        hist = list(s.tokens)
        out = []
        for i in range(len(drafts) + 1):
            if i == len(drafts) or p.greedy:
                tok, lp = s.sampler.sample_with_logprobs(lg[i], hist)
            else:
                probs = torch.softmax(s.sampler.final_logits(lg[i], hist).double(), 0)
                tok, _ = accept_or_resample(probs, drafts[i], s.sampler.generator, None if q is None else q[i])
                lp = s.sampler.logprob_of(lg[i], tok) if p.logprobs is not None else None
            out.append((tok, lp))
            hist.append(tok)
            if i == len(drafts) or tok != drafts[i]:
                break
        self._accepted(s, drafts, start, out)

    def verify_chosen(self, s: Sequence, start: int, rows: list[tuple[int, int]]) -> None:
        """verify for drafts verified on the device (engine/step_runner.py: _verify_on_device): rows[i] is, for row i
        of [last token, draft 1..k], the target's token and whether it accepted the draft there (greedy: the
        token is the draft; sampled: the draft passed the test, else the token is the resample)."""
        drafts, s.drafts = s.drafts, []
        s.draft_q = None
        out = []
        for i, (tok, acc) in enumerate(rows[:len(drafts) + 1]):
            if i < len(drafts) and acc:
                out.append((drafts[i], None))
                continue
            out.append((tok, None))
            break
        self._accepted(s, drafts, start, out)

    def _accepted(self, s: Sequence, drafts: list[int], start: int, out: list[tuple]) -> None:
        """After verification: out holds the accepted drafts and the target's token after them, (token, logprob)
        each. Counts, the next draft length, the rollback to the accepted rows, then the tokens streamed."""
        n_acc = len(out) - 1
        s.drafted += len(drafts)
        s.accepted += n_acc
        self.totals["drafted_tokens"] += len(drafts)
        self.totals["accepted_tokens"] += n_acc
        for counts in (s.spec_by, self.totals):   # per drafter, for stats()
            counts[f"{s.draft_src}_drafted"] += len(drafts)
            counts[f"{s.draft_src}_accepted"] += n_acc
        s.spec_k = min(self.config.spec_max_drafts, 2 * s.spec_k) if n_acc == len(drafts) else max(1, n_acc + 1)
        dl = s.adapt.get(s.draft_src)
        if dl is not None:
            dl.observe(len(drafts), n_acc)
        s.n_computed = start + 1 + n_acc          # the fed token and the accepted drafts have good KV
        if s.kv is not None:
            s.kv.keep_rows(start, 1 + n_acc)
        else:                                     # GPU path: rejected rows' blocks go back, states roll back
            self.runner.cut_back(s.slot, s.n_computed)
        for tok, lp in out:
            self.emit(s, tok, lp)
            if not self.alive(s):                # finished (end of generation, stop string, limit)
                break

    @staticmethod
    def alive(s: Sequence) -> bool:
        """s still runs: it holds KV (CPU path) or a slot (GPU path)."""
        return s.kv is not None or getattr(s, "slot", None) is not None

    def drafts_next(self) -> bool:
        """Whether a running sequence may draft in the next step. Drafts need the newest token on the host,
        so only then is a GPU-path step not overlapped with the next: a sequence whose drafter is backed off
        (engine/spec/adaptive.py) decodes like one without drafts, its drafter's upkeep deferred."""
        return bool(self.active) and any(
            s.adapt and self.draft_len(s) > 0 for s in self.running)

    def stats(self) -> dict:
        """stats()["spec"]: the mode, per-drafter acceptance, the measured costs, the MTP block's cache (mtp_pool)."""
        return dict(mode=self.config.spec, active=bool(self.active),
                    drafters=acceptance_by_drafter(self.totals),
                    adaptive=self.config.spec_adaptive, costs=self.costs.summary(),
                    mtp_pool=self.mtp_pool_stats())

    def mtp_pool_stats(self) -> dict | None:
        """GPU path with MTP drafts: the MTP block's cache (its type, bytes; its rows in the slots' blocks) and
        the parked conversations keeping their state."""
        m = self.mtp_slots
        if m is None:
            return None
        return dict(cache_type=m.cache_type, bytes=m.nbytes(), parked_states=len(self.parked_mtp))

    # ----- the GPU path: the model drafters' device caches, kept with parked slots -----
    def drafter_bytes_per_token(self, cache_types: tuple[str, str], spec) -> int:
        """Bytes the model drafters' caches add per pool token on the GPU path: the MTP block's KV, a
        DFlash drafter's context K/V (bfloat16 on the device; its weights are on the device before the fit,
        so counted in the free memory)."""
        n = self.mtp_bytes_per_token(cache_types, spec)
        if self.dflash is not None:
            n += self.dflash.context_bytes_per_token()
        return n

    def mtp_bytes_per_token(self, cache_types: tuple[str, str], spec) -> int:
        """Bytes the MTP block's cache adds per pool token on the GPU path (0 without MTP drafts)."""
        if "mtp" not in self.kinds:
            return 0
        from engine.planner import mtp_token_bytes
        s = spec
        return mtp_token_bytes(s.n_head_kv, s.head_dim, s.head_dim_v, *cache_types)

    def open_mtp(self, runner, cache_types: tuple[str, str]) -> None:
        """The MTP block over the runner's slots: its one layer's K/V in the pool's block layout (the fit counted
        them per pool token: mtp_bytes_per_token)."""
        self.close_mtp()
        self.parked_mtp = {}
        self.parked_dflash = {}
        if "mtp" not in self.kinds:
            return
        from engine.planner import mtp_cache_type
        from engine.runner.mtp import MtpSlots
        self.mtp_slots = MtpSlots(runner, mtp_cache_type(*cache_types))

    def close_mtp(self) -> None:
        if self.mtp_slots is not None:
            self.mtp_slots.close()
            self.mtp_slots = None

    def warm_up(self) -> None:
        """GPU path with MTP: the block's pass graphs captured and its eager kernels compiled now rather than inside
        the first requests' steps (engine/runner/mtp.py: MtpSlots.warm_up; compiled in the first request, they took
        3.3 s of a 128-token request's 4.7 s on the H100: 27 against 95 tok/s with drafts off, `hivejet bench
        spec`)."""
        if self.mtp_slots is not None:
            self.mtp_slots.warm_up()

    def mtp_from(self, s: Sequence, slot: int, n: int, take: bool):
        """The MTP state for s starting from the first n positions of the conversation in `slot`: with
        take, the parked conversation's own state (s continues it), else a fork of the parked or running
        donor's; rows before n kept, h_{n-1} known (MtpState.resume_at). None when MTP does not draft for
        s or the state cannot resume there (s then drafts with n-grams only, if at all)."""
        if self.mtp_slots is None or not self.ok(s):
            return None
        if take:
            st = self.parked_mtp.pop(slot, None)
            if st is not None and not st.resume_at(n):
                st.release()
                st = None
        else:
            donor = self.parked_mtp.get(slot) or next(
                (q.mtp for q in self.running if q.slot == slot and q.mtp is not None), None)
            st = donor.fork(n) if donor is not None else None
        self.totals["mtp_resumed" if st is not None else "mtp_not_resumed"] += 1
        return st

    def park(self, s: Sequence) -> None:
        """s finished and its slot is parked: its MTP state and DFlash context stay with the slot (the step's
        upkeep still writes its last rows) for a follow-up (mtp_from, dflash_from)."""
        if s.mtp is not None:
            self.parked_mtp[s.slot] = s.mtp
        if s.dflash is not None:
            self.parked_dflash[s.slot] = s.dflash

    def dflash_from(self, s: Sequence, slot: int, n: int, take: bool):
        """The DFlash context for s starting from the first n positions of the conversation in `slot`: with
        take, the parked conversation's own (s continues it; its rows before n kept: DFlashState.resume_at),
        else a copy of the parked or running donor's rows before n (DFlashState.fork). None when DFlash
        does not draft for s or the context does not reach n."""
        if self.dflash is None or not self.ok(s):
            return None
        if take:
            st = self.parked_dflash.pop(slot, None)
            st = st if st is not None and st.resume_at(n) else None
        else:
            donor = self.parked_dflash.get(slot) or next(
                (q.dflash for q in self.running if q.slot == slot and q.dflash is not None), None)
            try:
                st = donor.fork(n) if donor is not None else None
            except torch.OutOfMemoryError:
                st = None
        self.totals["dflash_resumed" if st is not None else "dflash_not_resumed"] += 1
        return st

    def drop_parked(self, slot: int) -> None:
        """A parked slot is taken or evicted: its MTP state writes no more rows there, its DFlash context is
        dropped."""
        st = self.parked_mtp.pop(slot, None)
        if st is not None:
            st.release()
        self.parked_dflash.pop(slot, None)

    def mtp_rows_catch_up(self, mtp_rows: list) -> None:
        """The MTP block after a GPU-path step (mtp_catch_up). Its rows take the runner's blocks (the chained
        drafts' rows wait or draft less when the pool is full: MtpSlots.room); should a pass still run out of
        memory, the sequences lose their MTP drafts (n-gram drafts go on), nothing else."""
        from engine.kv.blocks import PoolFullError
        try:
            self.mtp_catch_up(mtp_rows)
        except (PoolFullError, torch.OutOfMemoryError) as e:
            log.warning("no memory for MTP rows (%s): MTP drafting stops for %d sequences", e, len(mtp_rows))
            for s, _, _ in mtp_rows:
                if s.mtp is not None:
                    if s.slot is None:
                        self.parked_mtp = {k: v for k, v in self.parked_mtp.items() if v is not s.mtp}
                    s.mtp.release()
                    s.mtp = None
            self.totals["mtp_pool_full"] += 1

    def dflash_rows_step(self, dflash_rows: list) -> None:
        """The DFlash drafter after a GPU-path step (dflash_step), for the sequences still running or parked
        (a finished sequence's context kept with its slot takes its last rows). Its contexts grow on the
        device beside the pool (counted per token in the fit); should the device still run out, the
        sequences lose their DFlash drafts (others go on), nothing else."""
        parked = {id(st) for st in self.parked_dflash.values()}
        rows = [(s, start, f) for s, start, f in dflash_rows if s.slot is not None or id(s.dflash) in parked]
        try:
            self.dflash_step(rows)
        except torch.OutOfMemoryError:
            log.warning("out of GPU memory for DFlash contexts: DFlash drafting stops for %d sequences", len(rows))
            for s, _, _ in rows:
                s.dflash = None
            self.parked_dflash.clear()
            self.totals["dflash_out_of_memory"] += 1

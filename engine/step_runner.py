"""The GPU path's step execution (engine/runner/runner.py's slots, on a GPU or, with static slots, the CPU):
the Scheduler's plan run as one decode call for the generating sequences (their drafts as extra rows of
their slot) and prompt chunks, tokens chosen on the device or by the host Sampler, overlapped steps (a step
launched before the previous one's device-chosen tokens are read back), and a sequence's slot taken
(SlotTable.take) or let go (parked or released) around its run.
"""
from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.sample_device import check_chosen, choose_tokens, samples_on_device, verify_drafts

if TYPE_CHECKING:
    from engine.sequence import Sequence


class RunnerStep:
    """GPU path: the tokens one runner step chose on the device (engine/sample_device.py), in row order: the
    ids stay on the device as the next step's input tokens, and one small copy brings them to the host
    (pinned memory, non_blocking, an event to wait on) for the per-sequence bookkeeping."""

    def __init__(self):
        self.seqs: list[Sequence] = []      # the rows' sequences, in the ids' order
        self.row: dict[int, int] = {}        # sequence id -> its row in ids
        self.decode: set[int] = set()        # sequences with a decode row among them (ahead rows, _finish)
        self._parts: list[torch.Tensor] = []
        self.ids: torch.Tensor | None = None          # [rows] long on the device
        self.verified: list[tuple] = []               # (sequence, first position, rows) whose drafts the device verified
        self.verify_ids: torch.Tensor | None = None   # and their rows' [rows, 2] (token, accepted), in that order
        self._host: torch.Tensor | None = None
        self._event = None

    def choose(self, seqs: list[Sequence], logits: torch.Tensor, vocab_size: int) -> None:
        """Queue the choice of seqs' tokens from logits [len(seqs), V] (one uniform number from each
        sampled request's generator, drawn now: the Sampler's stream)."""
        us = [0.0 if s.params.greedy else s.sampler.next_uniform() for s in seqs]
        self._parts.append(choose_tokens(logits, [s.params for s in seqs], us, vocab_size))
        for s in seqs:
            self.row[s.id] = len(self.seqs)
            self.seqs.append(s)

    def send(self) -> None:
        """Start the ids' copy to the host (asynchronous on CUDA)."""
        if not self._parts:
            return
        self.ids = self._parts[0] if len(self._parts) == 1 else torch.cat(self._parts)
        self._parts = []
        if self.ids.device.type == "cuda":
            self._host = torch.empty(self.ids.shape, dtype=self.ids.dtype, pin_memory=True)
            self._host.copy_(self.ids, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = self.ids

    def read(self) -> list[int]:
        """The ids on the host (waits for the copy)."""
        if self._host is None:
            return []
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


class RunnerExecutor:
    """Runs the runner's steps for one engine. scheduler: engine/scheduler.py (the rows of each step);
    speculator: engine/spec/speculator.py (drafts, their verification, the model drafters' upkeep); slots:
    engine/slots.py; running, totals: the engine's; on_logits(s, logits) / append_token(s, token, logprob):
    the engine's way of sampling and streaming a sequence's token; encode_images: the engine's image
    encoding before a step (None without a vision projector); clock: engine/pacing.py StepClock."""

    def __init__(self, runner, config, model_spec, *, scheduler, speculator, slots, running: list,
                 totals: collections.Counter, on_logits: Callable, append_token: Callable,
                 encode_images: Callable | None, clock):
        self.runner, self.config, self.spec = runner, config, model_spec
        self.scheduler, self.speculator, self.slots = scheduler, speculator, slots
        self.running, self.totals = running, totals
        self.on_logits, self.append_token, self.encode_images = on_logits, append_token, encode_images
        self.clock = clock
        self.inflight: RunnerStep | None = None   # the last step, its device-chosen ids not yet read (overlap)
        self.ahead: RunnerStep | None = None      # the step whose decode rows run ahead of the host's tokens
        self.last_step = {"rows": 0, "seqs": 0, "ms": 0.0}

    def admit(self, s: Sequence, share: bool) -> None:
        """s starts running: it takes a slot (a parked conversation it continues, a shared prefix, a free
        slot, else the least recently parked one: SlotTable.take)."""
        self.slots.take(s, self.config.prefill_chunk, bool(self.spec.recurrent_layers), share, self.running,
                        self.totals)

    def let_go(self, s: Sequence, keep: bool) -> bool:
        """s finished: a decode row of s still running ahead is discarded first; then its slot is parked
        (its blocks, states and drafter states kept for a follow-up or a shared prefix) when `keep` and it
        holds tokens, else released. Returns whether it was parked."""
        if self.ahead is not None and s.id in self.ahead.decode:
            self.discard_ahead_row(s)
        parked = keep and s.n_computed > 0
        if parked:
            # resident (its blocks kept) until evicted; images by content (prefix_keys)
            self.slots.park(s.slot, s.prefix_keys(s.n_computed))
            self.speculator.park(s)
        else:
            self.slots.release(s.slot)
        s.slot = None
        return parked

    def step(self) -> None:
        """One step on the runner: every generating sequence's next token in one decode call (a CUDA
        graph on the GPU), then prompt chunks (each cut at multiples of prefill_chunk) within the
        step's token budget, in arrival order. The KV blocks they write are made free first.

        Tokens: rows whose request needs nothing host-only get theirs chosen on the device
        (engine/sample_device.py) and only the ids come back; the others' logits go to the host Sampler
        (the engine's on_logits), both kinds in the same step. With overlap_steps, a step's device-chosen ids stay on
        the device as the next step's input tokens and are read back by that next step after it has
        launched its decode (complete): streaming, stop strings and finishing run while the GPU
        computes. A sequence that such a token finishes (end of generation, stop string; a cancel) then
        had a row in the running step: its result is discarded (Engine._finish: discard_ahead_row)."""
        prev, self.inflight = self.inflight, None
        try:
            self._step(prev)
        except BaseException:
            self.ahead = None   # (the loop finishes every running sequence with "error")
            raise

    def _step(self, prev: RunnerStep | None) -> None:
        t0 = time.monotonic()
        self.clock.poll()    # (the steps the device has finished: prompt-chunk pacing)
        self.speculator.draft_s = 0.0   # (drafting time of this step: not the model's, for the adaptive draft lengths)
        if self.encode_images is not None:
            self.encode_images()   # (the images of prompts still to be read; a failed one finishes its request)
        while True:
            plan = self.scheduler.schedule(prev.row if prev is not None else None)
            if plan is not None:
                break
            # a sequence is to draft (drafts follow the newest token: an overlapped step is only launched
            # when no sequence was to draft next, see below), or the step is short of free blocks (evicting
            # and pre-empting need every sequence's tokens on the host): the previous step's tokens first
            self.complete(prev)
            prev = None
        dec, chunks = plan.decode, plan.chunks
        clock = self.clock.start()
        step = RunnerStep()
        host, host_lg = [], []   # the host Sampler's rows: their sequences, their logits (device rows)
        mtp_rows = []            # (sequence, first position, output-normed hidden rows) for the MTP block
        dflash_rows = []         # (sequence, first position, rows at the drafter's target layers)
        spec = self._launch_decode(dec, prev, step, host, host_lg, mtp_rows, dflash_rows) if dec else []
        self.complete(prev)   # the previous step's tokens, while this step's decode runs
        verified = [(s, 1 + len(s.drafts), len(s.drafts)) for s in dec]   # (rows, drafts: before verifying)
        rows = len(dec) + sum(len(s.drafts) for s in dec)
        firsts, first_lg = [], []   # prompts read to their end whose first token is chosen on the device
        rows += self._prefill(chunks, firsts, first_lg, host, host_lg, mtp_rows, dflash_rows)
        if firsts:
            step.choose(firsts, torch.cat(first_lg) if len(first_lg) > 1 else first_lg[0], self.spec.vocab_size)
        step.send()
        self.clock.stop(clock, bool(chunks))
        if host:   # host rows, in one copy: their tokens are needed before the next step is planned
            lgs = (torch.cat(host_lg) if len(host_lg) > 1 else host_lg[0]).cpu()
            for s, lg in zip(host, lgs):
                if s.n_generated == 0:
                    self.totals["prompt_tokens"] += s.n_prompt
                self.on_logits(s, lg)
        for seq, start, lg in spec:   # drafts: accepted as the target would have decoded them, the rest cut off
            self.speculator.verify(seq, start, lg.cpu())
        if step.verified:   # (drafts verified on the device: the tokens and acceptances in one copy)
            best, i = [(check_chosen(t), a) for t, a in step.verify_ids.tolist()], 0
            for seq, start, n in step.verified:
                self.speculator.verify_chosen(seq, start, best[i:i + n])
                i += n
        if self.speculator.active and dec:
            self.speculator.adapt_draft_lengths(verified)   # (the next drafts' lengths, before the MTP block drafts them)
        if self.config.overlap_steps and not self.speculator.drafts_next():
            self.inflight = step
            self.totals["overlapped_steps"] += 1
        else:
            self.complete(step)
        # the model drafters after every token of the step is known (device-chosen ones included)
        if mtp_rows:
            self.speculator.mtp_rows_catch_up(mtp_rows)
        if dflash_rows:
            self.speculator.dflash_rows_step(dflash_rows)
        if self.speculator.active and dec and not chunks:
            self.speculator.costs.add_step(rows, time.monotonic() - t0 - self.speculator.draft_s)
        self.last_step = {"rows": rows, "seqs": len(dec) + len(chunks),
                          "ms": round(1000 * (time.monotonic() - t0), 2)}
        self.totals["steps"] += 1

    def _prefill(self, chunks: list, firsts: list, first_lg: list, host: list, host_lg: list, mtp_rows: list,
                 dflash_rows: list) -> int:
        """Run the step's prompt chunks; a prompt read to its end has its first token chosen on the device
        (firsts / first_lg) or by the host Sampler (host / host_lg). Returns the rows run."""
        r, pc = self.runner, self.config.prefill_chunk
        rows = 0
        # chunks whose sequences need no hidden rows (no model drafter) may share padded passes with other
        # slots' (Runner.prefill_pieces: short pieces, prompt_pieces on)
        plain = [i for i, (s, _, _) in enumerate(chunks) if s.mtp is None and s.dflash is None and s.vision is None]
        shared = {}
        if r.prompt_pieces > 1 and len(plain) > 1:
            before = r.shared_passes
            lgs = r.prefill_pieces([(s.slot, s.tokens[lo:hi], lo) for s, lo, hi in (chunks[i] for i in plain)],
                                   chunk=pc)
            shared = {i: lgs[j:j + 1] for j, i in enumerate(plain)}
            self.totals["shared_prompt_passes"] += r.shared_passes - before
        for i, (s, lo, hi) in enumerate(chunks):
            out = shared.get(i)
            if out is None:
                out = r.prefill(s.slot, s.tokens[lo:hi], start=lo, chunk=pc,
                                hidden=s.mtp is not None or s.dflash is not None, inputs=self.prompt_inputs(s, lo, hi),
                                prompt_end=s.target)
            if s.mtp is not None:
                mtp_rows.append((s, lo, r.hidden))
            if s.dflash is not None:
                dflash_rows.append((s, lo, r.features))
            s.n_computed = hi
            rows += hi - lo
            if hi == s.n_prompt and s.n_generated == 0:   # (a recomputed sequence samples nothing here)
                if self.device_row(s):
                    firsts.append(s)
                    first_lg.append(out[-1:])
                else:
                    host.append(s)
                    host_lg.append(out[-1:].float())
        return rows

    def _launch_decode(self, dec: list, prev: RunnerStep | None, step: RunnerStep, host: list,
                       host_lg: list, mtp_rows: list, dflash_rows: list) -> list:
        """Launch the step's decode call: every generating sequence's row, and after it the rows of its
        drafts (positions p, p+1, .. of its slot; the previous step's tokens are read then). Device-chosen rows go to `step`,
        host-sampled rows to host / host_lg, the hidden rows of sequences with an MTP state to mtp_rows,
        those with a DFlash state their target-layer rows to dflash_rows;
        returns (sequence, its first row's position, its rows' logits) of the sequences with drafts verified on the
        host once the step's other work is done; those the device verifies go to step.verified / step.verify_ids."""
        r = self.runner
        spec = []
        pos = [s.n_computed for s in dec]
        if any(s.drafts for s in dec):   # drafts: rows p, p+1, .. of the same slot (prev is read: _step)
            first = self._decode_inputs(dec, None)
            slots, toks, poss, row0 = [], [], [], []
            for s, p, t in zip(dec, pos, first):
                row0.append(len(slots))
                slots += [s.slot] * (1 + len(s.drafts))
                toks += [t] + s.drafts
                poss += range(p, p + 1 + len(s.drafts))
            logits = r.decode(slots, toks, poss)
        else:
            row0 = list(range(len(dec)))
            logits = r.decode([s.slot for s in dec], self._decode_inputs(dec, prev), pos)
        for s, p in zip(dec, pos):
            s.n_computed = p + 1 + len(s.drafts)   # with drafts: set again by Speculator.verify
        on_dev = [self.device_row(s) for s in dec]
        if all(on_dev) and len(row0) == logits.shape[0]:
            step.choose(dec, logits, self.spec.vocab_size)
        elif any(on_dev):
            rows = [row0[i] for i, d in enumerate(on_dev) if d]
            step.choose([dec[i] for i, d in enumerate(on_dev) if d], logits[rows], self.spec.vocab_size)
        plain = [i for i, d in enumerate(on_dev) if not d and not dec[i].drafts]
        if plain:
            host += [dec[i] for i in plain]
            host_lg.append(logits[[row0[i] for i in plain]].float())   # (a copy: the graph's output buffer is rewritten next step)
        on_dev_rows = []
        for i, s in enumerate(dec):
            if s.drafts and self.device_verify(s):
                on_dev_rows += range(row0[i], row0[i] + 1 + len(s.drafts))
                step.verified.append((s, pos[i], 1 + len(s.drafts)))
            elif s.drafts:
                spec.append((s, pos[i], logits[row0[i]:row0[i] + 1 + len(s.drafts)].float()))
            rows = slice(row0[i], row0[i] + 1 + len(s.drafts))   # (views of the graph's buffers: read
            if s.mtp is not None:                                # before the next decode call)
                mtp_rows.append((s, pos[i], r.hidden[rows]))
            if s.dflash is not None:
                dflash_rows.append((s, pos[i], r.features[rows]))
        if on_dev_rows:
            step.verify_ids = self._verify_on_device([(s, k) for s, _, k in step.verified],
                                                     logits.index_select(0, torch.tensor(on_dev_rows).to(logits.device)))
        step.decode = {s.id for s in step.seqs}
        self.ahead = step
        return spec

    def device_row(self, s: Sequence) -> bool:
        """GPU path: whether s's token of this step is chosen on the device (device_sampling and nothing
        host-only; rows with drafts are verified on the host, a drafting sequence's step without drafts
        (its drafter backed off) is not)."""
        return (self.config.device_sampling and samples_on_device(s.params, s.req.constraint)
                and not s.drafts)

    def device_verify(self, s: Sequence) -> bool:
        """GPU path: whether s's drafts are verified on the device (device_sampling and nothing host-only; the
        drafts one-hot: not DFlash's sampled ones): only the tokens come back, not the rows' logits."""
        return (self.config.device_sampling and samples_on_device(s.params, s.req.constraint)
                and (s.params.greedy or s.draft_q is None))

    def _verify_on_device(self, seqs: list, logits: torch.Tensor) -> torch.Tensor:
        """The drafting rows of seqs [(sequence, rows)], their logits in order: [rows, 2] (the target's token after
        each row, whether it accepted the row's draft) on the device. Greedy rows: the argmax (choose_tokens),
        accepted when it is the draft; sampled rows: speculative sampling (sample_device.verify_drafts), two
        uniform numbers per draft and one for the row after them from the request's stream, drawn now."""
        dev, V = logits.device, self.spec.vocab_size
        rows = [(s, i == k - 1) for s, k in seqs for i in range(k)]             # (sequence, the row after its drafts)
        drafts = torch.tensor([d for s, _ in seqs for d in s.drafts + [-1]])
        greedy = [r for r, (s, _) in enumerate(rows) if s.params.greedy]
        sampled = [r for r, (s, _) in enumerate(rows) if not s.params.greedy]
        out = torch.empty(len(rows), 2, dtype=torch.long, device=dev)
        if greedy:
            g = torch.tensor(greedy)
            lg = logits if not sampled else logits[g.to(dev)]   # (all greedy: no copy of the rows)
            ids = choose_tokens(lg, [rows[r][0].params for r in greedy], [0.0] * len(greedy), V)
            out[g.to(dev)] = torch.stack([ids, (ids == drafts[g].to(dev, non_blocking=True)).long()], dim=1)
        if sampled:
            u_test, u_res = [], []
            for r in sampled:
                s, after = rows[r]
                u_test.append(s.sampler.next_uniform())
                u_res.append(0.0 if after else s.sampler.next_uniform())
            o = torch.tensor(sampled)
            out[o.to(dev)] = verify_drafts(logits[o.to(dev)], [rows[r][0].params for r in sampled],
                                           drafts[o].tolist(), u_test, u_res, V)
        return out

    def _decode_inputs(self, dec: list[Sequence], prev: RunnerStep | None):
        """The decode rows' input tokens: a sequence's last token on the host, or the id the previous
        step chose for it on the device when that is not read yet (a device tensor then: no sync)."""
        if prev is None or prev.ids is None or not any(s.id in prev.row for s in dec):
            return [s.tokens[-1] for s in dec]
        dev = prev.ids.device
        own = [s.tokens[-1] for s in dec if s.id not in prev.row]
        src = torch.cat([prev.ids, torch.tensor(own, dtype=torch.long).to(dev, non_blocking=True)]) if own else prev.ids
        idx, k = [], prev.ids.shape[0]
        for s in dec:
            if s.id in prev.row:
                idx.append(prev.row[s.id])
            else:
                idx.append(k)
                k += 1
        if idx == list(range(src.shape[0])):
            return src
        return src.index_select(0, torch.tensor(idx, dtype=torch.long).to(dev, non_blocking=True))

    def complete(self, step: RunnerStep | None) -> None:
        """A step's device-chosen tokens on the host: stream them, check stop strings and limits, finish
        (_append_token, as for host-sampled tokens). Sequences finished meanwhile (a cancel) are skipped."""
        if step is None:
            return
        if self.ahead is step:
            self.ahead = None   # its rows' results are read now: they no longer run ahead
        ids = step.read()
        running = set(self.running)
        for s, tok in zip(step.seqs, ids):
            if s not in running:
                continue
            check_chosen(tok)
            if s.n_generated == 0:
                self.totals["prompt_tokens"] += s.n_prompt
            self.totals["device_sampled_tokens"] += 1
            self.append_token(s, tok, None)

    def discard_ahead_row(self, s: Sequence) -> None:
        """s finishes while its decode row of the running step, fed the token that finished it, is still on
        the GPU (overlap_steps): that row's result is never read. Without recurrent layers the slot is cut
        back to the tokens before it (blocks too), exactly as without overlap; a recurrent model's states
        already moved past that token, so the slot keeps it (parked one token longer)."""
        self.ahead.decode.discard(s.id)
        self.totals["discarded_rows"] += 1
        if not self.spec.recurrent_layers:
            s.n_computed -= 1
            self.runner.truncate(s.slot, s.n_computed)

    def prompt_inputs(self, s: Sequence, lo: int, hi: int):
        """The runner's PromptInputs for s's rows [lo, hi) when its prompt holds images, else None."""
        vp = s.vision
        if vp is None:
            return None
        from engine.runner import PromptInputs
        pos, emb, bidir = vp.chunk_inputs(lo, hi)
        return PromptInputs(pos, emb, bidir, vp.pos_delta, s.prefix_keys(hi, lo))


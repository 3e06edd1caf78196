"""The GPU path's scheduling: one step of engine/runner/runner.py's slots for the Engine (a mixin of it).

Slots and the one KV pool they share (_open_runner, _fit_pool), admission into a slot with parked
conversations and shared prefixes (_take_slot), pool room, eviction and pre-emption before a step
(_make_room), and the step itself: decode rows and prompt chunks, tokens chosen on the device or by the
host Sampler, overlapped steps (_step_runner). The engine's loop, contract and CPU step stay in
engine/engine.py.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import torch

from engine.pacing import StepClock
from engine.planner import (DEVICE_CHECKPOINT_SHARE, MIN_DEVICE_CHECKPOINTS, auto_prefill_chunk,
                            device_checkpoint_count, facts_from_file, host_checkpoint_count)
from engine.prefix import common_prefix
from engine.runner import BUCKETS
from engine.sample_device import check_chosen, choose_tokens, samples_on_device
from engine.types import EngineError

if TYPE_CHECKING:
    from engine.engine import _Sequence
    from engine.planner import ModelFacts

log = logging.getLogger("hivejet.engine")

RUNNER_BLOCK = 16   # tokens per block of the GPU path's KV pool


class _RunnerStep:
    """GPU path: the tokens one runner step chose on the device (engine/sample_device.py), in row order: the
    ids stay on the device as the next step's input tokens, and one small copy brings them to the host
    (pinned memory, non_blocking, an event to wait on) for the per-sequence bookkeeping."""

    def __init__(self):
        self.seqs: list[_Sequence] = []      # the rows' sequences, in the ids' order
        self.row: dict[int, int] = {}        # sequence id -> its row in ids
        self.decode: set[int] = set()        # sequences with a decode row among them (ahead rows, _finish)
        self._parts: list[torch.Tensor] = []
        self.ids: torch.Tensor | None = None          # [rows] long on the device
        self._host: torch.Tensor | None = None
        self._event = None

    def choose(self, seqs: list[_Sequence], logits: torch.Tensor, vocab_size: int) -> None:
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


RUNNER_MAX_ROWS = BUCKETS[-1]   # rows of one decode step that still run as a CUDA graph
# recurrent models: sequences that draft in one step (each holds a copy of its recurrent states for the
# step, Runner.cut_back: ~150 MB for a 27B; 10 % of the GPU memory is left out of the KV pool for such)
RECURRENT_DRAFTERS = 4


class RunnerScheduler:
    """The Engine's GPU-path (engine/runner/runner.py) methods; Engine inherits them."""

    def _open_runner(self) -> None:
        """Put the model on the device with one slot per concurrent sequence and ONE KV pool they share:
        ctx_pool_tokens, else on a GPU as much as fits in the memory left after the weights, the fixed
        per-slot state and a step's workspace (_step_workspace, at least 10 % of the free memory; too
        little for 256 tokens is an error), else (static slots on the CPU) max_seqs x the context. One
        sequence may use up to min(its context, the pool). Recurrent models also get state checkpoints
        for prefix sharing (state_checkpoints; by default as many as fit in 2 % of the KV cache, which
        the fit leaves room for, or, when that is fewer than MIN_DEVICE_CHECKPOINTS on a GPU, up to
        HOST_CHECKPOINTS in pinned host memory: checkpoint_memory)."""
        from engine.runner import Runner, state_checkpoint_bytes
        c = self.config
        dev = torch.device(c.device)
        types = dict(cache_type_k=c.cache_type_k, cache_type_v=c.cache_type_v)
        want = c.ctx_size or self.spec.context_length
        if c.prefill_chunk % RUNNER_BLOCK:   # shared prefixes end on chunk ends: whole blocks, never copied
            self.model.close()
            raise EngineError(f"prefill_chunk {c.prefill_chunk} must be a multiple of {RUNNER_BLOCK} on the "
                              f"{c.device} path (its KV blocks)")
        one_ckpt = state_checkpoint_bytes(self.model) if c.resident_tokens > 0 else 0   # 0: no recurrent layers
        host_ckpt = c.checkpoint_memory == "host"
        ckpt_share = DEVICE_CHECKPOINT_SHARE if one_ckpt and c.state_checkpoints < 0 and not host_ckpt else 0.0
        try:
            if c.ctx_pool_tokens:
                pool = c.ctx_pool_tokens
                if self._checkpoints_to_host(dev, pool, one_ckpt, ckpt_share):
                    host_ckpt, ckpt_share = True, 0.0
            elif dev.type == "cuda":
                self.model.to_device(dev)
                if self._dflash is not None:
                    self._dflash.to_device(dev)
                free, _ = torch.cuda.mem_get_info(dev)
                if c.prefill_chunk == 0:   # (automatic: the CPU and a given pool size were settled by Engine)
                    c = self.config = dataclasses.replace(c, prefill_chunk=auto_prefill_chunk(free))
                facts = facts_from_file(self.model.file)   # (the open file's header, parsed once)
                budget = (free - max(int(0.1 * free), self._step_workspace(facts, want)) - self._vision_workspace()
                          - self._pieces_workspace(facts))
                pool = self._fit_pool(budget, want, 0 if host_ckpt else one_ckpt * max(0, c.state_checkpoints),
                                      ckpt_share)
                if self._checkpoints_to_host(dev, pool, one_ckpt, ckpt_share):
                    host_ckpt, ckpt_share = True, 0.0
                    pool = self._fit_pool(budget, want, 0, 0.0)   # (the KV pool takes the 2 % back)
                if pool < 256:
                    raise EngineError(f"not enough GPU memory for the KV cache: {free / 2**30:.1f} GiB free after "
                                      f"the weights, for {c.max_seqs} sequences' state and a pool of 256 tokens")
            else:
                pool = c.max_seqs * want
            blocks = max(1, pool // RUNNER_BLOCK)
            self.runner = Runner(self.model, device=dev, n_slots=c.max_seqs, n_blocks=blocks, block_size=RUNNER_BLOCK,
                                 max_ctx=min(want, blocks * RUNNER_BLOCK), rope_offsets=self._mrope_images(),
                                 shared_prompt_passes=c.shared_prompt_passes, **types)
            if self._dflash is not None and self._dflash.device != dev:   # (ctx_pool_tokens: no fit above)
                self._dflash.to_device(dev)
            if one_ckpt:
                if c.state_checkpoints >= 0:
                    n = c.state_checkpoints
                elif host_ckpt:
                    n = host_checkpoint_count(one_ckpt)
                else:
                    n = device_checkpoint_count(self.runner.kv_bytes(), one_ckpt)
                self.runner.enable_checkpoints(n, host=host_ckpt)
        except (ValueError, torch.OutOfMemoryError) as e:
            self.model.close()
            raise EngineError(f"cannot set up the {c.device} path: {e}") from None
        except EngineError:
            self.model.close()
            raise
        self.ctx_size = min(self.ctx_size, self.runner.max_ctx)
        self._open_mtp_pool(dev)
        self._clock = StepClock(self._pacer, dev)
        if dev.type == "cuda":
            # every decode graph a step can need, now: captured lazily, the first step with 4 (16) agents
            # stalled 7 (12) s on the H200 while its kernels compiled and its graph was captured
            top = next((b for b in BUCKETS if b >= c.max_seqs), BUCKETS[-1])
            try:
                self.runner.capture([b for b in BUCKETS if b <= top])
                if self._runner_spec_kinds() and c.spec_max_drafts > 0:   # (drafts of recurrent models: graphs of their own)
                    self.runner.capture_drafting(1 + c.spec_max_drafts)
                self.runner.capture_prefill(c.prefill_chunk)   # (prompt chunks: engine/runner/prefill.py)
            except (RuntimeError, torch.OutOfMemoryError) as e:
                self.model.close()
                raise EngineError(f"cannot capture the CUDA graphs on {c.device}: {e}") from None
        self._free_slots = list(range(c.max_seqs - 1, -1, -1))
        self._parked: collections.OrderedDict[int, list[int]] = collections.OrderedDict()  # slot -> its tokens
        self._inflight: _RunnerStep | None = None   # the last step, its device-chosen ids not yet read (overlap)
        self._ahead: _RunnerStep | None = None      # the step whose decode rows run ahead of the host's tokens

    def _mrope_images(self) -> bool:
        """Whether prompts may hold images whose M-RoPE positions run behind the token indices (Qwen): the
        runner's decode rows then add each slot's rope delta (Runner rope_offsets)."""
        return self.vision is not None and self._image_format.mrope

    def _vision_workspace(self) -> int:
        """What encoding the largest image takes on the GPU (engine/vision/mmproj.py mmproj_info; its
        weights are on the GPU already, counted in the free memory): kept out of the KV pool."""
        if self.vision is None or self.vision.device.type != "cuda":
            return 0
        return int(self.vision.facts["workspace_bytes"]) + self.EMBED_CACHE_BYTES   # (and the embeddings kept
        # for re-sent images, on the GPU with the encoder)

    def _prompt_inputs(self, s: _Sequence, lo: int, hi: int):
        """The runner's PromptInputs for s's rows [lo, hi) when its prompt holds images, else None."""
        vp = s.vision
        if vp is None:
            return None
        from engine.runner import PromptInputs
        pos, emb, bidir = vp.chunk_inputs(lo, hi)
        return PromptInputs(pos, emb, bidir, vp.pos_delta, s.prefix_keys(hi, lo))

    def _runner_spec_kinds(self) -> set[str]:
        """The drafters the GPU path runs: all of them (n-gram, MTP, DFlash), their drafts verified as extra
        decode rows of their sequence in the same step (its rows attend to the drafts before them; rejected
        rows are cut off, recurrent states rolled back: Runner.cut_back; with key preconditioning, within
        one segment: Runner.draft_room). The MTP block reads the rows' output-normed hidden states
        (Runner.hidden) and keeps its one layer's KV in its own pool on the device (_open_mtp_pool); a
        DFlash drafter reads their states at its target layers (Runner.features), its weights and context
        on the device."""
        return set(self._spec_kinds)

    def _cache_types(self) -> tuple[str, str]:
        from kernels.kvcodec import cache_type_name
        c = self.config
        return cache_type_name(c.cache_type_k), cache_type_name(c.cache_type_v or c.cache_type_k)

    def _drafter_bytes_per_token(self) -> int:
        """Bytes the model drafters' caches add per pool token on the GPU path: the MTP block's KV, a
        DFlash drafter's context K/V (bfloat16 on the device; its weights are on the device before the fit,
        so counted in the free memory)."""
        n = self._mtp_bytes_per_token()
        if self._dflash is not None:
            n += self._dflash.context_bytes_per_token()
        return n

    def _mtp_bytes_per_token(self) -> int:
        """Bytes the MTP block's cache adds per pool token on the GPU path (0 without MTP drafts)."""
        if "mtp" not in self._spec_kinds:
            return 0
        from engine.planner import mtp_token_bytes
        s = self.spec
        return mtp_token_bytes(s.n_head_kv, s.head_dim, s.head_dim_v, *self._cache_types())

    def _open_mtp_pool(self, dev: torch.device) -> None:
        """The MTP block's KV pool on the device: as many 16-token blocks as the main pool, plus room for
        every slot's draft rows and copied blocks (its rows mirror the main rows; the fit counted them)."""
        self._mtp_pool = None
        self._parked_mtp: dict[int, object] = {}   # parked slot -> the MTP state of its conversation
        self._parked_dflash: dict[int, object] = {}   # parked slot -> its DFlash context
        if "mtp" not in self._spec_kinds:
            return
        from engine.kv.pool import KVPool
        from engine.planner import mtp_cache_type
        extra = (self.config.max_seqs + 1) * 4   # (engine/planner.py: mtp_kv_bytes counts the same)
        self._mtp_pool = KVPool(cache_type_k=mtp_cache_type(*self._cache_types()), block_size=RUNNER_BLOCK,
                                device=dev, n_blocks=self.runner.pool.n_blocks + extra)

    def _step_workspace(self, facts: ModelFacts, ctx: int) -> int:
        """What a step allocates beyond the pool and the slots' state (engine/planner.py activation_bytes:
        a prompt chunk's activations, its dequantized matrix, its attention over `ctx` positions, the
        logits), left out of the pool when it is more than the usual 10 % of the free memory."""
        from engine import planner as P
        from kernels.kvcodec import cache_type_name
        c = self.config
        kt, vt = cache_type_name(c.cache_type_k), cache_type_name(c.cache_type_v or c.cache_type_k)
        return P.activation_bytes(facts, ctx, kt, c.max_seqs, c.prefill_chunk, vt)

    def _pieces_workspace(self, facts: ModelFacts) -> int:
        """The graph pool of the passes that hold several slots' short prompts (engine/planner.py
        piece_graph_bytes: 395 MiB on the 27B), kept out of the KV pool when the runner will capture them."""
        from engine import planner as P
        from engine.runner import prompt_pieces_per_pass
        c = self.config
        if prompt_pieces_per_pass(c.max_seqs, True, c.shared_prompt_passes) <= 1:
            return 0
        return P.piece_graph_bytes(facts, c.max_seqs)

    def _checkpoints_to_host(self, dev: torch.device, pool: int, one_ckpt: int, ckpt_share: float) -> bool:
        """checkpoint_memory "auto": the default state checkpoints go to host memory when fewer than
        MIN_DEVICE_CHECKPOINTS fit in the 2 % of a `pool`-token KV cache on a GPU (a 24 GiB card: none
        of the 27B's 150 MB each, so a regenerated reply would read its whole conversation again)."""
        from engine.runner import slot_bytes_per_token
        c = self.config
        if dev.type != "cuda" or not ckpt_share or c.checkpoint_memory != "auto":
            return False
        kv = pool * slot_bytes_per_token(self.model, cache_type_k=c.cache_type_k, cache_type_v=c.cache_type_v)
        return device_checkpoint_count(kv, one_ckpt) < MIN_DEVICE_CHECKPOINTS

    def _fit_pool(self, budget: int, want: int, ckpt_bytes: int, ckpt_share: float) -> int:
        """The most pool tokens (whole blocks) that fit in `budget` bytes beside every slot's fixed state
        (recurrent states, key preconditioning sized for min(want, pool) positions, the scratch slot's
        too), the given checkpoints and a `ckpt_share` of the KV for the default checkpoints."""
        from engine.runner import slot_bytes_per_token, slot_fixed_bytes
        c = self.config
        types = dict(cache_type_k=c.cache_type_k, cache_type_v=c.cache_type_v)
        per_token = max(1, slot_bytes_per_token(self.model, **types) + self._drafter_bytes_per_token())

        def fits(blocks: int) -> bool:
            tokens = blocks * RUNNER_BLOCK
            fixed = slot_fixed_bytes(self.model, **types, max_ctx=min(want, tokens)) * (c.max_seqs + 1)
            return (tokens + RUNNER_BLOCK) * per_token * (1 + ckpt_share) + fixed + ckpt_bytes <= budget
        lo, hi = 0, budget // (per_token * RUNNER_BLOCK) + 1       # lo fits (or is 0), hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo * RUNNER_BLOCK

    def _take_slot(self, s: _Sequence) -> None:
        """GPU path: a finished conversation stays parked in its slot (KV blocks and recurrent states in
        place); a request whose prompt continues one (its images compared by content: prefix_keys) takes
        that slot over and computes only the rest.
        Else the longest prefix another slot holds, running or parked (agents sharing a system prompt),
        is shared with the new slot (Runner.find_prefix / share_prefix: a multiple of prefill_chunk, its
        blocks referenced, recurrent states from a checkpoint), and only the rest is computed, with the
        numbers a cold run gives. Else a free slot, else the least recently parked one. A sequence back
        from a pre-emption needs all its tokens but the last again (s.target). With MTP drafts, the MTP
        block's cache comes along: the parked conversation's own, or a fork of the donor's (_mtp_from)."""
        r, pc = self.runner, self.config.prefill_chunk
        best, n, whole = None, 0, False
        prompt = s.prefix_keys(s.target)      # (images by content: a follow-up of a conversation with images)
        for slot, toks in self._parked.items():
            lcp = common_prefix(toks, prompt)
            if self.spec.recurrent_layers:   # the states are those after the parked tokens: all or nothing
                use = len(toks) if lcp >= len(toks) and len(toks) < s.target else 0
            else:
                use = min(lcp, s.target - 1)
                if s.vision is not None:
                    use = s.vision.safe_start(use)   # (an image attended both ways is read whole)
            if use > n:
                best, n, whole = slot, use, lcp >= len(toks)
        match = None
        if self._resident.budget > 0:
            donors = {q.slot: q.prefix_keys(q.n_computed) for q in self._running if q.slot is not None}
            donors.update(self._parked)
            match = r.find_prefix(prompt, donors, pc)
            if match is not None and s.vision is not None and not self.spec.recurrent_layers:
                n_safe = s.vision.safe_start(match.n) // pc * pc   # (an image attended both ways is read whole)
                match = dataclasses.replace(match, n=n_safe) if n_safe >= r.block_size else None
        # taking over a parked conversation the prompt does not continue loses that conversation: worth it
        # only for at least a block, and a chunk more than a copy would give
        if best is not None and not whole and (n < r.block_size or (match is not None and n - pc < match.n)):
            best, n = None, 0
        if match is not None and match.n > n:
            if s.vision is None:   # (model drafters do not draft for prompts with images: _attach_drafters)
                s.mtp = self._mtp_from(s, match.src, match.n, take=False)
                s.dflash = self._dflash_from(s, match.src, match.n, take=False)
            if self._free_slots:
                s.slot = self._free_slots.pop()
            else:   # the least recently parked slot other than the donor (the donor itself when it is the only one)
                s.slot = next((p for p in self._parked if p != match.src), match.src)
                del self._parked[s.slot]
                self._drop_parked_drafters(s.slot)
            if match.src in self._parked:
                self._parked.move_to_end(match.src)   # just used: evicted last
            r.share_prefix(match, s.slot)              # (drops what s.slot held before)
            s.n_computed = s.cached = match.n
            self._totals["cached_tokens"] += match.n
            self._totals["shared_tokens"] += match.n
        elif best is not None:
            del self._parked[best]
            if s.vision is None:   # (model drafters do not draft for prompts with images: _attach_drafters)
                s.mtp = self._mtp_from(s, best, n, take=True)
                s.dflash = self._dflash_from(s, best, n, take=True)
            self._drop_parked_drafters(best)
            s.slot = best
            r.truncate(best, n)                        # the blocks after the common part go back to the pool
            s.n_computed = s.cached = n
            self._totals["cached_tokens"] += n
        elif self._free_slots:
            s.slot = self._free_slots.pop()
        else:
            s.slot, _ = self._parked.popitem(last=False)
            self._drop_parked_drafters(s.slot)
            r.release(s.slot)

    def _mtp_from(self, s: _Sequence, slot: int, n: int, take: bool):
        """The MTP state for s starting from the first n positions of the conversation in `slot`: with
        take, the parked conversation's own state (s continues it), else a fork of the parked or running
        donor's; rows before n kept, h_{n-1} known (MtpState.resume_at). None when MTP does not draft for
        s or the state cannot resume there (s then drafts with n-grams only, if at all)."""
        if self._mtp_pool is None or not self._spec_ok(s):
            return None
        if take:
            st = self._parked_mtp.pop(slot, None)
            if st is not None and not st.resume_at(n):
                st.release()
                st = None
        else:
            donor = self._parked_mtp.get(slot) or next(
                (q.mtp for q in self._running if q.slot == slot and q.mtp is not None), None)
            st = donor.fork(n) if donor is not None else None
        self._totals["mtp_resumed" if st is not None else "mtp_not_resumed"] += 1
        return st

    def _park_drafters(self, s: _Sequence) -> None:
        """s finished and its slot is parked: its MTP state and DFlash context stay with the slot (the step's
        upkeep still writes its last rows) for a follow-up (_mtp_from, _dflash_from)."""
        if s.mtp is not None:
            self._parked_mtp[s.slot] = s.mtp
        if s.dflash is not None:
            self._parked_dflash[s.slot] = s.dflash

    def _dflash_from(self, s: _Sequence, slot: int, n: int, take: bool):
        """The DFlash context for s starting from the first n positions of the conversation in `slot`: with
        take, the parked conversation's own (s continues it; its rows before n kept: DFlashState.resume_at),
        else a copy of the parked or running donor's rows before n (DFlashState.fork). None when DFlash
        does not draft for s or the context does not reach n."""
        if self._dflash is None or not self._spec_ok(s):
            return None
        if take:
            st = self._parked_dflash.pop(slot, None)
            st = st if st is not None and st.resume_at(n) else None
        else:
            donor = self._parked_dflash.get(slot) or next(
                (q.dflash for q in self._running if q.slot == slot and q.dflash is not None), None)
            try:
                st = donor.fork(n) if donor is not None else None
            except torch.OutOfMemoryError:
                st = None
        self._totals["dflash_resumed" if st is not None else "dflash_not_resumed"] += 1
        return st

    def _drop_parked_drafters(self, slot: int) -> None:
        """A parked slot is taken or evicted: its MTP rows go back to the MTP pool, its DFlash context is
        dropped."""
        st = self._parked_mtp.pop(slot, None) if self._mtp_pool is not None else None
        if st is not None:
            st.release()
        self._parked_dflash.pop(slot, None)

    def _runner_has_room(self, s: _Sequence) -> bool:
        """GPU path: whether the pool's free blocks, plus those only parked conversations hold, can take all of
        s's tokens (a prefix it may share is not counted: it waits rather than push a running one out)."""
        r = self.runner
        spare = r.pool.n_free + sum(r.held_alone(p) for p in self._parked)
        return spare * r.block_size >= len(s.tokens) + 1

    def _step_runner(self) -> None:
        """One step on the runner: every generating sequence's next token in one decode call (a CUDA
        graph on the GPU), then prompt chunks (each cut at multiples of prefill_chunk) within the
        step's token budget, in arrival order. The KV blocks they write are made free first.

        Tokens: rows whose request needs nothing host-only get theirs chosen on the device
        (engine/sample_device.py) and only the ids come back; the others' logits go to the host Sampler
        (_on_logits), both kinds in the same step. With overlap_steps, a step's device-chosen ids stay on
        the device as the next step's input tokens and are read back by that next step after it has
        launched its decode (_complete_runner): streaming, stop strings and finishing run while the GPU
        computes. A sequence that such a token finishes (end of generation, stop string; a cancel) then
        had a row in the running step: its result is discarded (_finish: _discard_ahead_row)."""
        prev, self._inflight = self._inflight, None
        try:
            self._runner_step(prev)
        except BaseException:
            self._ahead = None   # (the loop finishes every running sequence with "error")
            raise

    def _runner_step(self, prev: _RunnerStep | None) -> None:
        t0 = time.monotonic()
        self._clock.poll()    # (the steps the device has finished: prompt-chunk pacing)
        self._draft_s = 0.0   # (drafting time of this step: not the model's, for the adaptive draft lengths)
        r, pc = self.runner, self.config.prefill_chunk
        if self.vision is not None:
            self._encode_images()   # (the images of prompts still to be read; a failed one finishes its request)
        while True:
            plan = self._plan_runner(prev)
            if prev is not None and any(s.drafts for s in plan[0]):
                # drafts follow the newest token, so the previous step's must be on the host first (an
                # overlapped step is only launched when no sequence was to draft next: see below)
                self._complete_runner(prev)
                prev = None
                continue
            room = self._make_room(*plan, drain=prev is not None)
            if room is not None:
                break
            # short of free blocks: the previous step's tokens first, then the plan the engine makes without
            # overlap (evicting and pre-empting need every sequence's tokens on the host)
            self._complete_runner(prev)
            prev = None
        dec, chunks = room
        clock = self._clock.start()
        step = _RunnerStep()
        host, host_lg = [], []   # the host Sampler's rows: their sequences, their logits (device rows)
        mtp_rows = []            # (sequence, first position, output-normed hidden rows) for the MTP block
        dflash_rows = []         # (sequence, first position, rows at the drafter's target layers)
        spec = self._launch_decode(dec, prev, step, host, host_lg, mtp_rows, dflash_rows) if dec else []
        self._complete_runner(prev)   # the previous step's tokens, while this step's decode runs
        verified = [(s, 1 + len(s.drafts), len(s.drafts)) for s in dec]   # (rows, drafts: before verifying)
        rows = len(dec) + sum(len(s.drafts) for s in dec)
        firsts, first_lg = [], []
        # chunks whose sequences need no hidden rows (no model drafter) may share padded passes with other
        # slots' (Runner.prefill_pieces: short pieces, prompt_pieces on)
        plain = [i for i, (s, _, _) in enumerate(chunks) if s.mtp is None and s.dflash is None and s.vision is None]
        shared = {}
        if r.prompt_pieces > 1 and len(plain) > 1:
            before = r.shared_passes
            lgs = r.prefill_pieces([(s.slot, s.tokens[lo:hi], lo) for s, lo, hi in (chunks[i] for i in plain)],
                                   chunk=pc)
            shared = {i: lgs[j:j + 1] for j, i in enumerate(plain)}
            self._totals["shared_prompt_passes"] += r.shared_passes - before
        for i, (s, lo, hi) in enumerate(chunks):
            out = shared.get(i)
            if out is None:
                out = r.prefill(s.slot, s.tokens[lo:hi], start=lo, chunk=pc,
                                hidden=s.mtp is not None or s.dflash is not None, inputs=self._prompt_inputs(s, lo, hi),
                                prompt_end=s.target)
            if s.mtp is not None:
                mtp_rows.append((s, lo, r.hidden))
            if s.dflash is not None:
                dflash_rows.append((s, lo, r.features))
            s.n_computed = hi
            rows += hi - lo
            if hi == s.n_prompt and s.n_generated == 0:   # (a recomputed sequence samples nothing here)
                if self._device_row(s):
                    firsts.append(s)
                    first_lg.append(out[-1:])
                else:
                    host.append(s)
                    host_lg.append(out[-1:].float())
        if firsts:
            step.choose(firsts, torch.cat(first_lg) if len(first_lg) > 1 else first_lg[0], self.spec.vocab_size)
        step.send()
        self._clock.stop(clock, bool(chunks))
        if host:   # host rows, in one copy: their tokens are needed before the next step is planned
            lgs = (torch.cat(host_lg) if len(host_lg) > 1 else host_lg[0]).cpu()
            for s, lg in zip(host, lgs):
                if s.n_generated == 0:
                    self._totals["prompt_tokens"] += s.n_prompt
                self._on_logits(s, lg)
        for seq, start, lg in spec:   # drafts: accepted as the target would have decoded them, the rest cut off
            self._verify_drafts(seq, start, lg.cpu())
        if self.spec_active and dec:
            self._adapt_draft_lengths(verified)   # (the next drafts' lengths, before the MTP block drafts them)
        if self.config.overlap_steps and not self._drafts_next():
            self._inflight = step
            self._totals["overlapped_steps"] += 1
        else:
            self._complete_runner(step)
        # the model drafters after every token of the step is known (device-chosen ones included)
        if mtp_rows:
            self._mtp_rows_catch_up(mtp_rows)
        if dflash_rows:
            self._dflash_rows_step(dflash_rows)
        if self.spec_active and dec and not chunks:
            self._costs.add_step(rows, time.monotonic() - t0 - self._draft_s)
        self._last_step = {"rows": rows, "seqs": len(dec) + len(chunks),
                           "ms": round(1000 * (time.monotonic() - t0), 2)}
        self._totals["steps"] += 1

    def _drafts_next(self) -> bool:
        """Whether a running sequence may draft in the next step. Drafts need the newest token on the host,
        so only then is a step not overlapped with the next: a sequence whose drafter is backed off
        (engine/spec/adaptive.py) decodes like one without drafts, its drafter's upkeep deferred."""
        return bool(self.spec_active) and any(
            s.adapt and self._draft_len(s) > 0 for s in self._running)

    def _launch_decode(self, dec: list, prev: _RunnerStep | None, step: _RunnerStep, host: list,
                       host_lg: list, mtp_rows: list, dflash_rows: list) -> list:
        """Launch the step's decode call: every generating sequence's row, and after it the rows of its
        drafts (positions p, p+1, .. of its slot; the previous step's tokens are read then). Device-chosen rows go to `step`,
        host-sampled rows to host / host_lg, the hidden rows of sequences with an MTP state to mtp_rows,
        those with a DFlash state their target-layer rows to dflash_rows;
        returns (sequence, its first row's position, its rows' logits) of the sequences with drafts,
        verified once the step's other work is done."""
        r = self.runner
        spec = []
        pos = [s.n_computed for s in dec]
        if any(s.drafts for s in dec):   # drafts: rows p, p+1, .. of the same slot (prev is read: _runner_step)
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
            s.n_computed = p + 1 + len(s.drafts)   # with drafts: set again by _verify_drafts
        on_dev = [self._device_row(s) for s in dec]
        if all(on_dev) and len(row0) == logits.shape[0]:
            step.choose(dec, logits, self.spec.vocab_size)
        elif any(on_dev):
            rows = [row0[i] for i, d in enumerate(on_dev) if d]
            step.choose([dec[i] for i, d in enumerate(on_dev) if d], logits[rows], self.spec.vocab_size)
        plain = [i for i, d in enumerate(on_dev) if not d and not dec[i].drafts]
        if plain:
            host += [dec[i] for i in plain]
            host_lg.append(logits[[row0[i] for i in plain]].float())   # (a copy: the graph's output buffer is rewritten next step)
        for i, s in enumerate(dec):
            if s.drafts:
                spec.append((s, pos[i], logits[row0[i]:row0[i] + 1 + len(s.drafts)].float()))
            rows = slice(row0[i], row0[i] + 1 + len(s.drafts))   # (views of the graph's buffers: read
            if s.mtp is not None:                                # before the next decode call)
                mtp_rows.append((s, pos[i], r.hidden[rows]))
            if s.dflash is not None:
                dflash_rows.append((s, pos[i], r.features[rows]))
        step.decode = {s.id for s in step.seqs}
        self._ahead = step
        return spec

    def _mtp_rows_catch_up(self, mtp_rows: list) -> None:
        """The MTP block after a GPU-path step (SpeculationMixin._mtp_catch_up). Its pool is sized to
        mirror the main pool, so running out is not expected; if it happens the sequences lose their MTP
        drafts (n-gram drafts go on), nothing else."""
        from engine.kv.pool import PoolFullError
        try:
            self._mtp_catch_up(mtp_rows)
        except PoolFullError as e:
            log.warning("MTP cache full (%s): MTP drafting stops for %d sequences", e, len(mtp_rows))
            for s, _, _ in mtp_rows:
                if s.mtp is not None:
                    if s.slot is None:
                        self._parked_mtp = {k: v for k, v in self._parked_mtp.items() if v is not s.mtp}
                    s.mtp.release()
                    s.mtp = None
            self._totals["mtp_pool_full"] += 1

    def _dflash_rows_step(self, dflash_rows: list) -> None:
        """The DFlash drafter after a GPU-path step (SpeculationMixin._dflash_step), for the sequences still
        running or parked (a finished sequence's context kept with its slot takes its last rows). Its
        contexts grow on the device beside the pool (counted per token in the fit); should the device
        still run out, the sequences lose their DFlash drafts (others go on), nothing else."""
        parked = {id(st) for st in self._parked_dflash.values()}
        rows = [(s, start, f) for s, start, f in dflash_rows if s.slot is not None or id(s.dflash) in parked]
        try:
            self._dflash_step(rows)
        except torch.OutOfMemoryError:
            log.warning("out of GPU memory for DFlash contexts: DFlash drafting stops for %d sequences", len(rows))
            for s, _, _ in rows:
                s.dflash = None
            self._parked_dflash.clear()
            self._totals["dflash_out_of_memory"] += 1

    def _device_row(self, s: _Sequence) -> bool:
        """GPU path: whether s's token of this step is chosen on the device (device_sampling and nothing
        host-only; rows with drafts are verified on the host, a drafting sequence's step without drafts
        (its drafter backed off) is not)."""
        return (self.config.device_sampling and samples_on_device(s.params, s.req.constraint)
                and not s.drafts)

    def _decode_inputs(self, dec: list[_Sequence], prev: _RunnerStep | None):
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

    def _complete_runner(self, step: _RunnerStep | None) -> None:
        """A step's device-chosen tokens on the host: stream them, check stop strings and limits, finish
        (_append_token, as for host-sampled tokens). Sequences finished meanwhile (a cancel) are skipped."""
        if step is None:
            return
        if self._ahead is step:
            self._ahead = None   # its rows' results are read now: they no longer run ahead
        ids = step.read()
        running = set(self._running)
        for s, tok in zip(step.seqs, ids):
            if s not in running:
                continue
            check_chosen(tok)
            if s.n_generated == 0:
                self._totals["prompt_tokens"] += s.n_prompt
            self._totals["device_sampled_tokens"] += 1
            self._append_token(s, tok, None)

    def _discard_ahead_row(self, s: _Sequence) -> None:
        """s finishes while its decode row of the running step, fed the token that finished it, is still on
        the GPU (overlap_steps): that row's result is never read. Without recurrent layers the slot is cut
        back to the tokens before it (blocks too), exactly as without overlap; a recurrent model's states
        already moved past that token, so the slot keeps it (parked one token longer)."""
        self._ahead.decode.discard(s.id)
        self._totals["discarded_rows"] += 1
        if not self.spec.recurrent_layers:
            s.n_computed -= 1
            self.runner.truncate(s.slot, s.n_computed)

    def _plan_runner(self, prev: _RunnerStep | None = None) -> tuple[list[_Sequence], list[tuple[_Sequence, int, int]]]:
        """The runner step's rows: the generating sequences (one decode row each, at position n_computed),
        and (sequence, lo, hi) prompt chunks in arrival order while the step's token budget lasts. A sequence
        back from a pre-emption reads all its tokens but the last as prompt chunks again. A sequence whose
        token from prev is not read yet gets no row when that token will end it by max_tokens or the
        context limit."""
        budget = max(self.config.step_tokens, len(self._running))
        pc = self.config.prefill_chunk
        pend = prev.row if prev is not None else {}
        dec = [s for s in self._running if s.n_computed >= s.target and not (
            s.id in pend and (s.n_generated + 1 >= s.params.max_tokens or len(s.tokens) + 1 >= self.ctx_size))]
        rows = len(dec)
        budget -= rows
        drafting = 0
        for s in dec:   # drafts (spec_active): rows after the sequence's own, while graphs have room
            s.drafts, s.draft_q, s.draft_src = [], None, ""
            if (s.drafter is not None or s.mtp is not None or s.dflash is not None) and (
                    not self.spec.recurrent_layers or drafting < RECURRENT_DRAFTERS):
                room = min(self._draft_len(s), self.ctx_size - len(s.tokens) - 1,
                           s.params.max_tokens - s.n_generated - 1, RUNNER_MAX_ROWS - rows, max(0, budget),
                           self.runner.draft_room(s.n_computed))
                s.drafts, s.draft_q, s.draft_src = self._take_drafts(s, room)
                rows += len(s.drafts)
                budget -= len(s.drafts)
                drafting += bool(s.drafts)
        budget = max(budget, pc)   # (room for one whole chunk beside the decode rows and drafts)
        chunks = []
        paced = None   # whether this step may take chunks after a request's first (engine/pacing.py)
        for s in self._running:
            if s.n_computed < s.target:
                lo = s.n_computed
                hi = min((lo // pc + 1) * pc, s.target)   # chunks end at fixed positions after a reused prefix
                if s.vision is not None:
                    hi = s.vision.chunk_end(lo, hi)       # an image attended both ways is never cut
                if hi - lo > budget and rows and (chunks or hi - lo <= pc):
                    continue   # (a chunk longer than a step's room, a Gemma image read whole, still goes beside
                    # the decode rows as the step's first chunk: else it waits for every other agent to finish)
                if dec and lo > s.cached:
                    paced = self._pacer.allow() if paced is None else paced
                    if not paced:
                        continue
                chunks.append((s, lo, hi))
                budget -= hi - lo
                rows += hi - lo
        return dec, chunks

    def _make_room(self, dec: list, chunks: list, drain: bool = False) -> tuple[list, list] | None:
        """Free the KV blocks a runner step needs before it runs: evict parked conversations (least
        recently used first), then pre-empt the newest running sequence (_preempt: recomputed later);
        a sequence that cannot fit even alone stops with reason "length". Returns the step's rows
        without the pre-empted ones; with drain, None instead of evicting anything (the caller reads the
        previous step's tokens first)."""
        r = self.runner
        while True:
            need = sum(r.blocks_needed(s.slot, s.n_computed, s.n_computed + 1 + len(s.drafts)) for s in dec)
            need += sum(r.blocks_needed(s.slot, lo, hi) for s, lo, hi in chunks)
            if need <= r.pool.n_free:
                return dec, chunks
            if drain:
                return None
            if self._evict_parked():
                continue
            if len(self._running) <= 1:   # (not expected: one sequence's context is at most the pool)
                for s in list(self._running):
                    log.warning("KV pool full: request %d stopped at %d tokens", s.id, len(s.tokens))
                    self._totals["pool_full_stops"] += 1
                    self._finish(s, "length")
                return [], []
            victim = max(self._running, key=lambda q: (q.t_start or 0, q.id))
            self._preempt(victim)
            dec = [s for s in dec if s is not victim]
            chunks = [c for c in chunks if c[0] is not victim]

    def _evict_parked(self) -> bool:
        """Drop the least recently used parked conversation (GPU path): its slot is free, its blocks go back
        to the pool unless another slot shares them. False when none is parked."""
        if not self._parked:
            return False
        slot, _ = self._parked.popitem(last=False)
        self._drop_parked_drafters(slot)
        self.runner.release(slot)
        self._free_slots.append(slot)
        self._totals["parked_evicted"] += 1
        return True

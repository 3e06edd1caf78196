"""The Engine: one thread owns the model; requests go in through submit(), events come out of
each request's handle.

Every step stacks the rows of all running sequences into one forward pass: a decode token for
each sequence that is generating, and the next chunk of each prompt still being read, within a
token budget. So several requests progress together and a long prompt never blocks the others.
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass

import torch

from engine.catalog import ensure_model
from engine.chat_template import ChatTemplate, ChatTemplateError
from engine.models import open_model
from engine.models.common import SeqChunk
from engine.sampling import Sampler, SamplingParams, StopChecker
from engine.tokenizer import StreamDecoder, Tokenizer
from engine.types import (ContextTooLongError, EngineError, FinishEvent, QueueFullError, Request, Timings,
                          TokenEvent, Usage)

log = logging.getLogger("hivejet.engine")


@dataclass
class EngineConfig:
    model: str                      # a GGUF path or a catalog name ("demo", "gemma3-270m")
    device: str = "cpu"
    max_seqs: int = 16              # sequences advanced together in one step
    ctx_size: int = 0               # context per sequence; 0 = the model's training context
    step_tokens: int = 512          # rows per step: decode rows first, prompt chunks fill the rest
    prefill_chunk: int = 256        # prompts are cut at multiples of this, whatever else is running,
                                    # so a sequence's numbers do not depend on its neighbours
    max_queue: int = 256            # waiting requests beyond this are refused
    threads: int = 0                # torch CPU threads; 0 = torch's default


def default_threads() -> int:
    """CPU threads for torch: all cores but one. A core left for the UI, the HTTP server and the
    rest of the machine matters: when another process takes a core, OpenMP's barrier waits stall a
    fully subscribed torch (measured on 2 cores: 0.2 s per demo-model token with 1 thread under load,
    2-19 s with 2)."""
    return max(1, (os.cpu_count() or 2) - 1)


class RequestHandle:
    """Iterate to receive TokenEvents and one final FinishEvent. cancel() stops the request; the
    engine frees its memory at the next step and sends FinishEvent(reason="cancelled")."""

    def __init__(self, rid: int, n_prompt: int):
        self.id = rid
        self.n_prompt = n_prompt
        self._events: queue.Queue = queue.Queue()
        self._cancelled = threading.Event()
        self.finish: FinishEvent | None = None

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def _put(self, ev) -> None:
        self._events.put(ev)

    def __iter__(self):
        while True:
            ev = self._events.get()
            if isinstance(ev, FinishEvent):
                self.finish = ev
                yield ev
                return
            yield ev

    def result(self) -> tuple[str, list[int], FinishEvent]:
        """Block until done; returns (text, token ids, finish event)."""
        text, ids, fin = [], [], None
        for ev in self:
            if isinstance(ev, TokenEvent):
                text.append(ev.text)
                ids.extend(ev.ids)
            else:
                fin = ev
        return "".join(text), ids, fin


class _Sequence:
    def __init__(self, rid: int, req: Request, prompt_ids: list[int], handle: RequestHandle,
                 tokenizer: Tokenizer, vocab_size: int, kv):
        self.id = rid
        self.req = req
        self.params: SamplingParams = req.sampling
        self.handle = handle
        self.tokens = list(prompt_ids)       # prompt then generated tokens
        self.n_prompt = len(prompt_ids)
        self.n_computed = 0                  # tokens whose KV is stored
        self.kv = kv
        self.sampler = Sampler(req.sampling, vocab_size)
        self.stopper = StopChecker(req.sampling.stop)
        self.decoder = StreamDecoder(tokenizer)
        self.t_submit = time.monotonic()
        self.t_start: float | None = None
        self.t_first: float | None = None
        self.recent = collections.deque()    # (time, tokens) for tok/s over the last seconds

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - self.n_prompt

    def state(self) -> str:
        if self.t_start is None:
            return "queued"
        if self.n_generated == 0:
            return f"prefill {100 * self.n_computed // max(self.n_prompt, 1)}%"
        return "decoding"

    def tok_per_s(self, now: float, window: float = 5.0) -> float:
        while self.recent and now - self.recent[0][0] > window:
            self.recent.popleft()
        if not self.recent:
            return 0.0
        span = max(now - self.recent[0][0], 1e-3)
        return sum(n for _, n in self.recent) / span if len(self.recent) > 1 else 0.0


class Engine:
    def __init__(self, config: EngineConfig, progress=None):
        self.config = config
        if config.device != "cpu":
            raise EngineError(f"device {config.device!r} is not supported yet (the GPU path is a later issue); use cpu")
        torch.set_num_threads(config.threads or default_threads())
        path = ensure_model(config.model, progress=progress or (lambda *_: None))
        self.model = open_model(path)
        self.model_path = path
        md = self.model.file.metadata
        try:
            self.tokenizer = Tokenizer.from_metadata(md)
        except ValueError as e:
            self.model.close()
            raise EngineError(f"{path}: {e}") from None
        tok = self.tokenizer
        bos = tok.decode([tok.bos_id]) if tok.bos_id is not None else ""
        eos = tok.decode([tok.eos_id]) if tok.eos_id is not None else ""
        self.template = ChatTemplate(md.get("tokenizer.chat_template"), bos_token=bos, eos_token=eos)
        self.spec = self.model.spec
        self.ctx_size = config.ctx_size or self.spec.context_length
        self.model_name = md.get("general.name") or path.stem
        self._ids = itertools.count(1)
        self._inbox: queue.Queue = queue.Queue()
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._running: list[_Sequence] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._totals = collections.Counter()
        self._last_step = {"rows": 0, "seqs": 0, "ms": 0.0}
        self._thread = threading.Thread(target=self._loop, name="hivejet-engine", daemon=True)
        self._thread.start()

    # ----- the contract -----
    def submit(self, req: Request) -> RequestHandle:
        """Validate and tokenize now (errors raise here, in the caller's thread); generation runs
        on the engine thread."""
        if self._stop.is_set():
            raise EngineError("the engine is shut down")
        req.sampling.validate(self.spec.vocab_size)
        ids = self.prompt_ids(req)
        if not ids:
            raise EngineError("the prompt is empty")
        if len(ids) >= self.ctx_size:
            raise ContextTooLongError(len(ids), self.ctx_size)
        if self._inbox.qsize() + len(self._waiting) >= self.config.max_queue:
            raise QueueFullError(f"too many waiting requests ({self.config.max_queue}); try again later")
        rid = next(self._ids)
        handle = RequestHandle(rid, len(ids))
        seq = _Sequence(rid, req, ids, handle, self.tokenizer, self.spec.vocab_size, self.model.new_kv())
        self._inbox.put(seq)
        return handle

    def prompt_ids(self, req: Request) -> list[int]:
        given = [x for x in (req.messages, req.prompt, req.prompt_ids) if x is not None]
        if len(given) != 1:
            raise EngineError("give exactly one of messages, prompt or prompt_ids")
        if req.prompt_ids is not None:
            bad = [t for t in req.prompt_ids if not isinstance(t, int) or not 0 <= t < self.spec.vocab_size]
            if bad:
                raise EngineError(f"prompt_ids holds ids outside the vocabulary (0..{self.spec.vocab_size - 1}): {bad[:5]}")
            return list(req.prompt_ids)
        if req.prompt is not None:
            return self.tokenizer.encode(req.prompt, add_special=True, parse_special=True)
        text = self.render_chat(req.messages, req.add_generation_prompt, req.tools, **req.template_kwargs)
        ids = self.tokenizer.encode(text, add_special=True, parse_special=True)
        bos = self.tokenizer.bos_id
        if len(ids) > 1 and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]  # the template wrote BOS itself; do not double it
        return ids

    def render_chat(self, messages, add_generation_prompt=True, tools=None, **kw) -> str:
        try:
            return self.template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kw)
        except ChatTemplateError as e:
            raise EngineError(f"chat template: {e}") from None

    def stats(self) -> dict:
        now = time.monotonic()
        with self._lock:
            running = list(self._running)
            waiting = list(self._waiting)
        seqs = []
        for s in running:
            seqs.append(dict(id=s.id, session=s.req.session, state=s.state(), context=len(s.tokens),
                             ctx_limit=self.ctx_size, prompt_tokens=s.n_prompt, generated=s.n_generated,
                             cached_tokens=0, tok_per_s=round(s.tok_per_s(now), 2), queue_position=None))
        for i, s in enumerate(waiting):
            seqs.append(dict(id=s.id, session=s.req.session, state="queued", context=len(s.tokens),
                             ctx_limit=self.ctx_size, prompt_tokens=s.n_prompt, generated=0,
                             cached_tokens=0, tok_per_s=0.0, queue_position=i + 1))
        return dict(model=self.model_name, path=str(self.model_path), arch=self.spec.arch, device=self.config.device,
                    ctx_size=self.ctx_size, running=len(running), waiting=len(waiting) + self._inbox.qsize(),
                    sequences=seqs, last_step=dict(self._last_step), totals=dict(self._totals))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout)
        self.model.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # ----- the engine thread -----
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._admit(block=not self._running and not self._waiting)
            self._drop_cancelled()
            if not self._running:
                continue
            try:
                self._step()
            except Exception as e:  # a failed step must not kill the engine or hang clients
                log.exception("step failed")
                for s in list(self._running):
                    self._finish(s, "error", error=f"{type(e).__name__}: {e}")
        for s in list(self._running) + list(self._waiting):
            self._finish(s, "cancelled", error="engine shut down")

    def _admit(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
        except queue.Empty:
            item = None
        while item is not None:
            with self._lock:
                self._waiting.append(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                item = None
        with self._lock:
            while self._waiting and len(self._running) < self.config.max_seqs:
                s = self._waiting.popleft()
                s.t_start = time.monotonic()
                self._running.append(s)

    def _drop_cancelled(self) -> None:
        for s in [s for s in self._running + list(self._waiting) if s.handle.cancelled]:
            self._finish(s, "cancelled")

    def _plan(self) -> list[tuple[_Sequence, SeqChunk]]:
        """Decode rows for every generating sequence, then prompt chunks in arrival order."""
        budget = max(self.config.step_tokens, len(self._running))
        plan = []
        for s in self._running:
            if s.n_computed >= s.n_prompt:  # generating: feed the last sampled token
                plan.append((s, SeqChunk(torch.tensor(s.tokens[s.n_computed:]), s.n_computed, s.kv, "last")))
                budget -= 1
        for s in self._running:
            if s.n_computed < s.n_prompt:
                n = min(self.config.prefill_chunk, s.n_prompt - s.n_computed)
                if n > budget and plan:
                    continue  # waits for a step with room; chunks are never cut differently
                last = s.n_computed + n == s.n_prompt
                chunk = SeqChunk(torch.tensor(s.tokens[s.n_computed:s.n_computed + n]), s.n_computed, s.kv,
                                 "last" if last else "none")
                plan.append((s, chunk))
                budget -= n
        return plan

    def _step(self) -> None:
        t0 = time.monotonic()
        plan = self._plan()
        logits = self.model.forward([c for _, c in plan])
        rows = sum(len(c.tokens) for _, c in plan)
        for (s, c), lg in zip(plan, logits):
            s.n_computed = c.start + len(c.tokens)
            if s.n_computed == s.n_prompt and s.n_generated == 0:
                self._totals["prompt_tokens"] += s.n_prompt
            if lg.shape[0]:
                self._on_logits(s, lg[-1])
        self._last_step = {"rows": rows, "seqs": len(plan), "ms": round(1000 * (time.monotonic() - t0), 2)}
        self._totals["steps"] += 1

    def _on_logits(self, s: _Sequence, logits: torch.Tensor) -> None:
        p = s.params
        constraint = s.req.constraint
        if constraint is not None:
            raw = logits
            logits = logits.clone()
            constraint.mask(logits)
            tok, _ = s.sampler.sample_with_logprobs(logits, s.tokens)
            lp = s.sampler.logprob_of(raw, tok) if p.logprobs is not None else None
            constraint.accept(tok)
        else:
            tok, lp = s.sampler.sample_with_logprobs(logits, s.tokens)
        now = time.monotonic()
        if s.t_first is None:
            s.t_first = now
        s.recent.append((now, 1))
        self._totals["generated_tokens"] += 1
        is_eog = (tok in self.tokenizer.eog_ids and not p.ignore_eos) or tok in p.stop_token_ids
        if is_eog:
            s.tokens.append(tok)
            self._emit_text(s, s.decoder.flush() + s.stopper.flush(), [], None)
            self._finish(s, "stop")
            return
        s.tokens.append(tok)
        text, stopped = s.stopper.feed(s.decoder.push(tok))
        self._emit_text(s, text, [tok], [lp] if lp is not None else None)
        if stopped or (constraint is not None and constraint.is_done()):
            if not stopped:
                self._emit_text(s, s.stopper.feed(s.decoder.flush())[0] + s.stopper.flush(), [], None)
            self._finish(s, "stop")
        elif s.n_generated >= p.max_tokens or len(s.tokens) >= self.ctx_size:
            self._emit_text(s, s.stopper.feed(s.decoder.flush())[0] + s.stopper.flush(), [], None)
            self._finish(s, "length")

    @staticmethod
    def _emit_text(s: _Sequence, text: str, ids: list[int], lps) -> None:
        if text or ids:
            s.handle._put(TokenEvent(text=text, ids=ids, logprobs=lps))

    def _finish(self, s: _Sequence, reason: str, error: str | None = None) -> None:
        with self._lock:
            if s in self._running:
                self._running.remove(s)
            elif s in self._waiting:
                self._waiting.remove(s)
            else:
                return
        s.kv = None  # frees the sequence's KV now
        now = time.monotonic()
        t_first = s.t_first or now
        n_gen = s.n_generated
        prompt_s = max(t_first - (s.t_start or s.t_submit), 1e-9)
        decode_s = max(now - t_first, 1e-9)
        timings = Timings(queued_ms=1000 * ((s.t_start or now) - s.t_submit), prompt_ms=1000 * prompt_s,
                          decode_ms=1000 * decode_s, prompt_tokens_per_s=s.n_computed / prompt_s if s.t_first else 0.0,
                          decode_tokens_per_s=(n_gen - 1) / decode_s if n_gen > 1 else 0.0)
        usage = Usage(prompt_tokens=s.n_prompt, completion_tokens=n_gen)
        s.handle._put(FinishEvent(reason=reason, usage=usage, timings=timings, error=error))

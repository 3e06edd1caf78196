"""The Engine: one thread owns the model; requests go in through submit(), events come out of
each request's handle.

Every step stacks the rows of all running sequences into one forward pass: a decode token for
each sequence that is generating, and the next chunk of each prompt still being read, within a
token budget. So several requests progress together and a long prompt never blocks the others.

This module holds the contract (EngineConfig, submit, the handles, stats) and the Engine, which ties
objects with one job each: the Scheduler (engine/scheduler.py: each step's rows as a StepPlan, room in the
KV pool, pre-emption), the step's executor (engine/step_cpu.py on the CPU path, engine/step_runner.py on
the runner's slots, engine/slots.py), and the Speculator (engine/spec/speculator.py: the drafters, their
drafts and verification). The Engine admits requests, runs the loop, streams tokens and finishes requests.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass

import torch

from engine.catalog import ensure_model
from engine.chat_template import ChatTemplate, ChatTemplateError, fallback_for
from engine.gguf.reader import GGUFError
from engine.models import open_model
from engine.pacing import PrefillPacer, StepClock
from engine.planner import auto_prefill_chunk
from engine.hostmem import kv_memory_tokens
from engine.prefix import Entry, ResidentCache, add_checkpoint
from engine.runner_fit import RunnerFit
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.slots import SlotTable
from engine.spec import SPEC_MODES
from engine.spec.speculator import Speculator, acceptance_by_drafter
from engine.step_cpu import CpuExecutor
from engine.step_runner import RunnerExecutor
from engine.sampling import StopChecker
from engine.tokenizer import Tokenizer
from engine.types import (DEFAULT_MAX_SEQS, ContextTooLongError, EngineError, FinishEvent, KVPoolTooSmallError,
                          QueueFullError, Request, Timings, TokenEvent, Usage)

log = logging.getLogger("hivejet.engine")


@dataclass
class EngineConfig:
    model: str                      # a GGUF path or a catalog name ("demo", "gemma3-270m")
    device: str = "cpu"             # cpu, cuda[:N], or auto: cuda when torch sees a GPU (every KV cache
                                    # type, images too), else cpu
    max_seqs: int = DEFAULT_MAX_SEQS  # sequences advanced together in one step
    ctx_size: int = 0               # context per sequence at most; 0 = the model's training context (GPU
                                    # path: also at most the KV pool, which all sequences share)
    step_tokens: int = 512          # rows per step: decode rows first, prompt chunks fill the rest (a step
                                    # always has room for one whole chunk beside its decode rows)
    prefill_chunk: int = 0          # prompts are cut at multiples of this, whatever else is running,
                                    # so a sequence's numbers do not depend on its neighbours; 0: auto
                                    # (engine/planner.py: auto_prefill_chunk, larger on a GPU with memory to spare)
    max_queue: int = 256            # waiting requests beyond this are refused
    threads: int = 0                # torch CPU threads; 0 = torch's default
    cache_type_k: str = "f16"       # KV cache types (kernels/kvcodec: f16, q8_0, turbo4, turbo3_tcq, ...)
    cache_type_v: str = "f16"
    mmproj: str | None = None       # vision projector GGUF (image input); "auto": the mmproj beside the model
    spec: str = "off"               # speculative decoding (CPU and GPU paths alike): "off", "ngram"
                                    # (prompt lookup), "mtp" (Qwen3.5/3.6's own MTP block, when the GGUF has it),
                                    # "dflash" (a DFlash drafter, spec_drafter), or the chains "mtp+ngram"
                                    # and "dflash+ngram" (SPEC_MODES)
    spec_drafter: str | None = None  # the DFlash drafter: a directory (config.json + model.safetensors, as
                                    # z-lab publishes them) or its GGUF port
    spec_max_drafts: int = 8        # draft rows per sequence and step at most (adapted per sequence)
    spec_adaptive: bool = True      # draft length from measured acceptance and step/drafter costs, backing
                                    # off when drafts do not pay (engine/spec/adaptive.py); False: from
                                    # acceptance only (doubling after a fully accepted step, else accepted + 1)
    spec_ngram_min_match: int = 4   # chains: a step takes the n-gram drafts instead of the model drafter's
                                    # when the conversation's suffix repeats an earlier span this long
    kv_memory: int = 0              # bytes the KV cache may use on the CPU (0: a quarter of the RAM), either
                                    # path (static slots: the shared pool's size, at most max_seqs x ctx_size);
                                    # when full: resident conversations are evicted, then the newest request
                                    # waits (its KV recomputed later)
    resident_tokens: int = 32768    # tokens of finished conversations kept for follow-ups and shared
                                    # prefixes (both paths); 0 turns prefix reuse off
    static_slots: bool = False      # step through engine/runner/runner.py (what device="cuda" does) on any device;
                                    # on the CPU this tests the GPU path's scheduling without a GPU
    ctx_pool_tokens: int = 0        # GPU path: tokens of the one KV pool all sequences share (one may use
                                    # it all); 0: as much as fits in 90 % of the GPU memory left after the
                                    # weights and per-slot state (static slots on the CPU: what kv_memory
                                    # holds, at most max_seqs x ctx_size)
    state_checkpoints: int = -1     # GPU path, recurrent models (qwen35): snapshots of a slot's recurrent
                                    # states at prompt chunk ends, so other requests can share shorter
                                    # prefixes (and a regenerated or edited reply, or a follow-up whose
                                    # history lost the last reply's reasoning, reads only the rest); -1: as
                                    # many as fit in 2 % of the KV cache (in host memory: up to 32 in an
                                    # eighth of the RAM, at most 4 GiB), 0: none
    checkpoint_memory: str = "auto"  # where those snapshots live on a GPU: "device", "host" (pinned RAM; a
                                    # save or restore is a PCIe copy) or "auto": the host when fewer than
                                    # 8 fit in the device's 2 % (a 24 GiB card: none for the 27B)
    device_sampling: bool = True    # GPU path: requests with nothing host-only (greedy or temperature with
                                    # top-k/top-p/min-p; no penalties, logit bias, grammar, logprobs) get their
                                    # tokens chosen on the device (engine/sample_device.py); only the ids come
                                    # back. False: every row's logits go to the host Sampler
    prefill_share: float = 0.5      # GPU path: while sequences generate, a prompt's chunks after its first
                                    # take about this share of the time (engine/pacing.py); 1: no pacing
    shared_prompt_passes: bool = True   # GPU path: the short prompts of requests arriving together read in one
                                    # pass (Runner.prefill_pieces: 16 agents' first tokens 2.3x sooner on the
                                    # 27B); its graphs take ~395 MiB there, kept out of the KV pool; False
                                    # leaves that memory to the KV cache
    overlap_steps: bool = True      # GPU path, with device_sampling: launch step N+1 (its input tokens are
                                    # step N's ids, on the device) before streaming step N's tokens, so the
                                    # host work runs while the GPU computes; same outputs (docs/ARCHITECTURE.md)


CHECKPOINT_MEMORY = ("auto", "device", "host")   # EngineConfig.checkpoint_memory


def resolve_auto_device(config: EngineConfig) -> str:
    """device="auto": the GPU path when torch sees a CUDA GPU (it serves every configuration: every KV
    cache type, K and V alike or not, images), else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _checked_config(config: EngineConfig) -> EngineConfig:
    """config with device "auto" resolved and an automatic prefill_chunk where it is settled before the model
    loads (the CPU, a given pool size); EngineError for a value out of range or a device torch does not see."""
    if config.device == "auto":
        config = dataclasses.replace(config, device=resolve_auto_device(config))
    if config.prefill_chunk < 0:
        raise EngineError(f"prefill_chunk {config.prefill_chunk}: a positive number of tokens, or 0 (auto)")
    if config.checkpoint_memory not in CHECKPOINT_MEMORY:
        raise EngineError(f"checkpoint_memory {config.checkpoint_memory!r}: one of {', '.join(CHECKPOINT_MEMORY)}")
    if config.prefill_chunk == 0 and (config.device == "cpu" or config.ctx_pool_tokens):
        config = dataclasses.replace(config, prefill_chunk=auto_prefill_chunk(None))
    if config.device not in ("cpu", "cuda") and not config.device.startswith("cuda:"):
        raise EngineError(f"unknown device {config.device!r} (cpu or cuda)")
    if config.device != "cpu" and not torch.cuda.is_available():
        raise EngineError(f"device {config.device!r} asked for, but torch sees no CUDA GPU")
    return config


def _has_image_parts(messages) -> bool:
    from engine.vision.prompt import has_image_parts
    return has_image_parts(messages)


def default_threads() -> int:
    """CPU threads for torch and the CPU path's matmul kernels (kernels/quant/intdot_numba.py follows torch's
    count): all cores. The CPU path's decode step is the integer matmuls, which spread a step's weights over the
    threads, and every core's share of the memory bandwidth counts; the UI, the HTTP server and the rest of the
    machine get a core back between steps. A busy machine is where fewer threads can win (a thread that waits on
    a descheduled one loses its time slice): `-t` / Settings' threads set the count
    (docs/decisions/cpu-matmul.md has the measurements)."""
    return max(1, os.cpu_count() or 1)


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


class Engine:
    """Requests in (submit), tokens out (each request's handle), one engine thread stepping the running
    sequences: self.scheduler plans a step, self.executor runs it, self.speculator drafts and verifies."""

    def __init__(self, config: EngineConfig, progress=None):
        config = _checked_config(config)
        self.config = config   # (a GPU fitting its pool picks an automatic prefill_chunk once the weights are on it)
        try:
            self._pacer = PrefillPacer(config.prefill_share)    # (the GPU path's prompt chunks)
        except ValueError as e:
            raise EngineError(str(e)) from None
        torch.set_num_threads(config.threads or default_threads())
        path = ensure_model(config.model, progress=progress or (lambda *_: None))
        self.model = open_model(path)
        try:
            self.model.set_cache_types(config.cache_type_k, config.cache_type_v)
        except ValueError as e:
            self.model.close()
            raise EngineError(str(e)) from None
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
        fallback = fallback_for(lambda t: len(tok.encode(t, add_special=False, parse_special=True)) == 1)
        self.template = ChatTemplate(md.get("tokenizer.chat_template"), bos_token=bos, eos_token=eos,
                                     fallback=fallback)
        if self.template.is_fallback:
            log.warning("%s has no chat template: chats use the %s fallback template (ending a reply at %s)",
                        path.name, fallback, " or ".join(self.template.stop_strings))
        self.spec = self.model.spec
        self.vision = None            # engine.vision.VisionEncoder when a projector is loaded
        self._image_format = None
        self._embed_cache: collections.OrderedDict = collections.OrderedDict()
        if config.mmproj:
            self._open_vision(config.mmproj, path)
        self.ctx_size = config.ctx_size or self.spec.context_length
        if config.spec not in SPEC_MODES:
            self.model.close()
            raise EngineError(f"unknown speculative decoding mode {config.spec!r} ({', '.join(SPEC_MODES)})")
        kinds = set(config.spec.split("+")) - {"off"}
        if "mtp" in kinds and getattr(self.model, "mtp", None) is None:
            self.model.close()
            raise EngineError(f"{path.name} has no MTP (NextN) block: use --spec ngram or off")
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._running: list[Sequence] = []
        self._totals = collections.Counter()
        self.speculator = Speculator(config, self.model, kinds, self._running, self._totals, self._append_token,
                                     self.ctx_size)
        self.runner = None            # engine/runner/runner.py: the GPU path (static KV/state slots, CUDA graphs)
        self.slots = None             # engine/slots.py: the runner's free and parked slots
        self._resident = ResidentCache(config.resident_tokens)
        self._pool_tokens = None      # the CPU pool's token limit (None on the GPU path)
        if "dflash" in kinds:
            self.speculator.open_dflash(config.spec_drafter)   # (before the GPU path's graphs: they keep its features)
        if config.device != "cpu" or config.static_slots:
            self._open_runner()
        if self.runner is None:
            pool = self.model.kv_pool()
            if pool.groups:   # (a model with no attention layers has no KV to limit)
                pool.set_limit(kv_memory_tokens(config.kv_memory, pool.bytes_per_token()))
                self._pool_tokens = pool.max_tokens
        self._open_core()
        self.model_name = md.get("general.name") or path.stem
        self._ids = itertools.count(1)
        self._inbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hivejet-engine", daemon=True)
        self._thread.start()

    def _open_vision(self, mmproj: str, model_path) -> None:
        from engine.vision import check_pair, find_mmproj, open_mmproj
        from engine.vision.prompt import FORMATS
        if mmproj == "auto":
            found = find_mmproj(model_path)
            if found is None:
                log.info("no mmproj file beside %s: images are not available", model_path)
                return
            mmproj = str(found)
        try:
            self.vision = open_mmproj(mmproj, device=self.config.device)
            check_pair(self.vision, self.spec.arch, self.spec.n_embd)
            self._image_format = FORMATS[self.vision.projector](self.tokenizer)
        except (GGUFError, ValueError) as e:
            if self.vision is not None:
                self.vision.close()
                self.vision = None
            self.model.close()
            raise EngineError(f"vision projector: {e}") from None
        log.info("vision projector %s (%s, %.1fM params)", mmproj, self.vision.projector, self.vision.n_params / 1e6)

    def _open_runner(self) -> None:
        """The GPU path (static slots on the CPU too): the runner with its memory fit (engine/runner_fit.py),
        the MTP block over its slots, the step clock for prompt-chunk pacing, the CUDA graphs and the
        slot table. The fit may pick an automatic prefill_chunk (self.config) and caps the context at the
        pool."""
        fit = RunnerFit(self.config, self.model, self.speculator, self.vision, self._image_format,
                        self.EMBED_CACHE_BYTES)
        self.runner = fit.open()
        self.config = self.speculator.config = fit.config
        self.speculator.runner = self.runner
        self.ctx_size = self.speculator.ctx_size = min(self.ctx_size, self.runner.max_ctx)
        dev = torch.device(self.config.device)
        self.speculator.open_mtp(self.runner, fit.cache_types())
        self._clock = StepClock(self._pacer, dev)
        fit.capture()
        self.slots = SlotTable(self.runner, self.config.max_seqs, self.speculator)

    def _open_core(self) -> None:
        """The Scheduler and the executor of the path the engine runs. Pre-empting and stopping go back to
        the engine, which owns the queue and finishing (late-bound: a test may wrap _preempt)."""
        c = self.config
        common = dict(step_tokens=c.step_tokens, prefill_chunk=c.prefill_chunk, ctx_size=self.ctx_size,
                      drafts=self.speculator, preempt=lambda s: self._preempt(s),
                      stop=lambda s: self._finish(s, "length"), totals=self._totals)
        encode = self._encode_images if self.vision is not None else None
        if self.runner is not None:
            self.scheduler = Scheduler(self._running, runner=self.runner, slots=self.slots, pacer=self._pacer,
                                       **common)
            self.executor = RunnerExecutor(self.runner, c, self.spec, scheduler=self.scheduler,
                                           speculator=self.speculator, slots=self.slots, running=self._running,
                                           totals=self._totals, on_logits=self._on_logits,
                                           append_token=self._append_token, encode_images=encode, clock=self._clock)
        else:
            self.scheduler = Scheduler(self._running, kv_pool=self.model.kv_pool(), pool_tokens=self._pool_tokens,
                                       resident=self._resident, **common)
            self.executor = CpuExecutor(self.model, scheduler=self.scheduler, speculator=self.speculator,
                                        resident=self._resident, running=self._running, totals=self._totals,
                                        on_logits=self._on_logits, encode_images=encode)

    @property
    def spec_active(self) -> set[str]:
        """The drafters that draft (the spec mode's: n-gram, MTP, DFlash)."""
        return self.speculator.active

    @property
    def has_vision(self) -> bool:
        """True when a vision projector is loaded: requests may carry images."""
        return self.vision is not None

    supports_images = has_vision

    def no_vision_reason(self) -> str:
        return (f"the loaded model ({self.model_name}) cannot see images: no vision projector (mmproj file) "
                "is loaded with it")

    # ----- the contract -----
    def submit(self, req: Request) -> RequestHandle:
        """Validate and tokenize now (errors raise here, in the caller's thread); generation runs
        on the engine thread. Images are decoded, checked and resized here too (a bad one raises
        engine.vision.ImageError, a ValueError); they are encoded on the engine thread."""
        if self._stop.is_set():
            raise EngineError("the engine is shut down")
        req.sampling.validate(self.spec.vocab_size)
        ids, vision = self._tokenize(req)
        if not ids:
            raise EngineError("the prompt is empty")
        r = self.runner
        if r is not None and len(ids) >= r.max_ctx < (self.config.ctx_size or self.spec.context_length):
            raise KVPoolTooSmallError(len(ids), r.max_ctx, r.device.type)   # the pool, not the context, is the limit
        if len(ids) >= self.ctx_size:
            raise ContextTooLongError(len(ids), self.ctx_size)
        if self._pool_tokens is not None and len(ids) >= self._pool_tokens:
            raise EngineError(f"the prompt has {len(ids)} tokens but the KV cache memory holds {self._pool_tokens} "
                              f"(raise kv_memory / --kv-memory, or use a smaller KV cache type)")
        if self._inbox.qsize() + len(self._waiting) >= self.config.max_queue:
            raise QueueFullError(f"too many waiting requests ({self.config.max_queue}); try again later")
        rid = next(self._ids)
        handle = RequestHandle(rid, len(ids))
        kv = self.model.new_kv() if self.runner is None else None   # the runner keeps KV in its slots
        seq = Sequence(rid, req, ids, handle, self.tokenizer, self.spec.vocab_size, kv)
        if req.messages is not None and self.template.stop_strings:   # a fallback template's end markers
            seq.stopper = StopChecker(list(req.sampling.stop) + list(self.template.stop_strings))
        seq.vision = vision
        self._inbox.put(seq)
        return handle

    def prompt_ids(self, req: Request) -> list[int]:
        """The prompt's token ids, image tokens included (each image counted at its real size)."""
        return self._tokenize(req)[0]

    def _tokenize(self, req: Request):
        """(prompt ids, VisionPrompt or None)."""
        given = [x for x in (req.messages, req.prompt, req.prompt_ids) if x is not None]
        if len(given) != 1:
            raise EngineError("give exactly one of messages, prompt or prompt_ids")
        images = list(req.images or [])
        if images or (req.messages is not None and _has_image_parts(req.messages)):
            if self.vision is None:
                raise EngineError(self.no_vision_reason())
            if req.prompt_ids is not None:
                raise EngineError("images need messages or prompt (where the image marks go), not prompt_ids")
            return self._tokenize_with_images(req, images)
        return self._text_prompt_ids(req), None

    def _text_prompt_ids(self, req: Request) -> list[int]:
        if req.prompt_ids is not None:
            bad = [t for t in req.prompt_ids if not isinstance(t, int) or not 0 <= t < self.spec.vocab_size]
            if bad:
                raise EngineError(f"prompt_ids holds ids outside the vocabulary (0..{self.spec.vocab_size - 1}): {bad[:5]}")
            return list(req.prompt_ids)
        if req.prompt is not None:
            self._check_text_fits(req.prompt)
            return self.tokenizer.encode(req.prompt, add_special=True, parse_special=True)
        text = self.render_chat(req.messages, req.add_generation_prompt, req.tools, **req.template_kwargs)
        self._check_text_fits(text)
        ids = self.tokenizer.encode(text, add_special=True, parse_special=True)
        bos = self.tokenizer.bos_id
        if len(ids) > 1 and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]  # the template wrote BOS itself; do not double it
        return ids

    def _check_text_fits(self, text: str) -> None:
        """Refuse a prompt text that cannot fit the context before tokenizing all of it (a 30 MB body would
        take a minute of CPU and gigabytes for the token lists). No token is longer than the vocabulary's
        longest piece, so a text of more than ctx x that many characters is too long for sure; a shorter one
        whose first 8 x ctx characters already make more than ctx + 64 tokens is too (BPE merges across the cut
        change the count by a few tokens at most). Raises ContextTooLongError with a lower bound."""
        limit = self.ctx_size
        if len(text) <= 4 * limit:
            return
        self.check_prompt_chars(len(text))
        if len(text) <= 8 * limit:
            return
        head = len(self.tokenizer.encode(text[:8 * limit], add_special=False, parse_special=True))
        if head > limit + 64:
            err = ContextTooLongError(head - 64, limit)
            err.lower_bound = True
            err.args = (f"the prompt has at least {err.n_prompt} tokens but the context holds {limit}",)
            raise err

    def check_prompt_chars(self, n_chars: int) -> None:
        """Raise ContextTooLongError (with a lower bound) when a prompt of `n_chars` characters cannot fit the
        context whatever its text: no token is longer than the vocabulary's longest piece. Cheap: callers use
        it before building the prompt (the server, on a request's message texts)."""
        longest = self._longest_piece()
        if n_chars > self.ctx_size * longest:
            err = ContextTooLongError(max(n_chars // longest, self.ctx_size), self.ctx_size)
            err.lower_bound = True
            err.args = (f"the prompt has at least {err.n_prompt} tokens but the context holds {self.ctx_size}",)
            raise err

    def _longest_piece(self) -> int:
        if getattr(self, "_longest", None) is None:
            tok = self.tokenizer
            self._longest = max(len(tok.token_bytes(i)) for i in range(tok.vocab_size)) or 1
        return self._longest

    def _tokenize_with_images(self, req: Request, images: list):
        from engine.vision import load_image
        from engine.vision.image import ImageError
        from engine.vision.prompt import ImageSpan, VisionPrompt, flatten_images, mrope_positions, split_images
        fmt = self._image_format
        if req.prompt is not None:
            text, sources = req.prompt, images
            if fmt.count(text) != len(sources):
                raise ImageError(f"the prompt holds {fmt.count(text)} image mark(s) for {len(sources)} image(s); "
                                 f"put {fmt.placeholder} where each image goes")
        else:
            msgs, sources = split_images(req.messages, images)
            kw = dict(add_generation_prompt=req.add_generation_prompt, tools=req.tools, **req.template_kwargs)
            try:
                text = self.render_chat(msgs, **kw)
            except EngineError:
                text = None
            if text is None or fmt.count(text) == 0:
                # a template that knows nothing of images: put the model's image mark in the text
                text = self.render_chat(flatten_images(msgs, fmt.placeholder), **kw)
            if fmt.count(text) != len(sources):
                raise ImageError(f"the chat template wrote {fmt.count(text)} image mark(s) for {len(sources)} "
                                 "image(s) (is an image in a message this template drops, or an image mark "
                                 "typed in the text?)")
        prepared = []
        for i, src in enumerate(sources):
            try:
                prepared.append(self.vision.prepare(load_image(src)))
            except ImageError as e:
                raise ImageError(f"image {i + 1}: {e}" if len(sources) > 1 else str(e)) from None
        ids = self.tokenizer.encode(fmt.before_tokenize(text), add_special=True, parse_special=True)
        bos = self.tokenizer.bos_id
        if req.messages is not None and len(ids) > 1 and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]
        ids, where = fmt.expand(ids, prepared)
        if len(where) != len(prepared):
            raise ImageError(f"found {len(where)} image mark(s) after tokenizing, for {len(prepared)} image(s)")
        spans = [ImageSpan(start, n, p.rows, p.cols, p.sha256, p) for (start, n), p in zip(where, prepared)]
        vp = VisionPrompt(spans, len(ids), bidirectional=fmt.bidirectional, embeds=[None] * len(spans))
        if fmt.mrope and self.spec.rope_sections:
            vp.positions, vp.pos_delta = mrope_positions(len(ids), spans)
        return ids, vp

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
                             cached_tokens=s.cached, tok_per_s=round(s.tok_per_s(now), 2), queue_position=None,
                             drafted=s.drafted, accepted=s.accepted,
                             acceptance=round(s.accepted / s.drafted, 3) if s.drafted else None,
                             drafters=acceptance_by_drafter(s.spec_by), images=len(s.image_hashes),
                             **self.speculator.length_stats(s)))
        for i, s in enumerate(waiting):
            seqs.append(dict(id=s.id, session=s.req.session, state="queued", context=len(s.tokens),
                             ctx_limit=self.ctx_size, prompt_tokens=s.n_prompt, generated=0,
                             cached_tokens=0, tok_per_s=0.0, queue_position=i + 1, images=len(s.image_hashes)))
        parked = self.slots.parked if self.slots is not None else {}
        vision = None
        if self.vision is not None:
            vision = dict(projector=self.vision.projector, path=str(self.vision.path),
                          n_params=self.vision.n_params)
        return dict(model=self.model_name, path=str(self.model_path), arch=self.spec.arch, device=self.config.device,
                    ctx_size=self.ctx_size, running=len(running), waiting=len(waiting) + self._inbox.qsize(),
                    sequences=seqs, last_step=dict(self.executor.last_step), totals=dict(self._totals), vision=vision,
                    prefill_pacing=dict(share=self._pacer.share, chunks_held=self._pacer.held),
                    spec=self.speculator.stats(),
                    resident=dict(conversations=len(self._resident.entries) + len(parked),
                                  tokens=self._resident.n_tokens + sum(len(t) for t in parked.values()),
                                  budget=self._resident.budget, evicted=self._resident.evicted),
                    kv_pool=self._pool_stats())

    def _pool_stats(self) -> dict | None:
        """GPU path: the shared KV pool's blocks (used, free, shared by several slots), in tokens too (what
        /metrics reports), the most tokens one sequence may hold, the blocks parked conversations keep and
        the recurrent-state checkpoints (Runner.checkpoint_stats). The CPU path: its fixed token limit, the
        tokens in use and those resident conversations hold (None for a model without attention layers)."""
        r = self.runner
        if r is None:   # the CPU path: its pool's fixed token limit and the tokens its blocks hold (resident ones too)
            if self._pool_tokens is None:
                return None
            pool = self.model.kv_pool()
            used = max((g.n_used for g in pool.groups), default=0) * pool.block_size
            return dict(path="cpu", capacity_tokens=self._pool_tokens, used_tokens=min(used, self._pool_tokens),
                        resident_tokens=self._resident.n_tokens, seq_max_tokens=self.ctx_size)
        out = r.pool_stats()
        out.update(capacity_tokens=out["tokens"], used_tokens=out["used"] * r.block_size, seq_max_tokens=r.max_ctx,
                   parked_blocks=sum(r.held(p) for p in list(self.slots.parked)), state_checkpoints=r.checkpoint_stats())
        return out

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout)
        self._resident.clear()
        if self.runner is not None and not self._thread.is_alive():   # (a step still running uses them)
            self.model.release_device()    # the device memory back at once (runner.close empties torch's
            self.speculator.close_mtp()
            self.runner.close()            # cache): a next engine sizes its KV pool to what is free
        self.model.close()
        if self.vision is not None:
            self.vision.close()

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
                if self._running and not self.scheduler.has_room(self._waiting[0]):
                    break   # waits until a running sequence finishes and frees KV
                s = self._waiting.popleft()
                s.t_start = time.monotonic()
                self.executor.admit(s, self._resident.budget > 0)   # (a slot, a reused prefix)
                if self.speculator.ok(s):
                    self.speculator.attach(s)
                self._running.append(s)

    def _preempt(self, s: Sequence) -> None:
        """Pool full: s goes back to the front of the queue and gives its KV back; it is computed again
        (prompt and generated tokens, in prompt chunks) when there is room."""
        with self._lock:
            self._running.remove(s)
            self._waiting.appendleft(s)
        if s.slot is not None:   # GPU path: the slot and its blocks go back
            self.slots.release(s.slot)
            s.slot = None
        else:
            s.kv.release()
            s.kv = self.model.new_kv()
        s.n_computed = s.cached = 0
        s.drafts = []
        if s.mtp is not None:   # (a new state when it runs again)
            s.mtp.release()
            s.mtp = None
        s.dflash = None
        s.t_start = None
        self._totals["preempted"] += 1

    def _drop_cancelled(self) -> None:
        for s in [s for s in self._running + list(self._waiting) if s.handle.cancelled]:
            self._finish(s, "cancelled")

    EMBED_CACHE_BYTES = 256 << 20   # image embeddings kept for re-sent images (a chat resends them each turn)

    def _encode_images(self) -> None:
        """Encode the images of sequences whose prompts still have to be read (on the engine
        thread, which owns the device). Same pixels, same embeddings: a small LRU by content hash."""
        for s in list(self._running):
            vp = s.vision
            if vp is None or vp.encoded or s.n_computed >= s.n_prompt:
                continue
            t0 = time.monotonic()
            try:
                for i, span in enumerate(vp.spans):
                    if vp.embeds[i] is not None:
                        continue
                    key = (span.sha256, span.rows, span.cols)
                    e = self._embed_cache.get(key)
                    if e is None:
                        e = self.vision.encode(span.image).float()
                        if e.shape[0] != span.n_tokens:
                            raise RuntimeError(f"the encoder gave {e.shape[0]} rows for {span.n_tokens} image tokens")
                        self._embed_cache[key] = e
                        self._totals["images_encoded"] += 1
                        while len(self._embed_cache) > 1 and \
                                sum(t.numel() * 4 for t in self._embed_cache.values()) > self.EMBED_CACHE_BYTES:
                            self._embed_cache.popitem(last=False)
                    else:
                        self._embed_cache.move_to_end(key)
                    vp.embeds[i] = e
                    span.image = None   # the pixels are no longer needed
            except Exception as e:  # noqa: BLE001 - one bad image must not stop the others
                log.exception("image encoding failed")
                self._finish(s, "error", error=f"image encoding failed: {type(e).__name__}: {e}")
                continue
            vp.encode_ms += 1000 * (time.monotonic() - t0)
            self._totals["image_encode_ms"] += round(1000 * (time.monotonic() - t0), 3)

    def _step(self) -> None:
        """One step: the executor runs the Scheduler's plan (engine/step_cpu.py, engine/step_runner.py)."""
        self.executor.step()

    def _on_logits(self, s: Sequence, logits: torch.Tensor) -> None:
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
        self._append_token(s, tok, lp)

    def _append_token(self, s: Sequence, tok: int, lp) -> None:
        """A sampled token: stream it, and finish the sequence on end of generation, a stop string,
        a finished grammar, max_tokens or the context limit."""
        p = s.params
        constraint = s.req.constraint
        if s.drafter is not None:
            s.drafter.extend([tok])
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
    def _emit_text(s: Sequence, text: str, ids: list[int], lps) -> None:
        if text or ids:
            s.handle._put(TokenEvent(text=text, ids=ids, logprobs=lps))

    def _finish(self, s: Sequence, reason: str, error: str | None = None) -> None:
        with self._lock:
            if s in self._running:
                self._running.remove(s)
            elif s in self._waiting:
                self._waiting.remove(s)
            else:
                return
        if s.drafter is not None:
            self.speculator.ngram_pool.add(s.tokens)   # other conversations can draft from this one
        if s.kv is not None:
            if reason != "error" and self._resident.budget > 0 and s.n_computed > 0:
                if self.spec.recurrent_layers:
                    add_checkpoint(s.checkpoints, s.kv)
                self._resident.add(s.id, Entry(s.prefix_keys(s.n_computed), s.kv, s.checkpoints))
            else:
                s.kv.release()
        s.kv = None  # the pool keeps a resident sequence's blocks; otherwise they are free now
        parked = False
        if getattr(s, "slot", None) is not None:   # GPU path: the slot parked (a follow-up may continue it) or freed
            parked = self.executor.let_go(s, keep=reason != "error" and self._resident.budget > 0)
        if s.mtp is not None and not parked:
            s.mtp.release()
            s.mtp = None
        now = time.monotonic()
        t_first = s.t_first or now
        n_gen = s.n_generated
        prompt_s = max(t_first - (s.t_start or s.t_submit), 1e-9)
        decode_s = max(now - t_first, 1e-9)
        timings = Timings(queued_ms=1000 * ((s.t_start or now) - s.t_submit), prompt_ms=1000 * prompt_s,
                          decode_ms=1000 * decode_s, prompt_tokens_per_s=s.n_computed / prompt_s if s.t_first else 0.0,
                          decode_tokens_per_s=(n_gen - 1) / decode_s if n_gen > 1 else 0.0,
                          image_encode_ms=s.vision.encode_ms if s.vision is not None else 0.0)
        usage = Usage(prompt_tokens=s.n_prompt, completion_tokens=n_gen, cached_tokens=s.cached)
        s.handle._put(FinishEvent(reason=reason, usage=usage, timings=timings, error=error,
                                  stop_string=s.stopper.matched if s.stopper.matched in s.params.stop else None))

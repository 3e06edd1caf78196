"""The Engine: one thread owns the model; requests go in through submit(), events come out of
each request's handle.

Every step stacks the rows of all running sequences into one forward pass: a decode token for
each sequence that is generating, and the next chunk of each prompt still being read, within a
token budget. So several requests progress together and a long prompt never blocks the others.
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
from engine.chat_template import ChatTemplate, ChatTemplateError
from engine.gguf.reader import GGUFError
from engine.models import open_model
from engine.models.common import SeqChunk
from engine.kv.pool import PoolFullError
from engine.prefix import Entry, ResidentCache, add_checkpoint, common_prefix
from engine.spec import SPEC_MODES
from engine.spec.adaptive import MAX_DEFERRED, DraftLength, StepCosts, choose_k, expected_tokens
from engine.spec.dflash import DFlashError, DraftRequest, load_drafter, propose
from engine.spec.mtp import CatchUp, MtpState, catch_up
from engine.spec.ngram import NgramDrafter, SharedNgramPool
from engine.spec.verify import accept_or_resample
from kernels.quant.ref import ROW_BLOCK
from engine.sample_device import check_chosen, choose_tokens, samples_on_device
from engine.sampling import Sampler, SamplingParams, StopChecker
from engine.tokenizer import StreamDecoder, Tokenizer
from engine.types import (ContextTooLongError, EngineError, FinishEvent, KVPoolTooSmallError, QueueFullError,
                          Request, Timings, TokenEvent, Usage)

log = logging.getLogger("hivejet.engine")

RUNNER_BLOCK = 16   # tokens per block of the GPU path's KV pool


@dataclass
class EngineConfig:
    model: str                      # a GGUF path or a catalog name ("demo", "gemma3-270m")
    device: str = "cpu"             # cpu, cuda[:N], or auto: cuda when there is one and the GPU path
                                    # can serve this configuration (no images, one f16/bf16/q8_0 KV type)
    max_seqs: int = 16              # sequences advanced together in one step
    ctx_size: int = 0               # context per sequence at most; 0 = the model's training context (GPU
                                    # path: also at most the KV pool, which all sequences share)
    step_tokens: int = 512          # rows per step: decode rows first, prompt chunks fill the rest
    prefill_chunk: int = 256        # prompts are cut at multiples of this, whatever else is running,
                                    # so a sequence's numbers do not depend on its neighbours
    max_queue: int = 256            # waiting requests beyond this are refused
    threads: int = 0                # torch CPU threads; 0 = torch's default
    cache_type_k: str = "f16"       # KV cache types (kernels/kvcodec: f16, q8_0, turbo4, turbo3_tcq, ...)
    cache_type_v: str = "f16"
    mmproj: str | None = None       # vision projector GGUF (image input); "auto": the mmproj beside the model
    spec: str = "off"               # speculative decoding (CPU path): "off", "ngram" (prompt lookup),
                                    # "mtp" (Qwen3.5/3.6's own MTP block, when the GGUF has it), "dflash"
                                    # (a DFlash drafter, spec_drafter), or the chains "mtp+ngram" and
                                    # "dflash+ngram" (SPEC_MODES)
    spec_drafter: str | None = None  # the DFlash drafter: a directory (config.json + model.safetensors, as
                                    # z-lab publishes them) or its GGUF port
    spec_max_drafts: int = 8        # draft rows per sequence and step at most (adapted per sequence)
    spec_adaptive: bool = True      # draft length from measured acceptance and step/drafter costs, backing
                                    # off when drafts do not pay (engine/spec/adaptive.py); False: from
                                    # acceptance only (doubling after a fully accepted step, else accepted + 1)
    spec_ngram_min_match: int = 4   # chains: a step takes the n-gram drafts instead of the model drafter's
                                    # when the conversation's suffix repeats an earlier span this long
    kv_memory: int = 0              # bytes the CPU path's KV pool may use (0: a quarter of the RAM); when
                                    # full: resident conversations are evicted, then the newest request
                                    # waits (its KV recomputed later)
    resident_tokens: int = 32768    # tokens of finished conversations kept for follow-ups and shared
                                    # prefixes (engine/prefix.py; CPU path); 0 turns prefix reuse off
    static_slots: bool = False      # step through engine/runner.py (what device="cuda" does) on any device;
                                    # on the CPU this tests the GPU path's scheduling without a GPU
    ctx_pool_tokens: int = 0        # GPU path: tokens of the one KV pool all sequences share (one may use
                                    # it all); 0: as much as fits in 90 % of the GPU memory left after the
                                    # weights and per-slot state (static slots on the CPU: max_seqs x ctx_size)
    state_checkpoints: int = -1     # GPU path, recurrent models (qwen35): snapshots of a slot's recurrent
                                    # states at prompt chunk ends, so other requests can share shorter
                                    # prefixes; -1: as many as fit in 2 % of the KV cache, 0: none
    device_sampling: bool = True    # GPU path: requests with nothing host-only (greedy or temperature with
                                    # top-k/top-p/min-p; no penalties, logit bias, grammar, logprobs) get their
                                    # tokens chosen on the device (engine/sample_device.py); only the ids come
                                    # back. False: every row's logits go to the host Sampler
    overlap_steps: bool = True      # GPU path, with device_sampling: launch step N+1 (its input tokens are
                                    # step N's ids, on the device) before streaming step N's tokens, so the
                                    # host work runs while the GPU computes; same outputs (docs/ARCHITECTURE.md)


def _default_kv_memory() -> int:
    """A quarter of the machine's RAM (8 GiB where that cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (AttributeError, ValueError, OSError):
        return 8 << 30


def resolve_auto_device(config: EngineConfig) -> str:
    """device="auto": the GPU path when torch sees a CUDA GPU and the configuration is one it serves
    (no vision projector; every KV cache type, K and V alike or not), else the CPU."""
    if not torch.cuda.is_available() or config.mmproj:
        return "cpu"
    return "cuda"


def _acceptance_by_drafter(counts) -> dict:
    """{drafter: {drafted, accepted, acceptance}} from "<drafter>_drafted" / "<drafter>_accepted" counts."""
    out = {}
    for name in ("ngram", "mtp", "dflash"):
        d, a = counts.get(f"{name}_drafted", 0), counts.get(f"{name}_accepted", 0)
        if d:
            out[name] = dict(drafted=d, accepted=a, acceptance=round(a / d, 3))
    return out


def _has_image_parts(messages) -> bool:
    from engine.vision.prompt import has_image_parts
    return has_image_parts(messages)


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
        self.vision = None                   # engine.vision.prompt.VisionPrompt when the prompt holds images
        self.slot: int | None = None         # the runner's slot (GPU path) while running
        self.cached = 0                      # prompt tokens taken from a resident/shared prefix
        self.drafter = None                  # engine.spec.ngram.NgramDrafter when speculating with n-grams
        self.mtp = None                      # engine.spec.mtp.MtpState when drafting with the MTP block
        self.dflash = None                   # engine.spec.dflash.DFlashState when drafting with DFlash
        self.drafts: list[int] = []          # this step's draft tokens (verified after the forward)
        self.draft_q = None                  # their drafter distributions [k, V] (None: one-hot drafts)
        self.draft_src = ""                  # the drafter that made them (ngram, mtp, dflash)
        self.spec_k = 0                      # current draft length (spec_adaptive=False: from acceptance only)
        self.adapt: dict[str, DraftLength] = {}   # per drafter: acceptance, next k, back-off (spec_adaptive)
        self.spec_src: str | None = None     # the drafter of its next step (for stats())
        self.drafted = self.accepted = 0     # draft tokens proposed / accepted so far
        self.spec_by = collections.Counter()  # "<drafter>_drafted" / "<drafter>_accepted" counts
        self.checkpoints: dict[int, dict] = {}   # recurrent-state snapshots by length (engine/prefix.py)

    @property
    def image_hashes(self) -> list[str]:
        """sha256 of each image's decoded pixels, in prompt order (with the image token spans in
        `vision.spans`): what a prefix cache must key on besides the token ids."""
        return self.vision.hashes if self.vision is not None else []

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - self.n_prompt

    @property
    def target(self) -> int:
        """Tokens to have in the KV before decoding: the prompt, or after a pre-emption everything but
        the last sampled token (which the next decode row feeds)."""
        return self.n_prompt if self.n_generated == 0 else len(self.tokens) - 1

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


class Engine:
    def __init__(self, config: EngineConfig, progress=None):
        if config.device == "auto":
            config = dataclasses.replace(config, device=resolve_auto_device(config))
        self.config = config
        if config.device not in ("cpu", "cuda") and not config.device.startswith("cuda:"):
            raise EngineError(f"unknown device {config.device!r} (cpu or cuda)")
        if config.device != "cpu" and not torch.cuda.is_available():
            raise EngineError(f"device {config.device!r} asked for, but torch sees no CUDA GPU")
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
        self.template = ChatTemplate(md.get("tokenizer.chat_template"), bos_token=bos, eos_token=eos)
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
        self._spec_kinds = set(config.spec.split("+")) - {"off"}
        if "mtp" in self._spec_kinds and getattr(self.model, "mtp", None) is None:
            self.model.close()
            raise EngineError(f"{path.name} has no MTP (NextN) block: use --spec ngram or off")
        self._ngram_pool = SharedNgramPool()
        self.runner = None            # engine/runner.py: the GPU path (static KV/state slots, CUDA graphs)
        self._resident = ResidentCache(config.resident_tokens)
        self._pool_tokens = None      # the CPU pool's token limit (None on the GPU path)
        if config.device != "cpu" or config.static_slots:
            self._open_runner()
        if self.runner is None:
            pool = self.model.kv_pool()
            if pool.groups:   # (a model with no attention layers has no KV to limit)
                budget = config.kv_memory or _default_kv_memory()
                pool.set_limit(max(256, budget // max(pool.bytes_per_token(), 1)))
                self._pool_tokens = pool.max_tokens
        self._dflash = None           # engine/spec/dflash.py: the DFlash drafter (CPU path only)
        self._costs = StepCosts()     # engine/spec/adaptive.py: measured step / drafting times (CPU path)
        self._draft_s = 0.0           # avoidable drafting seconds of the current step
        if self.runner is None and "dflash" in self._spec_kinds:
            self._open_dflash(config.spec_drafter)
        # the GPU path verifies no drafts yet (qwen35 would need its recurrent states per draft row):
        # say so once rather than silently decoding without them; stats() reports it too
        self.spec_active = self._spec_kinds if self.runner is None else set()
        if self.runner is not None and self._spec_kinds:
            log.warning("speculative decoding (%s) runs on the CPU path only for now: the %s path decodes "
                        "without drafts", config.spec, config.device)
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

    def _open_runner(self) -> None:
        """Put the model on the device with one slot per concurrent sequence and ONE KV pool they share:
        ctx_pool_tokens, else on a GPU as much as fits in 90 % of the memory left after the weights and
        the fixed per-slot state (too little for 256 tokens is an error), else (static slots on the CPU)
        max_seqs x the context. One sequence may use up to min(its context, the pool). Recurrent models
        also get state checkpoints for prefix sharing (state_checkpoints; by default as many as fit in
        2 % of the KV cache, which the fit leaves room for)."""
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
        ckpt_share = 0.02 if one_ckpt and c.state_checkpoints < 0 else 0.0
        try:
            if c.ctx_pool_tokens:
                pool = c.ctx_pool_tokens
            elif dev.type == "cuda":
                self.model.to_device(dev)
                free, _ = torch.cuda.mem_get_info(dev)
                pool = self._fit_pool(int(0.9 * free), want, one_ckpt * max(0, c.state_checkpoints), ckpt_share)
                if pool < 256:
                    raise EngineError(f"not enough GPU memory for the KV cache: {free / 2**30:.1f} GiB free after "
                                      f"the weights, for {c.max_seqs} sequences' state and a pool of 256 tokens")
            else:
                pool = c.max_seqs * want
            blocks = max(1, pool // RUNNER_BLOCK)
            self.runner = Runner(self.model, device=dev, n_slots=c.max_seqs, n_blocks=blocks, block_size=RUNNER_BLOCK,
                                 max_ctx=min(want, blocks * RUNNER_BLOCK), **types)
            if one_ckpt:
                n = c.state_checkpoints if c.state_checkpoints >= 0 else \
                    min(64, int(ckpt_share * self.runner.kv_bytes()) // one_ckpt)
                self.runner.enable_checkpoints(n)
        except (ValueError, torch.OutOfMemoryError) as e:
            self.model.close()
            raise EngineError(f"cannot set up the {c.device} path: {e}") from None
        except EngineError:
            self.model.close()
            raise
        self.ctx_size = min(self.ctx_size, self.runner.max_ctx)
        self._free_slots = list(range(c.max_seqs - 1, -1, -1))
        self._parked: collections.OrderedDict[int, list[int]] = collections.OrderedDict()  # slot -> its tokens
        self._inflight: _RunnerStep | None = None   # the last step, its device-chosen ids not yet read (overlap)
        self._ahead: _RunnerStep | None = None      # the step whose decode rows run ahead of the host's tokens

    def _fit_pool(self, budget: int, want: int, ckpt_bytes: int, ckpt_share: float) -> int:
        """The most pool tokens (whole blocks) that fit in `budget` bytes beside every slot's fixed state
        (recurrent states, key preconditioning sized for min(want, pool) positions, the scratch slot's
        too), the given checkpoints and a `ckpt_share` of the KV for the default checkpoints."""
        from engine.runner import slot_bytes_per_token, slot_fixed_bytes
        c = self.config
        types = dict(cache_type_k=c.cache_type_k, cache_type_v=c.cache_type_v)
        per_token = max(1, slot_bytes_per_token(self.model, **types))

        def fits(blocks: int) -> bool:
            tokens = blocks * RUNNER_BLOCK
            fixed = slot_fixed_bytes(self.model, **types, max_ctx=min(want, tokens)) * (c.max_seqs + 1)
            return (tokens + RUNNER_BLOCK) * per_token * (1 + ckpt_share) + fixed + ckpt_bytes <= budget
        lo, hi = 0, budget // (per_token * RUNNER_BLOCK) + 1       # lo fits (or is 0), hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo * RUNNER_BLOCK

    def _open_dflash(self, drafter: str | None) -> None:
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
        self._dflash = d
        self.model.capture_layers = d.cfg.target_layer_ids
        log.info("DFlash drafter %s: %d layers, blocks of %d, target layers %s", drafter, d.cfg.n_layer,
                 d.cfg.block_size, list(d.cfg.target_layer_ids))

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
        if vision is not None and self.runner is not None:
            raise EngineError("image input runs on the CPU path only for now (start the engine with device='cpu')")
        r = self.runner
        if r is not None and len(ids) >= r.max_ctx < (self.config.ctx_size or self.spec.context_length):
            raise KVPoolTooSmallError(len(ids), r.max_ctx)   # the pool, not the context, is the limit
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
        seq = _Sequence(rid, req, ids, handle, self.tokenizer, self.spec.vocab_size, kv)
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
            return self.tokenizer.encode(req.prompt, add_special=True, parse_special=True)
        text = self.render_chat(req.messages, req.add_generation_prompt, req.tools, **req.template_kwargs)
        ids = self.tokenizer.encode(text, add_special=True, parse_special=True)
        bos = self.tokenizer.bos_id
        if len(ids) > 1 and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]  # the template wrote BOS itself; do not double it
        return ids

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
                             drafters=_acceptance_by_drafter(s.spec_by), images=len(s.image_hashes),
                             **self._spec_length_stats(s)))
        for i, s in enumerate(waiting):
            seqs.append(dict(id=s.id, session=s.req.session, state="queued", context=len(s.tokens),
                             ctx_limit=self.ctx_size, prompt_tokens=s.n_prompt, generated=0,
                             cached_tokens=0, tok_per_s=0.0, queue_position=i + 1, images=len(s.image_hashes)))
        vision = None
        if self.vision is not None:
            vision = dict(projector=self.vision.projector, path=str(self.vision.path),
                          n_params=self.vision.n_params)
        return dict(model=self.model_name, path=str(self.model_path), arch=self.spec.arch, device=self.config.device,
                    ctx_size=self.ctx_size, running=len(running), waiting=len(waiting) + self._inbox.qsize(),
                    sequences=seqs, last_step=dict(self._last_step), totals=dict(self._totals), vision=vision,
                    spec=dict(mode=self.config.spec, active=bool(self.spec_active),
                              drafters=_acceptance_by_drafter(self._totals),
                              adaptive=self.config.spec_adaptive, costs=self._costs.summary()),
                    resident=dict(conversations=len(self._resident.entries) + len(getattr(self, "_parked", {})),
                                  tokens=self._resident.n_tokens + sum(len(t) for t in getattr(self, "_parked", {}).values()),
                                  budget=self._resident.budget, evicted=self._resident.evicted),
                    kv_pool=self._pool_stats())

    def _pool_stats(self) -> dict | None:
        """GPU path: the shared KV pool's blocks (used, free, shared by several slots), in tokens too (what
        /metrics reports), the most tokens one sequence may hold, and the blocks parked conversations keep.
        None on the CPU path."""
        r = self.runner
        if r is None:
            return None
        out = r.pool_stats()
        out.update(capacity_tokens=out["tokens"], used_tokens=out["used"] * r.block_size, seq_max_tokens=r.max_ctx,
                   parked_blocks=sum(r.held(p) for p in list(self._parked)))
        return out

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout)
        self._resident.clear()
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
                if self._running and not self._pool_has_room(self._waiting[0]):
                    break   # waits until a running sequence finishes and frees KV
                s = self._waiting.popleft()
                s.t_start = time.monotonic()
                if self.runner is not None:
                    self._take_slot(s)
                else:
                    self._reuse_prefix(s)
                    if self._spec_ok(s):
                        self._attach_drafters(s)
                self._running.append(s)

    def _take_slot(self, s: _Sequence) -> None:
        """GPU path: a finished conversation stays parked in its slot (KV blocks and recurrent states in
        place); a request whose prompt continues one takes that slot over and computes only the rest.
        Else the longest prefix another slot holds, running or parked (agents sharing a system prompt),
        is shared with the new slot (Runner.find_prefix / share_prefix: a multiple of prefill_chunk, its
        blocks referenced, recurrent states from a checkpoint), and only the rest is computed, with the
        numbers a cold run gives. Else a free slot, else the least recently parked one. A sequence back
        from a pre-emption needs all its tokens but the last again (s.target)."""
        r, pc = self.runner, self.config.prefill_chunk
        best, n, whole = None, 0, False
        prompt = s.tokens[:s.target]
        if s.vision is None:
            for slot, toks in self._parked.items():
                lcp = common_prefix(toks, prompt)
                if self.spec.recurrent_layers:   # the states are those after the parked tokens: all or nothing
                    use = len(toks) if lcp >= len(toks) and len(toks) < s.target else 0
                else:
                    use = min(lcp, s.target - 1)
                if use > n:
                    best, n, whole = slot, use, lcp >= len(toks)
        match = None
        if s.vision is None and self._resident.budget > 0:
            donors = {q.slot: q.tokens[:q.n_computed] for q in self._running if q.slot is not None and q.vision is None}
            donors.update(self._parked)
            match = r.find_prefix(prompt, donors, pc)
        # taking over a parked conversation the prompt does not continue loses that conversation: worth it
        # only for at least a block, and a chunk more than a copy would give
        if best is not None and not whole and (n < r.block_size or (match is not None and n - pc < match.n)):
            best, n = None, 0
        if match is not None and match.n > n:
            if self._free_slots:
                s.slot = self._free_slots.pop()
            else:   # the least recently parked slot other than the donor (the donor itself when it is the only one)
                s.slot = next((p for p in self._parked if p != match.src), match.src)
                del self._parked[s.slot]
            if match.src in self._parked:
                self._parked.move_to_end(match.src)   # just used: evicted last
            r.share_prefix(match, s.slot)              # (drops what s.slot held before)
            s.n_computed = s.cached = match.n
            self._totals["cached_tokens"] += match.n
            self._totals["shared_tokens"] += match.n
        elif best is not None:
            del self._parked[best]
            s.slot = best
            r.truncate(best, n)                        # the blocks after the common part go back to the pool
            s.n_computed = s.cached = n
            self._totals["cached_tokens"] += n
        elif self._free_slots:
            s.slot = self._free_slots.pop()
        else:
            s.slot, _ = self._parked.popitem(last=False)
            r.release(s.slot)

    def _pool_has_room(self, s: _Sequence) -> bool:
        """Whether the CPU pool (free blocks plus evictable resident ones) can take s's tokens."""
        if self.runner is not None:
            return self._runner_has_room(s)
        if self._pool_tokens is None:
            return True
        pool = self.model.kv_pool()
        free = min((g.n_free + (g.limit or g.capacity) - g.capacity) for g in pool.groups) * pool.block_size
        return free + self._resident.n_tokens >= len(s.tokens) + pool.block_size

    def _reserve_kv(self, plan: list) -> list:
        """Allocate every chunk's KV blocks before the forward. When the pool is full: evict resident
        conversations (least recently used first), then pre-empt the newest running sequence (its KV
        freed, back to the front of the queue, recomputed when there is room); a sequence that cannot
        fit even alone stops with reason "length". Returns the plan without pre-empted sequences."""
        while True:
            try:
                for s, c in plan:
                    s.kv.reserve(c.start, c.start + len(c.tokens))
                return plan
            except PoolFullError:
                if self._resident.evict_one():
                    continue
                if len(plan) <= 1 and len(self._running) <= 1:
                    s = plan[0][0] if plan else None
                    if s is not None:
                        log.warning("KV pool full: request %d stopped at %d tokens", s.id, len(s.tokens))
                        self._totals["pool_full_stops"] += 1
                        self._finish(s, "length")
                    return []
                victim = max(self._running, key=lambda r: (r.t_start or 0, r.id))
                self._preempt(victim)
                plan = [(s, c) for s, c in plan if s is not victim]

    def _runner_has_room(self, s: _Sequence) -> bool:
        """GPU path: whether the pool's free blocks, plus those only parked conversations hold, can take all of
        s's tokens (a prefix it may share is not counted: it waits rather than push a running one out)."""
        r = self.runner
        spare = r.pool.n_free + sum(r.held_alone(p) for p in self._parked)
        return spare * r.block_size >= len(s.tokens) + 1

    def _preempt(self, s: _Sequence) -> None:
        """Pool full: s goes back to the front of the queue and gives its KV back; it is computed again
        (prompt and generated tokens, in prompt chunks) when there is room."""
        with self._lock:
            self._running.remove(s)
            self._waiting.appendleft(s)
        if s.slot is not None:   # GPU path: the slot and its blocks go back
            self.runner.release(s.slot)
            self._free_slots.append(s.slot)
            s.slot = None
        else:
            s.kv.release()
            s.kv = self.model.new_kv()
        s.n_computed = s.cached = 0
        s.drafts = []
        s.t_start = None
        self._totals["preempted"] += 1

    def _spec_ok(self, s: _Sequence) -> bool:
        """Drafts for this sequence: on, no grammar constraint (it must see every token), no
        images. (qwen35's recurrent states roll back to the snapshot after the last accepted row.)"""
        return (bool(self._spec_kinds) and self.config.spec_max_drafts > 0 and s.req.constraint is None
                and s.vision is None)

    def _attach_drafters(self, s: _Sequence) -> None:
        """The drafters of the engine's spec mode for a sequence starting to run. A sequence that starts
        from a reused prefix gets no model drafter: the resident cache keeps no MTP rows or DFlash
        context (n-gram drafts still work)."""
        s.spec_k = self.config.spec_max_drafts
        if "ngram" in self._spec_kinds:
            s.drafter = NgramDrafter(pool=self._ngram_pool)
            s.drafter.extend(s.tokens)
        if s.cached == 0 and "mtp" in self._spec_kinds:
            s.mtp = MtpState(self.model.new_mtp_kv())
        if s.cached == 0 and self._dflash is not None:
            s.dflash = self._dflash.new_state()
        k_max = self.config.spec_max_drafts
        s.adapt = {name: DraftLength(min(k_max, self._dflash.cfg.block_size - 1) if name == "dflash" else k_max)
                   for name, st in (("ngram", s.drafter), ("mtp", s.mtp), ("dflash", s.dflash)) if st is not None}
        s.spec_src = self._draft_source(s)
        if self._costs.step_time(1) is not None:   # costs known: start from the prior (0: a probe at once)
            n = len(self._running)
            for name, dl in s.adapt.items():
                dl.decide(choose_k(dl.alpha, dl.k_max, self._costs.step_time, n + 1,
                                   lambda k, name=name: self._costs.draft_time(name, k), others_tokens=n))

    def _ngram_first(self, s: _Sequence) -> bool:
        """Whether s drafts with n-grams this step: it has no model drafter, or (a chain) the end of its
        conversation repeats an earlier span of at least spec_ngram_min_match tokens, where lookup
        predicts better than a model drafter."""
        if s.drafter is None:
            return False
        if s.mtp is None and s.dflash is None:
            return True
        return s.drafter.match_length() >= self.config.spec_ngram_min_match

    def _model_drafts_wanted(self, s: _Sequence) -> int:
        """Drafts to ask the MTP block / DFlash drafter for after this step: what the next step can
        verify (the draft length, the context and max_tokens left), 0 when s is not generating or
        takes n-gram drafts next."""
        if s.kv is None or s.n_computed < s.n_prompt or self._ngram_first(s):
            return 0
        return max(0, min(self._draft_len(s), self.ctx_size - len(s.tokens) - 1,
                          s.params.max_tokens - s.n_generated - 1))

    def _draft_source(self, s: _Sequence) -> str | None:
        """The drafter s takes its next drafts from (as _take_drafts chooses)."""
        if self._ngram_first(s):
            return "ngram"
        return "mtp" if s.mtp is not None else "dflash" if s.dflash is not None else None

    def _draft_len(self, s: _Sequence) -> int:
        """The draft length of s's next step: its drafter's adaptive k (spec_adaptive), else spec_k."""
        if not self.config.spec_adaptive:
            return s.spec_k
        dl = s.adapt.get(self._draft_source(s))
        return dl.k if dl is not None else 0

    def _adapt_draft_lengths(self, decode: list) -> None:
        """After a step's verification (before the model drafters draft for the next one): the draft
        length of every generating sequence's next drafter, k maximizing the step's expected tokens per
        second (engine/spec/adaptive.py: choose_k) from its acceptance and the measured costs, with the
        other sequences' rows, expected tokens and drafting time as in this step; 0 backs off (probes
        every few steps). decode: (sequence, chunk, drafts) of this step's generating sequences."""
        live = [(s, c, nd) for s, c, nd in decode if s.kv is not None and s.adapt]
        if not self.config.spec_adaptive or not live:
            return
        costs = self._costs
        mine = {}
        for s, c, nd in live:   # each one's share of the step as it ran: rows, expected tokens, drafting time
            dl = s.adapt.get(s.draft_src) if nd else None
            mine[s.id] = (len(c.tokens), expected_tokens(dl.alpha, nd) if dl else 1.0,
                          costs.draft_time(s.draft_src, nd) if dl else 0.0)
        rows, tokens, draft_s = (sum(v[i] for v in mine.values()) for i in range(3))
        for s, c, nd in live:
            src = self._draft_source(s)
            s.spec_src = src
            dl = s.adapt.get(src)
            if dl is None:
                continue
            r, e, d = mine[s.id]
            k = choose_k(dl.alpha, dl.k_max, costs.step_time, rows - r + 1,
                         lambda k, src=src: costs.draft_time(src, k), others_tokens=tokens - e,
                         others_time=draft_s - d)
            dl.decide(k)

    def _spec_length_stats(self, s: _Sequence) -> dict:
        """stats() of a running sequence: the draft length of its next step, whether its drafter is
        backed off, and per drafter k, backed_off and the acceptance estimate alpha."""
        if not self.config.spec_adaptive or not s.adapt:
            return dict(spec_k=s.spec_k if s.adapt else 0, spec_backed_off=False)
        dl = s.adapt.get(s.spec_src) or next(iter(s.adapt.values()))
        return dict(spec_k=dl.k, spec_backed_off=dl.backed_off,
                    spec_lengths={name: d.summary() for name, d in s.adapt.items()})

    def _take_drafts(self, s: _Sequence, room: int) -> tuple[list[int], torch.Tensor | None, str]:
        """This step's drafts for s (at most `room`): (tokens, their drafter distributions or None for
        one-hot drafts, the drafter's name)."""
        if room <= 0:
            return [], None, ""
        if self._ngram_first(s):
            t0 = time.perf_counter()
            d = s.drafter.propose(room)
            dt = time.perf_counter() - t0
            self._costs.add_draft("ngram", dt, 1)
            self._draft_s += dt
            return d, None, "ngram"
        if s.mtp is not None:
            return s.mtp.drafts[:room], None, "mtp"
        st = s.dflash
        if st is not None and st.drafts and st.position == len(s.tokens) - 1:   # drafts follow the last token
            d = st.drafts[:room]
            return d, (st.q[:len(d)] if st.q is not None else None), "dflash"
        return [], None, ""

    def _reuse_prefix(self, s: _Sequence) -> None:
        """Start s from the longest prefix of its prompt that a resident or running sequence holds."""
        if self._resident.budget <= 0 or s.vision is not None or s.n_prompt < 2 * ROW_BLOCK:
            return
        running = [Entry(r.tokens[:r.n_computed], r.kv, r.checkpoints) for r in self._running
                   if r.vision is None and r.kv is not None]
        n, entry, _ = self._resident.best(s.tokens[:s.n_prompt], bool(self.spec.recurrent_layers), running)
        if entry is None:
            return
        old = s.kv
        s.kv = entry.kv.fork()
        old.release()
        if entry.checkpoints:
            s.kv.restore(entry.checkpoints[n])
        s.kv.truncate(n)
        s.n_computed = s.cached = n
        self._totals["cached_tokens"] += n

    def _drop_cancelled(self) -> None:
        for s in [s for s in self._running + list(self._waiting) if s.handle.cancelled]:
            self._finish(s, "cancelled")

    def _plan(self) -> list[tuple[_Sequence, SeqChunk]]:
        """Decode rows for every generating sequence, then prompt chunks in arrival order."""
        budget = max(self.config.step_tokens, len(self._running))
        plan = []
        for s in self._running:
            if s.n_computed >= s.target:  # generating: feed the last sampled token (and drafts after it)
                lo, hi = s.n_computed, len(s.tokens)
                vp = s.vision
                pos = vp.generated_positions(lo, hi) if vp is not None and vp.positions is not None else None
                room = min(self._draft_len(s), self.ctx_size - hi - 1, s.params.max_tokens - s.n_generated - 1)
                s.drafts, s.draft_q, s.draft_src = self._take_drafts(s, room)
                toks = s.tokens[lo:hi] + s.drafts
                plan.append((s, SeqChunk(torch.tensor(toks), lo, s.kv, "all" if s.drafts else "last", positions=pos,
                                         rowwise=bool(s.drafts))))
                budget -= len(toks)
        prefilling = False
        for s in self._running:
            if s.n_computed < s.target:
                lo = s.n_computed
                pc = self.config.prefill_chunk
                hi = min((lo // pc + 1) * pc, s.target)   # chunk ends at fixed positions, even after a reused prefix
                vp = s.vision
                if vp is not None:
                    hi = vp.chunk_end(lo, hi)  # an image attended both ways is never split
                n = hi - lo
                if n > budget and plan and (prefilling or n <= self.config.step_tokens):
                    continue  # waits for a step with room; chunks are never cut differently (a chunk
                    # longer than a whole step, e.g. a large image read in one piece, goes with decode rows)
                last = hi == s.n_prompt and s.n_generated == 0   # (a recomputed sequence samples nothing here)
                pos = emb = bidir = None
                if vp is not None:
                    pos, emb, bidir = vp.chunk_inputs(lo, hi)
                chunk = SeqChunk(torch.tensor(s.tokens[lo:hi]), lo, s.kv, "last" if last else "none",
                                 positions=pos, embeds=emb, bidirectional=bidir)
                plan.append((s, chunk))
                budget -= n
                prefilling = True
        return plan

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
        r, pc = self.runner, self.config.prefill_chunk
        while True:
            room = self._make_room(*self._plan_runner(prev), drain=prev is not None)
            if room is not None:
                break
            # short of free blocks: the previous step's tokens first, then the plan the engine makes without
            # overlap (evicting and pre-empting need every sequence's tokens on the host)
            self._complete_runner(prev)
            prev = None
        dec, chunks = room
        step = _RunnerStep()
        host, host_lg = [], []   # the host Sampler's rows: their sequences, their logits (device rows)
        if dec:
            pos = [s.n_computed for s in dec]
            logits = r.decode([s.slot for s in dec], self._decode_inputs(dec, prev), pos)
            for s, p in zip(dec, pos):
                s.n_computed = p + 1
            on_dev = [self._device_row(s) for s in dec]
            if all(on_dev):
                step.choose(dec, logits, self.spec.vocab_size)
            elif any(on_dev):
                rows = [i for i, d in enumerate(on_dev) if d]
                step.choose([dec[i] for i in rows], logits[rows], self.spec.vocab_size)
            if not all(on_dev):
                rows = [i for i, d in enumerate(on_dev) if not d]
                host += [dec[i] for i in rows]
                host_lg.append(logits[rows].float())   # (a copy: the graph's output buffer is rewritten next step)
            step.decode = {s.id for s in step.seqs}
            self._ahead = step
        self._complete_runner(prev)   # the previous step's tokens, while this step's decode runs
        rows = len(dec)
        firsts, first_lg = [], []
        for s, lo, hi in chunks:
            out = r.prefill(s.slot, s.tokens[lo:hi], start=lo, chunk=pc)
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
        if host:   # host rows, in one copy: their tokens are needed before the next step is planned
            lgs = (torch.cat(host_lg) if len(host_lg) > 1 else host_lg[0]).cpu()
            for s, lg in zip(host, lgs):
                if s.n_generated == 0:
                    self._totals["prompt_tokens"] += s.n_prompt
                self._on_logits(s, lg)
        if self.config.overlap_steps:
            self._inflight = step
        else:
            self._complete_runner(step)
        self._last_step = {"rows": rows, "seqs": len(dec) + len(chunks),
                           "ms": round(1000 * (time.monotonic() - t0), 2)}
        self._totals["steps"] += 1

    def _device_row(self, s: _Sequence) -> bool:
        """GPU path: whether s's tokens are chosen on the device (device_sampling and nothing host-only)."""
        return self.config.device_sampling and samples_on_device(s.params, s.req.constraint)

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
        chunks = []
        for s in self._running:
            if s.n_computed < s.target:
                lo = s.n_computed
                hi = min((lo // pc + 1) * pc, s.target)   # chunks end at fixed positions after a reused prefix
                if hi - lo > budget and rows:
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
            need = sum(r.blocks_needed(s.slot, s.n_computed, s.n_computed + 1) for s in dec)
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
        self.runner.release(slot)
        self._free_slots.append(slot)
        self._totals["parked_evicted"] += 1
        return True

    def _step(self) -> None:
        if self.runner is not None:
            return self._step_runner()
        t0 = time.monotonic()
        if self.vision is not None:
            self._encode_images()
        self._draft_s = 0.0
        plan = self._reserve_kv(self._plan())
        if not plan:
            return
        chunks = [c for _, c in plan]
        decode = [(s, c, len(s.drafts)) for s, c in plan if s.n_computed >= s.target]   # generating sequences
        mtp = "mtp" in self._spec_kinds and any(s.mtp is not None for s, _ in plan)
        if mtp:
            logits, hidden = self.model.forward_with_hidden(chunks)
        else:
            logits = self.model.forward(chunks)
        rows = sum(len(c.tokens) for _, c in plan)
        recurrent = bool(self.spec.recurrent_layers) and self._resident.budget > 0
        for (s, c), lg in zip(plan, logits):
            s.n_computed = c.start + len(c.tokens)   # with drafts: set again by _verify_drafts
            if recurrent and s.vision is None and s.n_computed <= s.n_prompt:
                add_checkpoint(s.checkpoints, s.kv)   # a later request can resume here
            if s.n_computed == s.n_prompt and s.n_generated == 0:
                self._totals["prompt_tokens"] += s.n_prompt
            if s.drafts:
                self._verify_drafts(s, c.start, lg)
            elif lg.shape[0]:
                self._on_logits(s, lg[-1])
        if self._spec_kinds:
            self._adapt_draft_lengths(decode)
        if mtp:
            items = []
            for (s, c), h in zip(plan, hidden):
                if s.mtp is None or s.kv is None:
                    continue
                k = self._model_drafts_wanted(s)
                dl = s.adapt.get("mtp") if self.config.spec_adaptive else None
                items.append(CatchUp(s.mtp, s.tokens, c.start, h, s.n_computed - c.start, k,
                                     defer=dl is not None and dl.backed_off))
            timing = {}
            catch_up(self.model, items, timing)
            if timing:
                self._costs.add_draft("mtp", timing["chain_s"], timing["chain_rows"])
                self._draft_s += timing["chain_s"]
        if self._dflash is not None:
            self._dflash_step(plan)
        if self._spec_kinds and decode and len(decode) == len(plan):   # decode rows only: T(rows)
            self._costs.add_step(rows, time.monotonic() - t0 - self._draft_s)
        self._last_step = {"rows": rows, "seqs": len(plan), "ms": round(1000 * (time.monotonic() - t0), 2)}
        self._totals["steps"] += 1

    def _dflash_step(self, plan: list[tuple[_Sequence, SeqChunk]]) -> None:
        """After a step: append to each DFlash context the target's hidden states of the positions that
        became final (prompt rows, the fed token and accepted drafts; never rejected drafts), then draft
        the block after the last sampled token of every generating sequence."""
        grow, reqs = [], []
        for s, c in plan:
            st = s.dflash
            if st is None or s.kv is None or c.features is None:
                continue
            held, st.deferred = st.deferred, None      # (rows put off while drafting is backed off)
            n_held = 0 if held is None else held.shape[0]
            lo, hi = st.length + n_held - c.start, s.n_computed - c.start   # rows new to the context / still final
            new = c.features[lo:hi] if 0 <= lo < hi else None
            rows = new if held is None else held if new is None else torch.cat([held, new])
            if rows is None:
                continue
            dl = s.adapt.get("dflash") if self.config.spec_adaptive else None
            if (dl is not None and dl.backed_off and self._model_drafts_wanted(s) == 0
                    and rows.shape[0] <= MAX_DEFERRED):
                st.deferred = rows.clone() if rows is new else rows
                continue
            grow.append((st, rows))
        self._dflash.extend(grow)
        for s, c in plan:
            st = s.dflash
            if st is None or s.kv is None:
                continue
            k = self._model_drafts_wanted(s)
            if k and st.length == s.n_computed == len(s.tokens) - 1:
                reqs.append(DraftRequest(st, s.tokens[-1], k, s.sampler, s.tokens))
            else:
                st.drafts, st.q = [], None
        t0 = time.perf_counter()
        propose(self._dflash, self.model, reqs)
        if reqs:
            dt = time.perf_counter() - t0
            self._costs.add_draft("dflash", dt, len(reqs))
            self._draft_s += dt

    def _verify_drafts(self, s: _Sequence, start: int, lg: torch.Tensor) -> None:
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
        n_acc = 0
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
            n_acc += 1
        s.drafted += len(drafts)
        s.accepted += n_acc
        self._totals["drafted_tokens"] += len(drafts)
        self._totals["accepted_tokens"] += n_acc
        for counts in (s.spec_by, self._totals):   # per drafter, for stats()
            counts[f"{s.draft_src}_drafted"] += len(drafts)
            counts[f"{s.draft_src}_accepted"] += n_acc
        s.spec_k = min(self.config.spec_max_drafts, 2 * s.spec_k) if n_acc == len(drafts) else max(1, n_acc + 1)
        dl = s.adapt.get(s.draft_src)
        if dl is not None:
            dl.observe(len(drafts), n_acc)
        s.n_computed = start + 1 + n_acc          # the fed token and the accepted drafts have good KV
        s.kv.keep_rows(start, 1 + n_acc)
        for tok, lp in out:
            self._append_token(s, tok, lp)
            if s.kv is None:                      # finished (end of generation, stop string, limit)
                break

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
        self._append_token(s, tok, lp)

    def _append_token(self, s: _Sequence, tok: int, lp) -> None:
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
        if s.drafter is not None:
            self._ngram_pool.add(s.tokens)   # other conversations can draft from this one
        if s.kv is not None:
            if reason != "error" and s.vision is None and self._resident.budget > 0 and s.n_computed > 0:
                if self.spec.recurrent_layers:
                    add_checkpoint(s.checkpoints, s.kv)
                self._resident.add(s.id, Entry(s.tokens[:s.n_computed], s.kv, s.checkpoints))
            else:
                s.kv.release()
        s.kv = None  # the pool keeps a resident sequence's blocks; otherwise they are free now
        if getattr(s, "slot", None) is not None:
            if self._ahead is not None and s.id in self._ahead.decode:
                self._discard_ahead_row(s)
            if reason != "error" and s.vision is None and self._resident.budget > 0 and s.n_computed > 0:
                self._parked[s.slot] = s.tokens[:s.n_computed]   # resident (its blocks kept) until evicted
            else:
                self.runner.release(s.slot)
                self._free_slots.append(s.slot)
            s.slot = None
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
                                  stop_string=s.stopper.matched))

"""The bridge between the Qt UI and the engine: loading runs in a background thread (with progress and
cancel), generation is iterated in a background thread, and everything reaches the UI as Qt signals
(emitted from worker threads, delivered queued on the UI thread). The UI thread never waits on the engine.

Cancelling a load: `Engine(...)` cannot be interrupted half-way, so cancel returns the UI to its
previous state at once and the loader thread shuts the engine down as soon as it is built.

Switching models on the GPU: the loaded engine is shut down (its device memory freed) before the new one
is built, as LM Studio does by default: both would not fit a 24 GB card, and the new engine sizes its KV
pool to the memory that is free. The new file's header is read first, so a broken file leaves the loaded
model alone. On the CPU the old model keeps serving until the new one is ready (memory-mapped weights;
nothing to free first).

Remote endpoints (OpenAI-compatible servers) are driven through the same handle interface
(`RemoteHandle` yields TokenEvent / FinishEvent), so the chat page does not care which one it talks to.
"""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from PySide6.QtCore import QObject, Signal

from engine.sampling import SamplingParams
from engine.types import DEFAULT_MAX_SEQS, FinishEvent, Request, Timings, TokenEvent, Usage


def choose_device(kv_cache: str) -> str:
    """Where the app runs a model: the GPU when torch sees one (for any known KV cache type; speed first: a
    27B model is not usable on a CPU), else the CPU. The vision projector goes with the
    model on either."""
    import torch

    from kernels.kvcodec import CACHE_TYPES
    return "cuda" if torch.cuda.is_available() and kv_cache in CACHE_TYPES else "cpu"


@dataclass
class LoadedInfo:
    name: str
    path: str
    arch: str
    ctx_size: int
    context_length: int
    device: str
    vision: bool
    remote: bool = False
    kv_cache: str = "f16"
    vision_note: str = ""           # why the model cannot see images (no mmproj / a projector that did not fit)
    drafts: str = ""                # the drafters in use ("" when speculative decoding is off)
    spec_note: str = ""             # why a chosen drafter is not used


def pacing_share(value) -> float:
    """A stored "long prompts beside generating conversations" setting as EngineConfig.prefill_share: a
    number in (0, 1], else the default 0.5 (a hand-edited or broken setting never stops a load)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return 0.5
    return v if 0 < v <= 1 else 0.5


def parallel_conversations(store) -> int:
    """The store's "parallel conversations" setting as EngineConfig.max_seqs (the chat and the API server's
    agents together): an integer 1..64, else the default (a hand-edited or broken setting never stops a load)."""
    value = store.get_setting("parallel", DEFAULT_MAX_SEQS)
    try:
        v = int(value)
        whole = not isinstance(value, bool) and float(value) == v
    except (TypeError, ValueError):
        return DEFAULT_MAX_SEQS
    return v if whole and 1 <= v <= 64 else DEFAULT_MAX_SEQS


def spec_config(choice: str, model: str) -> tuple[str, str | None]:
    """The engine's speculative decoding for a Settings choice: "off", "ngram", or "auto": a DFlash drafter
    in the model's folder (a .gguf or a directory named like one: draft / dflash / eagle) with prompt lookup,
    else the model's MTP block with prompt lookup (the load falls back to prompt lookup alone when the model
    has none). Returns (EngineConfig.spec, spec_drafter)."""
    if choice != "auto":
        return (choice if choice in ("off", "ngram") else "off"), None
    from pathlib import Path

    from app.downloads import kind_of
    folder = Path(model).parent if Path(model).is_file() else None
    if folder is not None:
        for p in sorted(folder.iterdir()):
            if kind_of(p.name) == "drafter" and (p.suffix == ".gguf" or (p / "config.json").is_file()):
                return "dflash+ngram", str(p)
    return "mtp+ngram", None


class EngineController(QObject):
    loadStarted = Signal(str)
    loadProgress = Signal(str)
    loaded = Signal(object)          # LoadedInfo
    loadFailed = Signal(str)
    loadCancelled = Signal()
    unloaded = Signal()

    def __init__(self, threads: int = 0, parent=None):
        super().__init__(parent)
        self.engine = None
        self.remote: RemoteBackend | None = None
        self.info: LoadedInfo | None = None
        self.threads = threads
        self._load_token: object | None = None
        self.loading = False

    # ----- loading -----
    def load(self, model: str, ctx_size: int = 0, kv_cache: str | None = None, mmproj: str | None = "auto",
             spec: str = "off", prefill_share: float = 0.5, max_seqs: int = DEFAULT_MAX_SEQS) -> None:
        """Load in the background. kv_cache: the KV cache type for K and V (the planner's pick; None = f16).
        mmproj: the vision projector ("auto": the one beside the model; a projector that does not fit the model
        is dropped with a note, and the model loads without vision). spec: speculative decoding, a Settings
        choice (`spec_config`); a drafter the model cannot use is dropped with a note (prompt lookup stays).
        prefill_share: the GPU path's pacing of long prompts beside generating sequences (engine/pacing.py).
        max_seqs: conversations advanced together (the chat and the API server's agents; each slot's state
        and the KV pool share the memory: the planner's "parallel chats")."""
        token = object()
        self._load_token = token
        self.loading = True
        self.loadStarted.emit(model)
        kv = kv_cache or "f16"

        def work():
            from engine.engine import Engine, EngineConfig
            from engine.types import EngineError
            err = None
            eng = None
            note = ""
            spec_note = ""
            progress = lambda m: self.loadProgress.emit(str(m))  # noqa: E731
            try:
                self.loadProgress.emit(f"Opening {model} ...")
                device = choose_device(kv)
                if device != "cpu" and not self._free_device_for(model, token):
                    return
                mode, drafter = spec_config(spec, model)
                cfg = EngineConfig(model=model, ctx_size=ctx_size, threads=self.threads, cache_type_k=kv,
                                   max_seqs=max_seqs,
                                   cache_type_v=kv, mmproj=mmproj, device=device, spec=mode, spec_drafter=drafter,
                                   prefill_share=pacing_share(prefill_share))
                for _ in range(3):      # at most: without the projector, then with prompt lookup alone
                    try:
                        eng = Engine(cfg, progress=progress)
                        break
                    except EngineError as e:
                        if mmproj == "auto" and cfg.mmproj and str(e).startswith("vision projector"):
                            note = f"its mmproj file was not loaded ({e})"
                            self.loadProgress.emit(f"Loading without images: {note}")
                            cfg.mmproj = None
                        elif cfg.spec not in ("off", "ngram"):
                            spec_note = f"drafts by prompt lookup only ({e})"
                            self.loadProgress.emit(f"Loading with {spec_note}")
                            cfg.spec, cfg.spec_drafter = "ngram", None
                        else:
                            raise
                if eng is None:
                    raise EngineError("the model could not be loaded")
            except Exception as e:  # GGUFError, CatalogError, EngineError ...
                err = str(e) or type(e).__name__
            if self._load_token is not token:       # cancelled or superseded: discard
                if eng is not None:
                    eng.shutdown()
                return
            self.loading = False
            if err is not None:
                self.loadFailed.emit(err)
                return
            self._swap(eng)
            if not eng.has_vision:
                note = eng.no_vision_reason() + (f"; {note}" if note else "")
            self.info = LoadedInfo(eng.model_name, str(eng.model_path), eng.spec.arch, eng.ctx_size,
                                   eng.spec.context_length, eng.config.device, eng.has_vision,
                                   kv_cache=eng.config.cache_type_k, vision_note=note,
                                   drafts="+".join(sorted(eng.spec_active)), spec_note=spec_note)
            self.loaded.emit(self.info)

        threading.Thread(target=work, name="hivejet-load", daemon=True).start()

    def _free_device_for(self, model: str, token: object) -> bool:
        """In the loader thread, before a GPU engine is built: shut down a loaded GPU engine once the new
        file's header has been read (GGUFError otherwise, with the old model still loaded). False when
        the load was cancelled meanwhile."""
        old = self.engine
        if old is None or getattr(old.config, "device", "cpu") == "cpu":
            return True
        from pathlib import Path

        from engine.gguf.reader import GGUFFile
        if Path(model).is_file():
            GGUFFile(model).close()
        if self._load_token is not token:
            return False
        self.loadProgress.emit(f"Unloading {old.model_name} to free the GPU's memory ...")
        if self.engine is old:
            self.engine = None
            self.info = None
            self.unloaded.emit()
        old.shutdown()
        return True

    def connect_remote(self, backend: "RemoteBackend") -> None:
        self._load_token = None
        self.loading = False
        self._swap(None)
        self.remote = backend
        self.info = LoadedInfo(backend.model, backend.base_url, "remote", backend.ctx_size, backend.ctx_size,
                               "remote", False, remote=True,
                               vision_note=f"{backend.model} at {backend.base_url} is reached as text only: "
                                           "images are not sent to remote endpoints")
        self.loaded.emit(self.info)

    def cancel_load(self) -> None:
        if self.loading:
            self._load_token = None
            self.loading = False
            self.loadCancelled.emit()

    def _swap(self, eng) -> None:
        old = self.engine
        self.engine = eng
        self.remote = None
        if old is not None:
            threading.Thread(target=old.shutdown, daemon=True).start()

    def unload(self) -> None:
        self._swap(None)
        self.info = None
        self.unloaded.emit()

    def shutdown(self) -> None:
        self._load_token = None
        if self.engine is not None:
            self.engine.shutdown(timeout=5)
            self.engine = None

    @property
    def ready(self) -> bool:
        return self.engine is not None or self.remote is not None

    # ----- generation -----
    def count_tokens(self, messages: list[dict]) -> int | None:
        if self.engine is None:
            return None
        try:
            return len(self.engine.prompt_ids(Request(messages=messages)))
        except Exception:
            return None

    def generate(self, messages: list[dict], sampling: SamplingParams, session: str | None = None) -> "Generation":
        """Start a reply; raises (in the caller's thread) when the request is refused."""
        if self.remote is not None:
            handle = self.remote.submit(messages, sampling)
        elif self.engine is not None:
            handle = self.engine.submit(Request(messages=messages, sampling=sampling, session=session))
        else:
            raise RuntimeError("No model is loaded. Pick one in the model menu above.")
        g = Generation(handle)
        g.start()
        return g


class Generation(QObject):
    """One streaming reply. Signals come from the worker thread (queued to the UI)."""

    token = Signal(str)
    finished = Signal(object)       # FinishEvent

    def __init__(self, handle):
        super().__init__()
        self.handle = handle
        self.text = []
        self.n_tokens = 0
        self.done = False

    def start(self):
        threading.Thread(target=self._run, name="hivejet-gen", daemon=True).start()

    def _run(self):
        fin = None
        try:
            for ev in self.handle:
                if isinstance(ev, TokenEvent):
                    self.n_tokens += len(ev.ids)
                    if ev.text:
                        self.text.append(ev.text)
                        self.token.emit(ev.text)
                elif isinstance(ev, FinishEvent):
                    fin = ev
        except Exception as e:
            fin = FinishEvent("error", Usage(), Timings(), error=f"{type(e).__name__}: {e}")
        self.done = True
        self.finished.emit(fin or FinishEvent("error", Usage(), Timings(), error="the stream ended early"))

    def cancel(self):
        self.handle.cancel()


# ----------------------------------------------------------------------------------------------
# remote OpenAI-compatible endpoints

class RemoteError(RuntimeError):
    pass


def list_remote_models(base_url: str, api_key: str = "", timeout: float = 10) -> list[str]:
    req = urllib.request.Request(base_url.rstrip("/") + "/models", headers=_headers(api_key))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            data = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RemoteError(f"{base_url}: HTTP {e.code}" + (" (wrong API key?)" if e.code in (401, 403) else "")) from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise RemoteError(f"{base_url}: cannot connect ({getattr(e, 'reason', e)})") from None
    return [m.get("id", "") for m in data.get("data", []) if m.get("id")]


def _headers(api_key: str) -> dict:
    h = {"Content-Type": "application/json", "Accept": "text/event-stream", "User-Agent": "hivejet"}
    if api_key:
        h["Authorization"] = f"Bearer {api_key}"
    return h


class RemoteHandle:
    """Streams /chat/completions (SSE) and yields the engine's event types."""

    def __init__(self, backend: "RemoteBackend", messages, sampling: SamplingParams):
        self.backend, self.messages, self.sampling = backend, messages, sampling
        self._cancel = threading.Event()

    def cancel(self):
        self._cancel.set()

    def __iter__(self):
        b, s = self.backend, self.sampling
        body = dict(model=b.model, messages=self.messages, stream=True, max_tokens=s.max_tokens,
                    temperature=s.temperature, top_p=s.top_p)
        if s.seed is not None:
            body["seed"] = s.seed
        t0 = time.monotonic()
        t_first = None
        n = 0
        req = urllib.request.Request(b.base_url.rstrip("/") + "/chat/completions", data=json.dumps(body).encode(),
                                     headers=_headers(b.api_key), method="POST")
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                reason = "stop"
                for raw in r:
                    if self._cancel.is_set():
                        reason = "cancelled"
                        break
                    line = raw.decode("utf-8", "replace").strip()
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    ch = (json.loads(payload).get("choices") or [{}])[0]
                    text = (ch.get("delta") or {}).get("content") or ""
                    if text:
                        n += 1
                        t_first = t_first or time.monotonic()
                        yield TokenEvent(text=text, ids=[0])
                    if ch.get("finish_reason"):
                        reason = ch["finish_reason"]
        except urllib.error.HTTPError as e:
            yield FinishEvent("error", Usage(), Timings(), error=f"{b.base_url}: HTTP {e.code}")
            return
        except (urllib.error.URLError, OSError, ValueError) as e:
            yield FinishEvent("error", Usage(), Timings(), error=f"{b.base_url}: {getattr(e, 'reason', e)}")
            return
        t_end = time.monotonic()
        ttft = (t_first or t_end) - t0
        dt = max(t_end - (t_first or t0), 1e-6)
        yield FinishEvent(reason, Usage(completion_tokens=n),
                          Timings(prompt_ms=ttft * 1000, decode_ms=dt * 1000, decode_tokens_per_s=n / dt))


@dataclass
class RemoteBackend:
    base_url: str
    model: str
    api_key: str = ""
    ctx_size: int = 131072

    def submit(self, messages, sampling: SamplingParams) -> RemoteHandle:
        return RemoteHandle(self, messages, sampling)

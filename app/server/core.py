"""What the OpenAI and Anthropic routes share: the server state, API errors, sampling parameters from a request,
submitting to the engine off the event loop, and an async stream of a request's events."""
from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.concurrency import run_in_threadpool
from starlette.responses import StreamingResponse

from app.server.security import ServerSettings

log = logging.getLogger("hivejet.server")


class ApiError(Exception):
    """An error answered in the API's error shape (OpenAI's, or Anthropic's on /v1/messages)."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None,
                 anthropic_message: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.anthropic_message = anthropic_message or message   # the text on /v1/messages
        self.type = type or default_error_type(status)
        self.headers = headers or {}


def default_error_type(status: int) -> str:
    """The error `type` on the OpenAI routes, as OpenAI's API writes it: invalid_request_error for every
    client error (a 401 and a 404 model_not_found included; `code` says which), "requests" for a 429 (a limit
    on requests), server_error for 5xx."""
    if status == 429:
        return "requests"
    return "server_error" if status >= 500 else "invalid_request_error"


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    422: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error"}


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(path: str, status: int, message: str, type: str | None = None, param: str | None = None,
               code: str | None = None) -> dict:
    if is_anthropic_path(path):
        t = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": t, "message": message}}
    return {"error": {"message": message, "type": type or default_error_type(status), "param": param,
                      "code": code}}


@dataclass
class ServerState:
    settings: ServerSettings
    engine: Any = None                    # engine.engine.Engine once loaded
    load_error: str | None = None
    started: float = field(default_factory=time.time)
    metrics: Any = None
    _info: dict | None = None
    streams: set = field(default_factory=set)     # the EventStreams running now

    def begin_shutdown(self) -> None:
        """The server is stopping (SIGTERM, Ctrl-C, ServerThread.stop): end every running request now, so each
        stream sends its client an error event saying so before the connection closes."""
        for s in list(self.streams):
            s.stop_for_shutdown()

    def engine_or_503(self):
        if self.engine is None:
            if self.load_error:
                raise ApiError(503, f"the model failed to load: {self.load_error}")
            raise ApiError(503, "the model is still loading; try again shortly", headers={"Retry-After": "2"})
        return self.engine

    def model_names(self) -> list[str]:
        eng = self.engine
        names = [eng.model_name, eng.model_path.name, eng.model_path.stem, str(eng.config.model)]
        return [n for n in dict.fromkeys(names + list(self.settings.model_aliases)) if n]

    def model_id(self) -> str:
        return self.settings.model_aliases[0] if self.settings.model_aliases else self.engine.model_path.stem

    def check_model(self, name: str) -> None:
        if self.settings.accept_any_model:
            return
        if name not in self.model_names():
            raise ApiError(404, f"model {name!r} is not served here; this server has {self.model_id()!r} "
                                "(GET /v1/models lists it)", param="model", code="model_not_found")

    def info(self) -> dict:
        """Facts about the loaded model that routes need (computed once)."""
        if self._info is None:
            from app.server.tools import detect_format, template_has_reasoning
            eng = self.engine
            src = None if eng.template.is_fallback else eng.template.source
            self._info = dict(tool_format=detect_format(src), template_source=src,
                              reasoning=template_has_reasoning(src),
                              vision=getattr(eng, "vision", None) is not None)
        return self._info


# ----------------------------------------------------------------------------------------------- sampling
def sampling_params(*, engine, settings: ServerSettings, max_tokens: int | None, temperature=None, top_p=None,
                    top_k=None, min_p=None, seed=None, presence_penalty=None, frequency_penalty=None,
                    repetition_penalty=None, repeat_last_n=None, logit_bias=None, stop=None, ignore_eos=None,
                    logprobs: int | None = None):
    from engine.sampling import SamplingParams
    p = SamplingParams()
    limit = engine.ctx_size
    if settings.max_tokens_limit:
        limit = min(limit, settings.max_tokens_limit)
    p.max_tokens = min(max_tokens, limit) if max_tokens else limit
    for name, v in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("min_p", min_p),
                    ("seed", seed), ("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty),
                    ("repetition_penalty", repetition_penalty), ("penalty_last_n", repeat_last_n),
                    ("ignore_eos", ignore_eos)):
        if v is not None:
            setattr(p, name, v)
    if isinstance(p.temperature, int):
        p.temperature = float(p.temperature)
    if stop is not None:
        p.stop = [stop] if isinstance(stop, str) else list(stop)
    if logit_bias:
        bias = {}
        for k, v in logit_bias.items():
            try:
                tid = int(k)
            except (TypeError, ValueError):
                raise ApiError(400, f"logit_bias keys must be token ids, got {k!r}", param="logit_bias") from None
            bias[tid] = float(v)
        p.logit_bias = bias
    p.logprobs = logprobs
    try:
        p.validate(engine.spec.vocab_size)
    except ValueError as e:
        msg = str(e)
        param = msg.split(":")[0].replace("invalid sampling parameter ", "") if msg.startswith("invalid") else None
        raise ApiError(400, msg, param=param) from None
    return p


# ----------------------------------------------------------------------------------------------- running
async def submit(engine, req):
    """engine.submit off the event loop (it renders and tokenizes), engine errors mapped to ApiErrors."""
    from engine.types import ContextTooLongError, EngineError, QueueFullError
    try:
        return await run_in_threadpool(engine.submit, req)
    except (QueueFullError, ContextTooLongError, EngineError, ValueError) as e:
        raise api_error(without_traceback(e), "messages" if req.messages is not None else "prompt") from None


def api_error(e: Exception, what: str) -> ApiError:
    """The ApiError an engine's refusal of a request is answered with (what: the request's input field)."""
    from engine.types import ContextTooLongError, EngineError, QueueFullError
    if isinstance(e, QueueFullError):
        return ApiError(429, str(e), code="rate_limit_exceeded", headers={"Retry-After": "2"})
    if isinstance(e, ContextTooLongError):
        return overflow_error(e, what)
    if isinstance(e, EngineError) and "shut down" in str(e):
        return ApiError(503, str(e))
    return ApiError(400, str(e))


def without_traceback(e: BaseException) -> BaseException:
    """`e` with its traceback dropped, for an error answered as an ApiError. An error raised as
    `err = X(...); raise err` is named by a frame of its own traceback: a reference cycle that keeps those
    frames, and the request's prompt in them, in memory until the cyclic collector runs, which in a large
    heap can be much later (a refused 31 MB prompt held about 60 MB)."""
    e.__traceback__ = None
    return e


def overflow_error(e, what: str = "messages") -> ApiError:
    """A prompt longer than the context, in the words clients match to offer their token-limit help:
    OpenAI's "This model's maximum context length is N tokens. However, your messages resulted in M tokens"
    with code context_length_exceeded (litellm maps it to ContextWindowExceededError), and on /v1/messages
    Anthropic's "prompt is too long: M tokens > MAX maximum" (MAX: the longest prompt that still leaves room
    for one generated token)."""
    n, limit = e.n_prompt, e.limit
    at_least = "at least " if getattr(e, "lower_bound", False) else ""
    msg = (f"This model's maximum context length is {limit} tokens. However, your {what} resulted in "
           f"{at_least}{n} tokens ({n - limit + 1} too many to generate even one token). Please reduce the length "
           f"of the {what}.")
    from engine.types import KVPoolTooSmallError
    if isinstance(e, KVPoolTooSmallError):           # the shared KV pool, not the model, is the limit
        msg += f" ({e})"
    return ApiError(400, msg, param=what, code="context_length_exceeded",
                    anthropic_message=f"prompt is too long: {n} tokens > {limit - 1} maximum")


def constraint_failure(constraint, fin) -> str | None:
    """Why a constrained generation that ended as "stop" did not complete its grammar (llguidance's error, or
    an output that ended before the grammar could), or None: such an output is broken and must not be
    answered as a success. A stop string the client gave ends it by request, and is not a failure."""
    if constraint is None or fin.reason != "stop" or getattr(fin, "stop_string", None):
        return None
    err = getattr(constraint, "error", None)
    if err:
        return err
    m = getattr(constraint, "matcher", None)
    if m is not None and not (m.is_accepting() or m.is_stopped()):
        return "the output ended before the grammar was complete"
    return None


def constraint_error(why: str, param: str) -> ApiError:
    return ApiError(400, f"the constrained output could not be completed ({why}); the {param} schema may be "
                         "unsatisfiable for this model", param=param, code="constraint_unsatisfiable")


class EventStream:
    """Async iteration over a RequestHandle's events. A thread reads the handle (whose iteration blocks) and
    hands events to the event loop; the finish event is counted in the metrics there, whether or not anyone
    still reads the stream (a client that went away, a cancelled request). close() cancels the request."""

    def __init__(self, handle, state: "ServerState | None" = None):
        self.handle = handle
        self.state = state
        self.server_stopping = False
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        if state is not None:
            state.streams.add(self)
        # the request's context variables go with it into the thread (what a wrapper around the app keeps per
        # request, e.g. the app's request log, sees the finish the thread counts)
        ctx = contextvars.copy_context()
        self._thread = threading.Thread(target=ctx.run, args=(self._pump,), name=f"hivejet-req-{handle.id}",
                                        daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        from engine.types import FinishEvent
        for ev in self.handle:
            if isinstance(ev, FinishEvent) and self.state is not None:
                self.state.streams.discard(self)
                if self.state.metrics is not None:
                    self.state.metrics.finished(ev)
            try:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, ev)
            except RuntimeError:  # the loop is gone (server stopped)
                self.handle.cancel()

    async def next(self, timeout: float | None = None):
        if timeout is None:
            return await self.queue.get()
        return await asyncio.wait_for(self.queue.get(), timeout)

    def stop_for_shutdown(self) -> None:
        self.server_stopping = True
        self.close()

    def cancelled_message(self) -> str:
        return ("the server is shutting down; the request was stopped" if self.server_stopping
                else "the request was cancelled")

    def close(self) -> None:
        if self.handle.finish is None:
            self.handle.cancel()


async def collect(stream: EventStream, request) -> list:
    """All events of a non-streaming request; cancels the request at once if the client disconnects."""
    from engine.types import FinishEvent

    async def watch():
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                stream.close()
                return

    watcher = asyncio.ensure_future(watch())
    events = []
    try:
        while True:
            ev = await stream.next()
            events.append(ev)
            if isinstance(ev, FinishEvent):
                return events
    finally:
        watcher.cancel()
        stream.close()


class SSEResponse(StreamingResponse):
    """A text/event-stream response that cancels its request the moment the client goes away: it listens for
    http.disconnect while streaming (whatever the ASGI spec version) and always closes the generator."""

    def __init__(self, content, stream: EventStream, **kw):
        kw.setdefault("media_type", "text/event-stream")
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(kw.pop("headers", None) or {})}
        super().__init__(content, headers=headers, **kw)
        self.stream = stream

    async def __call__(self, scope, receive, send):
        async def watch(scope_):
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    self.stream.close()
                    scope_.cancel()
                    return

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch, tg.cancel_scope)
                try:
                    await self.stream_response(send)
                finally:
                    tg.cancel_scope.cancel()
        except OSError:  # the client went away mid-write
            pass
        finally:
            self.stream.close()
            await self.body_iterator.aclose()


def session_of(request, *candidates) -> str | None:
    for c in candidates:
        if isinstance(c, str) and c:
            return c[:256]
    h = request.headers.get("x-session-id")
    return h[:256] if h else None


def token_piece(engine, tid: int) -> tuple[str, list[int]]:
    b = engine.tokenizer.token_bytes(tid)
    return b.decode("utf-8", errors="replace"), list(b)

"""The server page's log of recent requests: an ASGI wrapper around the local API that notes each HTTP
request's time, method and route, status, duration (to the end of its body, a whole stream included)
and the tokens its generations produced (the server reports each finished generation to its Metrics,
in the request's own context, where the wrapper's record is reachable). Answered monitoring polls
(GET /health, /slots, /metrics) are left out, as in `hivejet serve`'s access log."""
from __future__ import annotations

import collections
import contextvars
import threading
import time

from app.server.access_log import POLL_PATHS

_record: contextvars.ContextVar[dict | None] = contextvars.ContextVar("hivejet_request_record", default=None)


class RequestLog:
    def __init__(self, maxlen: int = 200):
        self._lock = threading.Lock()
        self.entries: collections.deque[dict] = collections.deque(maxlen=maxlen)   # finished, oldest first
        self.version = 0        # bumped on every change (the page redraws only then)

    def recent(self, n: int = 100) -> list[dict]:
        """The last `n` finished requests, newest first."""
        with self._lock:
            return list(self.entries)[::-1][:n]

    def note_finish(self, fin) -> None:
        """Called with each FinishEvent the server counts; adds its tokens to the request it belongs to."""
        rec = _record.get()
        if rec is not None:
            rec["prompt_tokens"] += fin.usage.prompt_tokens
            rec["tokens"] += fin.usage.completion_tokens

    def attach(self, app):
        """`app` (app/server's create_app result) wrapped: returns the ASGI app to serve."""
        state = getattr(getattr(app, "state", None), "hivejet", None)
        metrics = getattr(state, "metrics", None)
        if metrics is not None:
            counted = metrics.finished

            def finished(fin):
                counted(fin)
                self.note_finish(fin)
            metrics.finished = finished

        async def logged(scope, receive, send):
            if scope.get("type") != "http":
                return await app(scope, receive, send)
            rec = dict(time=time.time(), method=scope.get("method", ""), path=scope.get("path", ""), status=0,
                       prompt_tokens=0, tokens=0, ms=0.0)
            t0 = time.monotonic()
            token = _record.set(rec)

            async def tracking(msg):
                if msg["type"] == "http.response.start":
                    rec["status"] = msg["status"]
                await send(msg)
            try:
                await app(scope, receive, tracking)
            finally:
                _record.reset(token)
                rec["ms"] = (time.monotonic() - t0) * 1000
                if rec["method"] == "GET" and rec["path"] in POLL_PATHS and 200 <= rec["status"] < 400:
                    return           # monitoring polls (hivejet top) would bury the requests that matter
                with self._lock:
                    self.entries.append(rec)
                    self.version += 1
        return logged

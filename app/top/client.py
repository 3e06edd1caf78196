"""A small HTTP client for the HiveJet server (stdlib only): GET /health, /slots, /metrics, and streamed
chat completions with the time to the first token."""
from __future__ import annotations

import http.client
import json
import os
import re
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from urllib.parse import urlparse


class ServerError(Exception):
    def __init__(self, message: str, status: int | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.code = status, code


class Client:
    def __init__(self, url: str, api_key: str | None = None, timeout: float = 10.0):
        self.url = url.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[:-3]
        self.api_key = api_key if api_key is not None else (os.environ.get("HIVEJET_API_KEY", "").split(",")[0] or None)
        self.timeout = timeout

    def _headers(self, extra: dict | None = None) -> dict:
        h = {"Accept": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        if extra:
            h.update(extra)
        return h

    def _open(self, path: str, body: dict | None = None, timeout: float | None = None, headers: dict | None = None):
        data = None
        h = self._headers(headers)
        if body is not None:
            data = json.dumps(body).encode()
            h["Content-Type"] = "application/json"
        req = urllib.request.Request(self.url + path, data=data, headers=h,
                                     method="POST" if body is not None else "GET")
        try:
            return urllib.request.urlopen(req, timeout=timeout or self.timeout)
        except urllib.error.HTTPError as e:
            try:
                msg = json.loads(e.read().decode("utf-8", "replace"))
                msg = msg.get("error", {}).get("message") or str(msg)
            except Exception:
                msg = e.reason
            raise ServerError(f"{path}: HTTP {e.code}: {msg}", e.code) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ServerError(f"cannot reach {self.url}: {reason}") from None

    def get_json(self, path: str, timeout: float | None = None) -> dict:
        with self._open(path, timeout=timeout) as r:
            return json.loads(r.read().decode("utf-8"))

    def get_text(self, path: str, timeout: float | None = None) -> str:
        with self._open(path, timeout=timeout) as r:
            return r.read().decode("utf-8", "replace")

    def health(self, timeout: float = 2.0) -> tuple[str, str]:
        """('ok', model) | ('loading', message) | ('down', message)."""
        try:
            d = self.get_json("/health", timeout=timeout)
            return "ok", d.get("model", "")
        except ServerError as e:
            if e.status == 503:
                return "loading", str(e)
            if e.status is not None:  # something answers (e.g. /health behind a key): treat as up
                return "ok", ""
            return "down", str(e)

    def model_id(self) -> str:
        d = self.get_json("/v1/models")
        return d["data"][0]["id"]

    def chat_stream(self, body: dict, on_text=None, cancel=None, timeout: float = 600.0,
                    session: str | None = None, on_connect=None) -> "ChatResult":
        """POST /v1/chat/completions with stream=true. on_text(piece) gets generated text as it arrives (with
        logprobs on, every token, including the text of tool calls that the server only sends whole).
        cancel: a threading.Event checked as chunks arrive; on_connect(conn) hands out the connection so that
        another thread can abort a stream at once with abort(conn) (the server then cancels the request)."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        res = ChatResult()
        u = urlparse(self.url)
        cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        conn = cls(u.hostname, u.port, timeout=timeout)
        headers = self._headers({"Content-Type": "application/json", "Accept": "text/event-stream"})
        if session:
            headers["x-session-id"] = session
        t0 = time.monotonic()
        calls: dict[int, dict] = {}
        content = []
        try:
            try:
                conn.request("POST", (u.path or "") + "/v1/chat/completions", json.dumps(body).encode(), headers)
                if on_connect is not None:
                    on_connect(conn)
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as e:
                if cancel is not None and cancel.is_set():
                    res.finish_reason = "cancelled"
                    return res
                raise ServerError(f"cannot reach {self.url}: {e}") from None
            if resp.status != 200:
                raise _http_error(resp)
            for obj in _events(resp, cancel, res):
                if "error" in obj:
                    raise ServerError(obj["error"].get("message", "error in stream"))
                if obj.get("usage"):
                    res.usage = obj["usage"]
                for ch in obj.get("choices") or []:
                    _add_choice(ch, res, content, calls, on_text, t0)
        finally:
            conn.close()
        res.seconds = time.monotonic() - t0
        res.content = "".join(content)
        res.tool_calls = [calls[i] for i in sorted(calls)]
        return res


def _http_error(resp) -> ServerError:
    """The ServerError of a chat request answered with an error status (the API's message and code)."""
    raw = resp.read().decode("utf-8", "replace")
    code = None
    try:
        err = json.loads(raw).get("error", {})
        msg, code = err.get("message") or raw, err.get("code")
    except Exception:
        msg = raw or resp.reason
    return ServerError(f"/v1/chat/completions: HTTP {resp.status}: {msg}", resp.status, code)


def _events(resp, cancel, res: "ChatResult"):
    """The JSON objects of a server-sent event stream, until [DONE] or its end; when `cancel` is set the
    stream stops and res.finish_reason becomes "cancelled"."""
    while True:
        if cancel is not None and cancel.is_set():
            res.finish_reason = "cancelled"
            return
        try:
            raw = resp.readline()
        except (OSError, ValueError, http.client.HTTPException) as e:
            if cancel is not None and cancel.is_set():
                res.finish_reason = "cancelled"
                return
            raise ServerError(f"the stream broke off: {e}") from None
        if not raw:
            if cancel is not None and cancel.is_set():
                res.finish_reason = "cancelled"
            return
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def _add_choice(ch: dict, res: "ChatResult", content: list[str], calls: dict[int, dict], on_text, t0: float) -> None:
    """One streamed choice delta: its text (to content and on_text), tool-call pieces (to calls), the time
    to the first token and the finish reason (to res)."""
    delta = ch.get("delta") or {}
    piece = delta.get("content") or ""
    lp = (ch.get("logprobs") or {}).get("content") or []
    tok_text = "".join(x.get("token", "") for x in lp)
    res.streamed_tokens += len(lp)
    got = bool(piece or lp or delta.get("tool_calls") or delta.get("reasoning_content"))
    if got and res.ttft is None:
        res.ttft = time.monotonic() - t0
    if piece:
        content.append(piece)
    text = tok_text or piece or delta.get("reasoning_content") or ""
    if text and on_text is not None:
        on_text(text)
    for tc in delta.get("tool_calls") or []:
        c = calls.setdefault(tc.get("index", 0), {"id": "", "name": "", "arguments": ""})
        c["id"] = tc.get("id") or c["id"]
        fn = tc.get("function") or {}
        c["name"] += fn.get("name") or ""
        c["arguments"] += fn.get("arguments") or ""
    if ch.get("finish_reason"):
        res.finish_reason = ch["finish_reason"]


def abort(conn) -> None:
    """Break off a chat_stream from another thread (its blocking read returns at once)."""
    sock = getattr(conn, "sock", None)
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


@dataclass
class ChatResult:
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict = field(default_factory=dict)
    ttft: float | None = None      # seconds from sending to the first generated token
    seconds: float = 0.0           # the whole request
    streamed_tokens: int = 0       # tokens received (one logprobs entry each, when logprobs were asked for)

    @property
    def completion_tokens(self) -> int:
        """The server's usage count; for a stream broken off before its usage chunk, the tokens received."""
        return int(self.usage.get("completion_tokens") or 0) or self.streamed_tokens

    @property
    def prompt_tokens(self) -> int:
        return int(self.usage.get("prompt_tokens") or 0)


# ----------------------------------------------------------------------------------------------- /metrics
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[str, list[tuple[dict, float]]]:
    """Prometheus text format -> {name: [(labels, value), ...]} (the hivejet_ prefix is kept)."""
    out: dict[str, list[tuple[dict, float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.groups()
        try:
            v = float(value)
        except ValueError:
            continue
        lab = {k: val.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
               for k, val in _LABEL.findall(labels or "")}
        out.setdefault(name, []).append((lab, v))
    return out


def metric(metrics: dict, name: str, default: float | None = 0.0, **labels) -> float | None:
    """One metric's value (summed over samples whose labels match `labels`); `name` without the prefix works."""
    samples = metrics.get(name) or metrics.get("hivejet_" + name)
    if not samples:
        return default
    vals = [v for lab, v in samples if all(lab.get(k) == str(x) for k, x in labels.items())]
    return sum(vals) if vals else default

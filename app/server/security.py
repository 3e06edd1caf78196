"""Server settings and the rules that keep a local API local: bind address vs API keys, constant-time key
checks, a request body size limit, and image sources (no remote fetches unless enabled, no files outside an
allowed folder)."""
from __future__ import annotations

import base64
import binascii
import hmac
import http.client
import ipaddress
import os
import socket
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urljoin, urlparse

__all__ = ["ServerSettings", "SettingsError", "is_loopback", "check_api_key", "host_refusal", "BodySizeLimit",
           "ImageError", "load_image", "fetch_image"]


class SettingsError(ValueError):
    """The server refuses to start with these settings."""


def is_loopback(host: str) -> bool:
    h = host.strip().strip("[]").lower()
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 18080
    api_keys: list[str] = field(default_factory=list)
    cors_origins: list[str] = field(default_factory=list)        # empty: CORS off
    max_body_bytes: int = 32 * 1024 * 1024
    max_json_values: int = 100_000                               # objects + arrays in one request body
    max_json_items: int = 1_000_000                              # values inside them (array entries, members)
    allow_remote_images: bool = False
    remote_image_max_bytes: int = 20 * 1024 * 1024               # a fetched image (engine.vision's limit)
    remote_image_timeout: float = 10.0                           # seconds for the whole fetch
    media_dir: str | None = None                                 # file:// images only from here
    model_aliases: list[str] = field(default_factory=list)       # extra names accepted in "model"
    accept_any_model: bool = False                               # any "model" name maps to the loaded one
    max_tokens_limit: int = 0                                    # 0 = no cap beyond the context
    public_health: bool = True                                   # /health answers without a key
    allowed_hosts: list[str] = field(default_factory=list)       # Host names accepted beyond loopback ("*": any)

    def validate(self) -> None:
        if not 0 <= int(self.port) <= 65535:
            raise SettingsError(f"port {self.port} is out of range")
        for k in self.api_keys:
            if not k or len(k) < 8:
                raise SettingsError("API keys must be at least 8 characters")
        if not is_loopback(self.host) and not self.api_keys:
            raise SettingsError(f"refusing to listen on {self.host}: listening on an address other than loopback "
                                "needs an API key (--api-key KEY or HIVEJET_API_KEY)")
        if self.max_body_bytes < 1024:
            raise SettingsError("max_body_bytes must be at least 1024")
        for h in self.allowed_hosts:
            if not h or any(c in h for c in "/ @?#"):
                raise SettingsError(f"allowed host {h!r}: give a host name or address (no scheme, path or port)")
        if self.media_dir is not None and not Path(self.media_dir).is_dir():
            raise SettingsError(f"media folder {self.media_dir} does not exist")

    @classmethod
    def keys_from_env(cls) -> list[str]:
        v = os.environ.get("HIVEJET_API_KEY", "")
        return [k for k in v.split(",") if k]


def check_api_key(given: str | None, keys: list[str]) -> bool:
    """True when `given` matches one of `keys`; compares with every key in constant time."""
    if not keys:
        return True
    g = (given or "").encode("utf-8", "surrogatepass")
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(g, k.encode("utf-8", "surrogatepass"))
    return ok and bool(g)


def _host_name(header: str) -> str:
    """The name in a Host header, without its port ("[::1]:8080" -> "::1")."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


def host_refusal(host_header: str | None, settings: ServerSettings) -> str | None:
    """Why a request's Host header is refused, or None. A server without API keys answers only requests
    addressed to a loopback name (localhost, 127.0.0.1, [::1]), the address it listens on, or a name in
    `allowed_hosts`: a web page that rebinds its own domain name to 127.0.0.1 (DNS rebinding) cannot drive
    it. With keys, only `allowed_hosts` (when given) restricts the names."""
    extra = [h.strip("[]").lower() for h in settings.allowed_hosts]
    if "*" in extra or (settings.api_keys and not extra) or not host_header:
        return None
    name = _host_name(host_header)
    if name in extra or (not settings.api_keys and (is_loopback(name)
                                                    or name == settings.host.strip("[]").lower())):
        return None
    return (f"the Host header names {name!r}, which this server does not answer to: it answers requests "
            f"addressed to localhost, 127.0.0.1 or [::1]{' or ' + ', '.join(extra) if extra else ''} (a guard "
            "against DNS rebinding; start it with --allowed-hosts NAME to accept another name)")


def key_from_headers(headers) -> str | None:
    auth = headers.get("authorization")
    if auth:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer":
            return value.strip()
    return headers.get("x-api-key")


_KEEP = b'"{[,'
_DROP = bytes(b for b in range(256) if b not in _KEEP)
_QUOTE, _COMMA, _BRACE, _BRACKET = b'",{['


def json_counts(body: bytes, block: int = 1 << 22) -> tuple[int, int]:
    """(objects and arrays, values inside them) in a JSON text, found without parsing it; brackets and commas
    inside strings are not counted. Parsed and validated, an object or array costs hundreds of bytes and a
    value in one tens of bytes (a token-id list of 10 million entries takes gigabytes), so a body's counts
    bound the memory it can take. The text is reduced (in C) to its quotes, opening brackets and commas,
    escaped quotes and backslashes removed; then, a block at a time, a running count of quotes tells which
    characters are inside a string. The values are at most one per comma plus one per object or array.
    Memory stays a fraction of the body."""
    import numpy as np
    bare = np.frombuffer(body.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _DROP), np.uint8)
    containers = commas = 0
    open_string = 0
    for i in range(0, len(bare), block):
        part = bare[i:i + block]
        # quotes so far, mod 2 (a uint8 sum wraps at 256, which keeps its parity): 1 inside a string
        outside = ((np.cumsum(part == _QUOTE, dtype=np.uint8) + open_string) & 1) == 0
        containers += int(np.count_nonzero(((part == _BRACE) | (part == _BRACKET)) & outside))
        commas += int(np.count_nonzero((part == _COMMA) & outside))
        open_string = int(not outside[-1])
    return containers, containers + commas


def release_freed_memory() -> None:
    """Give the memory freed after a large request back to the system (glibc keeps large freed blocks in
    the heap otherwise, and the process stays gigabytes larger after one big body)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class BodySizeLimit:
    """ASGI middleware: refuse bodies over `limit` bytes with 413, before anything parses them. A declared
    Content-Length over the limit is refused up front; otherwise the body is read here as it arrives (chunked
    included) and refused the moment it passes the limit, so the route's JSON parsing sees only bodies within
    it, whole, in one piece. A body holding more JSON objects and arrays than `max_json_values`, or more
    values in them than `max_json_items`, is refused (413) unparsed too."""

    def __init__(self, app, limit: int, error_body, max_json_values: int = 100_000,
                 max_json_items: int = 1_000_000):
        self.app, self.limit, self.error_body = app, limit, error_body
        self.max_json_values, self.max_json_items = max_json_values, max_json_items

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = None
        for k, v in scope.get("headers", []):
            if k == b"content-length":
                try:
                    length = int(v)
                except ValueError:
                    length = -1
        if length is not None and (length > self.limit or length < 0):
            return await self._refuse(scope, send, length)
        chunks, seen = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":      # the client went away before sending the whole body
                return
            part = msg.get("body", b"")
            seen += len(part)
            if seen > self.limit:
                chunks.clear()
                return await self._refuse(scope, send, seen)
            if part:
                chunks.append(part)
            if not msg.get("more_body", False):
                break
        pending = [b"".join(chunks) if len(chunks) != 1 else chunks[0]]
        chunks.clear()
        big = len(pending[0]) > 4 << 20
        why = await self._too_many_values(pending[0])
        if why:
            pending.clear()
            if big:
                release_freed_memory()
            return await self._refuse(scope, send, seen, why)

        async def replay():
            if pending:
                return {"type": "http.request", "body": pending.pop(), "more_body": False}
            return await receive()               # afterwards: http.disconnect, for the streaming routes

        try:
            await self.app(scope, replay, send)
        finally:
            if big:
                pending.clear()
                release_freed_memory()

    async def _too_many_values(self, body: bytes) -> str | None:
        """Why `body` holds too many JSON values to be parsed, or None. The counts of brackets and commas are
        upper bounds (some may be in strings): the exact count is made only when they pass a limit."""
        containers = body.count(b"{") + body.count(b"[")
        items = containers + body.count(b",")
        if containers > self.max_json_values or items > self.max_json_items:
            from starlette.concurrency import run_in_threadpool
            containers, items = await run_in_threadpool(json_counts, body)
        if containers > self.max_json_values:
            return (f"the request body holds {containers:,} JSON objects and arrays, more than the "
                    f"{self.max_json_values:,} a request may have")
        if items > self.max_json_items:
            return (f"the request body holds {items:,} JSON values (array entries and object members), more "
                    f"than the {self.max_json_items:,} a request may have")
        return None

    async def _refuse(self, scope, send, length, why: str | None = None):
        import json
        body = json.dumps(self.error_body(scope.get("path", ""), 413,
                                          why or f"request body too large (limit {self.limit} bytes)",
                                          code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


# ----------------------------------------------------------------------------------------------- images
class ImageError(ValueError):
    """A bad or forbidden image (HTTP 400)."""


_IMAGE_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a", b"RIFF", b"BM")


def _check_image_bytes(data: bytes, where: str) -> bytes:
    if not data:
        raise ImageError(f"{where}: the image is empty")
    if not data.startswith(_IMAGE_MAGIC) or (data.startswith(b"RIFF") and data[8:12] != b"WEBP"):
        raise ImageError(f"{where}: not a PNG, JPEG, GIF, WebP or BMP image")
    return data


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """Follow redirects only to http(s) URLs (urllib would also follow ftp://)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urlparse(urljoin(req.full_url, newurl)).scheme not in ("http", "https"):
            raise ImageError(f"the image URL redirects to {newurl!r}, which is not http(s)")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class _Deadline:
    """Shuts down every socket a fetch opened once its time is up, so a server that sends a byte at a time
    (each within the per-read timeout) cannot stretch the fetch past the limit."""

    def __init__(self, seconds: float):
        self.expired = False
        self._socks: list = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def register(self, sock) -> None:
        with self._lock:
            self._socks.append(sock)
            if self.expired:
                self._shut(sock)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            for sock in self._socks:
                self._shut(sock)

    @staticmethod
    def _shut(sock) -> None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def cancel(self) -> None:
        self._timer.cancel()


def _deadline_handlers(deadline: _Deadline):
    """urllib handlers whose connections register their sockets with `deadline`."""

    def conn_class(base):
        class Conn(base):
            def connect(self):
                super().connect()
                deadline.register(self.sock)
        return Conn

    class Http(urllib.request.HTTPHandler):
        def http_open(self, req):
            return self.do_open(conn_class(http.client.HTTPConnection), req)

    class Https(urllib.request.HTTPSHandler):
        def https_open(self, req):
            return self.do_open(conn_class(http.client.HTTPSConnection), req, context=self._context)

    return [Http(), Https()]


def fetch_image(url: str, settings: ServerSettings, where: str = "image") -> bytes:
    """GET an http(s) image with the server's limits: at most `remote_image_max_bytes`, the whole fetch
    (connecting, headers, redirects, body) within `remote_image_timeout` seconds, redirects only to http(s);
    then engine.vision.load_image checks the bytes. Raises ImageError (HTTP 400) naming the problem."""
    from engine.vision import ImageError as EngineImageError
    from engine.vision import load_image as decode_image
    if urlparse(url).scheme not in ("http", "https"):
        raise ImageError(f"{where}: only http and https image URLs can be fetched")
    limit = int(settings.remote_image_max_bytes)
    seconds = float(settings.remote_image_timeout)
    deadline = _Deadline(seconds)
    opener = urllib.request.build_opener(_HttpOnlyRedirects, *_deadline_handlers(deadline))
    req = urllib.request.Request(url, headers={"User-Agent": "hivejet", "Accept": "image/*"})
    chunks, n = [], 0
    try:
        with opener.open(req, timeout=seconds) as r:
            size = r.headers.get("Content-Length")
            if size and size.isdigit() and int(size) > limit:
                raise ImageError(f"{where}: the image at {url} is {int(size):,} bytes, more than the "
                                 f"{limit:,} byte limit")
            while True:
                chunk = r.read1(min(1 << 16, limit + 1 - n)) if hasattr(r, "read1") else r.read(1 << 16)
                if deadline.expired:
                    raise TimeoutError
                if not chunk:
                    break
                chunks.append(chunk)
                n += len(chunk)
                if n > limit:
                    raise ImageError(f"{where}: the image at {url} is more than the {limit:,} byte limit")
    except ImageError as e:
        raise ImageError(str(e) if str(e).startswith(where) else f"{where}: {e}") from None
    except urllib.error.HTTPError as e:
        raise ImageError(f"{where}: fetching {url} failed: HTTP {e.code} {e.reason}") from None
    except (TimeoutError, socket.timeout):
        raise ImageError(f"{where}: fetching {url} took longer than {seconds:g} s") from None
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:
        if deadline.expired:
            raise ImageError(f"{where}: fetching {url} took longer than {seconds:g} s") from None
        raise ImageError(f"{where}: fetching {url} failed: {getattr(e, 'reason', e)}") from None
    finally:
        deadline.cancel()
    if deadline.expired:
        raise ImageError(f"{where}: fetching {url} took longer than {seconds:g} s")
    data = b"".join(chunks)
    try:
        decode_image(data, max_bytes=limit)
    except EngineImageError as e:
        raise ImageError(f"{where}: {e}") from None
    return data


def load_image(url: str, settings: ServerSettings, where: str = "image") -> bytes:
    """The bytes of an image given as a data: URL, a file:// URL inside the media folder, or (when enabled)
    an http(s) URL. Raises ImageError for anything else."""
    if not isinstance(url, str) or not url:
        raise ImageError(f"{where}: empty image URL")
    if url.startswith("data:"):
        head, sep, payload = url.partition(",")
        if not sep or ";base64" not in head:
            raise ImageError(f"{where}: data URLs must be base64 (data:image/png;base64,...)")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageError(f"{where}: the base64 data is not valid") from None
        return _check_image_bytes(data, where)
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https"):
        if not settings.allow_remote_images:
            raise ImageError(f"{where}: remote image URLs are disabled on this server (send the image as a data: URL, "
                             "or start the server with --allow-remote-images)")
        return _check_image_bytes(fetch_image(url, settings, where), where)
    if parsed.scheme == "file":
        if not settings.media_dir:
            raise ImageError(f"{where}: file URLs are disabled on this server")
        root = Path(settings.media_dir).resolve()
        try:
            path = Path(unquote(parsed.path)).resolve()
        except (OSError, RuntimeError, ValueError):
            raise ImageError(f"{where}: bad file path") from None
        if not path.is_relative_to(root):
            raise ImageError(f"{where}: files outside the media folder cannot be read")
        if not path.is_file():
            raise ImageError(f"{where}: no such file in the media folder")
        return _check_image_bytes(path.read_bytes(), where)
    raise ImageError(f"{where}: unsupported image URL scheme {parsed.scheme!r}")

"""A local fake of the Hugging Face Hub for tests: the routes huggingface_hub (and app/downloads.py) call.

    GET  /api/models?search=&filter=gguf&limit=&sort=      model search (list of {id, downloads, likes, tags, ...})
    GET  /api/models/{owner}/{name}[/revision/{rev}]        model info with siblings
    GET  /api/models/{owner}/{name}/tree/{rev}[/{path}]     file listing: size, oid, lfs {oid (sha256), size}
    HEAD|GET /{owner}/{name}/resolve/{rev}/{file}           the bytes; Range (206), ETag, X-Repo-Commit,
                                                            X-Linked-Size/X-Linked-Etag, Accept-Ranges

Knobs for failure tests: `rate` (bytes/s, to make a download slow enough to pause), `drop_after`
(close the connection after this many body bytes of the next file response longer than that: a lost
network),
`offline` (every request fails with a closed connection), `corrupt` (serve wrong bytes for files).

Use: `with FakeHub({"org/repo": {"a-Q4_K_M.gguf": b"..."}}) as hub: ... hub.url ...`
"""
from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, repos: dict[str, dict[str, bytes]], lfs: bool = True):
        self.repos = repos
        self.lfs = lfs
        self.rate: float | None = None
        self.drop_after: int | None = None
        self.offline = False
        self.corrupt = False
        self.requests: list[tuple[str, str, dict]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_HEAD(self):
                hub._handle(self, head=True)

            def do_GET(self):
                hub._handle(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    # ----- routes -----
    @staticmethod
    def sha(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()

    def _json(self, h, obj, status=200, head=False):
        body = json.dumps(obj).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def _error(self, h, status, msg, head=False):
        h.send_response(status)
        body = json.dumps({"error": msg}).encode()
        h.send_header("Content-Type", "application/json")
        h.send_header("X-Error-Code", "RepoNotFound" if status == 404 else "Error")
        h.send_header("X-Error-Message", msg)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def _model_entry(self, rid):
        return {"id": rid, "modelId": rid, "author": rid.split("/")[0], "downloads": 1000 + len(rid),
                "likes": 7, "tags": ["gguf"], "library_name": "gguf", "private": False,
                "lastModified": "2026-01-02T03:04:05.000Z", "createdAt": "2025-01-01T00:00:00.000Z"}

    def _tree_entry(self, name, data):
        e = {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
        if self.lfs:
            e["lfs"] = {"oid": self.sha(data), "size": len(data), "pointerSize": 134}
        return e

    def _handle(self, h, head):
        u = urlparse(h.path)
        path = unquote(u.path)
        q = parse_qs(u.query)
        self.requests.append((h.command, path, dict(h.headers)))
        if self.offline:
            h.close_connection = True
            h.wfile.flush()
            h.connection.shutdown(2)
            return
        if path == "/api/models":
            search = (q.get("search") or [""])[0].lower()
            limit = int((q.get("limit") or ["1000"])[0])
            hits = [self._model_entry(r) for r in self.repos if search in r.lower()][:limit]
            return self._json(h, hits, head=head)
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(/.*)?", path)
        if m:
            rid, sub = m.group(1), (m.group(3) or "").strip("/")
            if rid not in self.repos:
                return self._error(h, 404, "Repository not found", head)
            files = [self._tree_entry(n, d) for n, d in sorted(self.repos[rid].items()) if n.startswith(sub)]
            return self._json(h, files, head=head)
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
        if m:
            rid = m.group(1)
            if rid not in self.repos:
                return self._error(h, 404, "Repository not found", head)
            e = self._model_entry(rid)
            e["sha"] = COMMIT
            e["siblings"] = [{"rfilename": n, "size": len(d)} for n, d in sorted(self.repos[rid].items())]
            return self._json(h, e, head=head)
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m:
            rid, _rev, name = m.groups()
            data = self.repos.get(rid, {}).get(name)
            if data is None:
                return self._error(h, 404, "Entry not found", head)
            return self._file(h, data, head)
        return self._error(h, 404, f"no route {path}", head)

    def _file(self, h, data: bytes, head: bool):
        if self.corrupt:
            data = bytes(b ^ 0xFF for b in data)
        etag = f'"{self.sha(data)}"'
        start, end = 0, len(data) - 1
        rng = h.headers.get("Range")
        status = 200
        if rng:
            mm = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
            if mm:
                start = int(mm.group(1))
                if mm.group(2):
                    end = min(int(mm.group(2)), end)
                if start >= len(data):
                    h.send_response(416)
                    h.send_header("Content-Range", f"bytes */{len(data)}")
                    h.send_header("Content-Length", "0")
                    h.end_headers()
                    return
                status = 206
        body = data[start:end + 1]
        h.send_response(status)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(len(body)))
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("ETag", etag)
        h.send_header("X-Repo-Commit", COMMIT)
        h.send_header("X-Linked-Size", str(len(data)))
        h.send_header("X-Linked-Etag", etag)
        if status == 206:
            h.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        h.end_headers()
        if head:
            return
        drop = self.drop_after
        if drop is not None and drop < len(body):  # a file shorter than the cut passes untouched
            self.drop_after = None
        else:
            drop = None
        sent = 0
        step = 16 * 1024
        try:
            while sent < len(body):
                n = min(step, len(body) - sent)
                if drop is not None and sent + n > drop:
                    h.wfile.write(body[sent:drop])
                    h.wfile.flush()
                    h.close_connection = True
                    h.connection.shutdown(2)
                    return
                h.wfile.write(body[sent:sent + n])
                sent += n
                if self.rate:
                    time.sleep(n / self.rate)
        except (BrokenPipeError, ConnectionResetError, OSError):
            h.close_connection = True


def fake_gguf_bytes(n: int, seed: int = 0) -> bytes:
    """Deterministic bytes standing in for a model file (downloads never parse them)."""
    import random
    r = random.Random(seed)
    return b"GGUF" + r.randbytes(n - 4)

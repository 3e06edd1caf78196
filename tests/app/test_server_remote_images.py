"""--allow-remote-images: http(s) image URLs fetched with limits (size, total time, http(s)-only redirects) from a
local http.server; errors are 400s in the OpenAI and Anthropic error shapes; without the flag they stay refused."""
from __future__ import annotations

import base64
import io
import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image

from app.server.security import ImageError, ServerSettings, load_image


def png(w=40, h=30) -> bytes:
    a = np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "PNG")
    return buf.getvalue()


PNG = png()
BIG = PNG + b"\0" * 5000          # a valid PNG header, over the small limit the tests set


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        if self.path == "/cat.png":
            self._send(PNG)
        elif self.path == "/big.png":
            self._send(BIG)
        elif self.path == "/big-chunked.png":        # no Content-Length: the limit applies while reading
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(BIG)
            self.close_connection = True
        elif self.path == "/text":
            self._send(b"hello, not an image")
        elif self.path == "/to-ftp":
            self.send_response(302)
            self.send_header("Location", "ftp://127.0.0.1/cat.png")
            self.end_headers()
        elif self.path == "/to-cat":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.end_headers()
        elif self.path == "/slow.png":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            for i in range(0, len(PNG), 16):
                self.wfile.write(PNG[i:i + 16])
                self.wfile.flush()
                time.sleep(0.1)
        else:
            self.send_error(404)

    def _send(self, data: bytes):
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def web():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_fetch_rules(web):
    s = ServerSettings(allow_remote_images=True, remote_image_max_bytes=4096, remote_image_timeout=1.0)
    assert load_image(f"{web}/cat.png", s) == PNG
    assert load_image(f"{web}/to-cat", s) == PNG                   # http redirects are followed
    for path, msg in (("/big.png", "limit"), ("/big-chunked.png", "limit"), ("/missing.png", "HTTP 404"),
                      ("/text", "not a PNG"), ("/to-ftp", "not http"), ("/slow.png", "longer than 1 s")):
        with pytest.raises(ImageError, match=msg):
            load_image(web + path, s)
    with pytest.raises(ImageError, match="failed"):
        load_image("http://127.0.0.1:9/cat.png", s)                 # nothing listens there
    with pytest.raises(ImageError, match="disabled"):
        load_image(f"{web}/cat.png", ServerSettings())


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from engine.engine import Engine, EngineConfig
    from engine.tools.synth_mmproj import write_mmproj, write_vlm
    d = tmp_path_factory.mktemp("remote_images")
    model = write_vlm(d / "qwen35-vlm.gguf", "qwen35")["path"]
    write_mmproj(d / "mmproj-qwen35-vlm.gguf", "qwen3vl_merger")
    eng = Engine(EngineConfig(model=str(model), mmproj="auto", threads=1))
    assert eng.has_vision
    yield eng
    eng.shutdown()


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"},
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_server_fetches_with_flag(vlm, web):
    from app.server.app import ServerThread, create_app
    srv = ServerThread(create_app(vlm, ServerSettings(allow_remote_images=True, remote_image_max_bytes=4096,
                                                   accept_any_model=True))).start()
    try:
        def oa(url):
            return post(srv.url + "/v1/chat/completions", {"model": "m", "max_tokens": 2, "temperature": 0,
                        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                                  {"type": "text", "text": "What is this?"}]}]})

        def an(url):
            return post(srv.url + "/v1/messages", {"model": "m", "max_tokens": 2, "messages": [{"role": "user",
                        "content": [{"type": "image", "source": {"type": "url", "url": url}},
                                    {"type": "text", "text": "What is this?"}]}]})

        status, r = oa(f"{web}/cat.png")
        assert status == 200, r
        data_url = "data:image/png;base64," + base64.b64encode(PNG).decode()
        status, r2 = oa(data_url)
        assert status == 200 and r["usage"]["prompt_tokens"] == r2["usage"]["prompt_tokens"] > 20   # same image
        status, r = an(f"{web}/cat.png")
        assert status == 200 and r["usage"]["input_tokens"] == r2["usage"]["prompt_tokens"]
        for path, msg in (("/missing.png", "404"), ("/big.png", "limit")):
            status, err = oa(web + path)
            assert status == 400 and msg in err["error"]["message"] and err["error"]["code"] == "invalid_image"
            status, err = an(web + path)
            assert status == 400 and err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
            assert msg in err["error"]["message"]
    finally:
        srv.stop()
    srv = ServerThread(create_app(vlm, ServerSettings(accept_any_model=True))).start()
    try:
        status, err = post(srv.url + "/v1/chat/completions", {"model": "m", "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"{web}/cat.png"}}]}]})
        assert status == 400 and "disabled" in err["error"]["message"]
    finally:
        srv.stop()

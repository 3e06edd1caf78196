"""`hivejet serve` on the demo model, sent four request bodies just under the 32 MB limit at once, of the
shapes that cost most once parsed: one long message, a completions prompt of millions of token ids, a
message of many text parts. Each is refused within seconds, the server's memory peak stays a small
multiple of the bodies, and afterwards the memory is handed back."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx2")

BODY = 31 << 20


def _kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _bodies(model: str) -> list[tuple[str, bytes, int]]:
    """(route, body, expected status) for each shape, each body under 32 MB."""
    long_text = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "word " * (BODY // 5)}]}
    ids = {"model": model, "max_tokens": 2, "prompt": [12345] * (BODY // 7)}
    parts = {"model": model, "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "w" * 300}] * 99_000}]}
    out = [("/v1/chat/completions", json.dumps(long_text).encode(), 400),
           ("/v1/completions", json.dumps(ids).encode(), 413),
           ("/v1/chat/completions", json.dumps(parts).encode(), 400)]
    assert all(len(b) < 32 << 20 for _, b, _ in out)
    return out


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_four_bodies_near_the_limit_at_once(smollm2_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "app.server", "-m", str(smollm2_path), "--port", str(port),
                             "-c", "8192", "--log-level", "warning"], stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while "serving" not in proc.stderr.readline():
            assert proc.poll() is None and time.monotonic() - t0 < 120
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        base = _kib(proc.pid, "VmRSS")
        for route, body, status in _bodies(model):
            with open(f"/proc/{proc.pid}/clear_refs", "w") as f:
                f.write("5")                     # the peak (VmHWM) restarts from the current size
            answers = []

            def send():
                t = time.monotonic()
                r = httpx.post(url + route, content=body, headers={"content-type": "application/json"}, timeout=120)
                answers.append((r.status_code, time.monotonic() - t, r.text[:200]))
            threads = [threading.Thread(target=send) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            time.sleep(0.5)
            peak_mb = (_kib(proc.pid, "VmHWM") - base) / 1024
            after_mb = (_kib(proc.pid, "VmRSS") - base) / 1024
            assert [a[0] for a in answers] == [status] * 4, (route, answers)
            assert max(a[1] for a in answers) < 30, (route, answers)
            assert peak_mb < 1500, (route, peak_mb)           # 4 x 31 MB sent (unbounded: 11.1 GB; a loaded 2-core run: 809 MB)
            assert after_mb < 120, (route, after_mb)          # handed back
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()

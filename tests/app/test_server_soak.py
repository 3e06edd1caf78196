"""32 concurrent streaming clients for 60 s (HIVEJET_SOAK_SECONDS), a third of them hanging up early, against
a server with a small queue: nothing fails except the intended 429s, and afterwards no sequence is left."""
from __future__ import annotations

import json
import os
import random
import threading
import time

import pytest

httpx = pytest.importorskip("httpx2")

CLIENTS = 32
SECONDS = float(os.environ.get("HIVEJET_SOAK_SECONDS", "60"))


@pytest.fixture(scope="module")
def server(smollm2_path):
    from app.server.app import ServerThread, create_app
    from app.server.security import ServerSettings
    from engine.engine import Engine, EngineConfig
    eng = Engine(EngineConfig(model=str(smollm2_path), ctx_size=256, max_seqs=16, max_queue=6))
    srv = ServerThread(create_app(eng, ServerSettings())).start()
    srv.engine = eng
    yield srv
    srv.stop()
    eng.shutdown()


@pytest.mark.slow
def test_32_streaming_clients_with_disconnects(server):
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    stats = {"done": 0, "hung_up": 0, "429": 0}
    errors: list[str] = []
    lock = threading.Lock()
    deadline = time.monotonic() + SECONDS

    def client(i: int):
        rng = random.Random(i)
        hang_up = i % 3 == 0
        with httpx.Client(timeout=120) as c:
            while time.monotonic() < deadline:
                body = {"model": model, "stream": True, "max_tokens": rng.randint(3, 10), "session": f"agent-{i}",
                        "messages": [{"role": "user", "content": f"Count to {rng.randint(3, 9)}."}],
                        "stream_options": {"include_usage": True}}
                try:
                    with c.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
                        if r.status_code == 429:
                            assert r.headers.get("retry-after"), "429 without Retry-After"
                            r.read()
                            assert r.json()["error"]["type"] == "requests"
                            with lock:
                                stats["429"] += 1
                            time.sleep(0.2 + rng.random() * 0.5)
                            continue
                        assert r.status_code == 200, f"{r.status_code} {r.read()!r}"
                        n, done, finish = 0, False, None
                        for line in r.iter_lines():
                            if not line.startswith("data: "):
                                continue
                            if line == "data: [DONE]":
                                done = True
                                break
                            obj = json.loads(line[6:])
                            assert "error" not in obj, obj
                            if obj["choices"] and obj["choices"][0]["finish_reason"]:
                                finish = obj["choices"][0]["finish_reason"]
                            n += 1
                            if hang_up and n >= 2:
                                break
                        with lock:
                            if hang_up and not done:
                                stats["hung_up"] += 1
                            else:
                                assert done and finish in ("stop", "length"), (done, finish)
                                stats["done"] += 1
                except Exception as e:  # noqa: BLE001 - every failure is reported
                    with lock:
                        errors.append(f"client {i}: {type(e).__name__}: {e}")
                    return

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SECONDS + 180)
    assert not errors, errors[:5]
    assert stats["done"] > 0 and stats["hung_up"] > 0, stats
    eng = server.engine
    t0 = time.monotonic()
    while eng.stats()["running"] or eng.stats()["waiting"]:
        assert time.monotonic() - t0 < 10, eng.stats()
        time.sleep(0.1)
    assert httpx.get(server.url + "/slots").json()["slots"] == []
    print(f"soak: {stats}")

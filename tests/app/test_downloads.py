"""app/downloads.py against the local fake hub: search, file listing, download, pause/resume (also after
a restart), cancel, checksum, free disk, lost network. Never the real hub."""
from __future__ import annotations

import time

import pytest

from app import downloads as D
from tests.app.fakehub import FakeHub, fake_gguf_bytes

BIG = fake_gguf_bytes(3 << 20, seed=1)
REPOS = {
    "acme/Qwen3-Tiny-GGUF": {"Qwen3-Tiny-Q4_K_M.gguf": BIG, "Qwen3-Tiny-Q8_0.gguf": fake_gguf_bytes(4096, 2),
                             "mmproj-Qwen3-Tiny-F16.gguf": fake_gguf_bytes(2048, 3), "README.md": b"# hi"},
    "other/Gemma-GGUF": {"gemma-IQ4_XS.gguf": fake_gguf_bytes(1000, 4)},
}


@pytest.fixture
def hub():
    with FakeHub({k: dict(v) for k, v in REPOS.items()}) as h:
        yield h


def wait_state(d, states, timeout=20):
    t = time.time()
    while d.state not in states:
        if time.time() - t > timeout:
            raise AssertionError(f"state {d.state} ({d.error}) never became {states}")
        time.sleep(0.02)


def test_quant_and_kind():
    assert D.quant_of("Qwen3.6-27B-Q4_K_M.gguf") == "Q4_K_M"
    assert D.quant_of("model-IQ4_XS.gguf") == "IQ4_XS"
    assert D.quant_of("gemma-3-270m-it-q8_0.gguf") == "Q8_0"
    assert D.quant_of("x-BF16-00001-of-00002.gguf") == "BF16"
    assert D.kind_of("mmproj-F16.gguf") == "mmproj" and D.kind_of("Qwen-dflash-draft.gguf") == "drafter"


def test_search_and_files(hub):
    c = D.HubClient(hub.url)
    hits = c.search("qwen")
    assert [h.id for h in hits] == ["acme/Qwen3-Tiny-GGUF"]
    files = c.files("acme/Qwen3-Tiny-GGUF")
    assert [f.path for f in files] == ["Qwen3-Tiny-Q4_K_M.gguf", "Qwen3-Tiny-Q8_0.gguf", "mmproj-Qwen3-Tiny-F16.gguf"]
    assert files[0].quant == "Q4_K_M" and files[0].size == len(BIG) and files[0].sha256 == FakeHub.sha(BIG)
    assert files[2].kind == "mmproj"
    with pytest.raises(D.HubError, match="not found"):
        c.files("nobody/nothing")


def test_offline_is_a_message(monkeypatch):
    c = D.HubClient("http://127.0.0.1:9")   # nothing listens there
    with pytest.raises(D.HubError, match="cannot reach|offline"):
        c.search("x")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(D.HubError, match="offline"):
        D.HubClient("http://127.0.0.1:9").search("x")


def test_download_verify_and_library(hub, tmp_path):
    m = D.DownloadManager(tmp_path, D.HubClient(hub.url))
    f = D.HubClient(hub.url).files("acme/Qwen3-Tiny-GGUF")[0]
    d = m.start(f)
    wait_state(d, ("done", "failed"))
    assert d.state == "done", d.error
    assert d.dest.read_bytes() == BIG and not d.part.exists() and not d.sidecar.exists()
    assert d.dest.parent.name == "acme--Qwen3-Tiny-GGUF"


def test_pause_resume_after_restart_and_cancel(hub, tmp_path):
    hub.rate = 1.5e6   # ~2 s for 3 MB
    client = D.HubClient(hub.url)
    f = client.files("acme/Qwen3-Tiny-GGUF")[0]
    m = D.DownloadManager(tmp_path, client)
    d = m.start(f)
    wait_state(d, ("downloading",))
    while d.done_bytes < 200_000:
        time.sleep(0.02)
    m.pause(d)
    wait_state(d, ("paused",))
    assert 0 < d.part.stat().st_size < len(BIG) and d.sidecar.exists()
    assert d.speed == 0.0
    # restart: a new manager finds the half-finished download and resumes it with a Range request
    hub.rate = None
    m2 = D.DownloadManager(tmp_path, client)
    restored = m2.restore()
    assert [r.filename for r in restored] == [f.path] and restored[0].state == "paused"
    assert restored[0].done_bytes == d.part.stat().st_size
    m2.resume(restored[0])
    wait_state(restored[0], ("done", "failed"))
    assert restored[0].state == "done", restored[0].error
    assert restored[0].dest.read_bytes() == BIG
    assert any(h.get("Range", "").startswith("bytes=") for _, p, h in hub.requests if "resolve" in p)
    # cancel removes the partial file
    hub.rate = 1e6
    g = client.files("acme/Qwen3-Tiny-GGUF")[1]
    hub.repos["acme/Qwen3-Tiny-GGUF"][g.path] = BIG[:2 << 20]
    g.size, g.sha256 = 2 << 20, FakeHub.sha(BIG[:2 << 20])
    d3 = m2.start(g)
    wait_state(d3, ("downloading",))
    m2.cancel(d3)
    wait_state(d3, ("cancelled",))
    assert not d3.part.exists() and not d3.sidecar.exists() and not d3.dest.exists()


def test_lost_network_then_resume(hub, tmp_path):
    client = D.HubClient(hub.url)
    f = client.files("acme/Qwen3-Tiny-GGUF")[0]
    hub.drop_after = 1 << 20
    m = D.DownloadManager(tmp_path, client)
    d = m.start(f)
    wait_state(d, ("failed", "done"))
    assert d.state == "failed" and "Network lost" in d.error and "Resume" in d.error
    assert d.part.stat().st_size == 1 << 20
    m.resume(d)
    wait_state(d, ("done", "failed"))
    assert d.state == "done" and d.dest.read_bytes() == BIG


def test_checksum_mismatch(hub, tmp_path):
    client = D.HubClient(hub.url)
    f = client.files("other/Gemma-GGUF")[0]
    hub.corrupt = True
    m = D.DownloadManager(tmp_path, client)
    d = m.start(f)
    wait_state(d, ("failed", "done"))
    assert d.state == "failed" and "Checksum mismatch" in d.error
    assert not d.dest.exists() and not d.part.exists()


def test_full_disk(hub, tmp_path, monkeypatch):
    import collections
    Usage = collections.namedtuple("Usage", "total used free")
    monkeypatch.setattr(D.shutil, "disk_usage", lambda p: Usage(10 << 30, 10 << 30, 1 << 20))
    client = D.HubClient(hub.url)
    m = D.DownloadManager(tmp_path, client)
    d = m.start(client.files("acme/Qwen3-Tiny-GGUF")[0])
    wait_state(d, ("failed", "done"))
    assert d.state == "failed" and "Not enough disk space" in d.error


def test_scan_library_pairs_and_reports_broken(tmp_path, smollm2_path):
    import shutil
    repo = tmp_path / "acme--Tiny"
    repo.mkdir()
    shutil.copy(smollm2_path, repo / "SmolLM2-Q4_1.gguf")
    (repo / "mmproj-F16.gguf").write_bytes(b"GGUF" + b"\0" * 10)   # broken, so not paired
    (tmp_path / "broken.gguf").write_bytes(b"nope")
    lib = {m.path.name: m for m in D.scan_library(tmp_path)}
    assert lib["SmolLM2-Q4_1.gguf"].arch == "llama" and lib["SmolLM2-Q4_1.gguf"].quant == "Q4_1"
    assert lib["broken.gguf"].error
    assert lib["mmproj-F16.gguf"].kind == "mmproj" and lib["SmolLM2-Q4_1.gguf"].mmproj is None

"""Models page against the local fake hub: search, file list with quant/size/fits, download with
pause/resume/cancel, lost network and full disk as messages; local import/delete/folder."""
from __future__ import annotations

import collections
import shutil

import pytest

pytest.importorskip("PySide6")

from app import downloads as D  # noqa: E402
from app.store import Store  # noqa: E402
from tests.app.fakehub import FakeHub, fake_gguf_bytes  # noqa: E402

BIG = fake_gguf_bytes(2 << 20, seed=5)


@pytest.fixture
def page(qtbot, tmp_path, monkeypatch):
    with FakeHub({"acme/Tiny-GGUF": {"Tiny-Q4_K_M.gguf": BIG, "Tiny-Q8_0.gguf": fake_gguf_bytes(2 << 20, 6),
                                     "mmproj-Tiny-F16.gguf": fake_gguf_bytes(3000, 7)}}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HIVEJET_MODELS", str(tmp_path / "models"))
        from app.gui.models_page import ModelsPage
        store = Store(tmp_path / "s.db")
        p = ModelsPage(store, vram_getter=lambda: (24 << 30, False))
        qtbot.addWidget(p)
        p.hub = hub
        yield p
        for d in p.manager.downloads.values():
            p.manager.pause(d)
            p.manager.wait(d, 5)
        store.close()


def search_and_list(p, qtbot):
    with qtbot.waitSignal(p.bridge.searchDone, timeout=10000):
        p.search("tiny")
    assert p.repo_list.count() == 1
    with qtbot.waitSignal(p.bridge.filesDone, timeout=10000):
        p.repo_list.setCurrentRow(0)
    return [[p.file_table.item(r, c).text() for c in range(5)] for r in range(p.file_table.rowCount())]


def test_search_lists_quant_size_fits_and_pairs(page, qtbot):
    rows = search_and_list(page, qtbot)
    assert rows[0][:3] == ["Tiny-Q4_K_M.gguf", "model", "Q4_K_M"] and rows[0][4] == "fits"
    assert rows[2][1] == "mmproj" and "Vision" in page.pair_note.text()


def test_download_pause_resume_cancel(page, qtbot):
    search_and_list(page, qtbot)
    page.hub.rate = 1e6
    started = page.download_row(0)
    d, proj = started[0], started[1]          # the model and its paired mmproj
    assert proj.filename.startswith("mmproj")
    qtbot.waitUntil(lambda: d.state == "downloading" and d.done_bytes > 100_000, timeout=10000)
    key = d.key()
    qtbot.waitUntil(lambda: "/s" in page.dl_table.item(page.dl_rows[key], 2).text(), timeout=5000)  # speed shown
    page._toggle(key)                           # pause
    # the row's label follows through a queued signal: wait for both
    qtbot.waitUntil(lambda: d.state == "paused" and page.download_status(key) == "paused", timeout=10000)
    assert d.part.exists()
    page.hub.rate = None
    page._toggle(key)                           # resume
    qtbot.waitUntil(lambda: d.state == "done", timeout=20000)
    qtbot.waitUntil(lambda: "verified" in page.download_status(key), timeout=5000)
    assert d.dest.read_bytes() == BIG
    # cancel another one
    page.hub.rate = 2e5
    page.file_table.selectRow(1)
    d2 = page.download_row(1)[0]
    qtbot.waitUntil(lambda: d2.state == "downloading", timeout=10000)
    page._cancel(d2.key())
    # as for the pause: the row's label follows through a queued signal, wait for both
    qtbot.waitUntil(lambda: d2.state == "cancelled" and page.download_status(d2.key()) == "cancelled",
                    timeout=10000)
    assert not d2.part.exists()


def test_lost_network_and_full_disk_are_messages(page, qtbot, monkeypatch):
    search_and_list(page, qtbot)
    page.hub.drop_after = 300_000
    d = page.download_row(0)[0]
    qtbot.waitUntil(lambda: d.state == "failed", timeout=10000)
    qtbot.waitUntil(lambda: "Network lost" in page.message.text(), timeout=5000)
    Usage = collections.namedtuple("Usage", "total used free")
    monkeypatch.setattr(D.shutil, "disk_usage", lambda p: Usage(1 << 40, 1 << 40, 1000))
    page._toggle(d.key())                       # resume -> the disk check fails
    qtbot.waitUntil(lambda: "Not enough disk space" in page.message.text(), timeout=10000)


def test_offline_search_is_a_message(page, qtbot, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    with qtbot.waitSignal(page.bridge.searchDone, timeout=20000):
        page.search("x")
    assert "cannot reach" in page.hub_status.text()


def test_import_delete_and_folder(page, qtbot, tmp_path, smollm2_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    assert not page.import_model(str(bad)) and "Not imported" in page.message.text()
    assert page.import_model(str(smollm2_path))
    names = [m.path.name for m in page.loadable()]
    assert smollm2_path.name in names
    m = next(m for m in page.library if m.path.name == smollm2_path.name)
    page.delete_model(m.path)
    assert smollm2_path.name not in [m.path.name for m in page.library]
    assert smollm2_path.exists()                # the original is untouched
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(smollm2_path, other / "x.gguf")
    page.set_folder(str(other))
    assert [m.path.name for m in page.loadable()] == ["x.gguf"]
    assert page.store.get_setting("models_dir") == str(other)


def test_hub_tab_suggests_models_before_a_search(page, qtbot):
    """Before any search the Hugging Face tab lists the suggested models with their fits badge (a 24 GiB
    GPU here); picking one searches the Hub for it."""
    from app.gui.models_page import suggested_models
    sug = suggested_models()
    assert sug and page.repo_list.count() == len(sug)
    texts = [page.repo_list.item(i).text() for i in range(page.repo_list.count())]
    assert texts[0].startswith(sug[0]["name"]) and texts[0].endswith("· fits")
    assert all(("fits" in t or "too big" in t) for t in texts)
    with qtbot.waitSignal(page.bridge.searchDone, timeout=10000):
        page.repo_list.setCurrentRow(0)
    assert page.search_edit.text() == sug[0]["search"]


def test_suggestions_in_cpu_mode_say_what_they_need(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("HIVEJET_MODELS", str(tmp_path / "models"))
    from app.gui.models_page import ModelsPage, suggested_models
    store = Store(tmp_path / "c.db")
    try:
        p = ModelsPage(store, vram_getter=lambda: (None, True))
        qtbot.addWidget(p)
        m = suggested_models()[-1]
        assert p.repo_list.item(p.repo_list.count() - 1).text().endswith(
            f"CPU mode: needs an NVIDIA GPU with {m['min_vram_gib']} GB")
    finally:
        store.close()

"""The desktop app with images and planner picks (offscreen Qt): a tiny synthetic qwen35 + qwen3vl_merger pair loads
with its mmproj found beside it and gets the attached image; a model without one shows the engine's reason; a
planner cell's KV cache type reaches the engine's config."""
from __future__ import annotations

import shutil
import time

import pytest

pytest.importorskip("PySide6")
pytest.importorskip("pytestqt")

from PySide6.QtGui import QColor, QImage  # noqa: E402
from PySide6.QtWidgets import QLabel  # noqa: E402

from app.store import Store  # noqa: E402

SAMPLING = dict(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, max_tokens=3, repetition_penalty=1.0, seed=1)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from engine.tools.synth_mmproj import write_mmproj, write_vlm
    d = tmp_path_factory.mktemp("gui_vlm")
    model = write_vlm(d / "qwen35-vlm.gguf", "qwen35")["path"]
    write_mmproj(d / "mmproj-qwen35-vlm.gguf", "qwen3vl_merger")
    blind = tmp_path_factory.mktemp("gui_blind") / "qwen35-vlm.gguf"
    shutil.copy(model, blind)
    return str(model), str(blind)


def wait_loaded(qapp, w, path, timeout=60):
    t = time.time()
    while not (w.ctl.info and w.ctl.info.path == str(path) and w.state_label.text().startswith("●")) \
            and time.time() - t < timeout:
        qapp.processEvents()
        time.sleep(0.02)
    assert w.ctl.info and w.ctl.info.path == str(path), w.state_label.text()


@pytest.fixture(scope="module")
def win(qapp, tmp_path_factory, pair):
    from app.gui.main_window import MainWindow
    from app.gui.theme import apply_theme
    apply_theme(qapp, "light")
    store = Store(tmp_path_factory.mktemp("home") / "hivejet.db")
    store.set_setting("default_sampling", SAMPLING)
    store.set_setting("threads", 1)
    w = MainWindow(store, model=pair[1])
    w.show()
    wait_loaded(qapp, w, pair[1])
    yield w
    w.close()
    store.close()


def orange() -> QImage:
    img = QImage(48, 32, QImage.Format_RGB32)
    img.fill(QColor("orange"))
    return img


def test_model_without_mmproj_keeps_the_banner(win, qtbot):
    chat = win.chat
    assert not win.ctl.info.vision and not win.ctl.engine.has_vision
    chat.new_conversation()
    chat.attach_image(orange())
    assert chat.vision_note.isVisible()
    assert "no vision projector (mmproj file) is loaded" in chat.vision_note.text()   # engine.no_vision_reason()
    assert chat.send("What colour is this?")
    qtbot.waitUntil(lambda: not chat.generating, timeout=60000)
    sent = chat.model_messages(win.store.thread(chat.current_id))
    assert sent[-2]["content"] == "What colour is this?"         # text only: the image stays in the store
    assert win.ctl.engine.stats()["totals"].get("images_encoded", 0) == 0


def test_vision_model_gets_the_image(win, qtbot, qapp, pair, tmp_path):
    win.load_model(pair[0])
    wait_loaded(qapp, win, pair[0])
    eng = win.ctl.engine
    assert win.ctl.info.vision and eng.has_vision and eng.config.mmproj == "auto"
    assert "sees images" in win.state_label.text()
    chat = win.chat
    cid = chat.new_conversation()
    f = tmp_path / "orange.png"
    assert orange().save(str(f))
    assert chat.attach_file(str(f))
    assert not chat.vision_note.isVisible()
    assert chat.send("What colour is this?")
    qtbot.waitUntil(lambda: not chat.generating, timeout=60000)
    th = win.store.thread(cid)
    assert th[1].state == "complete", th[1].meta
    assert eng.stats()["totals"]["images_encoded"] == 1
    sent = chat.model_messages(th)
    parts = sent[0]["content"]
    assert [p["type"] for p in parts] == ["image", "text"] and parts[1]["text"] == "What colour is this?"
    # the image's tokens count in the context meter: more than the text alone
    text_only = win.ctl.count_tokens([{"role": "user", "content": "What colour is this?"}])
    assert win.ctl.count_tokens(sent[:1]) > text_only + 2
    # the message shows a thumbnail
    w = chat.message_widgets()[0]
    thumbs = [l for l in w.findChildren(QLabel) if l.pixmap() is not None and not l.pixmap().isNull()]
    assert thumbs and "orange.png" in thumbs[0].toolTip()


def test_planner_cell_applies_kv_cache_type(win, qapp, smollm2_path):
    from engine import planner as P
    win.planner.select_model(str(smollm2_path))
    row = list(win.planner.table_plans).index("q8_0")
    win.planner.load_cell(row, P.CONTEXTS.index(8192))
    wait_loaded(qapp, win, smollm2_path)
    cfg = win.ctl.engine.config
    assert cfg.cache_type_k == cfg.cache_type_v == "q8_0" and win.ctl.info.kv_cache == "q8_0"
    assert win.ctl.engine.ctx_size == 8192
    assert "KV cache q8_0" in win.statusBar().currentMessage()
    assert "GPU engine" not in win.statusBar().currentMessage()


def test_device_choice_for_the_app(monkeypatch):
    """GPU first when torch sees one and the GPU path serves the cache type, the CPU otherwise."""
    import torch

    from app.gui.controller import choose_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert choose_device("f16") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert choose_device("q8_0") == "cuda"
    assert choose_device("f16") == "cuda"
    assert choose_device("turbo3_tcq") == "cuda"   # every cache type runs on the GPU path
    assert choose_device("no_such_type") == "cpu"

"""The desktop app's chat with the real demo model (offscreen Qt): load, send and stream, stop,
regenerate, edit-and-resend (branches), delete, attachments, persistence across a restart, bad models."""
from __future__ import annotations

import pytest

pytest.importorskip("PySide6")
pytest.importorskip("pytestqt")

from PySide6.QtGui import QColor, QImage  # noqa: E402

from app.store import Store  # noqa: E402

SAMPLING = dict(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, max_tokens=8, repetition_penalty=1.0, seed=1)


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def win(qapp, home, smollm2_path):
    from app.gui.main_window import MainWindow
    from app.gui.theme import apply_theme
    apply_theme(qapp, "light")
    store = Store(home / "hivejet.db")
    store.set_setting("default_sampling", SAMPLING)
    w = MainWindow(store, model=str(smollm2_path))
    w.show()
    import time
    t = time.time()
    while w.ctl.engine is None and time.time() - t < 60:
        qapp.processEvents()
        time.sleep(0.02)
    assert w.ctl.engine is not None, w.state_label.text()
    yield w
    w.close()
    store.close()


def wait_reply(qtbot, w, timeout=60000):
    qtbot.waitUntil(lambda: not w.chat.generating, timeout=timeout)


def test_loaded_state_and_first_run(win):
    assert "Smollm2" in win.state_label.text() or "SmolLM2" in win.state_label.text()
    assert "context 8,192" in win.state_label.text()
    assert win.chat.banner.isVisible() and "CPU mode" in win.chat.banner.text()
    assert win.model_combo.isEnabled() and not win.load_bar.isVisible()


def test_send_stream_and_context_meter(win, qtbot):
    chat = win.chat
    chat.new_conversation()
    tokens = []
    assert chat.send("What is 2+2?")
    chat.gen.token.connect(tokens.append)
    assert chat.generating and chat.stop_button.isEnabled() and not chat.send_button.isEnabled()
    with qtbot.waitSignal(chat.replyFinished, timeout=60000) as blocker:
        pass
    th = win.store.thread(chat.current_id)
    assert [m.role for m in th] == ["user", "assistant"]
    assert th[1].state == "complete" and th[1].content and th[1].meta["tokens"] <= 8
    assert "".join(tokens) == th[1].content       # streamed pieces add up to the stored reply
    assert blocker.args[0] == th[1].id
    assert chat.context_used > 0 and "/ 8,192 tokens" in chat.context_label.text()
    assert win.store.get_conversation(chat.current_id).title == "What is 2+2?"
    widgets = chat.message_widgets()
    assert len(widgets) == 2 and "tokens" in widgets[1].status.text()
    # under the reply: its tokens, decode speed and time to first token (kept with the message)
    assert " tok/s · first token " in widgets[1].status.text()
    assert widgets[1].status.text().startswith(f"{th[1].meta['tokens']} token")


def test_stop(win, qtbot):
    chat = win.chat
    chat.new_conversation()
    chat.s_max.setValue(200)                      # per-conversation sampling, saved
    assert win.store.get_conversation(chat.current_id).sampling["max_tokens"] == 200
    chat.send("Write a long story about a dragon.")
    qtbot.waitUntil(lambda: chat.gen is not None and chat.gen.n_tokens >= 1, timeout=30000)
    chat.stop_button.click()
    wait_reply(qtbot, win)
    last = win.store.thread(chat.current_id)[-1]
    assert last.state == "stopped" and last.meta["tokens"] < 200
    assert "stopped" in chat.message_widgets()[-1].status.text()


def test_regenerate_edit_branches_delete(win, qtbot):
    chat = win.chat
    cid = chat.new_conversation()
    chat.system_edit.setPlainText("You are terse.")
    chat.s_temp.setValue(0.9)
    chat.s_seed.setValue(-1)
    chat.send("Name a color.")
    wait_reply(qtbot, win)
    first = win.store.thread(cid)[-1]
    assert chat.regenerate()
    wait_reply(qtbot, win)
    second = win.store.thread(cid)[-1]
    assert second.id != first.id and second.parent_id == first.parent_id
    w = chat.message_widgets()[-1]
    assert "2/2" in [lab.text() for lab in w.findChildren(type(w.status))]
    chat.show_sibling(second.id, -1)                # back to the first reply
    assert win.store.thread(cid)[-1].id == first.id
    user = win.store.thread(cid)[0]
    assert chat.edit_and_resend(user.id, "Name a fruit.")
    wait_reply(qtbot, win)
    th = win.store.thread(cid)
    assert th[0].content == "Name a fruit." and len(win.store.siblings(th[0].id)) == 2
    chat.show_sibling(th[0].id, -1)
    assert win.store.thread(cid)[0].content == "Name a color."   # the old branch is still there
    doomed = win.store.thread(cid)[-1]
    chat.delete_message(doomed.id)
    assert win.store.get_message(doomed.id) is None
    last = win.store.thread(cid)[-1]           # the other reply to "Name a color." is shown now
    assert last.role == "assistant" and len(win.store.siblings(last.id)) == 1
    chat.delete_message(last.id)
    assert win.store.thread(cid)[-1].role == "user"
    # the system prompt went to the model
    msgs = chat.model_messages(win.store.thread(cid))
    assert msgs[0] == {"role": "system", "content": "You are terse."}


def test_attach_text_and_image(win, qtbot, tmp_path):
    chat = win.chat
    cid = chat.new_conversation()
    f = tmp_path / "notes.txt"
    f.write_text("The secret word is pineapple.")
    assert chat.attach_file(str(f))
    img = QImage(32, 16, QImage.Format_RGB32)
    img.fill(QColor("orange"))
    chat.attach_image(img)
    assert chat.vision_note.isVisible() and "cannot see images" in chat.vision_note.text()
    bad = tmp_path / "blob.bin"
    bad.write_bytes(b"\0\1\2" * 100)
    assert not chat.attach_file(str(bad)) and "not a text file" in chat.error_label.text()
    # a text-only model: the message with the image is refused, and nothing typed or attached is lost
    chat.composer.setPlainText("What is the secret word?")
    assert not chat.send()
    assert "Not sent" in chat.error_label.text() and "Remove the image" in chat.error_label.text()
    assert chat.composer.toPlainText() == "What is the secret word?" and len(chat.pending) == 2
    assert win.store.thread(cid) == []
    chat._remove_pending(1)                          # the image's ✕
    assert not chat.vision_note.isVisible()
    assert chat.send()
    wait_reply(qtbot, win)
    user = win.store.thread(cid)[0]
    assert [a["kind"] for a in user.attachments] == ["text"]
    sent = chat.model_messages(win.store.thread(cid))
    assert "pineapple" in sent[0]["content"] and "notes.txt" in sent[0]["content"]
    assert not chat.pending and not chat.vision_note.isVisible()


def test_persistence_across_restart(win, qtbot, home, qapp, smollm2_path):
    chat = win.chat
    cid = chat.new_conversation()
    chat.send("Remember me.")
    wait_reply(qtbot, win)
    n = len(win.store.thread(cid))
    from app.gui.main_window import MainWindow
    store2 = Store(home / "hivejet.db")          # a second process would see the same (WAL)
    w2 = MainWindow(store2, autoload=False)
    try:
        titles = [w2.chat.conv_list.item(i).text() for i in range(w2.chat.conv_list.count())]
        assert "Remember me." in titles
        w2.chat.open_conversation(cid)
        assert len(w2.chat.message_widgets()) == n
        assert w2.chat.message_widgets()[0].message.content == "Remember me."
    finally:
        w2.ctl.shutdown()
        w2.server.shutdown()
        w2.deleteLater()
        store2.close()


def test_corrupt_model_is_a_message(win, qtbot, tmp_path):
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    before = win.ctl.info.name
    with qtbot.waitSignal(win.ctl.loadFailed, timeout=30000):
        win.load_model(str(bad))
    assert "corrupt.gguf" in win.chat.error_label.text()
    assert win.ctl.engine is not None and win.ctl.info.name == before   # the old model keeps working
    assert win.model_combo.isEnabled()


def test_cancel_load(win, qtbot, smollm2_path):
    old = win.ctl.engine
    win.load_model(str(smollm2_path))
    assert win.cancel_load_button.isVisible() or win.cancel_load_button.isVisibleTo(win)
    win.cancel_load_button.click()
    assert not win.ctl.loading and win.model_combo.isEnabled()
    assert "cancelled" in win.statusBar().currentMessage().lower()
    qtbot.wait(2500)                               # the discarded engine is shut down, not swapped in
    assert win.ctl.engine is old


def test_no_model_send_is_a_message(qapp, tmp_path):
    from app.gui.main_window import MainWindow
    s = Store(tmp_path / "x.db")
    w = MainWindow(s, autoload=False)
    try:
        assert not w.chat.send("hello")
        assert "No model is loaded" in w.chat.error_label.text()
    finally:
        w.deleteLater()
        s.close()


def test_first_run_panel_shows_defaults_and_keeps_edits(qapp, tmp_path):
    """With no conversation yet the panel shows what a new conversation gets, and edits made there go to
    the conversation the first message starts."""
    from app.gui.chat import DEFAULT_SAMPLING
    from app.gui.main_window import MainWindow
    store = Store(tmp_path / "fresh.db")
    w = MainWindow(store, autoload=False)
    try:
        chat = w.chat
        assert chat.current_id is None
        assert chat.s_max.value() == DEFAULT_SAMPLING["max_tokens"] and chat.s_seed.value() == -1
        assert chat.s_top_p.value() == pytest.approx(DEFAULT_SAMPLING["top_p"])
        assert chat.s_rep.value() == pytest.approx(1.0)
        chat.s_max.setValue(333)
        chat.system_edit.setPlainText("Be brief.")
        cid = chat.new_conversation()                 # what the first send does
        c = store.get_conversation(cid)
        assert c.sampling["max_tokens"] == 333 and c.system_prompt == "Be brief."
        cid2 = chat.new_conversation()                # "+ New chat" later: the defaults again
        assert store.get_conversation(cid2).sampling["max_tokens"] == DEFAULT_SAMPLING["max_tokens"]
    finally:
        w.close()
        store.close()

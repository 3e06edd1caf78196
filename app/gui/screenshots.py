"""Render each page of the app to docs/screenshots/*.png, in a real X window (Xvfb when there is no
display): `python -m app.gui.screenshots [--out docs/screenshots] [--theme light|dark]`.

It uses a throw-away data folder, loads the demo model, has a real conversation with it, writes a
header-only synthetic Qwen3.5-27B layout so the Planner shows a 24 GB table, and turns the local server on.
Needs the Debian packages xvfb and libxcb-cursor0 ... (see docs/APP.md) when no display is available.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REPLY_WAIT_S = 300          # the longest wait for one demo reply (a busy CPU makes ~1 token/s)


def _ensure_display() -> subprocess.Popen | None:
    if os.environ.get("DISPLAY"):
        return None
    xvfb = shutil.which("Xvfb")
    if not xvfb:
        sys.exit("no display and no Xvfb: apt-get install xvfb (see docs/APP.md)")
    for n in range(90, 110):
        if not Path(f"/tmp/.X{n}-lock").exists():
            break
    proc = subprocess.Popen([xvfb, f":{n}", "-screen", "0", "1600x1000x24", "-nolisten", "tcp"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ["DISPLAY"] = f":{n}"
    time.sleep(1.0)
    return proc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(REPO / "docs" / "screenshots"))
    ap.add_argument("--theme", default="light", choices=["light", "dark"])
    args = ap.parse_args(argv)
    xvfb = _ensure_display()
    os.environ.pop("QT_QPA_PLATFORM", None)
    os.environ["QT_QPA_PLATFORM"] = "xcb"
    home = Path(tempfile.mkdtemp(prefix="hivejet-shots-"))
    os.environ["HIVEJET_HOME"] = str(home)
    try:
        return _run(Path(args.out), args.theme, home)
    finally:
        shutil.rmtree(home, ignore_errors=True)
        if xvfb is not None:
            xvfb.terminate()


def _run(out: Path, theme: str, home: Path) -> int:
    from PySide6.QtCore import QEvent, QEventLoop
    from PySide6.QtWidgets import QApplication

    from app.gui.main_window import MainWindow
    from app.gui.theme import apply_theme
    from app.store import Store

    out.mkdir(parents=True, exist_ok=True)
    demo, synth = _models(home)
    app = QApplication.instance() or QApplication(["hivejet"])
    apply_theme(app, theme)
    store = Store(home / "hivejet.db")
    store.set_setting("default_sampling", dict(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, max_tokens=48,
                                               repetition_penalty=1.0, seed=-1))
    w = MainWindow(store, model=str(demo))
    w.resize(1440, 900)
    w.show()

    def pump(secs: float, until=None):
        t = time.time()
        while time.time() - t < secs:
            app.processEvents(QEventLoop.AllEvents, 50)
            # processEvents leaves deleteLater()'d widgets alive (only a running event loop deletes them):
            # removed messages would still be painted into the shots
            app.sendPostedEvents(None, QEvent.DeferredDelete)
            if until is not None and until():
                return True
            time.sleep(0.02)
        return until() if until else True

    if not pump(120, lambda: w.ctl.engine is not None):
        print("the demo model did not load:", w.state_label.text(), file=sys.stderr)
        return 1
    _converse(w.chat, store, pump)
    _shoot_pages(w, out, synth, pump)
    w.close()
    store.close()
    return 0


def _models(home: Path) -> tuple[Path, Path]:
    """The demo model (linked into the throw-away models folder) and a header-only synthetic
    Qwen3.5-27B layout for the Planner."""
    from engine.catalog import ensure_model, models_dir
    from engine.tools.synth import write_synthetic

    src = ensure_model("demo")                       # the user's copy; the shots use their own folder
    os.environ["HIVEJET_MODELS"] = str(home / "models")
    demo = models_dir() / src.name
    try:
        os.link(src, demo)
    except OSError:
        shutil.copyfile(src, demo)
    synth_dir = models_dir() / "hivejet-synthetic"
    synth_dir.mkdir(parents=True, exist_ok=True)
    synth = synth_dir / "Qwen3.5-27B-layout-Q4_K_M-header-only.gguf"
    if not synth.exists():
        write_synthetic(synth, "qwen35", "27b-q4_k_m", header_only=True)
    return demo, synth


def _converse(chat, store, pump) -> None:
    """A two-message conversation with the demo model, and two more (empty) conversations in the list.
    A first, deleted conversation warms the engine up (the CPU kernels compile on first use), so the
    replies shown have the speed and first-token time of a warm engine."""
    warm = chat.new_conversation()
    chat.send("Hello")
    pump(REPLY_WAIT_S, lambda: not chat.generating)
    chat.delete_conversation(warm)
    chat.new_conversation()
    chat.send("Explain what this Python function does:\n\n```python\ndef mean(xs):\n    return sum(xs) / len(xs)\n```")
    pump(REPLY_WAIT_S, lambda: not chat.generating)
    chat.send("Give me one tip for naming variables.")
    pump(REPLY_WAIT_S, lambda: not chat.generating)
    store.create_conversation("Trip ideas for Lisbon")
    store.create_conversation("Refactor the download queue")
    chat.reload_conversations()


def _shoot_pages(w, out: Path, synth: Path, pump) -> None:
    """One PNG per page; the monitor's while a reply is being generated, the server's with it running."""
    chat = w.chat

    def shot(name: str, page: str, prep=None):
        w.show_page(page)
        if prep:
            prep()
        pump(2.0)       # the page laid out (a busy machine needs more than a moment)
        path = out / f"{name}.png"
        w.grab().save(str(path))
        print("wrote", path)

    shot("chat", "Chat")
    w.models.refresh_library()
    shot("models", "Models", lambda: w.models.tabs.setCurrentIndex(0))
    w.planner.vram_edit.setText("24GiB")
    shot("planner", "Planner", lambda: w.planner.select_model(str(synth)))
    w.server.port.setValue(18765)

    def server_on():
        w.server_switch.setChecked(True)
        pump(5, lambda: w.server.srv.running and w.server.srv.server.started)
    shot("server", "Server", server_on)
    chat.s_max.setValue(200)
    chat.send("Write a short poem about bees.")

    def decoding() -> bool:
        eng = w.ctl.engine
        return eng is not None and any(q.get("generated", 0) >= 8 for q in eng.stats()["sequences"])

    def monitor():     # the reply past its prefill, a few tokens in, so the row shows a decode speed
        pump(REPLY_WAIT_S, decoding)
        pump(3)
        w.monitor.refresh()
    shot("monitor", "Monitor", monitor)
    chat.stop()
    pump(10, lambda: not chat.generating)
    shot("settings", "Settings")


if __name__ == "__main__":
    sys.exit(main())

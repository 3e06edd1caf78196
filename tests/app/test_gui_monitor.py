"""The monitor's tok/s chart has labelled axes; Ctrl+Q closes the window."""
from __future__ import annotations

import pytest

pytest.importorskip("PySide6")

from app.store import Store  # noqa: E402


def test_chart_axes(qapp):
    from app.gui.monitor_page import Sparkline, nice_top
    assert [nice_top(v) for v in (0, 0.4, 1, 1.5, 3, 7, 13.5, 99, 101)] == [1, 1, 1, 2, 5, 10, 20, 100, 200]
    sp = Sparkline(n=121)
    for v in (0.0, 3.0, 13.5, 12.0):
        sp.add(v)
    ys, xs = sp.ticks()
    assert [lab for _, lab in ys] == ["0", "5", "10", "15", "20"]
    assert [lab for _, lab in xs] == ["-120 s", "-90 s", "-60 s", "-30 s", "now"]
    sp.resize(600, 180)
    img = sp.grab().toImage()                       # paints: axes and labels without errors
    assert not img.isNull()


def test_ctrl_q_quits(qapp, qtbot, tmp_path):
    from PySide6.QtCore import Qt
    from PySide6.QtTest import QTest
    from PySide6.QtWidgets import QApplication
    from app.gui.main_window import MainWindow
    store = Store(tmp_path / "q.db")
    w = MainWindow(store, autoload=False)
    try:
        w.show()
        qtbot.waitExposed(w)
        w.windowHandle().requestActivate()
        qtbot.waitUntil(lambda: QApplication.activeWindow() is w, timeout=3000)
        w.chat.composer.setFocus()
        QTest.keyClick(w.chat.composer, Qt.Key_Q, Qt.ControlModifier)
        qtbot.waitUntil(lambda: not w.isVisible(), timeout=3000)
    finally:
        w.close()
        store.close()

"""The app's icons come from resources/icons/*.svg (no emoji font needed): every UI string is free of
emoji, the navigation and the composer's buttons carry drawn icons."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("PySide6")

from app.store import Store  # noqa: E402

GUI = Path(__file__).resolve().parents[2] / "app" / "gui"
# pictographs and symbols that fonts without emoji draw as empty boxes
EMOJI = re.compile("[\U0001F000-\U0001FFFF\u2600-\u27BF\u2B00-\u2BFF\uFE0F]")


def test_no_emoji_in_the_app_sources():
    found = [f"{p.name}:{i}: {line.strip()}" for p in sorted(GUI.glob("*.py"))
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if EMOJI.search(line)]
    assert not found, "\n".join(found)


def test_icons_render(qapp):
    from PySide6.QtSvg import QSvgRenderer
    from app.gui.icons import ICON_DIR, pixmap, svg_source
    names = [p.stem for p in ICON_DIR.glob("*.svg") if p.stem != "hivejet"]
    assert {"chat", "models", "planner", "monitor", "server", "settings", "attach", "file", "image"} <= set(names)
    for n in names:
        assert QSvgRenderer(svg_source(n).encode()).isValid(), n
        img = pixmap(n, 24).toImage()
        drawn = sum(img.pixelColor(x, y).alpha() > 0 for x in range(24) for y in range(24))
        assert drawn > 10, n
    with pytest.raises(ValueError):
        svg_source("no-such-icon")


def test_navigation_and_buttons_have_icons(qapp, tmp_path):
    from app.gui.main_window import PAGES, MainWindow
    store = Store(tmp_path / "i.db")
    w = MainWindow(store, autoload=False)
    try:
        for i, name in enumerate(PAGES):
            it = w.nav.item(i)
            assert it.text() == name and not it.icon().isNull()
        for b in (w.chat.attach_button, w.chat.send_button, w.chat.stop_button):
            assert not b.icon().isNull() and not EMOJI.search(b.text())
    finally:
        w.close()
        store.close()


@pytest.mark.parametrize("mode", ["light", "dark"])
def test_spin_and_combo_boxes_draw_their_arrows(qapp, mode):
    """A styled spin or combo box draws its arrows only from the stylesheet's images: without them its
    step buttons are empty boxes."""
    from PySide6.QtWidgets import QComboBox, QSpinBox
    from app.gui.theme import apply_theme
    before = qapp.style().name(), qapp.palette(), qapp.styleSheet()
    apply_theme(qapp, mode)
    try:
        for box in (QSpinBox(), QComboBox()):
            if isinstance(box, QComboBox):
                box.addItems(["one", "two"])
            box.resize(120, 30)
            box.show()
            qapp.processEvents()
            img = box.grab().toImage()
            # the arrows' grey (#8a8f98) in the rightmost 20 pixels
            grey = sum(1 for x in range(box.width() - 20, box.width()) for y in range(box.height())
                       if abs(img.pixelColor(x, y).red() - 0x8a) < 30 and abs(img.pixelColor(x, y).blue() - 0x98) < 30
                       and img.pixelColor(x, y).saturation() < 60 and 90 < img.pixelColor(x, y).lightness() < 200)
            box.close()
            assert grey >= 8, (type(box).__name__, grey)
    finally:
        qapp.setStyle(before[0])
        qapp.setPalette(before[1])
        qapp.setStyleSheet(before[2])

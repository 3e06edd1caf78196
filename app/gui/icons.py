"""The app's icons: monochrome line drawings in resources/icons/NAME.svg (stroke="currentColor"), drawn
in a grey that reads on the light and the dark theme, and in the accent colour when selected. Icons are
drawn from the SVG files, so the app needs no emoji font (a fresh Linux install has none)."""
from __future__ import annotations

from functools import lru_cache

from PySide6.QtCore import QByteArray, QRectF, Qt
from PySide6.QtGui import QIcon, QPainter, QPixmap
from PySide6.QtSvg import QSvgRenderer

from app.gui.theme import RESOURCES

ICON_DIR = RESOURCES / "icons"
NEUTRAL = "#8a8f98"       # between LIGHT's and DARK's muted text: visible on both backgrounds
SELECTED = "#e08a0b"      # between the two themes' accents
SIZES = (16, 20, 24, 32, 48)


def svg_source(name: str) -> str:
    """The SVG text of icon `name`; ValueError when there is no such icon."""
    p = ICON_DIR / f"{name}.svg"
    if not p.is_file():
        raise ValueError(f"no icon {name!r} in {ICON_DIR}")
    return p.read_text()


def pixmap(name: str, size: int, color: str = NEUTRAL) -> QPixmap:
    r = QSvgRenderer(QByteArray(svg_source(name).replace("currentColor", color).encode()))
    pm = QPixmap(size, size)
    pm.fill(Qt.transparent)
    p = QPainter(pm)
    r.render(p, QRectF(0, 0, size, size))
    p.end()
    return pm


@lru_cache(maxsize=None)
def icon(name: str, color: str = NEUTRAL, selected: str | None = SELECTED) -> QIcon:
    """Icon `name` in `color`, and in `selected` for the selected state (list rows)."""
    ic = QIcon()
    for s in SIZES:
        ic.addPixmap(pixmap(name, s, color), QIcon.Normal)
        if selected:
            ic.addPixmap(pixmap(name, s, selected), QIcon.Selected)
    return ic

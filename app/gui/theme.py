"""Light and dark themes. "system" follows the desktop's colour scheme (Qt's styleHints().colorScheme(),
live: switching the system theme re-styles the window)."""
from __future__ import annotations

import sys
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QPalette

RESOURCES = Path(__file__).resolve().parents[2] / "resources"      # a source checkout
if not RESOURCES.is_dir():   # an installed wheel: pyproject's data-files put them in <prefix>/share/hivejet
    RESOURCES = Path(sys.prefix) / "share" / "hivejet" / "resources"

LIGHT = dict(bg="#f7f7f9", panel="#ffffff", rail="#f0f1f4", border="#e3e5ea", text="#1f2329", muted="#6b7280",
             accent="#d97706", accent_hover="#b45309", accent_soft="#fdebd0", accent_text="#b45309",
             hover="#eceef2", input="#ffffff", button="#ffffff", user_bubble="#fdf1de", bot_bubble="#ffffff",
             warn_bg="#fff7e6", warn_text="#8a5300", warn_border="#f5d49a", error="#c62828", ok_bg="#dcfce7",
             ok_text="#166534", no_bg="#fee2e2", no_text="#991b1b", switch_off="#cfd3da", scroll="#cdd0d6",
             alt_row="#fafafb")
DARK = dict(bg="#17181b", panel="#1f2024", rail="#1a1b1e", border="#2e3035", text="#e7e9ee", muted="#9aa0aa",
            accent="#f59e0b", accent_hover="#d97706", accent_soft="#3a2a12", accent_text="#fbbf24",
            hover="#2a2c31", input="#26282d", button="#26282d", user_bubble="#33280f", bot_bubble="#1f2024",
            warn_bg="#3a2d10", warn_text="#fcd38d", warn_border="#6b4f17", error="#f87171", ok_bg="#12361f",
            ok_text="#86efac", no_bg="#3b1414", no_text="#fca5a5", switch_off="#44474f", scroll="#3c3f46",
            alt_row="#222327")


def system_is_dark(app) -> bool:
    try:
        return app.styleHints().colorScheme() == Qt.ColorScheme.Dark
    except AttributeError:
        return app.palette().color(QPalette.Window).lightness() < 128


def resolve(mode: str, app) -> bool:
    """True for dark."""
    if mode == "dark":
        return True
    if mode == "light":
        return False
    return system_is_dark(app)


def apply_theme(app, mode: str = "system") -> bool:
    dark = resolve(mode, app)
    pal_colors = DARK if dark else LIGHT
    app.setStyle("Fusion")
    pal = QPalette()
    c = lambda k: QColor(pal_colors[k])  # noqa: E731
    pal.setColor(QPalette.Window, c("bg"))
    pal.setColor(QPalette.WindowText, c("text"))
    pal.setColor(QPalette.Base, c("input"))
    pal.setColor(QPalette.AlternateBase, c("alt_row"))
    pal.setColor(QPalette.Text, c("text"))
    pal.setColor(QPalette.Button, c("button"))
    pal.setColor(QPalette.ButtonText, c("text"))
    pal.setColor(QPalette.Highlight, c("accent"))
    pal.setColor(QPalette.HighlightedText, QColor("white"))
    pal.setColor(QPalette.PlaceholderText, c("muted"))
    pal.setColor(QPalette.Link, c("accent_text"))
    pal.setColor(QPalette.ToolTipBase, c("panel"))
    pal.setColor(QPalette.ToolTipText, c("text"))
    app.setPalette(pal)
    qss = (RESOURCES / "qss" / "app.qss").read_text()
    for k, v in pal_colors.items():
        qss = qss.replace("{" + k + "}", v)
    # the arrows of combo and spin boxes: once a box is styled, Qt draws them only from these images
    qss = qss.replace("{qss_dir}", (RESOURCES / "qss").as_posix())
    app.setStyleSheet(qss)
    app.setProperty("hivejet_dark", dark)
    return dark


def is_dark(app) -> bool:
    return bool(app.property("hivejet_dark"))

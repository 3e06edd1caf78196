"""HiveJet desktop app (PySide6). `run_gui(model)` opens the main window; see docs/APP.md."""
from __future__ import annotations


def display_available() -> bool:
    """True when Qt can open a window here (a display, or an explicit QT_QPA_PLATFORM)."""
    import os
    import sys
    if os.environ.get("QT_QPA_PLATFORM"):
        return True
    if sys.platform in ("win32", "darwin"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def run_gui(model: str | None = None) -> int:
    """Open the desktop app on `model` (a GGUF path or catalog name; None = the last model, else the
    demo model). Returns the Qt exit code."""
    import os
    import sys
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from PySide6.QtWidgets import QApplication
    from app.gui.main_window import MainWindow
    from app.gui.theme import apply_theme
    from app.store import Store
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("HiveJet")
    app.setOrganizationName("HiveJet")
    store = Store()
    mode = store.get_setting("theme", "system")
    apply_theme(app, mode)
    try:
        app.styleHints().colorSchemeChanged.connect(
            lambda *_: apply_theme(app, store.get_setting("theme", "system")))
    except AttributeError:
        pass
    w = MainWindow(store, model=model)
    w.show()
    rc = app.exec()
    store.close()
    return rc

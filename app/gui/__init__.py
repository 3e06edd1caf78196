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


def run_gui(model: str | None = None, smoke: bool = False) -> int:
    """Open the desktop app on `model` (a GGUF path or catalog name; None = the last model, else the
    demo model). Returns the Qt exit code.

    smoke=True is the installers' check (`python -m app.gui --smoke`): open the main window without loading a
    model, process events for a second, close, print "smoke ok" and return 0."""
    import os
    import sys
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from PySide6.QtWidgets import QApplication
    from app.gui.main_window import MainWindow
    from app.gui.theme import apply_theme
    from app.store import Store
    app = QApplication.instance() or QApplication(sys.argv[:1])
    from app.gui.gc_guard import MainThreadGC
    app._gc_guard = MainThreadGC(app)   # collections in the GUI thread only (see gc_guard)
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
    w = MainWindow(store, model=model, autoload=not smoke)
    w.show()
    if smoke:
        from PySide6.QtCore import QTimer
        QTimer.singleShot(1000, w.close)
        QTimer.singleShot(1200, app.quit)
    rc = app.exec()
    if smoke:
        ok = rc == 0 and w.windowTitle() == "HiveJet"
        print(f"smoke {'ok' if ok else 'FAILED'}: main window shown ({app.platformName()})")
        rc = 0 if ok else 1
    store.close()
    return rc

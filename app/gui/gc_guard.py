"""Python's cyclic garbage collector runs in the GUI thread only.

Left alone, a collection starts in whatever thread happens to allocate when a threshold is crossed: a
download or search worker, the engine thread, an HTTP handler. If the garbage holds Qt objects, their C++
destructors then run outside the thread that owns them, which crashes PySide6 (seen in the tests: a
segfault while "Garbage-collecting" in an HTTP server thread). So the app turns automatic collection
off and collects from a timer in the GUI thread, with the collector's own thresholds.
"""
from __future__ import annotations

import gc

from PySide6.QtCore import QObject, QTimer


class MainThreadGC(QObject):
    def __init__(self, parent: QObject | None = None, interval_ms: int = 500):
        super().__init__(parent)
        self.threshold = gc.get_threshold()
        gc.disable()
        self.timer = QTimer(self)
        self.timer.timeout.connect(self.check)
        self.timer.start(interval_ms)

    def check(self) -> None:
        """Collect the generations whose counts passed their thresholds, as automatic collection would."""
        c0, c1, c2 = gc.get_count()
        if c0 > self.threshold[0]:
            gc.collect(0)
            if c1 > self.threshold[1]:
                gc.collect(1)
                if c2 > self.threshold[2]:
                    gc.collect(2)

"""The app's tests run with Python's automatic garbage collection off and collect between tests, in
the main thread: a collection that starts in a worker or HTTP-handler thread may destroy Qt objects
outside their thread and crash PySide6 (the app itself collects from a GUI-thread timer:
app/gui/gc_guard.py)."""
import gc

import pytest


@pytest.fixture(autouse=True)
def _collect_in_the_main_thread():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        if enabled:
            gc.enable()

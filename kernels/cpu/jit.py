"""Lazy compilation of the CPU path's numba kernels: a module's kernels are compiled (or loaded from numba's cache,
`cache=True`: next to the module, or the user's cache folder where that is read-only) on first use, once per
process; without numba `kernels()` is None and the callers run their torch references (the same bits, slower)."""
from __future__ import annotations

import threading
from typing import Callable

_LOCK = threading.Lock()


class LazyKernels:
    """`compile()` returns a dict of numba functions; `get()` is that dict, or None where numba does not import."""

    def __init__(self, compile: Callable[[], dict]):
        self._compile = compile
        self._kernels: dict | None = None
        self._failed = False

    def get(self) -> dict | None:
        if self._kernels is None and not self._failed:
            with _LOCK:
                if self._kernels is None and not self._failed:
                    try:
                        self._kernels = self._compile()
                    except ImportError:
                        self._failed = True
        return self._kernels

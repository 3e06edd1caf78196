"""Lazy compilation of the CPU path's numba kernels: the kernels of every module that registered here are compiled
(or loaded from numba's cache, `cache=True`: next to the module, or the user's cache folder where that is read-only)
together, on the first use of any of them, once per process, and each run once on tiny inputs of the types the
engine passes, so that numba's type specialization happens then (the first prompt) and not inside a later decode
step. Without numba `get()` is None and the callers run their torch references (the same bits, slower)."""
from __future__ import annotations

import threading
from typing import Callable

_LOCK = threading.Lock()
_ALL: list["LazyKernels"] = []


class LazyKernels:
    """`compile()` returns a dict of numba functions and `warm(kernels)` calls each once; `get()` is that dict, or
    None where numba does not import."""

    def __init__(self, compile: Callable[[], dict], warm: Callable[[dict], None] | None = None):
        self._compile = compile
        self._warm = warm
        self._kernels: dict | None = None
        self._failed = False
        _ALL.append(self)

    def get(self) -> dict | None:
        if self._kernels is None and not self._failed:
            with _LOCK:
                for lk in _ALL:
                    lk._load()
        return self._kernels

    def _load(self) -> None:
        if self._kernels is not None or self._failed:
            return
        try:
            kernels = self._compile()
        except ImportError:
            self._failed = True
            return
        if self._warm is not None:
            self._warm(kernels)
        self._kernels = kernels


_RUN = threading.Lock()   # numba's workqueue threading layer takes one parallel launch at a time, process-wide
_SET_THREADS = [0]


class parallel_launch:
    """`with parallel_launch(numba):` around a call of a parallel numba kernel: one such launch at a time in the
    process (the workqueue layer is not safe for concurrent launches), with numba's thread count following torch's
    (set_num_threads; asked of numba only when torch's changes)."""

    def __init__(self, numba):
        self.numba = numba

    def __enter__(self):
        _RUN.acquire()
        n = torch_threads()
        if _SET_THREADS[0] != n:
            self.numba.set_num_threads(max(1, min(n, self.numba.config.NUMBA_NUM_THREADS)))
            _SET_THREADS[0] = n
        return self

    def __exit__(self, *exc):
        _RUN.release()
        return False


def torch_threads() -> int:
    import torch
    return torch.get_num_threads()

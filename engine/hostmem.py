"""How much memory the machine has (Linux and Windows), for defaults sized to it."""
from __future__ import annotations

import ctypes
import functools
import os


@functools.cache   # (asked for by every plan the planner's table makes)
def physical_memory(default: int = 8 << 30) -> int:
    """The machine's RAM in bytes (`default` where it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        pass
    try:   # Windows: GlobalMemoryStatusEx
        class _Status(ctypes.Structure):
            _fields_ = [("dwLength", ctypes.c_ulong), ("dwMemoryLoad", ctypes.c_ulong),
                        ("ullTotalPhys", ctypes.c_ulonglong), ("ullAvailPhys", ctypes.c_ulonglong),
                        ("ullTotalPageFile", ctypes.c_ulonglong), ("ullAvailPageFile", ctypes.c_ulonglong),
                        ("ullTotalVirtual", ctypes.c_ulonglong), ("ullAvailVirtual", ctypes.c_ulonglong),
                        ("ullAvailExtendedVirtual", ctypes.c_ulonglong)]
        st = _Status()
        st.dwLength = ctypes.sizeof(_Status)
        if ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(st)):
            return int(st.ullTotalPhys)
    except (AttributeError, OSError):
        pass
    return default


def kv_memory_tokens(kv_memory: int, per_token: int) -> int:
    """The KV cache tokens EngineConfig.kv_memory holds on the CPU at per_token bytes each (kv_memory 0: a
    quarter of the machine's RAM, 8 GiB where that cannot be read), at least 256."""
    return max(256, (kv_memory or physical_memory(32 << 30) // 4) // max(1, per_token))

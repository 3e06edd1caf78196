"""GPU facts through NVML (nvidia-ml-py's pynvml), with a clear no-GPU answer.

`detect_gpus()` returns one GpuInfo per NVIDIA GPU, or [] when there is none (no driver, no NVML
library, no device): the app then runs in CPU mode. `gpu_status()` adds the reason for the UI.
`sample(index)` reads the live numbers the Monitor page plots (utilisation, memory, temperature, power).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

_lock = threading.Lock()
_inited: bool | None = None
_init_error = ""


@dataclass
class GpuInfo:
    index: int
    name: str
    total: int        # bytes
    free: int         # bytes
    used: int
    driver: str
    cuda: str         # CUDA version the driver supports, e.g. "12.8"
    uuid: str = ""


@dataclass
class GpuSample:
    index: int
    util_pct: float | None
    mem_used: int | None
    mem_total: int | None
    temp_c: float | None
    power_w: float | None
    power_limit_w: float | None


def _init() -> bool:
    global _inited, _init_error
    with _lock:
        if _inited is not None:
            return _inited
        try:
            import pynvml
            pynvml.nvmlInit()
            _inited = True
        except Exception as e:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
            _inited = False
            _init_error = _explain(e)
        return _inited


def _explain(e: Exception) -> str:
    name = type(e).__name__
    if isinstance(e, ImportError):
        return "nvidia-ml-py is not installed"
    if "LibraryNotFound" in name or "not found" in str(e).lower():
        return "no NVIDIA driver found (NVML library missing)"
    if "DriverNotLoaded" in name:
        return "the NVIDIA driver is not loaded"
    return f"NVML unavailable: {e}"


def _s(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def detect_gpus() -> list[GpuInfo]:
    if not _init():
        return []
    import pynvml
    out = []
    try:
        driver = _s(pynvml.nvmlSystemGetDriverVersion())
        try:
            v = pynvml.nvmlSystemGetCudaDriverVersion_v2()
        except Exception:
            v = pynvml.nvmlSystemGetCudaDriverVersion()
        cuda = f"{v // 1000}.{(v % 1000) // 10}"
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            try:
                uuid = _s(pynvml.nvmlDeviceGetUUID(h))
            except Exception:
                uuid = ""
            out.append(GpuInfo(i, _s(pynvml.nvmlDeviceGetName(h)), int(mem.total), int(mem.free), int(mem.used),
                               driver, cuda, uuid))
    except Exception:
        return out
    return out


def gpu_status() -> tuple[list[GpuInfo], str]:
    """(gpus, message): message explains CPU mode when the list is empty."""
    gpus = detect_gpus()
    if gpus:
        return gpus, ""
    return [], f"No NVIDIA GPU: CPU mode ({_init_error or 'NVML reports no devices'})"


def sample(index: int = 0) -> GpuSample | None:
    if not _init():
        return None
    import pynvml
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:
        return None

    def tryget(fn, *a):
        try:
            return fn(*a)
        except Exception:
            return None
    util = tryget(pynvml.nvmlDeviceGetUtilizationRates, h)
    mem = tryget(pynvml.nvmlDeviceGetMemoryInfo, h)
    temp = tryget(pynvml.nvmlDeviceGetTemperature, h, 0)
    power = tryget(pynvml.nvmlDeviceGetPowerUsage, h)
    limit = tryget(pynvml.nvmlDeviceGetEnforcedPowerLimit, h)
    return GpuSample(index, float(util.gpu) if util else None, int(mem.used) if mem else None,
                     int(mem.total) if mem else None, float(temp) if temp is not None else None,
                     power / 1000 if power is not None else None, limit / 1000 if limit is not None else None)

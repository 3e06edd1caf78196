"""HiveJet's pinned PyTorch stacks: which (torch, CUDA wheel index, Triton) triple a machine gets.

The table is app/gpu_stack.json, one file that the first-run GPU setup (app/firstrun.py), the installers'
build scripts (the CPU build they bundle) and the CI check (tests/installer/test_gpu_stack.py: every version
resolves for its platform and Python) all read. Newest torch is not simply taken: a torch whose Triton does
not exist for the platform, or does not support the card (triton-windows supports Turing only up to Triton
3.2), would be downloaded and then fail. Rows are tried in order; the first whose compute capability range
and minimum driver CUDA version fit the GPU wins.

Standard library only (it runs before the app's dependencies exist)."""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

STACK_FILE = Path(__file__).with_name("gpu_stack.json")


def _ver2(s: str | None) -> tuple[int, int] | None:
    if not s:
        return None
    major, _, minor = s.partition(".")
    return int(major), int(minor or 0)


@dataclass(frozen=True)
class Stack:
    """One pinned triple. `triton` is the Triton distribution the setup installs beside torch on Windows
    (triton-windows); on Linux torch's CUDA wheels depend on `triton` themselves and the pin is checked only."""
    platform: str
    generation: str
    min_compute: tuple[int, int]
    max_compute: tuple[int, int] | None
    min_cuda: tuple[int, int]
    torch: str
    flavor: str
    index: str
    triton: str
    triton_version: str

    @property
    def torch_spec(self) -> str:
        return f"torch=={self.torch}+{self.flavor}"

    @property
    def triton_spec(self) -> str:
        return f"{self.triton}=={self.triton_version}"

    def fits(self, compute: tuple[int, int] | None, cuda: tuple[int, int] | None) -> bool:
        """Whether a GPU of this compute capability with a driver for this CUDA version runs the stack. An
        unknown compute capability (drivers older than 510 do not report it) counts as the newest."""
        if cuda is None or cuda < self.min_cuda:
            return False
        if compute is None:
            return self.max_compute is None
        return compute >= self.min_compute and (self.max_compute is None or compute <= self.max_compute)


@dataclass(frozen=True)
class CpuStack:
    platform: str
    torch: str
    local: str          # the local version tag of the build ("cpu" on Linux), "" for PyPI's own build
    index: str

    @property
    def torch_spec(self) -> str:
        return f"torch=={self.torch}" + (f"+{self.local}" if self.local else "")


def _platform_key(platform: str) -> str:
    return "win32" if platform == "win32" else "linux"


def load(path: Path = STACK_FILE) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def gpu_stacks(platform: str = sys.platform, table: dict | None = None) -> list[Stack]:
    table = table or load()
    key = _platform_key(platform)
    return [Stack(r["platform"], r["generation"], _ver2(r["min_compute"]), _ver2(r["max_compute"]),
                  _ver2(r["min_cuda"]), r["torch"], r["flavor"], r["index"], r["triton"], r["triton_version"])
            for r in table["gpu"] if r["platform"] == key]


def cpu_stack(platform: str = sys.platform, table: dict | None = None) -> CpuStack:
    table = table or load()
    key = _platform_key(platform)
    r = table["cpu"][key]
    return CpuStack(key, r["torch"], r["local"], r["index"])


def pythons(platform: str = sys.platform, table: dict | None = None) -> list[str]:
    """The Python versions the installers use on this platform (what the CI check resolves for)."""
    return list((table or load())["python"][_platform_key(platform)])


def pick(compute: tuple[int, int] | None, cuda: tuple[int, int] | None,
         platform: str = sys.platform) -> Stack | None:
    """The first pinned stack that runs on this GPU and driver, None when none does."""
    for s in gpu_stacks(platform):
        if s.fits(compute, cuda):
            return s
    return None


def for_flavor(flavor: str, compute: tuple[int, int] | None = None,
               platform: str = sys.platform) -> Stack | None:
    """The stack for a forced build tag (`hivejet-gpu-setup --flavor cu126`): the first row with that tag
    whose compute capability range holds the GPU (any row with it when the GPU is unknown)."""
    rows = [s for s in gpu_stacks(platform) if s.flavor == flavor]
    for s in rows:
        if compute is None or (compute >= s.min_compute and (s.max_compute is None or compute <= s.max_compute)):
            return s
    return None


def min_cuda(platform: str = sys.platform) -> tuple[int, int]:
    return min(s.min_cuda for s in gpu_stacks(platform))


def min_compute(platform: str = sys.platform) -> tuple[int, int]:
    return min(s.min_compute for s in gpu_stacks(platform))

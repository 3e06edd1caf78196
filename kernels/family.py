"""GPU architecture families: a device's compute capability -> the family whose kernel settings it takes.

The kernels were tuned on sm_90 (H100/H200). Cards of other generations differ in what a Triton kernel may
use, and a setting that asks for more than the card has fails when it launches:

    family  capabilities      cards                          shared memory / block  TMA  PDL  wgmma
    sm80    8.0, 8.7          A100, Jetson Orin              163 KB                 -    -    -
    sm86    8.6, 8.9 (< 8.0)  RTX 30xx, RTX 40xx, L4, L40    99 KB                  -    -    -
    sm90    9.x               H100, H200, GH200              227 KB                 yes  yes  yes
    sm100   10.x, 11.x        B200, GB200                    227 KB                 yes  yes  -
    sm120   12.x              RTX 50xx, RTX PRO 6000         99 KB                  yes  yes  -

(shared memory: the most one block may opt into, CUDA's sharedMemPerBlockOptin.) The Hopper paths (the
decode matmul's TMA tile loads, programmatic dependent launch, settings picked with wgmma's register
operands) are taken by sm90 only (`Family.hopper_paths`): sm_100 and sm_120 have TMA and PDL in hardware
but no wgmma, and those paths were never measured there, so they take the portable path of sm_80/86
until a run on such a card says otherwise (docs/GPU_FAMILIES.md).

Each kernel keeps one table of its settings by family name (kernels/quant/packed.py: PACKED_SETTINGS,
kernels/attention/paged.py: DECODE_SETTINGS ...); `device_family` picks the row for a CUDA device.

HIVEJET_GPU_FAMILY (test-only: sm80, sm86, sm90, sm100, sm120) forces the family of every device, so that
the sm_86 settings can be run and timed on an H100 (.ci/gpu/families.sh). A family with more than the card
has (sm90 on an RTX 3090) fails at launch: it is not a user setting.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

KB = 1024


@dataclass(frozen=True)
class Family:
    """An architecture family: its name, the capability the ahead-of-time test compiles it for (`arch`,
    e.g. 86; tests/kernels/test_aot_families.py), the most shared memory one block may use (bytes) and
    the hardware features it has."""
    name: str
    arch: int
    smem_per_block: int
    tma: bool
    pdl: bool
    wgmma: bool

    @property
    def hopper_paths(self) -> bool:
        """Whether kernels take the paths tuned and tested on sm_90 (TMA loads, PDL): only where wgmma is,
        i.e. on Hopper itself."""
        return self.tma and self.pdl and self.wgmma


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("sm80", 80, 163 * KB, tma=False, pdl=False, wgmma=False),
    Family("sm86", 86, 99 * KB, tma=False, pdl=False, wgmma=False),
    Family("sm90", 90, 227 * KB, tma=True, pdl=True, wgmma=True),
    Family("sm100", 100, 227 * KB, tma=True, pdl=True, wgmma=False),
    Family("sm120", 120, 99 * KB, tma=True, pdl=True, wgmma=False),
)}

# the test-only override (module doc); read here and nowhere else
FORCED = os.environ.get("HIVEJET_GPU_FAMILY", "").strip() or None
if FORCED is not None and FORCED not in FAMILIES:
    raise ValueError(f"HIVEJET_GPU_FAMILY={FORCED!r}: one of {', '.join(FAMILIES)}")


def family_of(capability: tuple[int, int]) -> Family:
    """The family of a compute capability (major, minor), the override aside."""
    major, minor = capability
    if major >= 12:
        return FAMILIES["sm120"]
    if major >= 10:
        return FAMILIES["sm100"]
    if major == 9:
        return FAMILIES["sm90"]
    if major == 8 and minor in (0, 7):
        return FAMILIES["sm80"]
    # 8.6, 8.9 and anything older (Triton needs sm_75+; the smallest limits are the safe ones)
    return FAMILIES["sm86"]


@lru_cache(maxsize=None)
def _device_family(device_index: int) -> Family:
    import torch
    return family_of(torch.cuda.get_device_capability(device_index))


def device_family(device=None) -> Family:
    """The family of a CUDA device (an index, a torch.device, or None: the current one); HIVEJET_GPU_FAMILY
    when set."""
    if FORCED is not None:
        return FAMILIES[FORCED]
    import torch
    if device is None:
        index = torch.cuda.current_device()
    elif isinstance(device, int):
        index = device
    else:
        index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_family(index)


def by_family(table: dict, family: Family | str):
    """A kernel's settings for a family from its table {family name: settings} (every table has a row for
    every family: a family added here without one is a KeyError, not a silent fallback)."""
    name = family if isinstance(family, str) else family.name
    if name not in table:
        raise KeyError(f"no settings for {name} (the table has {', '.join(sorted(table))})")
    return table[name]

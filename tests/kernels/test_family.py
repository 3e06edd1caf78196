"""GPU families (kernels/family.py): capabilities to families, every kernel table with a row per family, the
Hopper paths only on sm90, and the test-only override."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kernels.family import FAMILIES, by_family, family_of
from tests.kernels.sm90 import REPO


@pytest.mark.parametrize("cc, name", [((8, 0), "sm80"), ((8, 7), "sm80"), ((8, 6), "sm86"), ((8, 9), "sm86"),
                                      ((7, 5), "sm86"), ((9, 0), "sm90"), ((10, 0), "sm100"), ((10, 3), "sm100"),
                                      ((12, 0), "sm120"), ((12, 1), "sm120")])
def test_capability_to_family(cc, name):
    assert family_of(cc).name == name


def test_limits_and_hopper_paths():
    assert {n: f.smem_per_block // 1024 for n, f in FAMILIES.items()} == dict(sm80=163, sm86=99, sm90=227,
                                                                             sm100=227, sm120=99)
    # sm_120 has TMA and PDL but no wgmma: it must not take the paths tuned and tested on sm_90
    assert [n for n, f in FAMILIES.items() if f.hopper_paths] == ["sm90"]
    assert FAMILIES["sm120"].tma and FAMILIES["sm120"].pdl and not FAMILIES["sm120"].hopper_paths


def test_every_kernel_table_has_every_family():
    from kernels.attention.paged import DECODE_SETTINGS, PREFILL_SETTINGS
    from kernels.quant.packed import PACKED_SETTINGS
    for table in (PACKED_SETTINGS, DECODE_SETTINGS, PREFILL_SETTINGS):
        assert set(table) == set(FAMILIES)
    with pytest.raises(KeyError, match="no settings for sm999"):
        by_family(PACKED_SETTINGS, "sm999")


def test_tma_only_for_the_sm90_family():
    from gguf import GGMLQuantizationType as QT

    from kernels.quant.packed import tuned_config
    from kernels.quant.packing import pack_weight
    from tests.kernels.test_packed import _random_weight
    # a 256-value tile with its codes kept: the layout that takes TMA on sm_90
    p = pack_weight(_random_weight(QT.Q4_K, 128, 512), QT.Q4_K, 128, 512, tile_n=128, tile_k=256, coded=True)
    assert tuned_config(p, 0, 132, tma=True, family=FAMILIES["sm90"]).get("tma")
    for name in ("sm80", "sm86", "sm100", "sm120"):
        assert not tuned_config(p, 0, 132, tma=True, family=FAMILIES[name]).get("tma"), name


def _forced(value: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HIVEJET_GPU_FAMILY=value)
    return subprocess.run([sys.executable, "-c", "from kernels.family import device_family; "
                           "print(device_family(0).name)"], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_the_override_forces_a_family_and_rejects_unknown_ones():
    r = _forced("sm86")
    assert r.returncode == 0 and r.stdout.strip() == "sm86", r.stderr[-500:]
    r = _forced("sm75")
    assert r.returncode != 0 and "HIVEJET_GPU_FAMILY='sm75'" in r.stderr


def test_the_registry_takes_each_familys_settings():
    """kernels/launches.py compiles what the tables give: no TMA or PDL outside sm90, no register cap outside
    sm90, the prompt attention's smaller blocks on the 99 KB families."""
    from kernels.launches import attention_launches, packed_launches
    sm90, sm86 = packed_launches(FAMILIES["sm90"]), packed_launches(FAMILIES["sm86"])
    assert any(lc.constants.get("PDL") for lc in sm90) and not any(lc.constants.get("PDL") for lc in sm86)
    assert any("maxnreg" in lc.options for lc in sm90) and not any("maxnreg" in lc.options for lc in sm86)
    pre = [lc for lc in attention_launches(FAMILIES["sm86"]) if lc.name.startswith("attn_prefill")]
    assert pre and all(lc.constants["BLOCK_T"] == 16 and lc.constants["BLOCK_M"] * lc.constants["G_PAD"]
                       * max(lc.constants["DK"], lc.constants["DV"]) <= 4096 for lc in pre)

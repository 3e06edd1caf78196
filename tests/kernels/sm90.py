"""Running a script that compiles a Triton kernel for the H200 (sm_90) on a machine without a GPU:
Triton's own compiler and ptxas, in a process without TRITON_INTERPRET (the test session sets it, and
Triton reads it when a kernel is defined). The script prints its figures on its last line, or exits
with 3 when it cannot compile here (then the test skips)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sm90_figures(script: str, *args: str) -> list[int]:
    """The integers on the last line the script prints (run with `args`, from the repository's root)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "HIVEJET_NIBBLES_PTX")}
    r = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=300,
                       cwd=REPO)
    if r.returncode == 3:
        pytest.skip(r.stdout.strip())
    assert r.returncode == 0, r.stderr[-2000:]
    return [int(v) for v in r.stdout.strip().splitlines()[-1].split()]

"""The CPU path's logits do not depend on the CPU's instruction set.

torch picks its elementwise and reduction kernels by instruction set (AVX-512, AVX2 or scalar) and MKL
its BLAS kernels likewise. In float32 their summation orders and exp/tanh approximations differ in the
7th digit, and the CPU path's 8-bit activation rounding (as llama.cpp's CPU backend does it) turns such
differences into other tokens: the same code scored SmolLM2 and Gemma-3 on heapq_py at 95.3 % and 96.1 %
same top token against llama.cpp on an AVX2 machine and 94.9 % on an AVX-512 one, below the 95 % limit
(docs/ACCURACY.md). So the references compute in float64 and round once. Here the same forward (a prompt
chunk, then single-row decode steps) runs in two child processes, one with the machine's kernels and one
with torch's scalar kernels (ATEN_CPU_CAPABILITY=default), MKL's SSE4.2 code path and numba's kernels for a
generic CPU (NUMBA_CPU_NAME=generic), and the logits
must be equal to the bit. (Before the float64 references: up to 1.9 in a log-prob on Gemma-3.)
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TINY_SEED = 5
ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import sys, torch
from engine.models import open_model
from engine.models.common import SeqChunk
path, out = sys.argv[1], sys.argv[2]
m = open_model(path)
g = torch.Generator().manual_seed(0)
n_vocab = min(m.spec.vocab_size, 500)
prompt = torch.randint(0, n_vocab, (150,), generator=g)
kv = m.new_kv()
logits = [m.forward([SeqChunk(tokens=prompt, start=0, kv=kv, logits="all")])[0]]
for i in range(3):  # decode rows (qwen35: the recurrent form of the delta rule)
    logits.append(m.forward([SeqChunk(tokens=logits[-1][-1:].argmax(-1), start=150 + i, kv=kv)])[0])
torch.save(torch.cat(logits), out)
from kernels.quant import intdot_vnni
print(torch.backends.cpu.get_cpu_capability(), intdot_vnni.usable())
"""


def _logits(model: Path, out: Path, scalar: bool) -> tuple[torch.Tensor, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if scalar:
        # (and numba's kernels compiled for a generic x86-64: no AVX-512, so prompt rows take the float32-dot
        # matmul kernel rather than the VNNI one, kernels/quant/intdot_vnni.py)
        env.update(ATEN_CPU_CAPABILITY="default", MKL_ENABLE_INSTRUCTIONS="SSE4_2", NUMBA_CPU_NAME="generic")
    r = subprocess.run([sys.executable, "-c", CHILD, str(model), str(out)], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(out), r.stdout.strip()


@pytest.mark.parametrize("model", ["smollm2", "gemma3", "qwen35"])
def test_cpu_logits_do_not_depend_on_the_instruction_set(model, smollm2_path, gemma3_path, tiny, tmp_path):
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("torch runs its scalar kernels here already: nothing to compare them with")
    path = {"smollm2": smollm2_path, "gemma3": gemma3_path}.get(model) or tiny(model)
    native, cap = _logits(path, tmp_path / "native.pt", scalar=False)
    scalar, scalar_cap = _logits(path, tmp_path / "scalar.pt", scalar=True)
    assert scalar_cap.split()[0] == "DEFAULT" and cap.split()[0] != "DEFAULT", (cap, scalar_cap)
    assert scalar_cap.split()[1] == "False", scalar_cap   # (the float32-dot prompt kernel there)
    assert native.shape == (153, native.shape[1]) and torch.isfinite(native).all()
    diff = (native - scalar).abs().max().item()
    assert torch.equal(native, scalar), f"{model}: logits differ by up to {diff:g} between {cap} and scalar kernels"

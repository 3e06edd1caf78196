"""engine/planner.py counts a model's paired vision projector: weights + image-encoding workspace, its own line
in `hivejet plan`, and part of every total."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from app import cli_plan as C
from engine import planner as P
from engine.vision import mmproj_info
from engine.tools.synth_mmproj import write_mmproj, write_vlm


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("plan_mmproj")
    model = write_vlm(d / "qwen35-vlm.gguf", "qwen35")["path"]
    mm = write_mmproj(d / "mmproj-qwen35-vlm.gguf", "qwen3vl_merger")["path"]
    alone = tmp_path_factory.mktemp("plan_alone") / "qwen35-vlm.gguf"
    alone.write_bytes(open(model, "rb").read())
    return model, mm, alone


def test_mmproj_in_plan(pair):
    model, mm, alone = pair
    info = mmproj_info(mm)
    assert info["n_bytes"] > 0 and info["workspace_bytes"] > 0
    f = P.model_facts(model)
    assert f.mmproj == str(mm) and f.mmproj_projector == "qwen3vl_merger"
    assert f.vision_bytes == info["n_bytes"] + info["workspace_bytes"]
    bare = P.model_facts(alone)
    assert bare.mmproj is None and bare.vision_bytes == 0
    assert P.model_facts(model, mmproj=None).vision_bytes == 0
    p, q = P.plan(f, 8192, "q8_0"), P.plan(bare, 8192, "q8_0")
    assert p.vision == f.vision_bytes and q.vision == 0
    assert p.total == p.weights + p.kv + p.recurrent + p.workspace + p.vision == q.total + f.vision_bytes
    # the projector can tip a plan over: exactly the text-only total fits, the vision total does not
    assert P.plan(bare, 8192, "q8_0", vram=q.total).fits and not P.plan(f, 8192, "q8_0", vram=q.total).fits


def test_plan_cli_shows_projector_line(pair, capsys):
    model, mm, alone = pair
    assert C.run_plan(argparse.Namespace(model=str(model), vram="1GiB", kv="f16", seqs=1)) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("vision projector"))
    assert Path(mm).name in line and "qwen3vl_merger" in line and "included in the totals" in line
    assert "+ vision projector" in out
    assert C.run_plan(argparse.Namespace(model=str(alone), vram="1GiB", kv="f16", seqs=1)) == 0
    assert "vision projector" not in capsys.readouterr().out

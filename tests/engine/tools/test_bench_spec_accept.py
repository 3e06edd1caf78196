"""`hivejet bench spec --accept` (engine/tools/bench_spec_accept.py) on a synthetic qwen35 with an MTP block,
on the CPU: the report's runs, the controlled acceptance it claims, the output checked against drafts off."""
from __future__ import annotations

import json

import pytest

from app.cli import main
from engine.tools.bench_spec_accept import bench_accept
from engine.tools.synth import write_synthetic


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("acc") / "qwen35_mtp.gguf"
    write_synthetic(path, "qwen35", "tiny", seed=8, mtp=True)
    return str(path)


def test_bench_accept_reports_each_agent_count(mtp_model):
    lines = []
    # (draft lengths from acceptance alone: the adaptive ones depend on this machine's measured step costs)
    res = bench_accept(mtp_model, [1.0, 0.0], agents=(1, 3), n_gen=12, device="cpu", prompt_len=16, adaptive=False,
                       log=lines.append)
    assert [r["agents"] for r in res["runs"]] == [1, 3]
    assert "controlled" in res["acceptance"] and "acceptance was controlled" in lines[0]
    for r in res["runs"]:
        assert r["same_as_off"]
        assert r["off"]["tokens"] == r["controlled"]["tokens"] == r["uncontrolled"]["tokens"] == 12 * r["agents"]
        c = r["controlled"]
        # rate 1 then 0: every drafted position 1 accepted, position 2 never
        assert c["accepted"] == r["replaced_by_target"] > 0 and c["drafted"] == r["replaced"]
        assert c["accepted"] <= c["drafted"]
        assert r["speedup"] > 0 and "outs" not in c
    assert len(lines) == 3


def test_cli_spec_accept(mtp_model, tmp_path, capsys):
    out = tmp_path / "acc.json"
    assert main(["bench", "spec", "--accept", "0.5", "-m", mtp_model, "--device", "cpu", "--agents", "2", "-n", "8", "--no-adaptive",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "acceptance was controlled" in printed and " 2 agents:" in printed
    saved = json.loads(out.read_text())
    assert saved["rates"] == [0.5] and saved["adaptive"] is False
    assert main(["bench", "spec", "--accept", "0.9,x", "-m", mtp_model]) == 2
    assert "'x' is not a number" in capsys.readouterr().err
    assert main(["bench", "spec", "--accept", "0.9"]) == 2

"""`hivejet bench agents` end to end on the CPU with a tiny synthetic model: the server starts, every
scenario runs and reports numbers (speed is measured on the GPU machine, not asserted here)."""
from __future__ import annotations

from engine.tools.bench_agents import bench_agents, print_agents
from engine.tools.synth import write_synthetic


def test_bench_agents_runs_every_scenario(tmp_path, capsys):
    path = tmp_path / "tiny.gguf"
    write_synthetic(path, "llama", "tiny", seed=3)
    res = bench_agents(str(path), device="cpu", agents=(1, 2), gen=6, context=48, new_tokens=5, long_prompt=96,
                       duration=1.0)
    r = res["results"]["HiveJet"]
    assert [d["agents"] for d in r["decode"]] == [1, 2] and all(d["total"] > 0 for d in r["decode"])
    for d in r["decode"]:   # where the wall time beyond decoding went
        assert 0 < d["ttft_s"]["min"] <= d["ttft_s"]["median"] <= d["ttft_s"]["max"] < d["wall_s"]
        assert 0 <= d["end_spread_s"] < d["wall_s"]
    assert len(r["long_context"]["per_agent"]) == 4 and len(r["follow_up_ttft"]) == 4
    assert r["during_prefill"]["intruder_ttft"] > 0 and r["paused_agents"]["total"] > 0
    assert all(x > 0 for x in r["during_prefill"]["before"])   # the long prompt waits until the three decode
    assert all(x > 0 for x in r["long_context"]["per_agent"])
    print_agents(res)
    assert "follow-up first token" in capsys.readouterr().out
    # the chart: both "servers" (here the same run twice) in one PNG through `hivejet bench plot`
    import json
    from PIL import Image

    from app.cli import main
    res_b = {"model": res["model"], "results": {"other": r}}
    for name, obj in (("a.json", res), ("b.json", res_b)):
        (tmp_path / name).write_text(json.dumps(obj))
    assert main(["bench", "plot", str(tmp_path / "a.json"), str(tmp_path / "b.json"), str(tmp_path / "a.png")]) == 0
    assert Image.open(tmp_path / "a.png").size == (900, 40 + 5 * 190)


def test_bench_agents_runs_chosen_scenarios_with_serve_args(tmp_path, capsys):
    """--scenarios 3 4 (the follow-ups read their conversations first; the long prompt beside three
    agents) and --serve-args reach `hivejet serve`: only those results, printed and plotted."""
    import json
    from PIL import Image

    from app.cli import main
    path = tmp_path / "tiny.gguf"
    write_synthetic(path, "llama", "tiny", seed=3)
    res = bench_agents(str(path), device="cpu", gen=4, context=40, new_tokens=5, long_prompt=64,
                       scenarios=(3, 4), serve_args=("--prefill-chunk", "32"))
    r = res["results"]["HiveJet"]
    assert set(r) == {"follow_up_ttft", "during_prefill"}
    assert res["serve_args"] == ["--prefill-chunk", "32"] and res["scenarios"] == [3, 4]   # (the run says how)
    assert len(r["follow_up_ttft"]) == 4 and r["during_prefill"]["intruder_ttft"] > 0
    print_agents(res)
    out = capsys.readouterr().out
    assert "3. follow-up" in out and "4. 3 agents" in out and "1. " not in out
    (tmp_path / "a.json").write_text(json.dumps(res))
    assert main(["bench", "plot", str(tmp_path / "a.json"), str(tmp_path / "a.png")]) == 0
    assert Image.open(tmp_path / "a.png").size == (900, 40 + 2 * 190)
    # a server that does not start with the given arguments: a clear error, not a hang
    import pytest
    with pytest.raises(RuntimeError, match="exited"):
        bench_agents(str(path), device="cpu", scenarios=(3,), serve_args=("--prefill-chunk", "100"))

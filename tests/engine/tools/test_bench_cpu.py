"""The benchmark scenarios' CPU-side pieces: the modelled speculative speedup from a row table, the
row-scaling plot, and `hivejet bench spec` end to end on a tiny model (speed itself is measured on the
GPU machine, never asserted here)."""
from __future__ import annotations

import json

from engine.tools.bench_spec import measure, modelled
from engine.tools.synth import write_synthetic


ROWS = [dict(rows=1, ms=20.0, tok_s=50.0, vs_1row=1.0), dict(rows=4, ms=21.0, tok_s=190.0, vs_1row=1.05),
        dict(rows=16, ms=24.0, tok_s=666.0, vs_1row=1.2)]


def test_modelled_speedup_uses_the_row_table():
    out = {r["rows"]: r for r in modelled(ROWS)}
    assert abs(out[16]["speedup"] - 6.5 / 1.2) < 1e-9          # DFlash: 15 drafts + 1 row
    assert abs(out[4]["step_cost"] - 1.05) < 1e-9               # MTP: 3 drafts + 1 row
    assert abs(out[4]["tokens_per_step"] - (1 + 0.73 + 0.73 ** 2 + 0.73 ** 3)) < 1e-9


def test_plot_rows(tmp_path):
    from PIL import Image

    from engine.tools.bench_decode import plot_rows
    out = tmp_path / "rows.png"
    plot_rows(dict(rows=ROWS, model="m.gguf", device="test"), str(out))
    assert Image.open(out).size == (760, 440)


def test_bench_spec_measures_each_mode(tmp_path):
    path = tmp_path / "q.gguf"
    write_synthetic(path, "qwen35", "tiny", seed=2, mtp=True)
    rows = {r["spec"]: r for r in measure(str(path), n_tokens=12)}
    assert set(rows) == {"off", "ngram", "mtp"}
    for r in rows.values():
        assert r["tokens"] >= 1 and r["same_as_off"] is True
    assert rows["mtp"]["drafted"] > 0
    json.dumps(rows)


def test_verify_costs_run_on_the_runner(tmp_path):
    """`hivejet bench spec --verify-rows` on the CPU with tiny models (llama: rows of one slot; qwen35: the
    delta-rule waves and cut_back): every configuration is timed, the k = 0 step is the base, and every
    step starts from the same state (the drafts are cut back: the pool is as after the prompts)."""
    from engine.tools.bench_spec import verify_costs
    from engine.tools.synth import write_synthetic
    for arch in ("llama", "qwen35"):
        path = tmp_path / f"{arch}.gguf"
        write_synthetic(path, arch, "tiny", seed=2)
        res = verify_costs(str(path), device="cpu", drafts=(0, 4), seqs=(1, 2), pos=32, reps=2)
        assert [(r["seqs"], r["drafts"], r["rows"]) for r in res] == [(1, 0, 1), (1, 4, 5), (2, 0, 2), (2, 4, 10)]
        assert all(r["ms"] > 0 for r in res) and res[0]["vs_no_drafts"] == 1.0


def test_decode_result_prints_its_ceiling_and_family():
    from engine.tools.bench_decode import ceiling_text
    res = dict(family="sm86", decode_read_bytes=16_000_000_000, hivejet=[dict(test="pp512", depth=0, tok_s=900.0),
                                                                         dict(test="tg128", depth=0, tok_s=45.0)],
               card=dict(key="rtx4090"))
    text = ceiling_text(res)
    assert text.startswith("kernel settings of the sm86 family; decode ceiling on RTX 4090 (1008 GB/s")
    assert "63.0 tok/s" in text and "measured 45.0 tok/s = 71% of it" in text
    assert "not in the card table" in ceiling_text(dict(family="sm90", decode_read_bytes=1, hivejet=[]))


def test_bench_decode_on_the_cpu_path(tmp_path, capsys):
    """`hivejet bench decode --device cpu` (engine/tools/bench_cpu.py) end to end on a tiny model: both figures,
    their repeats, the decode steps' times, the same figures through the runner, the table printed (speed is
    not asserted)."""
    from engine.tools.bench_cpu import bench_cpu, print_cpu
    path = tmp_path / "llama.gguf"
    write_synthetic(path, "llama", "tiny", seed=2)
    res = bench_cpu(str(path), n_prompt=8, n_gen=3, threads=1, reps=2, json_path=str(tmp_path / "r.json"),
                    runner=True)
    tests = {r["test"]: r for r in res["hivejet"]}
    assert set(tests) == {"pp8", "tg3"} and res["threads"] == 1
    assert [r["test"] for r in res["runner"]] == ["pp8", "tg3"] and len(res["runner"][1]["tok_s_runs"]) == 1
    assert len(tests["pp8"]["tok_s_runs"]) == 2 and all(t > 0 for t in tests["pp8"]["tok_s_runs"])
    assert tests["tg3"]["step_ms_min"] <= tests["tg3"]["step_ms_median"]
    assert json.loads((tmp_path / "r.json").read_text())["model"] == "llama.gguf"
    print_cpu(res)
    out = capsys.readouterr().out
    assert "pp8" in out and "tg3 runner" in out


def test_llamacpp_cpu_build_errors_are_clear(tmp_path, monkeypatch):
    """A folder without llama-bench, and a build without cmake, fail with errors that say what is missing."""
    import pytest

    from engine.tools import llamacpp_cpu
    from engine.tools.bench_cpu import _llama_bench_path
    with pytest.raises(FileNotFoundError, match="no llama-bench in"):
        _llama_bench_path(str(tmp_path))
    monkeypatch.setattr(llamacpp_cpu.shutil, "which", lambda name: None)
    with pytest.raises(llamacpp_cpu.BuildError, match="needs cmake"):
        llamacpp_cpu.build(tmp_path / "cache")

"""Planner page: the numbers are engine/planner's; no GPU here -> the CPU-mode state."""
from __future__ import annotations

import pytest

pytest.importorskip("PySide6")

from engine import planner as P  # noqa: E402
from engine.tools.synth import write_synthetic  # noqa: E402


def test_planner_page_matches_engine_planner(qtbot, tmp_path):
    from app.gui.planner_page import PlannerPage
    path = tmp_path / "q27.gguf"
    write_synthetic(path, "qwen35", "27b-q4_k_m", header_only=True)
    page = PlannerPage()
    qtbot.addWidget(page)
    assert page.cpu_mode and "No NVIDIA GPU: CPU mode" in page.gpu_card.text()
    page.vram_edit.setText("24GiB")
    page.set_models([("27B", str(path))])
    f = P.model_facts(path)
    vram = P.parse_size("24GiB")
    kvs = list(P.KV_TYPES)
    for r, kt in enumerate(kvs):
        for c, ctx in enumerate(P.CONTEXTS):
            plan = P.plan(f, ctx, kt, 1, vram)
            item = page.table.item(r, c)
            assert item.data(0x0100) == plan.total           # Qt.UserRole
            assert item.text() == f"{plan.total / P.GiB:.2f} GiB"
        assert page.table.item(r, len(P.CONTEXTS)).text() == f"{P.max_context(f, kt, vram):,}"
    got = []
    page.loadRequested.connect(lambda *a: got.append(a))
    page.load_cell(kvs.index("turbo3"), P.CONTEXTS.index(131072))
    assert got == [(str(path), 131072, "turbo3", 1)]
    page.seqs.setValue(4)                                    # parallel chats multiply KV + state
    assert page.table.item(0, 0).data(0x0100) == P.plan(f, P.CONTEXTS[0], kvs[0], 4, vram).total
    page.load_cell(0, 0)                                     # what loads is what was planned for
    assert got[-1] == (str(path), P.CONTEXTS[0], kvs[0], 4)
    assert PlannerPage(parallel=16).seqs.value() == 16       # (the app's setting: main_window passes it)
    page.vram_edit.setText("lots")
    page.refresh()
    assert "Cannot read a memory size" in page.error.text()


def test_planner_page_bad_file(qtbot, tmp_path):
    from app.gui.planner_page import PlannerPage
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 8)
    page = PlannerPage()
    qtbot.addWidget(page)
    page.set_models([("bad", str(bad))])
    assert "Cannot plan for this file" in page.error.text()


def test_planner_page_prints_the_decode_ceiling_on_a_card(qtbot, tmp_path):
    from app.gui.planner_page import PlannerPage
    from engine.cards import BY_KEY
    path = tmp_path / "q27.gguf"
    write_synthetic(path, "qwen35", "27b-q4_k_m", header_only=True)
    page = PlannerPage()
    qtbot.addWidget(page)
    page.set_models([("27B", str(path))])
    read = P.model_facts(path).decode_read_bytes
    # no GPU here: the 24 GB RTX 3090
    assert f"decode ceiling on RTX 3090: {936e9 / read:.0f} tok/s" in page.summary.text()
    page.card_combo.setCurrentIndex(page.card_combo.findData("rtx5090"))
    assert f"decode ceiling on RTX 5090: {1792e9 / read:.0f} tok/s" in page.summary.text()
    assert BY_KEY["rtx5090"].bandwidth_gbs == 1792

"""The card table (engine/cards.py) and the decode ceiling the planner's read bytes give on a card."""
from __future__ import annotations

import pytest

from engine.cards import BY_KEY, card, card_for_device, ceiling_line, decode_ceiling


def test_the_consumer_cards_figures():
    got = {k: (BY_KEY[k].bandwidth_gbs, BY_KEY[k].memory_gb, BY_KEY[k].sm)
           for k in ("rtx3090", "rtx4090", "rtx5090", "a100-40gb", "a100-80gb", "h100", "h200")}
    assert got == {"rtx3090": (936, 24, "sm_86"), "rtx4090": (1008, 24, "sm_89"), "rtx5090": (1792, 32, "sm_120"),
                   "a100-40gb": (1555, 40, "sm_80"), "a100-80gb": (2039, 80, "sm_80"), "h100": (3350, 80, "sm_90"),
                   "h200": (4800, 141, "sm_90")}


def test_card_names_and_an_unknown_one():
    assert card("RTX3090") is BY_KEY["rtx3090"] and card("rtx 4090") is BY_KEY["rtx4090"]
    with pytest.raises(ValueError, match="unknown card 'gtx9000'.*rtx3090"):
        card("gtx9000")


@pytest.mark.parametrize("name, memory, key", [
    ("NVIDIA GeForce RTX 3090", None, "rtx3090"), ("NVIDIA GeForce RTX 3090 Ti", None, "rtx3090ti"),
    ("NVIDIA GeForce RTX 4090", None, "rtx4090"), ("NVIDIA GeForce RTX 5090", None, "rtx5090"),
    ("NVIDIA A100-SXM4-80GB", None, "a100-80gb"), ("NVIDIA A100-SXM4-40GB", None, "a100-40gb"),
    ("NVIDIA A100", 85e9, "a100-80gb"), ("NVIDIA H100 80GB HBM3", None, "h100"), ("NVIDIA H200", None, "h200"),
    ("NVIDIA H100 PCIe", None, "h100-pcie")])
def test_device_names_to_cards(name, memory, key):
    assert card_for_device(name, memory) is BY_KEY[key]


def test_an_unknown_device_has_no_card():
    assert card_for_device("Tesla T4") is None


def test_the_ceiling():
    # 16.1 GB read per token on an RTX 3090: 936 / 16.1 = 58.1 tok/s
    assert decode_ceiling(16_100_000_000, BY_KEY["rtx3090"]) == pytest.approx(58.14, abs=0.01)
    line = ceiling_line(16_100_000_000, BY_KEY["rtx3090"], measured_tok_s=29.07)
    assert "58.1 tok/s" in line and "RTX 3090 (936 GB/s, 24 GB, sm_86)" in line and "50% of it" in line


def test_planner_read_bytes_leave_out_the_embedding_rows_and_mtp(tmp_path):
    from engine.planner import model_facts
    from engine.tools.synth import write_synthetic
    path = tmp_path / "m.gguf"
    write_synthetic(str(path), "qwen35", "tiny")
    f = model_facts(path)
    assert 0 < f.decode_read_bytes < f.device_weight_bytes

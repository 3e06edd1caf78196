"""GPU cards: memory bandwidth, memory size and architecture of the cards HiveJet's users run, and the decode
ceiling a model implies on one.

A decode step reads every weight the step uses once (the token embedding table only for its rows), so one
sequence can decode at most bandwidth / (weight bytes read per token) tokens per second, whatever the kernels
do: the ceiling `hivejet plan`, the planner page and `hivejet bench decode` print (`--card NAME`, or the card
in use). Figures: the makers' specifications (memory bandwidth in GB/s = 1e9 bytes/s, memory in GB = 1e9
bytes as the makers count, compute capability).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Card:
    """One card: its `--card` name, what it is called, memory bandwidth (GB/s), memory (GB), compute
    capability, and what its device name (torch.cuda.get_device_name) contains."""
    key: str
    name: str
    bandwidth_gbs: float
    memory_gb: float
    capability: tuple[int, int]
    match: tuple[str, ...]

    @property
    def sm(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"


CARDS: tuple[Card, ...] = (
    Card("rtx3060", "RTX 3060 12GB", 360, 12, (8, 6), ("RTX 3060",)),
    Card("rtx3080", "RTX 3080", 760, 10, (8, 6), ("RTX 3080",)),
    Card("rtx3090", "RTX 3090", 936, 24, (8, 6), ("RTX 3090",)),
    Card("rtx3090ti", "RTX 3090 Ti", 1008, 24, (8, 6), ("RTX 3090 Ti",)),
    Card("rtxa6000", "RTX A6000", 768, 48, (8, 6), ("RTX A6000",)),
    Card("rtx4070tis", "RTX 4070 Ti SUPER", 672, 16, (8, 9), ("RTX 4070 Ti SUPER",)),
    Card("rtx4080", "RTX 4080", 717, 16, (8, 9), ("RTX 4080",)),
    Card("rtx4090", "RTX 4090", 1008, 24, (8, 9), ("RTX 4090",)),
    Card("rtx6000ada", "RTX 6000 Ada", 960, 48, (8, 9), ("RTX 6000 Ada",)),
    Card("l40s", "L40S", 864, 48, (8, 9), ("L40S",)),
    Card("rtx5080", "RTX 5080", 960, 16, (12, 0), ("RTX 5080",)),
    Card("rtx5090", "RTX 5090", 1792, 32, (12, 0), ("RTX 5090",)),
    Card("rtxpro6000", "RTX PRO 6000 Blackwell", 1792, 96, (12, 0), ("RTX PRO 6000",)),
    Card("a100-40gb", "A100 40GB", 1555, 40, (8, 0), ("A100-SXM4-40GB", "A100-PCIE-40GB", "A100 40GB")),
    Card("a100-80gb", "A100 80GB", 2039, 80, (8, 0), ("A100-SXM4-80GB", "A100 80GB", "A100-PCIE-80GB")),
    Card("h100-pcie", "H100 PCIe", 2000, 80, (9, 0), ("H100 PCIe",)),
    Card("h100", "H100 SXM", 3350, 80, (9, 0), ("H100 80GB HBM3", "H100 SXM")),
    Card("h200", "H200", 4800, 141, (9, 0), ("H200",)),
    Card("b200", "B200", 8000, 180, (10, 0), ("B200",)),
)
BY_KEY = {c.key: c for c in CARDS}


def card(key: str) -> Card:
    """The card named `key` (`--card`), case and spaces aside; ValueError naming the known ones."""
    k = key.lower().replace(" ", "").replace("_", "-")
    if k in BY_KEY:
        return BY_KEY[k]
    raise ValueError(f"unknown card {key!r}: one of {', '.join(BY_KEY)}")


def card_for_device(device_name: str, total_memory: int | None = None) -> Card | None:
    """The table's card for a CUDA device name (torch.cuda.get_device_name), the longest match winning (an
    "RTX 3090 Ti" is not an "RTX 3090"); for an A100 without its size in the name, the memory decides. None
    for a card not in the table."""
    hits = [(len(m), c) for c in CARDS for m in c.match if m.lower() in device_name.lower()]
    if not hits and "A100" in device_name and total_memory:
        return BY_KEY["a100-80gb" if total_memory > 50e9 else "a100-40gb"]
    return max(hits, key=lambda t: t[0])[1] if hits else None


def current_card() -> Card | None:
    """The card of CUDA device 0, when there is one and the table knows it."""
    try:
        import torch
        if not torch.cuda.is_available():
            return None
        props = torch.cuda.get_device_properties(0)
        return card_for_device(props.name, props.total_memory)
    except Exception:   # no torch, no driver: no card
        return None


def decode_ceiling(read_bytes: int, c: Card) -> float:
    """The most tokens per second one sequence can decode on card c when a step reads read_bytes."""
    return c.bandwidth_gbs * 1e9 / read_bytes if read_bytes > 0 else float("inf")


def ceiling_line(read_bytes: int, c: Card, measured_tok_s: float | None = None) -> str:
    """One line for the CLI: the ceiling on c (and a measured speed's share of it)."""
    top = decode_ceiling(read_bytes, c)
    line = (f"decode ceiling on {c.name} ({c.bandwidth_gbs:.0f} GB/s, {c.memory_gb:.0f} GB, {c.sm}): "
            f"{top:.1f} tok/s ({read_bytes / 1e9:.2f} GB of weights read per token)")
    if measured_tok_s:
        line += f"; measured {measured_tok_s:.1f} tok/s = {measured_tok_s / top:.0%} of it"
    return line

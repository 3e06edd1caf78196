"""What a runner step is made of, as data: a step's rows in slots (SlotBatch, the stand-in for the model's
Batch), a prompt chunk's inputs besides its ids (PromptInputs). (Captured decode steps and the guard around
captures: engine/runner/graphs.py.)"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch


if TYPE_CHECKING:
    from engine.runner.runner import Runner


@dataclass
class PromptInputs:
    """What a prompt chunk with images gives the model besides its token ids (engine/vision/prompt.py's
    VisionPrompt.chunk_inputs, for the rows of one prefill call): RoPE positions [n] or [n, 3] (M-RoPE; None:
    start..start+n), (row indices, float rows [k, n_embd]) replacing those rows' token embeddings, spans
    [lo, hi) of positions attended both ways, and the slot's rope delta (the generated tokens' RoPE position
    minus their index: M-RoPE models after images, Runner(rope_offsets=True)); keys: the rows' ids as the
    prefix grid hashes them (images by content: VisionPrompt.prefix_keys; None: the slot leaves the grid)."""

    positions: torch.Tensor | None = None
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    bidirectional: list[tuple[int, int]] | None = None
    rope_delta: int = 0
    keys: list[int] | None = None


class SlotBatch:
    """Stands in for engine.models.common.Batch in a runner step: rows live in runner slots.
    decode: row r is slot slots[r]'s next token at positions[r]. prefill: all rows are one slot's
    chunk at positions start.. (the slot and start given as Python ints)."""

    chunks = ()
    valid: torch.Tensor | None = None   # a padded prompt chunk (engine/runner/prefill.py): 1 real row, 0 padding
    keep: torch.Tensor | None = None    # and the rows that make its new conv window (qwen35)
    pieces = None                       # and its pieces' layout (engine/runner/prefill.py: PromptPieces)
    # a prompt chunk with images (PromptInputs): RoPE positions where they are not `positions` (M-RoPE; decode
    # rows of a slot after images: positions + its rope delta), rows taking image embeddings, and position
    # spans attended both ways (Gemma 3)
    rope_positions: torch.Tensor | None = None
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    bidirectional: list[tuple[int, int]] | None = None

    def __init__(self, runner: Runner, positions: torch.Tensor, slots: torch.Tensor, decode: bool,
                 slot: int = -1, start: int = 0, attention=None):
        self.runner, self.positions, self.slots, self.decode = runner, positions, slots, decode
        # the attention over the runner's pool (another one for the MTP block's own layer: engine/runner/mtp.py)
        self.attention = runner.attention if attention is None else attention
        self.slot, self.start = slot, start
        self.rope: dict = {}
        self._pool: dict = {}
        self.layout: torch.Tensor | None = None  # a drafting step's rows (kernels/gdn/verify.py), else None
        self.centers = True     # decode: make the key centers of rows at a new segment (Runner._needs_centers)

    def rows(self) -> torch.Tensor:
        """Each row's place in the pool's caches (the same for every layer: computed once per step)."""
        if "rows" not in self._pool:
            self._pool["rows"] = self.runner.tables.rows(self.slots.long(), self.positions.long())
        return self._pool["rows"]

    def tables(self) -> torch.Tensor:
        """The decode rows' block tables [rows, max_blocks] (once per step)."""
        if "tables" not in self._pool:
            self._pool["tables"] = self.runner.block_table.index_select(0, self.slots.long())
        return self._pool["tables"]

    def lengths(self) -> torch.Tensor:
        """The decode rows' key counts, int32 (positions + 1; once per step)."""
        if "lengths" not in self._pool:
            self._pool["lengths"] = (self.positions + 1).to(torch.int32)
        return self._pool["lengths"]

    def attend(self, il, q, k, v, scale, window):
        return self.attention.attend(self, il, q, k, v, scale, window)

    def attend_prepared(self, il, q, k, v, prep, scale, window, gate=None, out_dtype=None):
        """DecoderModel.attend_heads' GPU shortcut: decode rows over a float cache do the norms and rope
        (engine/models/common.py: HeadPrep) in the kernel that writes K and V, the output gate in the
        attention's merge kernel. None where that does not apply (the model preps and attends as usual)."""
        if not self.decode:
            return None
        return self.attention.attend_prepared(self, il, q, k, v, prep, scale, window, gate, out_dtype)

    def state_slots(self) -> torch.Tensor:
        """The decode rows' recurrent-state slots, padding rows -1 (no state update; once per step)."""
        if "state_slots" not in self._pool:
            r = self.runner
            self._pool["state_slots"] = torch.where(self.slots == r.scratch, -1, self.slots)
        return self._pool["state_slots"]

    def delta_net(self, il, shape, L, qkv, alpha_x, beta_x):
        return self.runner.recurrent.delta_net(self, il, shape, L, qkv, alpha_x, beta_x)

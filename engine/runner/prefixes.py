"""Which of a slot's first positions another slot can start from, bit for bit: the runner's prefix bookkeeping.

A slot's first positions can be given to another slot (Runner.copy_prefix) so that the other computes only the
rest of its prompt. The result is the one a cold prefill gives, bit for bit, when the copied prefix was itself
prefilled by the same full chunks from position 0 (`exact_length`) and ends on that grid: then the rest is cut into
the chunks a cold run cuts, the copied rows are the bytes it would have written, and so are the key preconditioning
(the smoothing weights come from the first chunk; a segment's center from the chunk that first reaches it, which
ends within the prefix) and, from a checkpoint, the recurrent states. Rows a slot decoded, or prefilled off that
grid, are not offered.

Per slot: the grid its exact prefix was prefilled on and the digests of that prefix at each multiple of it (the
recurrent-state checkpoints' keys, chained chunk by chunk), and the position its recurrent states are at (-1: not
known).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from engine.prefix import common_prefix

HOST_CHECKPOINT_STRIDE = 4   # host-memory checkpoints: every 4th prompt chunk end (and each prompt's last: grid_step)


def _digest(prev: bytes, tokens) -> bytes:
    """The hash of a prefix, chained chunk by chunk: the previous prefix's digest and the next chunk's ids."""
    ids = torch.as_tensor(tokens, dtype=torch.long).numpy().tobytes()
    return hashlib.blake2b(prev + ids, digest_size=16).digest()


def prefix_digests(tokens, chunk: int, upto: int) -> list[bytes]:
    """Digests of tokens[:i * chunk] for i = 0 .. upto // chunk: the keys state checkpoints are saved under."""
    out = [b""]
    for lo in range(0, upto // chunk * chunk, chunk):
        out.append(_digest(out[-1], tokens[lo:lo + chunk]))
    return out


@dataclass
class PrefixMatch:
    """What Runner.find_prefix found: copy slot `src`'s first n positions; recurrent models take their
    states after n positions from `state`, a slot whose states are at n (int) or a checkpoint key."""
    src: int
    n: int
    state: object = None


class SlotPrefixes:
    """n_slots slots' exact prefixes and state positions. checkpoints: the runner's StateCheckpoints
    (engine/runner/checkpoints.py); recurrent: whether the model has recurrent states (a prefix then also needs
    the states at its length); block_size: the shortest prefix worth sharing."""

    def __init__(self, n_slots: int, checkpoints, recurrent: bool, block_size: int):
        self.checkpoints, self.recurrent, self.block_size = checkpoints, recurrent, block_size
        self.grid: list[tuple[int, list]] = [(0, [b""]) for _ in range(n_slots)]
        self.live = [0] * n_slots

    def start_over(self, slot: int) -> None:
        """Slot restarts at position 0 (its states zeroed)."""
        self.live[slot] = 0

    def forget(self, slot: int) -> None:
        """Slot's rows are given back: no prefix, states not known."""
        self.grid[slot] = (0, [b""])
        self.live[slot] = -1

    def exact_length(self, slot: int, chunk: int | None = None) -> int:
        """How many of slot's first positions were prefilled by full chunks of `chunk` tokens on multiples of
        it from position 0 (or copied from such a slot), not rewritten since: what a cold prefill in those
        chunks writes there, key preconditioning included."""
        c, digests = self.grid[slot]
        return c * (len(digests) - 1) if c and chunk in (None, c) else 0

    def rewrite(self, slot: int, pos: int) -> None:
        """Rows from pos on are written again: the slot's exact prefix ends at the last grid point before."""
        c, digests = self.grid[slot]
        if c and pos < c * (len(digests) - 1):
            del digests[pos // c + 1:]

    def begin_rows(self, slot: int, lo: int) -> int:
        """Before a slot's prompt rows from lo run: the exact prefix cut at lo, the states' position unknown until
        the rows are in (grid_step). Returns where the states were."""
        live = self.live[slot]
        self.rewrite(slot, lo)
        self.live[slot] = -1                  # (not known should the pass fail)
        return live

    def decode_row(self, slot: int, p: int) -> None:
        """A decode row at p: below the exact prefix it cuts it there, and the states move one position on."""
        self.rewrite(slot, p)
        self.live[slot] = p + 1 if self.live[slot] == p else -1

    def grid_step(self, slot: int, lo: int, hi: int, tokens: torch.Tensor, chunk: int, live: int,
                  prompt_end: int = 0) -> None:
        """After a prefill chunk [lo, hi) (live: where the states were before it): a full chunk on the grid
        that continues the exact prefix extends it, and (recurrent models, with checkpoints) the states
        there are kept as a checkpoint; in host memory, only every HOST_CHECKPOINT_STRIDE-th chunk end
        and those a prompt ending at `prompt_end` is resumed at when it is sent again (the last before its
        last token) or followed up (its last) (a copy over PCIe costs ~3 % of a chunk's time)."""
        c, digests = (chunk, [b""]) if lo == 0 else self.grid[slot]
        if lo == 0:
            self.checkpoints.new_chain(slot)
        self.live[slot] = hi
        if c != chunk or lo != c * (len(digests) - 1) or hi - lo != chunk or (self.recurrent and live != lo):
            self.grid[slot] = (c, digests)
            return
        # digests are the checkpoints' keys: only computed when there are checkpoints (host tokens only)
        hashing = self.checkpoints.max > 0 and digests[-1] is not None and tokens.device.type == "cpu"
        digests.append(_digest(digests[-1], tokens) if hashing else None)
        self.grid[slot] = (c, digests)
        if hashing and (not self.checkpoints.on_host or hi // chunk % HOST_CHECKPOINT_STRIDE == 0
                        or not prompt_end or hi >= (prompt_end - 1) // chunk * chunk):
            self.checkpoints.save(slot, (digests[-1], hi, chunk), self._on_chain)

    def off_grid(self, slot: int, hi: int) -> None:
        """After rows prefilled with images and no keys: the slot offers no prefix to other slots (image
        placeholder ids do not say what its rows hold) and saves no checkpoints; its states are at hi."""
        self.grid[slot] = (0, [b""])
        self.checkpoints.new_chain(slot)
        self.live[slot] = hi

    def _on_chain(self, slot: int, prev: tuple, key: tuple) -> bool:
        """Whether checkpoint `prev` is an earlier point of the prefix slot's checkpoint `key` ends (the
        digest of slot's exact prefix at prev's length is prev's: host checkpoints skip chunk ends)."""
        c, digests = self.grid[slot]
        i = prev[1] // c if c else -1
        return prev[2] == key[2] == c and prev[1] < key[1] and 0 <= i < len(digests) and digests[i] == prev[0]

    def find(self, prompt: list[int], donors: dict[int, list[int]], chunk: int) -> PrefixMatch | None:
        """The longest prefix of `prompt` another slot can give with the result a cold run in chunks of `chunk`
        gives; donors: slot -> the tokens whose KV it holds (running or parked). The length is a multiple of
        `chunk`, within the donor's exact prefix, leaves at least the prompt's last token to compute and is at
        least one block. Recurrent models also need the states at that length: a donor whose states are there,
        else a checkpoint. None when nothing qualifies."""
        top = (len(prompt) - 1) // chunk * chunk
        lim = {}
        for slot, toks in donors.items():
            e = min(top, self.exact_length(slot, chunk), len(toks))
            m = common_prefix(toks[:e], prompt) // chunk * chunk
            if m >= self.block_size:
                lim[slot] = m
        if not lim:
            return None
        src = max(lim, key=lim.get)
        if not self.recurrent:
            return PrefixMatch(src, lim[src])
        keys = prefix_digests(prompt, chunk, lim[src]) if len(self.checkpoints) else []
        for n in range(lim[src], self.block_size - 1, -chunk):
            live = [d for d, m in lim.items() if m >= n and self.live[d] == n]
            if live:
                return PrefixMatch(live[0], n, live[0])
            if keys and (keys[n // chunk], n, chunk) in self.checkpoints:
                return PrefixMatch(src, n, (keys[n // chunk], n, chunk))
        return None

    def copy(self, src: int, dst: int, n: int) -> None:
        """dst now holds src's first n positions (Runner.copy_prefix; src == dst: cut back to n)."""
        c, digests = self.grid[src]
        self.grid[dst] = (c, digests[:min(n // c, len(digests) - 1) + 1]) if c else (0, [b""])
        if src != dst or self.live[src] != n:
            self.live[dst] = -1           # the states are not yet those after n positions

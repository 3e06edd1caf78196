"""Recurrent-state checkpoints: snapshots of a slot's recurrent states (qwen35's conv windows and delta-rule
states) taken at prompt chunk ends, so that a request sharing a shorter prefix of another slot's prompt (a
regenerated or edited reply, a follow-up whose history dropped the last reply's reasoning) resumes there.

A slot's live states are valid only at its own length, so such a request needs one of these. They are kept by
(digest of the prefix, length, chunk), least recently used out first, with one twist: a slot's previous
checkpoint on the same chain is superseded by its next one and goes first, so each prompt's last checkpoint
(what a follow-up or a re-sent prompt needs) outlives the intermediate ones of longer prompts. Buffers live on
the device (allocated when enabled) or, where too few fit there, in pinned host memory (allocated as first
used; a save or restore is then a stream-ordered copy over PCIe). Buffers are only ever reused, never freed
before close().
"""
from __future__ import annotations

import collections
import logging
from typing import Callable

import torch

log = logging.getLogger("hivejet.engine")

Key = tuple   # (digest of the prefix, length, chunk)


def empty_host_cache() -> None:
    """Free the pinned host memory torch's caching host allocator keeps (torch >= 2.9 names it
    torch.accelerator.empty_host_cache; torch 2.11's CUDA build also has torch._C._host_emptyCache)."""
    fn = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) \
        or getattr(torch._C, "_host_emptyCache", None)
    if fn is not None:
        fn()


class StateCheckpoints:
    """The checkpoints of the runner's recurrent states `conv_state` / `ssm_state` ({layer: [slots, ...]},
    the runner's own tensors: saves read them, restores write them)."""

    def __init__(self, conv_state: dict, ssm_state: dict, device: torch.device):
        self.conv_state, self.ssm_state, self.device = conv_state, ssm_state, device
        self.max = 0                  # how many may be kept
        self.on_host = False          # buffers in pinned host memory
        self.evicted = 0
        self._keys: collections.OrderedDict[Key, int] = collections.OrderedDict()   # key -> buffer, LRU first
        self.buffers: list[tuple[dict, dict]] = []   # buffer -> (conv states, ssm states) by layer
        self._last: dict[int, Key] = {}              # slot -> the last checkpoint it saved (its chain's end)
        self._superseded: set[Key] = set()           # checkpoints a later one of the same chain followed

    def enable(self, count: int, host: bool = False) -> None:
        """Keep up to `count` (none for a model without recurrent states); `host`: in pinned host memory on a
        GPU, allocated as each is first used, instead of device memory allocated now."""
        count = max(0, count) if self.conv_state else 0
        self.max = count
        self.clear()
        self.on_host = bool(host) and count > 0   # (on the CPU: allocated as used, no more)
        if not self.on_host:
            self.buffers = [self._new_buffer() for _ in range(count)]

    def clear(self) -> None:
        self._keys.clear()
        self._last.clear()
        self._superseded.clear()
        self.buffers = []

    def _new_buffer(self) -> tuple[dict, dict]:
        where = dict(device="cpu", pin_memory=self.device.type == "cuda") if self.on_host else {}
        return ({il: t.new_zeros(t.shape[1:], **where) for il, t in self.conv_state.items()},
                {il: t.new_zeros(t.shape[1:], **where) for il, t in self.ssm_state.items()})

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: Key) -> bool:
        return key in self._keys

    def bytes(self, host: bool = False) -> int:
        """The buffers' bytes on the device (host: in host memory instead, as allocated so far)."""
        if host != self.on_host:
            return 0
        return sum(t.numel() * t.element_size() for buf in self.buffers for d in buf for t in d.values())

    def stats(self) -> dict | None:
        """How many are kept of how many, where, their buffers' bytes, evictions so far (None without)."""
        if not self.max:
            return None
        return dict(kept=len(self._keys), max=self.max, memory="host" if self.on_host else "device",
                    bytes=self.bytes(host=self.on_host), evicted=self.evicted)

    def lengths(self) -> list[int]:
        """The lengths the checkpoints were taken at, least recently used first."""
        return [key[1] for key in self._keys]

    def new_chain(self, slot: int) -> None:
        """slot starts another prefix: what it saves next supersedes nothing."""
        self._last.pop(slot, None)

    def save(self, slot: int, key: Key, on_chain: Callable[[int, Key, Key], bool]) -> None:
        """Keep slot's states under `key`; on_chain(slot, prev, key): whether slot's previous checkpoint `prev`
        is an earlier point of the prefix `key` ends (then it is superseded). When all buffers are taken,
        superseded checkpoints go first (least recently used first), then the others."""
        prev = self._last.get(slot)
        self._last[slot] = key
        if prev is not None and prev in self._keys and on_chain(slot, prev, key):
            self._superseded.add(prev)
        if key in self._keys:                 # the same prefix on the same grid: the same states
            self._keys.move_to_end(key)
            self._superseded.discard(key)
            return
        if len(self._keys) < self.max and len(self._keys) == len(self.buffers):
            try:   # a host buffer, first used now
                self.buffers.append(self._new_buffer())
            except RuntimeError as e:   # (pinned memory refused: keep the ones there are)
                log.warning("state checkpoints: host memory for no more than %d (%s)", len(self.buffers), e)
                self.max = len(self.buffers)
                if not self.buffers:
                    return
        if len(self._keys) < self.max:
            i = len(self._keys)
        else:
            old = next((k for k in self._keys if k in self._superseded), next(iter(self._keys)))
            i = self._keys.pop(old)
            self._superseded.discard(old)
            self.evicted += 1
        conv, ssm = self.buffers[i]
        for il in self.conv_state:   # (stream-ordered: the host's buffers are only ever read by a restore)
            conv[il].copy_(self.conv_state[il][slot], non_blocking=True)
            ssm[il].copy_(self.ssm_state[il][slot], non_blocking=True)
        self._keys[key] = i

    def restore(self, key: Key, dst: int) -> None:
        """Slot dst's states from checkpoint `key`, which becomes the most recently used and is kept like a
        chain's end (wanted after all); what dst saves next supersedes nothing."""
        self._last.pop(dst, None)
        i = self._keys[key]
        self._keys.move_to_end(key)
        self._superseded.discard(key)
        conv, ssm = self.buffers[i]
        for il in self.conv_state:
            self.conv_state[il][dst].copy_(conv[il], non_blocking=True)
            self.ssm_state[il][dst].copy_(ssm[il], non_blocking=True)

    def close(self) -> None:
        """Drop every buffer; host ones' pinned memory back to the OS."""
        on_host = self.on_host
        self.clear()
        if on_host and self.device.type == "cuda":
            empty_host_cache()   # (torch keeps freed pinned blocks for reuse: give them back to the OS)

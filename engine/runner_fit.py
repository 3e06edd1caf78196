"""Opening the GPU path's runner (engine/runner/runner.py) for an Engine: one slot per concurrent sequence
and ONE KV pool they share, sized to the memory the device has left (the memory fit), recurrent-state
checkpoints for prefix sharing, and the CUDA graphs every step can need, captured up front.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from engine.hostmem import kv_memory_tokens
from engine.planner import (
    DEVICE_CHECKPOINT_SHARE,
    MIN_DEVICE_CHECKPOINTS,
    auto_prefill_chunk,
    device_checkpoint_count,
    facts_from_file,
    host_checkpoint_count,
)
from engine.runner import BUCKETS, slot_bytes_per_token, slot_fixed_bytes
from engine.scheduler import RUNNER_BLOCK
from engine.types import EngineError

if TYPE_CHECKING:
    from engine.planner import ModelFacts


class RunnerFit:
    """The runner for `model` under `config` (EngineConfig). open() returns it (the config may come back with
    an automatic prefill_chunk: self.config); capture() takes its CUDA graphs. The Speculator's DFlash
    drafter moves to the device with the model, and its drafters' caches count in the fit."""

    def __init__(self, config, model, speculator, vision=None, image_format=None, embed_cache_bytes: int = 0):
        self.config, self.model, self.spec = config, model, model.spec
        self.speculator = speculator
        self.vision, self.image_format, self.embed_cache_bytes = vision, image_format, embed_cache_bytes
        self.runner = None

    def open(self):
        """Put the model on the device with one slot per concurrent sequence and ONE KV pool they share:
        ctx_pool_tokens, else on a GPU as much as fits in the memory left after the weights, the fixed
        per-slot state and a step's workspace (step_workspace, at least 10 % of the free memory; too
        little for 256 tokens is an error), else (static slots on the CPU) max_seqs x the context. One
        sequence may use up to min(its context, the pool). Recurrent models also get state checkpoints
        for prefix sharing (state_checkpoints; by default as many as fit in 2 % of the KV cache, which
        the fit leaves room for, or, when that is fewer than MIN_DEVICE_CHECKPOINTS on a GPU, up to
        HOST_CHECKPOINTS in pinned host memory: checkpoint_memory)."""
        from engine.runner import Runner, state_checkpoint_bytes
        c = self.config
        dev = torch.device(c.device)
        types = dict(cache_type_k=c.cache_type_k, cache_type_v=c.cache_type_v)
        want = c.ctx_size or self.spec.context_length
        if c.prefill_chunk % RUNNER_BLOCK:   # shared prefixes end on chunk ends: whole blocks, never copied
            self.model.close()
            raise EngineError(f"prefill_chunk {c.prefill_chunk} must be a multiple of {RUNNER_BLOCK} on the "
                              f"{c.device} path (its KV blocks)")
        one_ckpt = state_checkpoint_bytes(self.model) if c.resident_tokens > 0 else 0   # 0: no recurrent layers
        host_ckpt = c.checkpoint_memory == "host"
        ckpt_share = DEVICE_CHECKPOINT_SHARE if one_ckpt and c.state_checkpoints < 0 and not host_ckpt else 0.0
        try:
            if c.ctx_pool_tokens:
                pool = c.ctx_pool_tokens
                if self.checkpoints_to_host(dev, pool, one_ckpt, ckpt_share):
                    host_ckpt, ckpt_share = True, 0.0
            elif dev.type == "cuda":
                self.model.to_device(dev)
                if self.speculator.dflash is not None:
                    self.speculator.dflash.to_device(dev)
                free, _ = torch.cuda.mem_get_info(dev)
                if c.prefill_chunk == 0:   # (automatic: the CPU and a given pool size were settled by Engine)
                    c = self.config = dataclasses.replace(c, prefill_chunk=auto_prefill_chunk(free))
                facts = facts_from_file(self.model.file)   # (the open file's header, parsed once)
                budget = (free - max(int(0.1 * free), self.step_workspace(facts, want)) - self.vision_workspace()
                          - self.pieces_workspace(facts) - self.draft_workspace())
                pool = self.fit_pool(budget, want, 0 if host_ckpt else one_ckpt * max(0, c.state_checkpoints),
                                      ckpt_share)
                if self.checkpoints_to_host(dev, pool, one_ckpt, ckpt_share):
                    host_ckpt, ckpt_share = True, 0.0
                    pool = self.fit_pool(budget, want, 0, 0.0)   # (the KV pool takes the 2 % back)
                if pool < 256:
                    raise EngineError(f"not enough GPU memory for the KV cache: {free / 2**30:.1f} GiB free after "
                                      f"the weights, for {c.max_seqs} sequences' state and a pool of 256 tokens")
            else:
                pool = self.cpu_pool(want)
            blocks = max(1, pool // RUNNER_BLOCK)
            self.runner = Runner(self.model, device=dev, n_slots=c.max_seqs, n_blocks=blocks, block_size=RUNNER_BLOCK,
                                 max_ctx=min(want, blocks * RUNNER_BLOCK), rope_offsets=self.mrope_images(),
                                 shared_prompt_passes=c.shared_prompt_passes, **types)
            if self.speculator.dflash is not None and self.speculator.dflash.device != dev:   # (ctx_pool_tokens: no fit above)
                self.speculator.dflash.to_device(dev)
            if one_ckpt:
                if c.state_checkpoints >= 0:
                    n = c.state_checkpoints
                elif host_ckpt:
                    n = host_checkpoint_count(one_ckpt)
                else:
                    n = device_checkpoint_count(self.runner.kv_bytes(), one_ckpt)
                self.runner.enable_checkpoints(n, host=host_ckpt)
        except (ValueError, torch.OutOfMemoryError) as e:
            self.model.close()
            raise EngineError(f"cannot set up the {c.device} path: {e}") from None
        except EngineError:
            self.model.close()
            raise
        return self.runner

    def capture(self) -> None:
        """On a GPU, every decode graph a step can need, now: captured lazily, the first step with 4 (16)
        agents stalled 7 (12) s on the H200 while its kernels compiled and its graph was captured."""
        c = self.config
        dev = self.runner.device
        if dev.type == "cuda":
            top = next((b for b in BUCKETS if b >= c.max_seqs), BUCKETS[-1])
            try:
                self.runner.capture([b for b in BUCKETS if b <= top])
                if self.speculator.active and c.spec_max_drafts > 0:   # (drafts of recurrent models: graphs of their own)
                    self.runner.capture_drafting(c.max_seqs * (1 + c.spec_max_drafts))
                    self.speculator.warm_up()   # (the MTP block's pass graphs, its eager kernels compiled)
                self.runner.capture_prefill(c.prefill_chunk)   # (prompt chunks: engine/runner/prefill.py)
            except (RuntimeError, torch.OutOfMemoryError) as e:
                self.model.close()
                raise EngineError(f"cannot capture the CUDA graphs on {c.device}: {e}") from None

    def mrope_images(self) -> bool:
        """Whether prompts may hold images whose M-RoPE positions run behind the token indices (Qwen): the
        runner's decode rows then add each slot's rope delta (Runner rope_offsets)."""
        return self.vision is not None and self.image_format.mrope

    def vision_workspace(self) -> int:
        """What encoding the largest image takes on the GPU (engine/vision/mmproj.py mmproj_info; its
        weights are on the GPU already, counted in the free memory): kept out of the KV pool."""
        if self.vision is None or self.vision.device.type != "cuda":
            return 0
        return int(self.vision.facts["workspace_bytes"]) + self.embed_cache_bytes   # (and the embeddings kept
        # for re-sent images, on the GPU with the encoder)

    def cache_types(self) -> tuple[str, str]:
        from kernels.kvcodec import cache_type_name
        c = self.config
        return cache_type_name(c.cache_type_k), cache_type_name(c.cache_type_v or c.cache_type_k)

    def step_workspace(self, facts: ModelFacts, ctx: int) -> int:
        """What a step allocates beyond the pool and the slots' state (engine/planner.py activation_bytes:
        a prompt chunk's activations, its dequantized matrix, its attention over `ctx` positions, the
        logits), left out of the pool when it is more than the usual 10 % of the free memory."""
        from engine import planner as P
        from kernels.kvcodec import cache_type_name
        c = self.config
        kt, vt = cache_type_name(c.cache_type_k), cache_type_name(c.cache_type_v or c.cache_type_k)
        return P.activation_bytes(facts, ctx, kt, c.max_seqs, c.prefill_chunk, vt)

    def draft_workspace(self) -> int:
        """What a recurrent model's drafting steps keep for their commit (engine/runner/sizes.py:
        draft_kept_bytes: ~250 MB on the 27B), kept out of the KV pool when drafts are on."""
        from engine.runner.sizes import draft_kept_bytes
        if not (self.speculator.active and self.config.spec_max_drafts > 0):
            return 0
        return draft_kept_bytes(self.model, BUCKETS[-1])

    def pieces_workspace(self, facts: ModelFacts) -> int:
        """The graph pool of the passes that hold several slots' short prompts (engine/planner.py
        piece_graph_bytes: 395 MiB on the 27B), kept out of the KV pool when the runner will capture them."""
        from engine import planner as P
        from engine.runner import prompt_pieces_per_pass
        c = self.config
        if prompt_pieces_per_pass(c.max_seqs, True, c.shared_prompt_passes) <= 1:
            return 0
        return P.piece_graph_bytes(facts, c.max_seqs)

    def checkpoints_to_host(self, dev: torch.device, pool: int, one_ckpt: int, ckpt_share: float) -> bool:
        """checkpoint_memory "auto": the default state checkpoints go to host memory when fewer than
        MIN_DEVICE_CHECKPOINTS fit in the 2 % of a `pool`-token KV cache on a GPU (a 24 GiB card: none
        of the 27B's 150 MB each, so a regenerated reply would read its whole conversation again)."""
        c = self.config
        if dev.type != "cuda" or not ckpt_share or c.checkpoint_memory != "auto":
            return False
        kv = pool * slot_bytes_per_token(self.model, cache_type_k=c.cache_type_k, cache_type_v=c.cache_type_v)
        return device_checkpoint_count(kv, one_ckpt) < MIN_DEVICE_CHECKPOINTS

    def cpu_pool(self, want: int) -> int:
        """Static slots on the CPU: the pool tokens kv_memory holds (engine/hostmem.py kv_memory_tokens, at
        pool_bytes_per_token each), at most max_seqs x the context."""
        return min(self.config.max_seqs * want, kv_memory_tokens(self.config.kv_memory, self.pool_bytes_per_token()))

    def pool_bytes_per_token(self) -> int:
        """Bytes per pool token: the slots' KV and the model drafters' caches."""
        c = self.config
        return max(1, slot_bytes_per_token(self.model, cache_type_k=c.cache_type_k, cache_type_v=c.cache_type_v)
                   + self.speculator.drafter_bytes_per_token(self.cache_types(), self.spec))

    def fit_pool(self, budget: int, want: int, ckpt_bytes: int, ckpt_share: float) -> int:
        """The most pool tokens (whole blocks) that fit in `budget` bytes beside every slot's fixed state
        (recurrent states, key preconditioning sized for min(want, pool) positions, the scratch slot's
        too), the given checkpoints and a `ckpt_share` of the KV for the default checkpoints."""
        c = self.config
        types = dict(cache_type_k=c.cache_type_k, cache_type_v=c.cache_type_v)
        per_token = self.pool_bytes_per_token()

        def fits(blocks: int) -> bool:
            tokens = blocks * RUNNER_BLOCK
            fixed = slot_fixed_bytes(self.model, **types, max_ctx=min(want, tokens)) * (c.max_seqs + 1)
            return (tokens + RUNNER_BLOCK) * per_token * (1 + ckpt_share) + fixed + ckpt_bytes <= budget
        lo, hi = 0, budget // (per_token * RUNNER_BLOCK) + 1       # lo fits (or is 0), hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo * RUNNER_BLOCK


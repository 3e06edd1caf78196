"""A request as the engine thread keeps it while it waits and runs (Sequence): what the Scheduler plans
over, the executors step and the Speculator drafts for.
"""
from __future__ import annotations

import collections
import time

from engine.sampling import Sampler, SamplingParams, StopChecker
from engine.spec.adaptive import DraftLength
from engine.tokenizer import StreamDecoder, Tokenizer
from engine.types import Request


class Sequence:
    """One request on the engine thread: its tokens (prompt then generated), how many have KV, its
    sampler, stop checker and stream decoder, where its KV lives (CPU path: its own SequenceKV; runner: a
    slot), its drafters' states and what stats() reports. `handle` is the RequestHandle its events go to."""

    def __init__(self, rid: int, req: Request, prompt_ids: list[int], handle,
                 tokenizer: Tokenizer, vocab_size: int, kv):
        self.id = rid
        self.req = req
        self.params: SamplingParams = req.sampling
        self.handle = handle
        self.tokens = list(prompt_ids)       # prompt then generated tokens
        self.n_prompt = len(prompt_ids)
        self.n_computed = 0                  # tokens whose KV is stored
        self.kv = kv
        self.sampler = Sampler(req.sampling, vocab_size)
        self.stopper = StopChecker(req.sampling.stop)
        self.decoder = StreamDecoder(tokenizer)
        self.t_submit = time.monotonic()
        self.t_start: float | None = None
        self.t_first: float | None = None
        self.recent = collections.deque()    # (time, tokens) for tok/s over the last seconds
        self.vision = None                   # engine.vision.prompt.VisionPrompt when the prompt holds images
        self.slot: int | None = None         # the runner's slot (GPU path) while running
        self.cached = 0                      # prompt tokens taken from a resident/shared prefix
        self.drafter = None                  # engine.spec.ngram.NgramDrafter when speculating with n-grams
        self.mtp = None                      # engine.spec.mtp.MtpState when drafting with the MTP block
        self.dflash = None                   # engine.spec.dflash.DFlashState when drafting with DFlash
        self.drafts: list[int] = []          # this step's draft tokens (verified after the forward)
        self.draft_q = None                  # their drafter distributions [k, V] (None: one-hot drafts)
        self.draft_src = ""                  # the drafter that made them (ngram, mtp, dflash)
        self.spec_k = 0                      # current draft length (spec_adaptive=False: from acceptance only)
        self.adapt: dict[str, DraftLength] = {}   # per drafter: acceptance, next k, back-off (spec_adaptive)
        self.spec_src: str | None = None     # the drafter of its next step (for stats())
        self.ngram_wait = 0                  # steps before the next n-gram lookup (GPU path, after a miss)
        self.drafted = self.accepted = 0     # draft tokens proposed / accepted so far
        self.spec_by = collections.Counter()  # "<drafter>_drafted" / "<drafter>_accepted" counts
        self.checkpoints: dict[int, dict] = {}   # recurrent-state snapshots by length (engine/prefix.py)

    @property
    def image_hashes(self) -> list[str]:
        """sha256 of each image's decoded pixels, in prompt order (with the image token spans in
        `vision.spans`): what a prefix cache must key on besides the token ids."""
        return self.vision.hashes if self.vision is not None else []

    def prefix_keys(self, hi: int | None = None, lo: int = 0) -> list[int]:
        """The tokens [lo, hi) (hi None: to the end) as a prefix cache compares them: the token ids, each image
        token replaced by a key of its image's content and its place in the image (VisionPrompt.prefix_keys)."""
        toks = self.tokens[lo:hi]
        return toks if self.vision is None else self.vision.prefix_keys(toks, lo)

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - self.n_prompt

    @property
    def target(self) -> int:
        """Tokens to have in the KV before decoding: the prompt, or after a pre-emption everything but
        the last sampled token (which the next decode row feeds)."""
        return self.n_prompt if self.n_generated == 0 else len(self.tokens) - 1

    def state(self) -> str:
        if self.t_start is None:
            return "queued"
        if self.n_generated == 0:
            return f"prefill {100 * self.n_computed // max(self.n_prompt, 1)}%"
        return "decoding"

    def tok_per_s(self, now: float, window: float = 5.0) -> float:
        while self.recent and now - self.recent[0][0] > window:
            self.recent.popleft()
        if not self.recent:
            return 0.0
        span = max(now - self.recent[0][0], 1e-3)
        return sum(n for _, n in self.recent) / span if len(self.recent) > 1 else 0.0

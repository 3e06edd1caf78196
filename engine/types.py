"""The data that crosses the Engine contract: requests in, events out. No tensors here."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.sampling import SamplingParams, TokenLogprob

# conversations advanced together by default (EngineConfig.max_seqs; `serve --agents`; the app's "Parallel
# conversations"): issue #6's 16 concurrent sequences
DEFAULT_MAX_SEQS = 16


class TokenConstraint(Protocol):
    """Constrained decoding (JSON schema, grammar): the engine calls `mask` on each step's logits
    before sampling (set forbidden tokens to -inf in place), `accept` with the sampled token, and
    finishes the request with reason "stop" once `is_done()` is true."""

    def mask(self, logits) -> None: ...
    def accept(self, token_id: int) -> None: ...
    def is_done(self) -> bool: ...


@dataclass
class Request:
    """One generation request. Give `messages` (chat, rendered with the model's template), or
    `prompt` (raw text, tokenized with the model's BOS rule), or `prompt_ids`."""

    messages: list[dict] | None = None
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    session: str | None = None            # conversation/agent id (prefix reuse keys on it later)
    # images (engine/vision): bytes, file paths, data: URLs or PIL images, in prompt order, one per image
    # part of `messages` (or, with no image parts, all placed at the start of the last user message);
    # with `prompt`, one per image mark in the text. Image parts may instead carry their own data.
    images: list[Any] = field(default_factory=list)
    tools: list[dict] | None = None
    add_generation_prompt: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)   # e.g. enable_thinking
    constraint: TokenConstraint | None = None


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Timings:
    queued_ms: float = 0.0
    prompt_ms: float = 0.0          # submit -> first token
    decode_ms: float = 0.0          # first token -> finish
    prompt_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    image_encode_ms: float = 0.0    # vision tower time for this request's images (0 when cached or none)


@dataclass
class TokenEvent:
    text: str                                   # newly completed text (may be "" mid-character)
    ids: list[int]
    logprobs: list[TokenLogprob] | None = None


@dataclass
class FinishEvent:
    reason: str                                 # "stop" | "length" | "cancelled" | "error"
    usage: Usage
    timings: Timings
    error: str | None = None
    stop_string: str | None = None


class EngineError(RuntimeError):
    """The engine cannot take a request (bad parameters, context too long, engine stopped)."""


class QueueFullError(EngineError):
    """Too many requests are waiting; the caller should retry later (HTTP 429)."""


class ContextTooLongError(EngineError, ValueError):
    def __init__(self, n_prompt: int, limit: int):
        self.n_prompt, self.limit = n_prompt, limit
        super().__init__(f"the prompt has {n_prompt} tokens but the context holds {limit} "
                         f"({n_prompt - limit + 1} too many to generate even one token)")


class KVPoolTooSmallError(ContextTooLongError):
    """The runner's path: the prompt does not fit even the whole shared KV pool (the limit is the pool, not the
    model). device: the pool's ("cuda": sized to the GPU memory left; "cpu": to kv_memory)."""

    def __init__(self, n_prompt: int, pool_tokens: int, device: str = "cuda"):
        super().__init__(n_prompt, pool_tokens)
        more = ("raise kv_memory / --kv-memory" if device == "cpu" else
                "leave the pool more GPU memory: fewer parallel sequences, a smaller model")
        self.args = (f"the prompt has {n_prompt} tokens but the KV pool holds {pool_tokens} in all, even with "
                     f"no other conversation in it (use a smaller KV cache type, or {more})",)

"""Token sampling with llama.cpp semantics, on one row of float logits (CPU or CUDA).

The chain is llama.cpp's default one: logit bias -> penalties (repeat / frequency / presence over the
last `penalty_last_n` tokens) -> greedy argmax when temperature is 0, otherwise top-k -> top-p ->
min-p -> temperature -> draw from the softmax.

The draw: the Sampler owns one CPU `torch.Generator` (seeded from `params.seed`). Each random step
takes one uniform number u from it and picks the token by inverse CDF (the first candidate whose
cumulative probability exceeds u * total) on the logits' own device. That is exactly a categorical
draw like `torch.multinomial(probs, 1)`, but the random stream does not depend on the device, a
CUDA row needs no CUDA generator, and only one integer crosses back to the host.
"""
from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["SamplingParams", "TokenLogprob", "Sampler", "StopChecker", "apply_penalties", "MAX_STOP_STRINGS",
           "MAX_LOGPROBS"]

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
MAX_REPETITION_PENALTY = 10.0
MAX_ABS_PRESENCE_FREQUENCY = 2.0  # OpenAI's range for presence_penalty / frequency_penalty
_TOP_P_FIRST_TRY = 1024  # top-p without top-k: candidates looked at before falling back to a full sort
_HOST_CANDIDATES = 4096  # candidate lists this short finish the chain on the CPU


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.8          # 0 => greedy (argmax, ties -> lowest id)
    top_k: int = 40                   # <= 0 disables
    top_p: float = 0.95               # 1.0 disables
    min_p: float = 0.05               # 0 disables
    repetition_penalty: float = 1.0   # llama.cpp repeat_penalty: logit>0 ? logit/p : logit*p (distinct tokens)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0    # logit -= count*freq + (count>0)*presence
    penalty_last_n: int = 64          # -1 = whole context; 0 disables
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None       # number of top logprobs to report per token (None = off)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first bad field."""
        def bad(name: str, why: str):
            raise ValueError(f"invalid sampling parameter {name}: {why}")

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", f"must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_int(self.top_k):
            bad("top_k", f"must be an integer (<= 0 disables it), got {self.top_k!r}")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            bad("top_p", f"must be in (0, 1] (1 disables it), got {self.top_p!r}")
        if not _is_number(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            bad("min_p", f"must be in [0, 1] (0 disables it), got {self.min_p!r}")
        if (not _is_number(self.repetition_penalty)
                or not (0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY)):
            bad("repetition_penalty",
                f"must be in (0, {MAX_REPETITION_PENALTY:g}] (1 disables it), got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not (-MAX_ABS_PRESENCE_FREQUENCY <= v <= MAX_ABS_PRESENCE_FREQUENCY):
                bad(name, f"must be in [-{MAX_ABS_PRESENCE_FREQUENCY:g}, {MAX_ABS_PRESENCE_FREQUENCY:g}], got {v!r}")
        if not _is_int(self.penalty_last_n) or self.penalty_last_n < -1:
            bad("penalty_last_n", f"must be an integer >= -1 (-1 = whole context, 0 = off), got {self.penalty_last_n!r}")
        if not isinstance(self.logit_bias, dict):
            bad("logit_bias", f"must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
        for tid, b in self.logit_bias.items():
            if not _is_int(tid) or tid < 0 or (vocab_size is not None and tid >= vocab_size):
                limit = f" [0, {vocab_size})" if vocab_size is not None else " >= 0"
                bad("logit_bias", f"token id {tid!r} is not an integer in{limit}")
            if not _is_number(b) or math.isnan(b):
                bad("logit_bias", f"bias for token {tid} must be a number (+-inf allowed), got {b!r}")
        if not isinstance(self.stop, (list, tuple)):
            bad("stop", f"must be a list of strings, got {type(self.stop).__name__}")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str):
                bad("stop", f"stop strings must be strings, got {type(s).__name__}")
            if s == "":
                bad("stop", "stop strings must not be empty")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            bad("stop_token_ids", f"must be a list of token ids, got {type(self.stop_token_ids).__name__}")
        for tid in self.stop_token_ids:
            if not _is_int(tid) or tid < 0 or (vocab_size is not None and tid >= vocab_size):
                bad("stop_token_ids", f"token id {tid!r} is out of range")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", f"must be true or false, got {self.ignore_eos!r}")
        if self.seed is not None and (not _is_int(self.seed) or not (0 <= self.seed < 2**64)):
            bad("seed", f"must be an integer in [0, 2^64) or None for a random seed, got {self.seed!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not (0 <= self.logprobs <= MAX_LOGPROBS)):
            bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def _penalty_window(history: Sequence[int], last_n: int) -> Sequence[int]:
    if last_n == 0 or not history:
        return ()
    if last_n < 0 or last_n >= len(history):
        return history
    return history[len(history) - last_n:]


def _penalties_active(params: SamplingParams) -> bool:
    return params.penalty_last_n != 0 and (
        params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0)


def _apply_penalties_(logits: torch.Tensor, history: Sequence[int], params: SamplingParams) -> torch.Tensor:
    """In place on a float 1-D tensor; see apply_penalties."""
    if not _penalties_active(params):
        return logits
    window = _penalty_window(history, params.penalty_last_n)
    if len(window) == 0:
        return logits
    ids = torch.as_tensor(window, dtype=torch.long)
    ids = ids[(ids >= 0) & (ids < logits.shape[0])]
    if ids.numel() == 0:
        return logits
    uniq, counts = torch.unique(ids, return_counts=True)
    uniq = uniq.to(logits.device, non_blocking=True)
    counts = counts.to(device=logits.device, dtype=logits.dtype, non_blocking=True)
    vals = logits.index_select(0, uniq)
    p = float(params.repetition_penalty)
    if p != 1.0:
        vals = torch.where(vals > 0, vals / p, vals * p)
    if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
        vals = vals - (counts * float(params.frequency_penalty) + float(params.presence_penalty))
    logits.index_copy_(0, uniq, vals)
    return logits


def apply_penalties(logits: torch.Tensor, history: Sequence[int], params: SamplingParams) -> torch.Tensor:
    """Return a penalised copy of the 1-D `logits` (llama.cpp's penalties sampler).

    Over the last `penalty_last_n` tokens of `history` (-1: all of it, 0: none), for each distinct token
    with count c: logit = logit / p if logit > 0 else logit * p (p = repetition_penalty), then
    logit -= c * frequency_penalty + presence_penalty.
    """
    return _apply_penalties_(logits.detach().to(torch.float32).clone(), history, params)


def _small_to_host(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Move short equal-length 1-D candidate tensors off the GPU in one copy: the rest of the chain is a
    dozen tiny ops, each a kernel launch on the GPU but microseconds on the CPU, and a sync happens anyway
    when the sampled id is read. float64 carries float32 values and token ids exactly."""
    if ts[0].device.type == "cpu" or ts[0].shape[0] > _HOST_CANDIDATES:
        return ts
    k = ts[0].shape[0]
    packed = torch.cat([t.to(torch.float64) for t in ts]).cpu()
    return tuple(packed[i * k:(i + 1) * k].to(t.dtype) for i, t in enumerate(ts))


def _check_samplable(best_logit: float) -> None:
    if best_logit == float("-inf") or math.isnan(best_logit):
        raise ValueError("no token can be sampled: every candidate's logit is -inf or NaN "
                         "(check logit_bias and the model output)")


class Sampler:
    """Samples one token per call from a row of logits; owns the seeded random generator."""

    def __init__(self, params: SamplingParams, vocab_size: int):
        params.validate(vocab_size)
        self.params = params
        self.vocab_size = int(vocab_size)
        self.seed: int = params.seed if params.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(self.seed)
        self._bias_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def next_uniform(self) -> float:
        """The next uniform number in [0, 1) of this request's random stream: one per sampled (not greedy)
        token. The draw below takes it; the GPU path's device sampler (engine/sample_device.py) takes it
        here on the host and picks the token on the device with the same inverse CDF."""
        return torch.rand((), generator=self.generator, dtype=torch.float64).item()

    # -- pieces of the chain ------------------------------------------------------------------------
    def _row(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.dim() == 2 and logits.shape[0] == 1:
            logits = logits[0]
        if logits.dim() != 1:
            raise ValueError(f"expected one row of logits [V], got shape {tuple(logits.shape)}")
        if logits.shape[0] < self.vocab_size:
            raise ValueError(f"logits have {logits.shape[0]} entries, fewer than the vocabulary ({self.vocab_size})")
        # Output layers padded past the vocabulary: those ids are not tokens.
        return logits[: self.vocab_size].detach()

    def _apply_bias_(self, x: torch.Tensor) -> None:
        if not self.params.logit_bias:
            return
        cached = self._bias_cache.get(x.device)
        if cached is None:
            ids = torch.tensor(list(self.params.logit_bias.keys()), dtype=torch.long)
            vals = torch.tensor([float(v) for v in self.params.logit_bias.values()], dtype=torch.float32)
            cached = (ids.to(x.device), vals.to(x.device))
            self._bias_cache[x.device] = cached
        ids, vals = cached
        x.index_add_(0, ids, vals)  # -inf bias gives -inf; +inf gives +inf (and the token is forced)

    def _process(self, raw: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        x = raw.to(torch.float32, copy=True)
        self._apply_bias_(x)
        _apply_penalties_(x, history, self.params)
        return x

    @staticmethod
    def _top_p_prefix(x: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits, ids, probabilities) of the most probable tokens of x, sorted descending: enough of
        them to hold top_p of the probability. The probabilities are over the whole vocabulary.

        Sorting a 262k vocabulary costs far more than a torch.topk of a thousand, and model outputs
        usually put top_p of their mass in far fewer tokens; so try that first, sort all if it falls short.
        """
        probs = torch.softmax(x, dim=0)
        k = _TOP_P_FIRST_TRY
        if k < x.shape[0]:
            top_probs, ids = torch.topk(probs, k, sorted=True)
            if float(top_probs.sum()) < top_p:
                top_probs, ids = torch.sort(probs, descending=True)
        else:
            top_probs, ids = torch.sort(probs, descending=True)
        return x.index_select(0, ids), ids, top_probs

    def _truncate(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Top-k, top-p, min-p and temperature on the processed logits x.

        Returns (vals, ids): the candidates' logits (-inf for the ones cut) and their token ids, or
        ids None when vals is indexed by token id (no top-k / top-p reordering happened)."""
        p = self.params
        n = x.shape[0]
        ids: torch.Tensor | None = None
        vals = x
        if 0 < p.top_k < n:
            vals, ids = _small_to_host(*torch.topk(x, p.top_k, sorted=True))
        if p.top_p < 1.0:
            if ids is not None:  # after top-k: probabilities renormalised over the k candidates (llama.cpp)
                probs = torch.softmax(vals, dim=0)
            else:
                vals, ids, probs = self._top_p_prefix(x, p.top_p)
                vals, ids, probs = _small_to_host(vals, ids, probs)
            cum = torch.cumsum(probs, dim=0)
            # Keep the smallest prefix whose cumulative probability reaches top_p (at least one token).
            keep = (cum < p.top_p).sum() + 1
            mask = torch.arange(vals.shape[0], device=vals.device) < keep
            vals = vals.masked_fill(~mask, float("-inf"))
        if p.min_p > 0.0:
            # p_i >= min_p * p_max  <=>  logit_i >= max_logit + log(min_p); the max always survives.
            vmax = vals.max()
            vals = vals.masked_fill(vals < vmax + math.log(p.min_p), float("-inf"))
        if p.temperature != 1.0:
            vals = vals / p.temperature
        return vals, ids

    def _draw(self, x: torch.Tensor) -> int:
        """Truncate, then draw one token id from the softmax of what is left (inverse CDF)."""
        vals, ids = self._truncate(x)
        vmax = vals.max()
        # Weights relative to the best candidate (a softmax without the normalisation, which the inverse
        # CDF does not need). A +inf bias makes vmax +inf: then only the +inf entries get weight.
        w = torch.where(vals == vmax, torch.ones_like(vals), torch.exp(vals - vmax))
        w = torch.nan_to_num(w, nan=0.0)
        cum = torch.cumsum(w.to(torch.float64), dim=0)
        u = self.next_uniform()
        pos = torch.searchsorted(cum, (cum[-1] * u).reshape(1), right=True).clamp_(max=vals.shape[0] - 1)
        if ids is not None:
            pos = ids.index_select(0, pos)
        tok, best = torch.cat([pos.to(torch.float64), vmax.reshape(1).to(torch.float64)]).tolist()
        _check_samplable(best)
        return int(tok)

    def final_logits(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        """The [V] logits the random draw uses: after bias, penalties, top-k / top-p / min-p (cut tokens
        are -inf) and temperature. For greedy params, only the argmax is finite. For tests and debugging."""
        x = self._process(self._row(logits), history)
        if self.params.greedy:
            out = torch.full_like(x, float("-inf"))
            i = torch.argmax(x)
            out[i] = x[i]
            return out
        vals, ids = self._truncate(x)
        if ids is None:
            return vals
        return torch.full_like(x, float("-inf")).index_copy_(0, ids.to(x.device), vals.to(x.device))

    # -- public API -------------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, history: Sequence[int]) -> int:
        raw = self._row(logits)
        x = self._process(raw, history)
        if self.params.greedy:
            tok = torch.argmax(x)  # the first maximal index: ties go to the lowest id
            tok, best = torch.stack([tok.to(torch.float64), x[tok].to(torch.float64)]).tolist()
            _check_samplable(best)
            return int(tok)
        return self._draw(x)

    def sample_with_logprobs(self, logits: torch.Tensor, history: Sequence[int]) -> tuple[int, TokenLogprob | None]:
        """Sample, and report OpenAI-style logprobs: log_softmax of the raw model logits (before bias,
        penalties and temperature). None when params.logprobs is None."""
        raw = self._row(logits)
        token = self.sample(raw, history)
        if self.params.logprobs is None:
            return token, None
        return token, self.logprob_of(raw, token)

    def logprob_of(self, logits: torch.Tensor, token: int) -> TokenLogprob:
        """Logprob of `token` and the top `params.logprobs` alternatives under the raw logits."""
        raw = self._row(logits)
        k = self.params.logprobs or 0
        lp = torch.log_softmax(raw.to(torch.float32), dim=0)
        chosen = lp[token].reshape(1)
        if k == 0:
            return TokenLogprob(token, float(chosen.item()), [])
        top_v, top_i = torch.topk(lp, min(k, lp.shape[0]), sorted=True)
        # One device->host transfer; float64 holds token ids exactly.
        packed = torch.cat([chosen.to(torch.float64), top_v.to(torch.float64), top_i.to(torch.float64)]).tolist()
        n = top_v.shape[0]
        top = [(int(i), float(v)) for v, i in zip(packed[1:1 + n], packed[1 + n:])]
        return TokenLogprob(token, float(packed[0]), top)


class StopChecker:
    """Finds stop strings in streamed text.

    feed() returns the text that is safe to emit now: it holds back any tail that could be the start of a
    stop string. When a stop string completes, it returns the text before it and True; the stop string
    and everything after it are dropped, and later feeds return ("", True).
    """

    def __init__(self, stop: list[str]):
        if isinstance(stop, str):
            stop = [stop]
        self.stops: list[str] = [s for s in stop if s]
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended generation

    def _holdback(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buf = self._held + text
        first = -1
        for s in self.stops:
            i = buf.find(s)
            if i != -1 and (first == -1 or i < first):
                first, self.matched = i, s
        if first != -1:
            self.stopped = True
            self._held = ""
            return buf[:first], True
        h = self._holdback(buf)
        self._held = buf[len(buf) - h:] if h else ""
        return buf[: len(buf) - h], False

    def flush(self) -> str:
        """The held-back text, at the end of generation (nothing if a stop string matched)."""
        out, self._held = self._held, ""
        return "" if self.stopped else out

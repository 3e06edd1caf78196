"""Adaptive draft length: per sequence and drafter, the number of drafts k (0..k_max) that maximizes the
step's expected tokens per second, from measured acceptance and measured costs.

- Acceptance: one rate alpha per sequence and drafter, the geometric model (each draft accepted with
  probability alpha once the ones before it were): a step with k drafts yields
  E(k) = 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha) tokens. alpha is estimated from
  exponentially decayed counts (accepted drafts / (accepted drafts + rejections)), starting from a
  weak prior (alpha = 0.5) that decays away like old observations.
- Costs (per engine: the same hardware for every sequence, `StepCosts`): T(n), the wall time of a
  decode step of n rows without the avoidable drafting work (target forward, verification and sampling,
  the drafters' unavoidable catch-up), kept as exponential moving averages per power-of-two bucket of n
  and interpolated (non-decreasing in n); D(k), a drafter's avoidable time per sequence for k drafts:
  a DFlash block forward (one per sequence, whatever k), the MTP block's chained forwards (k - 1: the
  first draft falls out of the catch-up that runs anyway), an n-gram lookup (~free).
- Choice (`choose_k`): with the step's other rows and expected tokens fixed, k maximizes
  (E(k) + E_others) / (T(base + k) + D(k) + D_others); k = 0 (one row) unless some k > 0 beats it by
  `margin`. With one sequence this is its own tokens per second; with several it is the step's, so one
  sequence's drafts do not slow the others down for less than they gain.
- Back-off (`DraftLength`): when k = 0 wins the sequence stops drafting with that drafter, but after
  16 steps it drafts once with a small k (a probe: 2 drafts), so a sequence whose text becomes
  predictable (a code edit) takes speculation up again. A fully accepted probe is followed at once by
  one twice as long (up to k_max); a failed one doubles the wait (up to 32 steps). While backed off, the drafters'
  upkeep is put off (engine.py: the MTP catch-up and the DFlash context are written in one batch when
  drafts are next wanted, at most MAX_DEFERRED rows later).

The choice never changes the tokens (verification keeps the output exact whatever k is); it only
moves where the time goes. Pure functions and small state classes, so it can be tested with
synthetic costs (tests/engine/test_spec_adaptive.py).
"""
from __future__ import annotations

from collections.abc import Callable

MARGIN = 0.03          # a k > 0 must beat k = 0 by this fraction (noise in the timings)
PROBE_EVERY = 16       # steps a backed-off sequence waits before drafting once again (doubling after
PROBE_MAX = 32         # each failed probe, up to PROBE_MAX)
PROBE_K = 2            # drafts in a probe (doubling while probes are fully accepted)
DECAY = 0.8            # weight of the earlier acceptance counts per observation
PRIOR = (0.5, 0.5)     # initial counts (accepted, rejected), decayed like observations: alpha = 0.5
                       # before any observation, and no floor once drafts keep failing
MAX_DEFERRED = 64      # rows a backed-off sequence's drafter upkeep (MTP catch-up, DFlash context)
                       # may put off before they are written anyway


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step yields with k drafts under geometric acceptance: the accepted drafts plus the
    target's own token (correction or bonus)."""
    if k <= 0:
        return 1.0
    alpha = min(max(alpha, 0.0), 1.0)
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def choose_k(alpha: float, k_max: int, step_time: Callable[[int], float | None], base_rows: int,
             draft_cost: Callable[[int], float], others_tokens: float = 0.0, others_time: float = 0.0,
             margin: float = MARGIN) -> int:
    """The draft count in 0..k_max maximizing (E(k) + others_tokens) / (T(base_rows + k) + draft_cost(k)
    + others_time). base_rows: the step's rows with this sequence feeding one (its own row plus the
    other sequences'). step_time(n) returns None while nothing is measured: then k_max (optimistic, so
    drafting starts and the costs get measured) unless alpha is 0. k = 0 unless a k > 0 beats it by margin."""
    if k_max <= 0:
        return 0

    if step_time(base_rows) is None:          # nothing measured yet: draft (the costs get measured)
        return k_max if alpha > 0 else 0

    def rate(k: int) -> float:
        t = step_time(base_rows + k) + (draft_cost(k) if k else 0.0) + others_time
        return (expected_tokens(alpha, k) + others_tokens) / max(t, 1e-12)

    r0 = rate(0)
    best_k, best = 0, r0 * (1.0 + margin)
    for k in range(1, k_max + 1):
        r = rate(k)
        if r > best:
            best_k, best = k, r
    return best_k


def draft_units(drafter: str, k: int) -> int:
    """Units of a drafter's avoidable work for k drafts of one sequence: the MTP block's chained
    forwards (k - 1), else one call (a DFlash block forward, an n-gram lookup) when k > 0."""
    if k <= 0:
        return 0
    return k - 1 if drafter == "mtp" else 1


class StepCosts:
    """Per engine: measured step and drafting times (seconds)."""

    def __init__(self, weight: float = 0.2):
        self.weight = weight
        self.buckets: dict[int, list[float]] = {}    # bucket -> [mean rows, mean seconds, samples]
        self.drafters: dict[str, list[float]] = {}   # drafter -> [mean seconds per unit, samples]
        self._curve: tuple[list[float], list[float]] | None = None

    @staticmethod
    def bucket(rows: int) -> int:
        """1 -> 0, 2 -> 1, 3..4 -> 2, 5..8 -> 3, ... (rows rounded up to a power of two)."""
        return max(0, int(rows) - 1).bit_length()

    def _ema(self, entry: list[float], idx: int, value: float) -> None:
        entry[idx] += self.weight * (value - entry[idx])

    def add_step(self, rows: int, secs: float) -> None:
        """A decode step of `rows` rows took `secs` (without the avoidable drafting work)."""
        if rows <= 0 or secs <= 0:
            return
        e = self.buckets.get(self.bucket(rows))
        if e is None:
            self.buckets[self.bucket(rows)] = [float(rows), float(secs), 1]
        else:
            self._ema(e, 0, rows)
            self._ema(e, 1, min(secs, 4 * e[1]))   # one outlier (a GC pause, a busy core) moves it less
            e[2] += 1
        self._curve = None

    def step_time(self, rows: int) -> float | None:
        """Estimated T(rows): piecewise linear through the buckets' (mean rows, mean seconds), made
        non-decreasing, extended beyond them with the nearest segment's slope (flat with one bucket);
        None before any step was measured."""
        if self._curve is None:
            pts = sorted((e[0], e[1]) for e in self.buckets.values())
            xs, ys = [], []
            for x, y in pts:
                xs.append(x)
                ys.append(max(y, ys[-1]) if ys else y)
            self._curve = (xs, ys)
        xs, ys = self._curve
        if not xs:
            return None
        if len(xs) == 1:
            return ys[0]
        if rows <= xs[0]:
            i = 0
        elif rows >= xs[-1]:
            i = len(xs) - 2
        else:
            i = next(j for j in range(len(xs) - 1) if xs[j] <= rows <= xs[j + 1])
        dx = xs[i + 1] - xs[i]
        slope = (ys[i + 1] - ys[i]) / dx if dx > 0 else 0.0
        # below the first bucket: no less than proportional to the rows (T has a non-negative fixed part)
        return max(ys[i] + slope * (rows - xs[i]), ys[0] * rows / xs[0] if rows < xs[0] else 0.0, 1e-9)

    def add_draft(self, drafter: str, secs: float, units: int) -> None:
        """A drafter spent `secs` on `units` units of work (draft_units)."""
        if units <= 0 or secs < 0:
            return
        per = secs / units
        e = self.drafters.get(drafter)
        if e is None:
            self.drafters[drafter] = [per, 1]
        else:
            self._ema(e, 0, min(per, 4 * e[0]) if e[0] > 0 else per)
            e[1] += 1

    def draft_time(self, drafter: str | None, k: int) -> float:
        """Estimated avoidable drafting time of one sequence for k drafts (0 before any measurement)."""
        e = self.drafters.get(drafter) if drafter else None
        return e[0] * draft_units(drafter, k) if e is not None else 0.0

    def summary(self) -> dict:
        """For stats(): mean step milliseconds per row bucket and drafting milliseconds per unit."""
        return dict(step_ms={int(round(e[0])): round(1000 * e[1], 3) for _, e in sorted(self.buckets.items())},
                    draft_ms={d: round(1000 * e[0], 3) for d, e in sorted(self.drafters.items())})


class DraftLength:
    """One sequence's draft length with one drafter: the acceptance estimate, the k for the next step,
    and the back-off state."""

    def __init__(self, k_max: int, probe_every: int = PROBE_EVERY, probe_k: int = PROBE_K,
                 decay: float = DECAY, prior: tuple[float, float] = PRIOR, probe_max: int = PROBE_MAX):
        self.k_max = max(0, int(k_max))
        self.k = self.k_max                # the first step drafts in full (optimistic: nothing measured yet)
        self.probe_every, self.probe_k, self.decay, self.prior = probe_every, probe_k, decay, prior
        self.probe_max = max(probe_max, probe_every)
        self.interval = probe_every        # steps between probes now
        self.accepted, self.rejected = map(float, prior)   # decayed counts, starting from the prior's
        self.observations = 0
        self.backed_off = False
        self.idle = probe_every            # steps since the last drafts while backed off (a fresh one
        self.probe = min(probe_k, self.k_max)   # that starts backed off probes at once)
        self._probe_passed = False

    @property
    def alpha(self) -> float:
        n = self.accepted + self.rejected
        return self.accepted / n if n > 0 else 0.0

    def observe(self, drafted: int, accepted: int) -> None:
        """A verified step: `accepted` of `drafted` drafts accepted (a rejection when fewer)."""
        if drafted <= 0:
            return
        self.accepted = self.decay * self.accepted + accepted
        self.rejected = self.decay * self.rejected + (1 if accepted < drafted else 0)
        self.observations += 1
        if self.backed_off:                # that was a probe
            self.idle = 0
            passed = accepted == drafted
            self._probe_passed = passed and self.probe < self.k_max
            if self._probe_passed:         # the next probe at once, twice as long (up to k_max)
                self.probe, self.interval = min(self.k_max, 2 * self.probe), self.probe_every
            else:                          # after a failed one the wait doubles
                self.probe = min(self.probe_k, self.k_max)
                self.interval = self.probe_every if passed else min(2 * self.interval, self.probe_max)

    def decide(self, k: int) -> int:
        """Take the chooser's k for the next step; when it is 0, back off (k = 0) except for a probe
        every `interval` steps, or at once after a fully accepted probe. Returns the k set."""
        k = max(0, min(int(k), self.k_max))
        if k > 0:
            self.k, self.backed_off, self.idle, self._probe_passed = k, False, 0, False
            self.probe, self.interval = min(self.probe_k, self.k_max), self.probe_every
            return k
        if not self.backed_off:
            self.backed_off = True
            if self.observations:
                self.idle = 0
        self.idle += 1
        if self._probe_passed:
            self._probe_passed = False
            self.idle = self.interval
        self.k = self.probe if self.idle >= self.interval else 0
        return self.k

    def summary(self) -> dict:
        return dict(k=self.k, backed_off=self.backed_off, alpha=round(self.alpha, 3))

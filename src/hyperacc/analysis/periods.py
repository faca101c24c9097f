"""Spikes that recur on a fixed period of steps: work a loop does every N steps (a checkpoint save, an
evaluation, logging), told from spikes that fall at random (docs/detection.md, "Periodic spikes").

For the sorted steps ``S`` of a set of spikes among a rank's judged steps ``J``:

    candidates: the CANDIDATES most frequent gaps of at least 2 steps from each spike to each of the
        next three (three, so that a spike of other work in between does not hide the period)
    for each candidate P, r = the most frequent s mod P over S (the smallest of equally frequent ones)
    H = |{s in S : s mod P = r}|        the spikes on the period
    E = |{t in J : t mod P = r}|        the judged steps on the period
    periodic  when  H >= period_min_repeats
              AND   H >= period_coverage x E
              AND   P(Binomial(E, q) >= H) < top_alpha / (P x candidates),   q = |S| / |J|
              AND   for each divisor d of P (1 < d < P) with spikes on r mod d off the period:
                    P(Hypergeometric: H or more of the H_d spikes on r mod d fall on the E of its
                    E_d judged steps that are r mod P) x P / d  <  top_alpha
    the period: the smallest candidate that is periodic (its multiples are too, and a recurrence
        that did not spike makes a gap of 2P)

The binomial is the chance that spikes falling at the rank's own rate fill that many of the period's
steps; ``P x candidates`` pays for choosing the best of the ``P`` phases of each candidate tried. The
divisors' test tells a period from a finer one that spiked only part of the time: spikes on half of
the steps that are 0 mod 80, at random, are not "every 320 steps" because a few of them happened to
fall on 320, 640 and 960. A transient stretch of spikes (a fail-slow over 60 steps) has gaps of 1 to
3 and covers few of its period's steps over the run; a loaded host's spikes do not line up on one
phase. Pure: steps in, a period or None out.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from hyperacc.analysis.robust import binom_sf, hypergeom_sf

LAGS = 3  # gaps from each spike to each of the next LAGS spikes are candidates for the period
CANDIDATES = 4  # the most frequent gaps tried


@dataclasses.dataclass(frozen=True)
class Period:
    every: int  # P: steps between two recurrences
    first: int  # the first and last judged step on the period that spiked
    last: int
    repeats: int  # H: spikes on the period
    expected: int  # E: judged steps on the period
    lost_ns: float  # what the spikes on the period lost (their excess), where given
    p_value: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def spike_period(
    spikes: np.ndarray, judged: np.ndarray, min_repeats: int, coverage: float, alpha: float,
    excess: np.ndarray | None = None,
) -> Period | None:  # fmt: skip
    """The period of ``spikes`` (sorted steps) among ``judged`` (sorted steps), or None (module
    docstring). ``excess``: each spike's excess, for the time the period's spikes lost."""
    s = np.asarray(spikes, dtype=np.int64)
    j = np.asarray(judged, dtype=np.int64)
    if s.size < min_repeats or j.size == 0 or alpha <= 0:
        return None
    gaps = np.concatenate([s[lag:] - s[:-lag] for lag in range(1, min(LAGS, s.size - 1) + 1)])
    gaps = gaps[gaps >= 2]
    if gaps.size == 0:
        return None
    values, counts = np.unique(gaps, return_counts=True)
    tried = values[np.argsort(-counts, kind="stable")[:CANDIDATES]]
    q = min(s.size / j.size, 1.0)
    for every in sorted(int(v) for v in tried):
        phases, counts = np.unique(s % every, return_counts=True)
        phase = int(phases[np.argmax(counts)])
        on = s % every == phase
        repeats = int(on.sum())
        expected = max(_on_period(j, every, phase), repeats)  # spikes are judged steps: never fewer
        if repeats < min_repeats or repeats < coverage * expected:
            continue
        p = float(binom_sf(repeats, expected, q))
        if p >= alpha / (every * tried.size) or not _finer_than_divisors(s, j, every, phase, repeats, expected, alpha):
            continue
        hits = s[on]
        lost = float(np.asarray(excess, dtype=np.float64)[on].sum()) if excess is not None else float("nan")
        return Period(every, int(hits[0]), int(hits[-1]), repeats, expected, lost, p)
    return None


def _finer_than_divisors(
    s: np.ndarray, j: np.ndarray, every: int, phase: int, repeats: int, expected: int, alpha: float
) -> bool:  # fmt: skip
    """Whether the spikes on the period are more than a finer period's spikes that fell there (module
    docstring): for each divisor ``d`` with spikes on ``phase`` mod ``d`` off the period."""
    for d in _divisors(every):
        on_d = int((s % d == phase % d).sum())
        if on_d <= repeats:
            continue  # every spike of the finer lattice is on the period: nothing finer to explain it
        slots = _on_period(j, d, phase % d)
        if hypergeom_sf(repeats, slots, expected, on_d) * (every // d) >= alpha:
            return False
    return True


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` above 1 and below ``n`` (vectorised: step numbers, and so periods, can be
    large where a job numbers its steps sparsely)."""
    d = np.arange(2, math.isqrt(n) + 1, dtype=np.int64)
    d = d[n % d == 0]
    return sorted({int(x) for x in d} | {n // int(x) for x in d})


def _on_period(judged: np.ndarray, every: int, phase: int) -> int:
    """How many of ``judged`` (sorted steps) are ``phase`` mod ``every``: by arithmetic where they are
    one run of consecutive steps (the usual rank), else by counting."""
    lo, hi = int(judged[0]), int(judged[-1])
    if hi - lo + 1 == judged.size:
        return (hi - phase) // every - (lo - 1 - phase) // every
    return int((judged % every == phase).sum())

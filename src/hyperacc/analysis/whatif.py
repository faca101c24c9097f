"""What-if: the job time each culprit cost, by replaying the recorded steps with its lateness taken away
(docs/detection.md, "What-if").

Under a synchronous collective every rank waits for the last one to arrive, so a step's time holds the
last rank's lateness over the next-to-last: the difference of their waits in the collective (a rank
that arrives ``d`` later waits ``d`` less; the start of the step cancels). Taking a culprit's lateness
away at a step where it arrived last leaves every other rank's timing as recorded and shortens the step
to the next-to-last arrival: ``saved = wait of the first other rank in the order of waits - wait of the
culprit``. The same with several culprits at once skips all of them. Steps where the culprit was not
last are unchanged.

Pure over the per-step least waits that ``run_reduce._Cluster`` keeps (``wait_low``, ``wait_rank``,
``low_cause``) and the culprits ``diagnose`` found.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Culprit:
    """What to take away: rank ``rank``'s lateness at steps ``since_step``-``until_step``, at all of them
    (a straggler, an episode) or only where its spike had one of ``causes`` (a rank-specific cause)."""

    what: str  # straggler | episode | spikes
    rank: int
    since_step: int
    until_step: int
    causes: tuple[int, ...] | None = None  # spike cause codes (``_Cluster.causes``); None: every step
    label: str = ""  # the cause in words, for spikes


def saved_ns(
    steps: np.ndarray, wait_low: np.ndarray, wait_rank: np.ndarray, low_cause: np.ndarray,
    culprits: Sequence[Culprit],
) -> np.ndarray:  # fmt: skip
    """Per step, the time saved by taking every culprit in ``culprits`` away together.

    ``wait_low``/``wait_rank``: (steps x K) least waits and their ranks, least first (inf/-1: none);
    a step saves the wait of its first non-culprit rank less the least wait, where its last rank to
    arrive is a culprit that applies at that step (where all K kept are culprits, the K-th: a bound)."""
    n, k = wait_low.shape
    if n == 0 or not culprits:
        return np.zeros(n)
    # out[s, j]: the rank in column j of step s is a culprit that applies there
    culprit = np.zeros((n, k), dtype=bool)
    for c in culprits:
        at = (steps >= c.since_step) & (steps <= c.until_step)
        hit = (wait_rank == c.rank) & at[:, None]
        if c.causes is not None:  # only the spikes of those causes, where the rank arrived last
            hit[:, 1:] = False
            hit[:, 0] &= np.isin(low_cause, c.causes)
        culprit |= hit
    last_is_culprit = culprit[:, 0] & np.isfinite(wait_low[:, 0])
    # the first column that is not a culprit (k - 1 where all are)
    first_other = np.where(culprit.all(axis=1), k - 1, np.argmax(~culprit, axis=1))
    other = np.take_along_axis(wait_low, first_other[:, None], axis=1)[:, 0]
    gain = np.where(last_is_culprit & np.isfinite(other), other - wait_low[:, 0], 0.0)
    return np.maximum(gain, 0.0)


def what_if(
    steps: np.ndarray, step_ns: np.ndarray, wait_low: np.ndarray, wait_rank: np.ndarray, low_cause: np.ndarray,
    culprits: Sequence[Culprit],
) -> dict[str, Any] | None:  # fmt: skip
    """The job time over the timed steps (``step_ns``: the cluster's step time per step, NaN: not
    timed), and without each culprit and without all of them (None: no step timed, or no wait
    measured)."""
    timed = np.isfinite(step_ns)
    if not timed.any() or not np.isfinite(wait_low[:, 0]).any():
        return None
    job = float(step_ns[timed].sum())
    s, low, rank, cause = steps[timed], wait_low[timed], wait_rank[timed], low_cause[timed]
    rows = []
    for c in culprits:
        saved = float(saved_ns(s, low, rank, cause, [c]).sum())
        rows.append({"what": c.what, "rank": c.rank, "since_step": c.since_step, "until_step": c.until_step,
                     "cause": c.label or None, **_without(job, saved)})  # fmt: skip
    together = float(saved_ns(s, low, rank, cause, culprits).sum()) if culprits else 0.0
    return {
        "job_ns": job,
        "first_step": int(s[0]),
        "last_step": int(s[-1]),
        "culprits": rows,
        "all": _without(job, together),
    }


def _without(job: float, saved: float) -> dict[str, float]:
    return {"saved_ns": saved, "job_ns_without": job - saved, "saved_frac": saved / job if job > 0 else 0.0}

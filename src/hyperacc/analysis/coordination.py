"""The second document's view of a run: step-time distribution, the cost of coordination, and lost time
split into the failure modes of synchronous training.

Pure functions over per-step cluster arrays (one value per step, reduced over ranks while the ranks are
streamed, so memory does not grow with ranks x steps):

- ``step_max``: the cluster's step time (the slowest rank's; under a synchronous all-reduce all ranks
  are within the boundary skew of it);
- ``wait_min`` / ``wait_max`` / ``wait_sum``: the least, largest and summed exposed wait in collectives
  over the ranks that measured it (``ranks``); the least is the collective's own cost (the last rank to
  arrive waits only for the transfer), the rest of every other rank's wait is waiting for late arrivals;
- ``step_sum``: the summed step time of the same ranks.

Rules, formulas and defaults: docs/detection.md, "Coordination and failure modes". When the evidence
does not separate the modes, the answer is "not enough evidence", never a guess.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hyperacc.analysis.robust import nan_median, nan_quantiles, rank_sum_greater_p

# Spike causes that belong to the runtime/control failure mode (launch latency, allocator, host, GC).
RUNTIME_CAUSES = ("gc", "allocator", "page_faults", "host")
# A mode is named only when it accounts for at least this share of the step time.
MIN_SHARE = 0.05
# Fabric contention: the collective's own cost grew by this factor from the first to the last third of
# the run while the arrival spread did not grow as much ...
GROWTH = 1.25
# ... and the growth is beyond the steps' noise: the last third's least waits larger than the first
# third's in a one-sided rank-sum test at this significance (the other count tests' ``top_alpha``).
TREND_ALPHA = 1e-3


@dataclasses.dataclass(frozen=True)
class Distribution:
    steps: int
    mean_ns: float
    p50_ns: float
    p90_ns: float
    p99_ns: float
    p999_ns: float
    cv: float  # standard deviation / mean
    jitter: float  # median |step - previous step| / median step
    steps_per_s: float
    samples_per_s: float | None  # when the global batch size is known


def distribution(step_ns: np.ndarray, samples_per_step: float | None = None) -> Distribution | None:
    """Percentiles, CV, jitter and throughput of the cluster's step times (NaN: step not measured)."""
    x = np.asarray(step_ns, dtype=np.float64)
    ok = x[~np.isnan(x)]
    if ok.size < 2:
        return None
    p50, p90, p99, p999 = (float(v) for v in nan_quantiles(ok, (0.5, 0.9, 0.99, 0.999)))
    mean = float(ok.mean())
    diffs = np.abs(np.diff(x))
    jitter = float(nan_median(diffs)) / p50 if p50 > 0 else math.nan
    rate = 1e9 / mean if mean > 0 else math.nan
    return Distribution(
        steps=int(ok.size), mean_ns=mean, p50_ns=p50, p90_ns=p90, p99_ns=p99, p999_ns=p999,
        cv=float(ok.std() / mean) if mean > 0 else math.nan, jitter=jitter, steps_per_s=rate,
        samples_per_s=rate * samples_per_step if samples_per_step else None,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Coordination:
    wait_share: float  # share of all ranks' step time spent blocked in collectives
    collective_share: float  # of that, the collectives' own cost (the least wait of each step)
    late_share: float  # waiting for late arrivals: each rank's wait less the step's least wait
    spread_p50_ns: float  # arrival spread per step (largest wait less the least), median ...
    spread_p99_ns: float  # ... and 99th percentile
    spread_trend: float  # median spread of the last third of steps / of the first third
    collective_trend: float  # the same for the collective's own cost
    collective_trend_p: float  # that the last third's own cost is larger than the first third's by chance
    steps: int
    collective_first_ns: float = math.nan  # the collective's own cost, median of the first third of steps
    # the rise of the ranks' run-queue delay (waiting for a CPU) from the first to the last third, median of
    # each third (NaN: not measured): on a host whose CPUs are contended the collective's threads wait too
    run_delay_rise_ns: float = math.nan


def coordination(
    step_sum: np.ndarray, wait_sum: np.ndarray, wait_min: np.ndarray, wait_max: np.ndarray, ranks: np.ndarray,
    run_delay: np.ndarray | None = None,
) -> Coordination | None:
    """Where the time of synchronisation goes, over the steps where at least two ranks measured a wait.
    ``run_delay``: the ranks' mean run-queue delay per step (NaN: not measured)."""
    step_sum, wait_sum = np.asarray(step_sum, float), np.asarray(wait_sum, float)
    wait_min, wait_max, ranks = np.asarray(wait_min, float), np.asarray(wait_max, float), np.asarray(ranks, float)
    ok = (ranks >= 2) & ~np.isnan(wait_sum) & ~np.isnan(step_sum) & (step_sum > 0)
    if ok.sum() < 3:
        return None
    total = float(step_sum[ok].sum())
    wait = float(wait_sum[ok].sum())
    own = float((wait_min[ok] * ranks[ok]).sum())
    spread = wait_max[ok] - wait_min[ok]
    p50, p99 = (float(v) for v in nan_quantiles(spread, (0.5, 0.99)))
    return Coordination(
        wait_share=wait / total,
        collective_share=own / total,
        late_share=max(wait - own, 0.0) / total,
        spread_p50_ns=p50,
        spread_p99_ns=p99,
        spread_trend=_trend(spread),
        collective_trend=_trend(wait_min[ok]),
        collective_trend_p=_trend_p(wait_min[ok]),
        steps=int(ok.sum()),
        collective_first_ns=_thirds(wait_min[ok])[0],
        run_delay_rise_ns=_rise(np.asarray(run_delay, float)[ok]) if run_delay is not None else math.nan,
    )


def _ends(values: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The first and the last third of ``values`` (None under 9 values: too few to see a trend)."""
    n = values.size
    return (values[: n // 3], values[-(n // 3) :]) if n >= 9 else None


def _thirds(values: np.ndarray) -> tuple[float, float]:
    """Medians of the first and of the last third of ``values``, NaN left out (NaN: under 9 values, or a
    third with none measured)."""
    ends = _ends(values)
    if ends is None:
        return math.nan, math.nan
    first, last = ends
    if np.isnan(first).all() or np.isnan(last).all():
        return math.nan, math.nan
    return float(np.nanmedian(first)), float(np.nanmedian(last))


def _rise(values: np.ndarray) -> float:
    first, last = _thirds(values)
    return last - first


def _trend(values: np.ndarray) -> float:
    """Median of the last third over the median of the first third (NaN when too short or zero)."""
    first, last = _thirds(values)
    return last / first if first > 0 else math.nan


def _trend_p(values: np.ndarray) -> float:
    """``rank_sum_greater_p`` of the last third of steps against the first third (NaN under 9 steps)."""
    ends = _ends(values)
    return rank_sum_greater_p(*ends) if ends is not None else math.nan


def _cpu_explains(coord: Coordination) -> bool:
    """Whether the collective's own cost, less what the ranks' run-queue delay rose by, no longer grew by
    ``GROWTH``: the rise is then as much the host's CPUs as the fabric (docs/detection.md)."""
    rise, first = coord.run_delay_rise_ns, coord.collective_first_ns
    if not rise > 0 or not first > 0:
        return False
    return first * coord.collective_trend - rise < GROWTH * first


@dataclasses.dataclass(frozen=True)
class Mode:
    mode: str  # sync_amplification | fabric_contention | locality | runtime
    share: float | None  # of the step time, where it can be put in numbers
    verdict: str  # "likely" | "not enough evidence" | "no"
    evidence: str
    tells_apart: str  # what would separate it from the others


def failure_modes(
    coord: Coordination | None,
    by_local_rank: Mapping[int, Sequence[float]] | None = None,
    runtime_shares: Mapping[str, float] | None = None,
) -> list[Mode]:
    """The four failure modes of the second document, each with its evidence (docs/detection.md).

    ``by_local_rank``: for each local rank, its self-time ratio to the median of its node on each node
    (two nodes or more); ``runtime_shares``: share of step time lost to spikes of the runtime causes
    (launch, allocator, host syncs, gc).
    """
    modes: list[Mode] = []
    if coord is None:
        modes.append(Mode("sync_amplification", None, "not enough evidence",
                          "no step with waits measured on two or more ranks",
                          "waits at the gradient collective on every rank"))  # fmt: skip
        modes.append(Mode("fabric_contention", None, "not enough evidence",
                          "no step with waits measured on two or more ranks",
                          "the least wait of each step (the collective's own cost) over time"))  # fmt: skip
    else:
        late = coord.late_share
        modes.append(
            Mode(
                "sync_amplification",
                late,
                "likely" if late >= MIN_SHARE else "no",
                f"{late:.1%} of step time is ranks waiting for late arrivals (arrival spread p50 "
                f"{coord.spread_p50_ns / 1e6:.3g} ms, p99 {coord.spread_p99_ns / 1e6:.3g} ms)",
                "the rank that arrives last changes little and waits least; pacing or removing the straggler "
                "shrinks it, a faster network does not",
            )
        )
        grew = coord.collective_trend >= GROWTH and not coord.spread_trend >= coord.collective_trend
        if math.isnan(coord.collective_trend):
            verdict, why = "not enough evidence", "too few steps to see a trend"
        elif grew and coord.collective_share >= MIN_SHARE and not coord.collective_trend_p < TREND_ALPHA:
            verdict, why = "not enough evidence", (
                f"the collective's own cost grew {coord.collective_trend:.2f}x from the first to the last third "
                f"of the steps, within their noise (p = {coord.collective_trend_p:.2g})"
            )
        elif grew and coord.collective_share >= MIN_SHARE and _cpu_explains(coord):
            verdict, why = "not enough evidence", (
                f"the collective's own cost grew {coord.collective_trend:.2f}x from the first to the last third "
                f"of the steps, but the ranks' run-queue delay rose {coord.run_delay_rise_ns / 1e6:.3g} ms a step "
                "with it: on a host whose CPUs are contended the collective's threads wait for a CPU too"
            )
        elif grew and coord.collective_share >= MIN_SHARE:
            verdict, why = "likely", (
                f"the collective's own cost grew {coord.collective_trend:.2f}x from the first to the last third "
                f"of the run while the arrival spread changed {coord.spread_trend:.2f}x"
            )
        else:
            verdict, why = "no", (
                f"the collective's own cost is {coord.collective_share:.1%} of step time and changed "
                f"{coord.collective_trend:.2f}x over the run"
            )
        modes.append(
            Mode(
                "fabric_contention",
                coord.collective_share,
                verdict,
                why,
                "the least wait grows while arrivals stay together; it shows on every rank at once",
            )
        )
    modes.append(_locality(by_local_rank))
    modes.append(_runtime(runtime_shares))
    return modes


def _locality(by_local_rank: Mapping[int, Sequence[float]] | None) -> Mode:
    tell = "the same local rank slower on every node (a device or link position), not one node"
    if not by_local_rank or min((len(v) for v in by_local_rank.values()), default=0) < 2:
        return Mode("locality", None, "not enough evidence", "needs two or more nodes with the same layout", tell)
    worst, ratios = max(by_local_rank.items(), key=lambda kv: float(np.min(kv[1])))
    low = float(np.min(ratios))
    if low >= 1.0 + MIN_SHARE:
        return Mode(
            "locality",
            low - 1.0,
            "likely",
            f"local rank {worst} is at least {low:.2f}x its node's median self-time on every one of "
            f"{len(ratios)} nodes",
            tell,
        )
    return Mode("locality", None, "no", "no local rank is slower on every node", tell)


def _runtime(shares: Mapping[str, float] | None) -> Mode:
    tell = "spikes that coincide with launch latency, allocator retries, host syncs or GC on one rank"
    if not shares:
        return Mode("runtime", None, "no", "no spike of a runtime cause", tell)
    total = float(sum(shares.values()))
    parts = ", ".join(f"{k} {v:.1%}" for k, v in sorted(shares.items(), key=lambda kv: -kv[1]) if v > 0)
    verdict = "likely" if total >= MIN_SHARE else "no"
    return Mode("runtime", total, verdict, f"time lost to runtime spikes: {parts or 'none'}", tell)


def to_dict(obj: Any) -> Any:
    """Plain JSON types (NaN becomes None)."""
    if dataclasses.is_dataclass(obj):
        return {k: to_dict(v) for k, v in dataclasses.asdict(obj).items()}
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    return obj

"""The report's reductions: a run read one rank at a time into bounded summaries (per-rank boxes,
the cluster's step time per step, node histograms, the ranks worth drawing), and its event tables."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hyperacc import store
from hyperacc.analysis.options import DetectionOptions

_HIST_EDGES = np.geomspace(1e3, 1e12, 4001)  # 1 us .. 1000 s, 0.5 % wide bins (node quantiles)

_QUIET_EVENT_KINDS = frozenset({"collective", "memory_peak"})  # profiler detail, shown in the export


@dataclasses.dataclass
class _RankSummary:
    rank: int
    node: int
    n: int
    q: tuple[float, float, float, float, float]  # lower whisker, q1, median, q3, upper whisker (ns)
    mean: float
    mad: float
    outliers: int


class _StepMax:
    """The cluster's step time (the slowest rank's ``step_ns``) per recorded step, indexed sparsely:
    memory follows the records, not the step numbers (a step numbered 10**12 costs one entry)."""

    def __init__(self) -> None:
        self.steps = np.zeros(0, dtype=np.int64)  # sorted
        self.values = np.zeros(0)  # NaN where no rank measured the step

    def add(self, steps: np.ndarray, values: np.ndarray) -> None:
        pos = np.searchsorted(self.steps, steps)
        if not (pos < self.steps.size).all() or not np.array_equal(self.steps[pos], steps):
            merged = np.union1d(self.steps, steps)
            grown = np.full(merged.size, np.nan)
            grown[np.searchsorted(merged, self.steps)] = self.values
            self.steps, self.values = merged, grown
            pos = np.searchsorted(self.steps, steps)
        np.fmax.at(self.values, pos, values)

    def at(self, step: int) -> float | None:
        i = int(np.searchsorted(self.steps, step))
        if i < self.steps.size and self.steps[i] == step and np.isfinite(self.values[i]):
            return float(self.values[i])
        return None


def _summarise(rank: int, node: int, v: np.ndarray) -> _RankSummary:
    q1, med, q3 = np.percentile(v, [25, 50, 75])
    iqr = q3 - q1
    inside = v[(v >= q1 - 1.5 * iqr) & (v <= q3 + 1.5 * iqr)]
    lo, hi = (float(inside.min()), float(inside.max())) if inside.size else (float(q1), float(q3))
    return _RankSummary(
        rank=rank,
        node=node,
        n=int(v.size),
        q=(lo, float(q1), float(med), float(q3), hi),
        mean=float(v.mean()),
        mad=float(np.median(np.abs(v - med))),
        outliers=int(v.size - inside.size),
    )


def _hist_quantiles(counts: np.ndarray, qs: tuple[float, ...]) -> list[float]:
    cum = np.cumsum(counts)
    total = cum[-1]
    mids = np.sqrt(_HIST_EDGES[:-1] * _HIST_EDGES[1:])
    return [float(mids[min(int(np.searchsorted(cum, q * total)), len(mids) - 1)]) for q in qs]


def _choose_ranks(ranks, summaries, diag, flagged, k: int) -> list[int]:
    if len(ranks) <= k:
        return list(ranks)
    order: list[int] = sorted(flagged)
    per_rank = (diag or {}).get("spikes", {}).get("per_rank", []) or []
    order += [int(p["rank"]) for p in sorted(per_rank, key=lambda p: -(p.get("spikes") or 0)) if p.get("spikes")][: k // 3]
    order += [s.rank for s in sorted(summaries, key=lambda s: -s.q[2])]
    seen: list[int] = []
    for r in order:
        if r not in seen:
            seen.append(r)
        if len(seen) >= k:
            break
    return sorted(seen)


def _events(run_dir) -> pa.Table | None:
    table = store.read_events(run_dir)
    if table.num_rows == 0:
        return None
    keep = pc.invert(pc.is_in(table.column("kind"), value_set=pa.array(sorted(_QUIET_EVENT_KINDS))))
    return table.filter(keep)


def _options(diag: Mapping[str, Any] | None) -> DetectionOptions:
    """The detection options the diagnosis ran with (the defaults without one)."""
    return DetectionOptions.from_mapping((diag or {}).get("options") or {})


def _runtime(run_dir, opts: DetectionOptions) -> pa.Table | None:
    from hyperacc.present.kineto import read_runtime_api, runtime_api_outliers

    table = read_runtime_api(run_dir)
    return runtime_api_outliers(table, opts=opts) if table is not None and table.num_rows else None

"""Straggler ranks: robust outliers per window and metric, persistence, culprit vs victim, node grouping.

Input is a table of per-window, per-rank summaries (WINDOW_SCHEMA, from the tracer while training runs
or from ``windows.summarize_windows`` offline). The rules and their defaults are in
docs/detection.md ("Stragglers"); in short:

* per window and metric, a rank is an outlier when it is SLOW by both the modified z-score
  (median/MAD, > 3.5) and Tukey's upper fence of the other ranks (Q3 + 1.5 IQR), and by at least 5 % and a floor in
  absolute terms. Fast ranks are never outliers; a rank without data in a window is not judged there,
  and a window with fewer than ``min_ranks`` reporting ranks is not judged at all;
* under a synchronous all-reduce every rank's step time is the same, so step time is never judged.
  Self-time names the culprit; a rank that, over its flagged windows, waited in the collective longer
  than the median rank by more than it was slow is a victim and is never a compute straggler;
* a rank is a straggler once it is an outlier in ``k`` of its last ``n`` judged windows;
* when more than half of a node's ranks are stragglers, the node is the problem.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from hyperacc.analysis.options import METRIC_KIND, STRAGGLER_METRICS, DetectionOptions
from hyperacc.analysis.robust import loo_upper_fence, modified_z, nan_median

# When a rank is slow on several metrics, one names the kind. Data and GC are parts of the step that explain a slow self-time; the launch probe is timed outside the
# step, so it names the kind only when nothing inside the step is slow.
_KIND_PRIORITY: tuple[str, ...] = ("data_ns", "gc_ns", "self_ns", "forward_ns", "backward_ns", "launch_ns")
# Parts of the self-time: their excess must also be material to the whole (min_slowdown of the median
# self-time), so a data wait that doubles from 0.5 to 1 ms in a 100 ms step is no straggler.
_PARTS: tuple[str, ...] = ("forward_ns", "backward_ns", "data_ns", "gc_ns")


@dataclasses.dataclass
class WindowGrid:
    """Window summaries pivoted to (rank x window) matrices; NaN where a rank has no judged value."""

    ranks: np.ndarray  # (R,)
    nodes: np.ndarray  # (R,)
    windows: np.ndarray  # (W,)
    first_step: np.ndarray  # (W,)
    last_step: np.ndarray  # (W,)
    metrics: dict[str, np.ndarray]  # STRAGGLER_METRICS -> (R, W)
    comm_wait: np.ndarray  # (R, W)
    host: dict[str, np.ndarray]  # host signals -> (R, W) (offline summaries only)


def window_grid(windows: pa.Table | Mapping[str, Any], opts: DetectionOptions) -> WindowGrid:
    cols = _columns(windows)
    rank = np.asarray(cols["rank"], dtype=np.int64)
    win = np.asarray(cols["window"], dtype=np.int64)
    ranks, ri = np.unique(rank, return_inverse=True)
    wins, wi = np.unique(win, return_inverse=True)
    shape = (ranks.size, wins.size)
    nodes = np.zeros(ranks.size, dtype=np.int64)
    nodes[ri] = np.asarray(cols["node"], dtype=np.int64)  # the last row of a rank wins
    steps = np.asarray(cols["steps"], dtype=np.float64)
    enough = steps >= opts.min_window_samples

    def pivot(values: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        grid = np.full(shape, np.nan)
        v = np.asarray(values, dtype=np.float64)
        if mask is not None:
            v = np.where(mask, v, np.nan)
        grid[ri, wi] = v
        return grid

    def col(name: str) -> np.ndarray:
        return np.asarray(cols[name], dtype=np.float64) if name in cols else np.full(rank.size, np.nan)

    if "gc_ns_median" in cols:  # the typical step's GC time; rare long pauses are spikes
        gc_per_step = col("gc_ns_median")
    else:  # WINDOW_SCHEMA alone: mean GC time per step
        with np.errstate(invalid="ignore", divide="ignore"):
            gc_per_step = col("gc_ns_sum") / steps
    metrics = {
        "self_ns": pivot(col("self_ns_median"), enough),
        "forward_ns": pivot(col("forward_ns_median"), enough),
        "backward_ns": pivot(col("backward_ns_median"), enough),
        "data_ns": pivot(col("data_ns_median"), enough),
        "launch_ns": pivot(col("launch_ns_median")),  # probe steps are sparse: one sample is a median
        "gc_ns": pivot(gc_per_step, enough),
    }
    first = np.full(wins.size, np.iinfo(np.int64).max)
    np.minimum.at(first, wi, np.asarray(cols["first_step"], dtype=np.int64))
    last = np.full(wins.size, np.iinfo(np.int64).min)
    np.maximum.at(last, wi, np.asarray(cols["last_step"], dtype=np.int64))
    host = {
        name: pivot(col(f"{name}_median"), enough)
        for name in ("invol_ctx_switches", "major_faults")
        if f"{name}_median" in cols
    }
    return WindowGrid(
        ranks, nodes, wins, first, last, metrics, pivot(col("comm_wait_ns_median"), enough), host
    )


def outlier_flags(
    values: np.ndarray, opts: DetectionOptions, floor: float, whole: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Slow outliers of a (rank x window) matrix, judged per window (column).

    Returns (flags, judged, cluster_median). ``judged`` is False where the rank has no value or the
    window has fewer than ``opts.min_ranks`` values; ``flags`` is only ever True where judged.
    ``whole`` (per window) is the cluster's median self-time when ``values`` is a part of it: the
    excess must then also be ``min_slowdown`` of the whole.
    """
    values = np.asarray(values, dtype=np.float64)
    present = ~np.isnan(values)
    eligible = present.sum(axis=0) >= opts.min_ranks
    judged = present & eligible[None, :]
    if not judged.any():
        return np.zeros_like(judged), judged, np.full(values.shape[1], np.nan)
    z, med, _ = modified_z(values, axis=0, min_mad_rel=opts.min_mad_rel)
    upper = loo_upper_fence(values, k=opts.iqr_k)  # each rank against the fence of the others
    with np.errstate(invalid="ignore"):
        by_z = z > opts.z_threshold
        by_iqr = values > upper
        robust = (by_z & by_iqr) if opts.outlier_rule == "and" else (by_z | by_iqr)
        excess = values - med[None, :]
        material = (excess >= floor) & (values >= med[None, :] * (1.0 + opts.min_slowdown))
        if whole is not None:
            material &= ~(excess < opts.min_slowdown * whole[None, :])  # NaN whole: no constraint
    return robust & material & judged, judged, med


def confirmation(flags: np.ndarray, judged: np.ndarray, k: int, n: int) -> tuple[int, int, bool] | None:
    """Persistence of one rank's flags over windows.

    Returns (confirm_window, since_window, active) as window indices, or None when the rank never was an
    outlier in ``k`` of ``n`` consecutive judged windows. ``since_window`` is the first flagged window of
    the run of ``n`` that confirmed it; ``active`` says whether it is still confirmed at its last window.
    """
    js = np.flatnonzero(judged)
    if js.size == 0:
        return None
    f = flags[js].astype(np.int64)
    if f.sum() < k:
        return None
    c = np.concatenate(([0], np.cumsum(f)))
    i = np.arange(js.size)
    rolling = c[i + 1] - c[np.maximum(i + 1 - n, 0)]
    hits = np.flatnonzero(rolling >= k)
    if hits.size == 0:
        return None
    i0 = int(hits[0])
    group = js[max(0, i0 - n + 1) : i0 + 1]
    since = int(group[np.flatnonzero(flags[group])[0]])
    return int(js[i0]), since, bool(rolling[-1] >= k)


def slowest_flags(
    values: np.ndarray, judged: np.ndarray, med: np.ndarray, opts: DetectionOptions, floor: float
) -> np.ndarray:
    """(rank x window) True where the rank is the slowest judged rank of the window by a material margin
    (at least ``floor`` and ``min_slowdown`` above the window's median). Ties flag nobody."""
    v = np.where(judged, values, -np.inf)
    top = v == v.max(axis=0, keepdims=True)
    unique = top.sum(axis=0) == 1
    with np.errstate(invalid="ignore"):
        excess = values - med[None, :]
        material = (excess >= floor) & (values >= med[None, :] * (1.0 + opts.min_slowdown))
    return top & unique[None, :] & material & judged


def top_confirmation(top: np.ndarray, judged: np.ndarray, opts: DetectionOptions) -> tuple[int, int, bool] | None:
    """Rank-order persistence (docs/detection.md): a rank that is the slowest in so many windows that
    exchangeable ranks would rarely do it, P(Binomial(w, 1/R) >= count) < ``top_alpha`` over its first
    ``w`` judged windows (R the ranks judged per window). Returns (confirm_window, since_window, active)."""
    if opts.top_alpha <= 0:
        return None
    from scipy.stats import binom

    ranks_per_window = judged.sum(axis=0).astype(np.float64)
    cols = np.flatnonzero(ranks_per_window >= opts.min_ranks)
    if cols.size == 0:
        return None
    hits = np.cumsum(top[cols].astype(np.int64))
    w = np.arange(1, cols.size + 1)
    p_one = 1.0 / np.cumsum(ranks_per_window[cols]) * w  # 1 / mean ranks judged so far
    pvals = binom.sf(hits - 1, w, p_one)
    ok = np.flatnonzero((pvals < opts.top_alpha) & (hits >= opts.top_min_windows))
    if ok.size == 0:
        return None
    i0 = int(ok[0])
    since = int(cols[np.flatnonzero(top[cols[: i0 + 1]])[0]])
    active = bool(pvals[-1] < opts.top_alpha)
    return int(cols[i0]), since, active


@dataclasses.dataclass
class Straggler:
    rank: int
    node: int
    kind: str  # compute | data | launch | gc | host | node
    metric: str  # self_ns | data_ns | launch_ns | gc_ns
    slowdown: float | None  # the metric's ratio to the cluster median (None when that median is 0)
    since_step: int
    windows_flagged: int
    windows_seen: int
    confirmed_step: int  # last step of the window that completed k of n
    until_step: int  # last step of the last flagged window
    active: bool  # still confirmed at the rank's last judged window
    excess_ns: float  # metric minus cluster median, median over flagged windows
    self_slowdown: float | None  # self-time ratio to the cluster median over the same windows
    comm_wait_ns: float | None  # this rank's wait in the collective over the flagged windows
    cluster_comm_wait_ns: float | None  # the cluster median wait over the same windows
    metrics: list[str]  # every metric on which the rank is a confirmed straggler
    rank_kind: str  # the kind before node grouping

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def detect_stragglers(windows: pa.Table | Mapping[str, Any], opts: DetectionOptions) -> list[Straggler]:
    """Confirmed stragglers from window summaries, at most one entry per rank (docs/detection.md)."""
    grid = window_grid(windows, opts)
    if grid.ranks.size == 0 or grid.windows.size == 0:
        return []
    found: dict[int, dict[str, tuple]] = {}
    med_comm = _cluster_median(grid.comm_wait)
    med_self = _cluster_median(grid.metrics["self_ns"])
    for metric in STRAGGLER_METRICS:
        values = grid.metrics[metric]
        if np.isnan(values).all():
            continue
        floor = opts.launch_floor_ns if metric == "launch_ns" else opts.floor_ns
        flags, judged, med = outlier_flags(values, opts, floor, med_self if metric in _PARTS else None)
        top = slowest_flags(values, judged, med, opts, floor) if metric == "self_ns" else None
        for r in range(values.shape[0]):
            conf = confirmation(flags[r], judged[r], opts.persist_k, opts.persist_n)
            rank_flags = flags[r]
            if conf is None and top is not None:
                conf = top_confirmation(top[r], judged, opts)
                rank_flags = top[r]
            if conf is None:
                continue
            if METRIC_KIND[metric] == "compute" and _waits_more(
                grid.comm_wait[r], med_comm, rank_flags, values[r] - med
            ):
                continue  # a victim: it waited longer than the median rank, so nobody waited for it
            found.setdefault(int(r), {})[metric] = (conf, rank_flags, judged[r], values[r], med)
    out: list[Straggler] = []
    self_vals = grid.metrics["self_ns"]
    self_med = _cluster_median(self_vals)
    for r, per_metric in sorted(found.items()):
        metric = next(m for m in _KIND_PRIORITY if m in per_metric)
        (confirm_w, since_w, active), flags, judged, values, med = per_metric[metric]
        fw = np.flatnonzero(flags)
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = values[fw] / med[fw]
            self_ratio = self_vals[r, fw] / self_med[fw]
        kind = METRIC_KIND[metric]
        if kind == "compute" and _host_signal(grid, r, fw, opts):
            kind = "host"
        out.append(
            Straggler(
                rank=int(grid.ranks[r]),
                node=int(grid.nodes[r]),
                kind=kind,
                metric=metric,
                slowdown=_finite_or_none(nan_median(ratio)),
                since_step=int(grid.first_step[since_w]),
                windows_flagged=int(flags.sum()),
                windows_seen=int(judged.sum()),
                confirmed_step=int(grid.last_step[confirm_w]),
                until_step=int(grid.last_step[fw[-1]]),
                active=active,
                excess_ns=_finite(nan_median(values[fw] - med[fw])),
                self_slowdown=_finite_or_none(nan_median(self_ratio)),
                comm_wait_ns=_finite_or_none(nan_median(grid.comm_wait[r, fw])),
                cluster_comm_wait_ns=_finite_or_none(nan_median(med_comm[fw])),
                metrics=[m for m in STRAGGLER_METRICS if m in per_metric],
                rank_kind=kind,
            )
        )
    _group_by_node(out, grid, opts)
    return out


def _waits_more(wait: np.ndarray, cluster_wait: np.ndarray, flags: np.ndarray, excess: np.ndarray) -> bool:
    """Over its flagged windows, the rank waited in the collective longer than the median rank, by more
    than it was slow (medians over the flagged windows).

    A culprit late by ``d`` waits about ``d`` less than the median rank; a rank that waits more than it is
    slow cannot have held the others up. Judged over all flagged windows together, and with that margin,
    because one window's wait is noisy where the collective itself competes for the cores (gloo on a CPU:
    waits of 15 +- 1 ms around a lateness of 0.4 ms).
    """
    with np.errstate(invalid="ignore"):
        diff = wait[flags] - cluster_wait[flags]
    ok = ~np.isnan(diff)
    if not ok.any():
        return False
    return float(np.median(diff[ok])) > max(float(np.nanmedian(excess[flags])), 0.0)


def _group_by_node(stragglers: list[Straggler], grid: WindowGrid, opts: DetectionOptions) -> None:
    """More than ``node_fraction`` of a node's ranks slow (and at least two): the node is the problem.

    Only with two or more nodes: in a one-node job there is no other node to be slower than."""
    node_ids, node_sizes = np.unique(grid.nodes, return_counts=True)
    if node_ids.size < 2:
        return
    size = dict(zip(node_ids.tolist(), node_sizes.tolist(), strict=True))
    slow: dict[int, int] = {}
    for s in stragglers:
        slow[s.node] = slow.get(s.node, 0) + 1
    for s in stragglers:
        n = size.get(s.node, 1)
        if n >= 2 and slow[s.node] / n > opts.node_fraction:
            s.kind = "node"


def _host_signal(grid: WindowGrid, r: int, windows: np.ndarray, opts: DetectionOptions) -> bool:
    """A compute straggler whose context switches or major faults are outliers in most flagged windows."""
    for values in grid.host.values():
        flags, judged, _ = outlier_flags(values, opts, floor=1.0)
        seen = judged[r, windows]
        if seen.sum() and flags[r, windows].sum() > seen.sum() / 2:
            return True
    return False


def _cluster_median(values: np.ndarray) -> np.ndarray:
    if values.size == 0:
        return np.full(values.shape[1] if values.ndim == 2 else 0, np.nan)
    return nan_median(values, axis=0)


def _columns(windows: pa.Table | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(windows, pa.Table):
        out = {}
        for name in windows.column_names:
            col = windows.column(name)
            if pa.types.is_floating(col.type) or col.null_count:
                out[name] = col.cast(pa.float64()).to_numpy(zero_copy_only=False)
            else:
                out[name] = col.to_numpy(zero_copy_only=False)
        return out
    return windows


def _finite(x: float) -> float:
    x = float(x)
    return x if np.isfinite(x) else float("nan")


def _finite_or_none(x: float) -> float | None:
    x = float(x)
    return x if np.isfinite(x) else None

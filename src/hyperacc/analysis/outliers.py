"""The cross-rank outlier rule and its persistence, on a (rank x window) grid: modified z-score AND the
other ranks' Tukey fence AND a material excess, confirmed over windows (docs/detection.md,
"Stragglers and episodes"). Used by ``stragglers.py``, the doctor's judge and the Kineto import."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import pyarrow as pa

from hyperacc.analysis.options import DetectionOptions
from hyperacc.analysis.robust import binom_sf, loo_upper_fence, modified_z

# Host and device columns of the metrics measured on both clocks.
_CLOCKED: dict[str, tuple[str, str]] = {
    "self_ns": ("self_ns_median", "dev_self_ns_median"),
    "forward_ns": ("forward_ns_median", "dev_forward_ns_median"),
    "backward_ns": ("backward_ns_median", "dev_backward_ns_median"),
    "comm_wait_ns": ("comm_wait_ns_median", "dev_comm_wait_ns_median"),
}


# A straggler still confirmed at the end was materially slower than the median in at least one of its
# last END_WINDOWS judged windows (docs/detection.md, "Stragglers and episodes").
END_WINDOWS = 2


def _recent(flags: np.ndarray, opts: DetectionOptions) -> bool:
    """Still slow at the end: flagged in ``persist_k`` of the last ``persist_n`` judged windows (in more
    than half of them when fewer were judged)."""
    last = flags[-opts.persist_n :]
    need = opts.persist_k if last.size >= opts.persist_n else last.size // 2 + 1
    return bool(last.sum() >= need)


def _columns(windows: pa.Table | Mapping[str, Any]) -> Mapping[str, Any]:
    pa = sys.modules.get("pyarrow")  # a table can only be one when pyarrow is loaded (rank 0 need not)
    if pa is not None and isinstance(windows, pa.Table):
        out = {}
        for name in windows.column_names:
            col = windows.column(name)
            if pa.types.is_floating(col.type) or col.null_count:
                out[name] = col.cast(pa.float64()).to_numpy(zero_copy_only=False)
            else:
                out[name] = col.to_numpy(zero_copy_only=False)
        return out
    return windows


@dataclasses.dataclass
class WindowGrid:
    """Window summaries pivoted to (rank x window) matrices; NaN where a rank has no judged value."""

    ranks: np.ndarray  # (R,)
    nodes: np.ndarray  # (R,)
    windows: np.ndarray  # (W,)
    first_step: np.ndarray  # (W,)
    last_step: np.ndarray  # (W,)
    metrics: dict[str, np.ndarray]  # STRAGGLER_METRICS -> (R, W)
    device: np.ndarray  # (W,) True where self, wait, forward and backward are on the device clock
    comm_wait: np.ndarray  # (R, W), on the same clock as self-time
    busy: np.ndarray  # (R, W) step less wait (host clock)
    self_host: np.ndarray  # (R, W) self-time on the host clock (what CPU time is compared with)
    cpu: np.ndarray  # (R, W) CPU time of the training thread per step
    host: dict[str, np.ndarray]  # host signals -> (R, W); ``sys_cpu_ns`` is a window mean, the rest medians
    culprit: np.ndarray  # (R, W) steps the rank waited least (offline)
    culprit_known: np.ndarray  # (R, W) steps of the window with a known culprit (offline)
    data_gap: np.ndarray | None = None  # (R, W) share of steps whose data wait is the input gap

    def leave_out(self, row: int, first_step: int, last_step: int) -> None:
        """Every window of rank row ``row`` that overlaps steps ``first_step``-``last_step``, left out of the
        rules as if the rank had not summarised it (NaN in every matrix), in place."""
        cols = (self.first_step <= last_step) & (self.last_step >= first_step)
        for m in (*self.metrics.values(), self.comm_wait, self.busy, self.self_host, self.cpu,
                  *self.host.values(), self.culprit, self.culprit_known, self.data_gap):  # fmt: skip
            if m is not None:
                m[row, cols] = np.nan


def window_grid(windows: pa.Table | Mapping[str, Any] | WindowGrid, opts: DetectionOptions) -> WindowGrid:
    """The window summaries pivoted to rank x window matrices (returned as they are when already
    pivoted, so the rules can share one pivot)."""
    if isinstance(windows, WindowGrid):
        return windows
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

    # The device clock where every rank judged in the window has it (never a mix of clocks).
    host_self, dev_self = pivot(col("self_ns_median"), enough), pivot(col("dev_self_ns_median"), enough)
    has_host, has_dev = ~np.isnan(host_self), ~np.isnan(dev_self)
    device = has_dev.any(axis=0) & ~(has_host & ~has_dev).any(axis=0)

    def clocked(name: str) -> np.ndarray:
        host_col, dev_col = _CLOCKED[name]
        return np.where(device[None, :], pivot(col(dev_col), enough), pivot(col(host_col), enough))

    if "gc_ns_median" in cols:  # the typical step's GC time; rare long pauses are spikes
        gc_per_step = col("gc_ns_median")
    else:  # WINDOW_SCHEMA alone: mean GC time per step
        with np.errstate(invalid="ignore", divide="ignore"):
            gc_per_step = col("gc_ns_sum") / steps
    metrics = {
        "self_ns": clocked("self_ns"),
        "forward_ns": clocked("forward_ns"),
        "backward_ns": clocked("backward_ns"),
        "data_ns": pivot(col("data_ns_median"), enough),
        "launch_ns": pivot(col("launch_ns_median")),  # probe steps are sparse: one sample is a median
        "gc_ns": pivot(gc_per_step, enough),
        # CPU time measures work only where a waiting rank sleeps (gloo, the host clock); on the device
        # clock a rank waiting in a device sync may spin, so there it is not judged
        "cpu_ns": np.where(device[None, :], np.nan, pivot(col("cpu_ns_median"), enough)),
    }
    first = np.full(wins.size, np.iinfo(np.int64).max)
    np.minimum.at(first, wi, np.asarray(cols["first_step"], dtype=np.int64))
    last = np.full(wins.size, np.iinfo(np.int64).min)
    np.maximum.at(last, wi, np.asarray(cols["last_step"], dtype=np.int64))
    host = {
        name: pivot(col(f"{name}_median"), enough)
        for name in ("invol_ctx_switches", "major_faults", "vol_ctx_switches", "minor_faults", "other_ns",
                     "self_run_delay_ns")  # fmt: skip
        if f"{name}_median" in cols
    }
    if "sys_cpu_ns_mean" in cols:
        host["sys_cpu_ns"] = pivot(col("sys_cpu_ns_mean"), enough)
    busy = pivot(col("busy_ns_median"), enough)
    if np.isnan(busy).all() and "step_ns_median" in cols:  # WINDOW_SCHEMA alone
        busy = pivot(col("step_ns_median") - np.nan_to_num(col("comm_wait_ns_median")), enough)
    return WindowGrid(
        ranks, nodes, wins, first, last, metrics, device, clocked("comm_wait_ns"), busy, host_self,
        pivot(col("cpu_ns_median"), enough), host, pivot(col("culprit_steps")), pivot(col("culprit_known")),
        pivot(col("data_gap_share")),
    )  # fmt: skip


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


def cross_rank_outliers(values: np.ndarray, opts: DetectionOptions, floor: float) -> tuple[np.ndarray, ...]:
    """One cross-rank comparison (a single window): the same rule as ``outlier_flags``.

    Returns (flagged, z, ratio to the median, judged) per value; nothing is judged with fewer than
    ``opts.min_ranks`` finite values (the fence of the other ranks needs three of them)."""
    v = np.asarray(values, dtype=np.float64).reshape(-1, 1)
    v = np.where(np.isfinite(v), v, np.nan)
    flags, judged, med = outlier_flags(v, opts, floor)
    z, _, _ = modified_z(v, axis=0, min_mad_rel=opts.min_mad_rel)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(med[None, :] > 0, v / med[None, :], np.nan)
    z = np.where(judged, z, np.nan)
    return flags[:, 0], z[:, 0], ratio[:, 0], judged[:, 0]


def confirmation(
    flags: np.ndarray, judged: np.ndarray, k: int, n: int, beyond: np.ndarray | None = None
) -> tuple[int, int, bool] | None:
    """Persistence of one rank's flags over windows.

    Returns (confirm_window, since_window, active) as window indices, or None when the rank never was an
    outlier in ``k`` of ``n`` consecutive judged windows. ``since_window`` is the first flagged window of
    the run of ``n`` that confirmed it; ``active`` says whether it is still confirmed at its last window.
    ``beyond`` (per window) must also hold at the confirming window (``beyond_floor``).
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
    ok = rolling >= k
    if beyond is not None:
        ok &= beyond[js]
    hits = np.flatnonzero(ok)
    if hits.size == 0:
        return None
    i0 = int(hits[0])
    group = js[max(0, i0 - n + 1) : i0 + 1]
    since = int(group[np.flatnonzero(flags[group])[0]])
    return int(js[i0]), since, bool(rolling[-1] >= k)


def beyond_floor(flags: np.ndarray, judged: np.ndarray, opts: DetectionOptions) -> np.ndarray:
    """(rank x window) True where, counting the windows up to there, the rank was an outlier in more
    windows than the other ranks were: P(Binomial(w_r, q) >= k_r) < ``top_alpha`` / R, with ``q = (K_o
    + 1) / (W_o + 2)`` the other ranks' pooled rate of outlier windows (``K_o`` of ``W_o``, with one
    pseudo-count).

    On a shared host every rank is an outlier in a window now and then (it lost its cores for a
    while); that is the floor the ranks share, and a straggler must stand out from it. Every other rank
    counts in the floor (a trimmed floor would be too low under exchangeable noise), so several slow
    ranks raise each other's floor and need more windows to stand out; a slow node has its own rule.
    With ``top_alpha`` = 0 the test is off (always True)."""
    if opts.top_alpha <= 0:
        return np.ones(flags.shape, dtype=bool)
    f = np.cumsum(flags & judged, axis=1).astype(np.float64)
    w = np.cumsum(judged, axis=1).astype(np.float64)
    ranks = max(int(judged.any(axis=1).sum()), 1)
    out = np.zeros(flags.shape, dtype=bool)
    rows = np.arange(flags.shape[0])
    for r, i in zip(*np.nonzero(flags & judged), strict=True):
        others = (rows != r) & (w[:, i] > 0)
        if not others.any():
            continue
        q = (float(f[others, i].sum()) + 1.0) / (float(w[others, i].sum()) + 2.0)
        out[r, i] = float(binom_sf(f[r, i], w[r, i], q)) < opts.top_alpha / ranks
    # once significant, the count only matters where the rank is flagged again: carry it forward
    return np.maximum.accumulate(out, axis=1)


def majority(material: np.ndarray, judged: np.ndarray, horizon: int) -> np.ndarray:
    """(rank x window) True where the rank was materially slower than the window median in more than
    half of its last ``horizon`` judged windows (up to and including this one).

    Persistence that means what it says: a rank that a busy host starves now and then is an outlier
    in a few windows (three of five, even), but not slower in most of them; a straggler is."""
    out = np.zeros(material.shape, dtype=bool)
    full = judged.all(axis=1)  # the usual case, every window judged: all such ranks at once
    if full.any():
        m = np.concatenate([np.zeros((int(full.sum()), 1), np.int64), np.cumsum(material[full], axis=1)], axis=1)
        i = np.arange(material.shape[1])
        lo = np.maximum(i + 1 - horizon, 0)
        out[full] = 2 * (m[:, i + 1] - m[:, lo]) > (i + 1 - lo)
    for r in np.flatnonzero(~full):
        js = np.flatnonzero(judged[r])
        if js.size == 0:
            continue
        m = np.concatenate(([0], np.cumsum(material[r, js].astype(np.int64))))
        i = np.arange(js.size)
        lo = np.maximum(i + 1 - horizon, 0)
        out[r, js] = 2 * (m[i + 1] - m[lo]) > (i + 1 - lo)
    return out


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


def top_confirmation(
    top: np.ndarray,
    judged: np.ndarray,
    opts: DetectionOptions,
    p_one: np.ndarray | None = None,
    eligible: np.ndarray | None = None,
    gate: np.ndarray | None = None,
) -> tuple[int, int, bool] | None:
    """Rank-order persistence (docs/detection.md): a rank (or node) that is the slowest in so many
    windows that exchangeable ranks would rarely do it, P(Binomial(w, p) >= count) < ``top_alpha`` over
    its first ``w`` judged windows. ``p`` is 1/R (R the ranks judged per window) unless ``p_one`` gives
    each window's chance and ``eligible`` the windows judged. Returns (confirm_window, since_window,
    active)."""
    if opts.top_alpha <= 0:
        return None
    if eligible is None:
        ranks_per_window = judged.sum(axis=0).astype(np.float64)
        eligible = ranks_per_window >= opts.min_ranks
    cols = np.flatnonzero(eligible)
    if cols.size == 0:
        return None
    hits = np.cumsum(top[cols].astype(np.int64))
    w = np.arange(1, cols.size + 1)
    if p_one is None:
        chance = 1.0 / np.cumsum(judged.sum(axis=0)[cols]) * w  # 1 / mean ranks judged so far
    else:
        chance = np.cumsum(p_one[cols]) / w
    pvals = binom_sf(hits, w, chance)
    # Bonferroni over the ranks (or nodes) tested: each gets its share of top_alpha
    tested = max(int((judged.sum(axis=1) > 0).sum()), 1) if p_one is None else 1
    good = (pvals < opts.top_alpha / tested) & (hits >= opts.top_min_windows)
    if gate is not None:
        good &= gate[cols]
    ok = np.flatnonzero(good)
    if ok.size == 0:
        return None
    i0 = int(ok[0])
    since = int(cols[np.flatnonzero(top[cols[: i0 + 1]])[0]])
    return int(cols[i0]), since, _recent(top[cols], opts)

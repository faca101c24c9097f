"""Straggler ranks and nodes: robust outliers per window and metric, persistence, culprit vs victim.

Input is a table of per-window, per-rank summaries (``windows.summarize_windows``, offline or from the
tracer's live aggregation). The rules and their defaults are in docs/detection.md ("Stragglers"); in
short:

* per window and metric, a rank is an outlier when it is SLOW by both the modified z-score
  (median/MAD, > ``z_threshold``) and Tukey's upper fence of the other ranks (Q3 + ``iqr_k`` IQR), and by
  ``min_slowdown`` and a floor in absolute terms (``outlier_flags``, the one cross-rank outlier test).
  Fast ranks are never outliers; a rank without data in a window is not judged there, and a window
  with fewer than ``min_ranks`` reporting ranks is not judged at all;
* a part of the rank's own time (forward, backward, data, GC) counts only in windows where the own time
  itself is materially slower and the part explains at least half of that: a part that grows while the
  self-time stays normal is contention, not a straggler;
* self-time and wait are judged on the device clock where every rank of the window has it, else on the
  host clock, never a mix of the two in one comparison;
* under a synchronous all-reduce every rank's step time is the same, so step time is never judged.
  A rank that, over its flagged windows, waited in the collective longer than the median rank by more
  than it was slow is a victim and is never a straggler;
* a rank is a straggler once it is an outlier in ``k`` of its last ``n`` judged windows, or the slowest
  rank, or the per-step culprit, far more often than exchangeable ranks would be;
* a node whose ranks are all slower than every other rank, by more than the spread within nodes, in
  more windows than chance allows, is a slow node (this works from two nodes up, where half the ranks
  being slow breaks every per-rank test);
* the kind of a slow self-time comes from where the time went: CPU time grew with it (compute) or not
  (host: preempted or blocked).

Why this module is over 500 lines: the rank rule and the node rule share the straggler record and its
evidence (``Straggler``, ``_compute_or_host``, ``_culprit_evidence``); the window grid and the outlier
test they both judge with live in ``outliers.py``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import pyarrow as pa

from hyperacc.analysis.options import METRIC_KIND, STRAGGLER_METRICS, DetectionOptions
from hyperacc.analysis.outliers import (
    _CLOCKED,
    END_WINDOWS,
    WindowGrid,
    _recent,
    beyond_floor,
    confirmation,
    majority,
    outlier_flags,
    slowest_flags,
    top_confirmation,
    window_grid,
)
from hyperacc.analysis.robust import MAD_TO_SIGMA, binom_sf, nan_median

# When a rank is slow on several metrics, one names the kind. A slow launch path lengthens everything the
# host launches (data collation, forward), while a data or compute problem leaves the probe alone, so
# the probe names the kind first; data and GC are parts of the step that explain a slow self-time.
_KIND_PRIORITY: tuple[str, ...] = ("launch_ns", "data_ns", "gc_ns", "self_ns", "forward_ns", "backward_ns", "cpu_ns")
# Parts of the rank's own time, and the whole each must show in: data, forward and backward happen
# before the gradient collective (inside the self-time of either tracer generation); a GC pause can
# happen anywhere, also after the collective, so it must show in the busy time (step less wait).
_PARTS: dict[str, str] = {"forward_ns": "self", "backward_ns": "self", "data_ns": "self", "gc_ns": "busy"}


@dataclasses.dataclass
class Straggler:
    rank: int
    node: int
    kind: str  # compute | page_faults | data | launch | gc | host | host_work | unknown (a gap neither work nor waiting shows) | node
    metric: str  # self_ns | forward_ns | backward_ns | data_ns | launch_ns | gc_ns
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
    rule: str = "outlier"  # what confirmed it: outlier | rank_order | culprit | node
    clock: str = "host"  # host | device: the clock of the judged self-time and wait
    kind_basis: str = "metric"  # cpu_time | sys_cpu_time | device_clock | major_faults | wall_time_only | metric
    cpu_share: float | None = None  # CPU time excess / self-time excess over the flagged windows
    windows_since: int = 0  # judged windows from since_step to its last judged window
    culprit_steps: int | None = None  # steps of the flagged windows in which it waited least (offline)
    culprit_known: int | None = None  # steps of the flagged windows with a known culprit
    culprit_expected: float | None = None  # the share an exchangeable rank would have (1 / ranks)
    node_ratio: float | None = None  # slow node: its median self-time / the other nodes', flagged windows
    node_baseline_ratio: float | None = None  # the same in the node's first judged windows (its baseline)
    gc_ns: float | None = None  # its typical GC time per step over the flagged windows
    cluster_gc_ns: float | None = None  # the cluster median of the same
    between_steps: bool = False  # judged on the input gap of a loop without a DataLoader
    # a host straggler that blocked off its CPU: its voluntary context switches per step over the cluster
    # median, median over the flagged windows, where at least one (it waits: a read, a lock, a sleep)
    blocked_per_step: float | None = None
    # kind page_faults: its CPU time in the kernel and its minor page faults per step over the flagged
    # windows, and the cluster medians of the same
    sys_cpu_ns: float | None = None
    cluster_sys_cpu_ns: float | None = None
    minor_faults: float | None = None
    cluster_minor_faults: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def detect_stragglers(windows: pa.Table | Mapping[str, Any] | WindowGrid, opts: DetectionOptions) -> list[Straggler]:
    """Confirmed stragglers from window summaries, at most one entry per rank (docs/detection.md).

    ``active`` says whether each is still confirmed at its last judged window: the diagnosis calls the
    active ones stragglers and the others episodes (slow for a while, then recovered). ``windows`` may
    be the summaries already pivoted (``outliers.window_grid``), which this does not change."""
    grid = window_grid(windows, opts)
    if grid.ranks.size == 0 or grid.windows.size == 0:
        return []
    found: dict[int, dict[str, tuple]] = {}
    med_comm = _cluster_median(grid.comm_wait)
    wholes = {"self": grid.metrics["self_ns"], "busy": grid.busy}
    whole_med = {k: _cluster_median(v) for k, v in wholes.items()}
    for metric in STRAGGLER_METRICS:
        values = grid.metrics[metric]
        if np.isnan(values).all():
            continue
        floor = opts.launch_floor_ns if metric == "launch_ns" else opts.floor_ns
        part = _PARTS.get(metric)
        flags, judged, med = outlier_flags(values, opts, floor, whole_med[part] if part else None)
        if part:
            flags &= _shows_in_whole(values - med[None, :], wholes[part], whole_med[part], opts)
        top = slowest_flags(values, judged, med, opts, floor) if metric == "self_ns" else None
        with np.errstate(invalid="ignore"):
            above = (values - med[None, :] >= floor) & (values >= med[None, :] * (1 + opts.min_slowdown))
        mostly = majority(judged & above, judged, 2 * opts.persist_n)
        beyond = beyond_floor(flags, judged, opts) & mostly
        # a rule can confirm only a rank flagged in some window: an outlier, the slowest, or (with a
        # culprit record) materially above the median; the others are not tried
        candidates = flags.any(axis=1)
        if top is not None:
            candidates |= top.any(axis=1)
            if (grid.culprit_known > 0).any():
                candidates |= above.any(axis=1)
        for r in np.flatnonzero(candidates):
            chosen = None
            for rule in ("outlier", "rank_order", "culprit"):
                if rule == "outlier":
                    conf = confirmation(flags[r], judged[r], opts.persist_k, opts.persist_n, beyond[r])
                    rank_flags = flags[r]
                elif rule == "rank_order" and top is not None:
                    conf, rank_flags = top_confirmation(top[r], judged, opts, gate=mostly[r]), top[r]
                elif rule == "culprit" and metric == "self_ns":
                    conf, rank_flags = _culprit_confirmation(grid, r, judged, med, opts, floor)
                else:
                    continue
                chosen = _better(chosen, conf, rank_flags, rule, mostly[r], judged[r], above[r])
                if chosen is not None and chosen[0][2]:
                    break
            if chosen is None:
                continue
            conf, rank_flags, rule = chosen
            # A victim: it waited longer than the median rank, so nobody waited for it. (Not asked of the
            # launch probe, timed outside the step, nor of CPU time: a rank waiting at a collective
            # sleeps, so more CPU time is more work, whatever the noisy waits say.)
            if metric not in ("launch_ns", "cpu_ns") and _waits_more(
                grid.comm_wait[r], med_comm, rank_flags, values[r] - med
            ):
                continue
            # Nor is a rank the job did not wait for: with a per-step culprit record (offline), it
            # arrived last in its flagged windows no more often than an exchangeable rank would.
            if metric not in ("launch_ns", "cpu_ns") and not _waited_for(grid, r, rank_flags, judged, opts):
                continue
            found.setdefault(int(r), {})[metric] = (conf, rank_flags, judged[r], values[r], med, rule)
    _drop_hidden(found, grid)
    out = [_straggler(grid, r, per_metric, med_comm, opts) for r, per_metric in sorted(found.items())]
    _slow_nodes(out, grid, opts, med_comm)
    _group_by_node(out, grid, opts)
    return out


def _better(chosen: tuple | None, conf: tuple | None, flags: np.ndarray, rule: str, mostly: np.ndarray,
            judged: np.ndarray, above: np.ndarray) -> tuple | None:
    """The rules in order: the first that still confirms the rank at its last window wins, else the first
    that confirmed it at all (an episode). "Still" includes being slower than the median in most of its
    recent windows at its last judged window, and materially slower in at least one of its last
    ``END_WINDOWS`` judged windows: persistent means what it says, and a rank the host starved for a
    stretch of the run that is back to the median at its end has recovered."""
    if conf is None:
        return chosen
    last = np.flatnonzero(judged)
    still = bool(last.size and mostly[last[-1]] and above[last[-END_WINDOWS:]].any())
    conf = (conf[0], conf[1], bool(conf[2] and still))
    if chosen is None or (conf[2] and not chosen[0][2]):
        return (conf, flags, rule)
    return chosen


def judged_windows(windows: pa.Table | Mapping[str, Any] | WindowGrid, opts: DetectionOptions) -> int:
    """Windows in which at least ``min_ranks`` ranks had a judged self-time (or, without self-time,
    any judged metric): how much of the run the straggler rules could see."""
    grid = window_grid(windows, opts)
    if grid.ranks.size == 0:
        return 0
    best = 0
    for metric in ("self_ns", *STRAGGLER_METRICS):
        present = ~np.isnan(grid.metrics[metric])
        best = max(best, int((present.sum(axis=0) >= opts.min_ranks).sum()))
        if metric == "self_ns" and best:
            return best
    return best


def _straggler(
    grid: WindowGrid, r: int, per_metric: dict[str, tuple], med_comm: np.ndarray, opts: DetectionOptions
) -> Straggler:
    # the kind comes from the metrics still confirmed at the end, when there are any
    active = [m for m in _KIND_PRIORITY if m in per_metric and per_metric[m][0][2]]
    metric = active[0] if active else next(m for m in _KIND_PRIORITY if m in per_metric)
    (confirm_w, since_w, active), flags, judged, values, med, rule = per_metric[metric]
    fw = np.flatnonzero(flags)
    self_vals = grid.metrics["self_ns"]
    self_med = _cluster_median(self_vals)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = values[fw] / med[fw]
        self_ratio = self_vals[r, fw] / self_med[fw]
    kind = METRIC_KIND[metric]
    basis, cpu_share = "metric", None
    blocked = _blocked(grid, r, fw)
    if metric == "launch_ns" and _gc_heavy(grid, r, fw, opts):
        kind = "gc"  # the collector lengthens everything the host does, the probe included
    elif metric == "cpu_ns":  # it spends more CPU time per step: it computes more
        basis = "cpu_time"
    elif kind == "compute":
        kind, basis, cpu_share = _compute_or_host(grid, r, fw, opts, blocked)
    gap_wait = False  # a self-time excess held by the input gap of a loop without a DataLoader
    working = kind == "compute" and basis == "cpu_time"
    if (metric == "self_ns" and kind == "host" or working) and _held_by_input(grid, r, fw, opts):
        # Off its CPU, in its input wait: named as the data rule names it (which confirms the same rank
        # on ``data_ns`` a window or more later, its part test being stricter): not "host" first.
        # Working, in its input fetch: it loads or preprocesses its input on the training thread (a
        # DataLoader with num_workers=0 on that rank, here 2.26x the CPU time of ranks with a worker
        # each, was told a compute straggler: "it computes more"), its compute phases no slower.
        gap_wait = _in_gap(grid, r, fw)
        if gap_wait:
            kind, basis, cpu_share = _between_steps(grid, r, fw, opts)
        else:
            kind, basis = "data", "input_fetch"
            # its CPU time's excess over its input time's (held above ``floor_ns``, so never over zero)
            cpu_share = _finite_or_none(float(_excess(grid.cpu, r, fw) / _excess(grid.metrics["data_ns"], r, fw))) if working else None
    if kind == "compute" and basis == "cpu_time" and _kernel_paging(grid, r, fw, opts):
        kind, basis = "page_faults", "sys_cpu_time"
    elif metric == "data_ns" and _in_gap(grid, r, fw):
        kind, basis, cpu_share = _between_steps(grid, r, fw, opts)
    elif kind == "compute" and basis == "cpu_time" and metric == "self_ns":
        outside = _worked_outside(grid, r, fw, opts)
        if outside is not None:
            kind, basis, cpu_share = "host_work", "outside_phases", outside
    judged_since = np.flatnonzero(judged)
    judged_since = judged_since[judged_since >= since_w]
    s = Straggler(
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
        rule=rule,
        clock="device" if metric in _CLOCKED and grid.device[fw].all() else "host",
        kind_basis=basis,
        cpu_share=cpu_share,
        windows_since=int(judged_since.size),
    )
    _culprit_evidence(s, grid, r, fw)
    gc = grid.metrics["gc_ns"]
    if fw.size and not np.isnan(gc[r, fw]).all():
        s.gc_ns = _finite_or_none(nan_median(gc[r, fw]))
        s.cluster_gc_ns = _finite_or_none(nan_median(nan_median(gc[:, fw], axis=0)))
    s.between_steps = (metric == "data_ns" and _in_gap(grid, r, fw)) or basis == "outside_phases" or gap_wait
    if kind == "host":
        s.blocked_per_step = blocked
    if kind == "page_faults":
        for name in ("sys_cpu_ns", "minor_faults"):
            v = grid.host[name]
            setattr(s, name, _finite_or_none(nan_median(v[r, fw])))
            setattr(s, f"cluster_{name}", _finite_or_none(nan_median(nan_median(v[:, fw], axis=0))))
    return s


def _blocked(grid: WindowGrid, r: int, fw: np.ndarray) -> float | None:
    """How many more times per step than the cluster median row ``r`` blocked off its CPU (voluntary
    context switches) over its flagged windows ``fw``, when at least once; else None (not measured, or
    not more: preempted). A slow rank arrives last at the collective and waits less there, so the
    collective's own switches can only lower its count (docs/detection.md, "Kind")."""
    vol = grid.host.get("vol_ctx_switches")
    return None if vol is None else blocked_rise(vol[:, fw], r)


def switch_rise(vol: np.ndarray, r: int) -> float | None:
    """How many more times per step than the cluster median row ``r`` of ``vol`` (rank x column:
    voluntary context switches per step) blocked off its CPU, median over the columns (a fraction or
    below zero too); None where not measured."""
    if not vol.shape[1] or np.isnan(vol[r]).all():
        return None
    rise = nan_median(vol[r] - nan_median(vol, axis=0))
    return float(rise) if np.isfinite(rise) else None


def blocked_rise(vol: np.ndarray, r: int) -> float | None:
    """``switch_rise`` when at least once a step; else None (not measured, or not more: preempted)."""
    rise = switch_rise(vol, r)
    return rise if rise is not None and rise >= 1.0 else None


def _shows_in_whole(
    part_excess: np.ndarray, whole: np.ndarray, whole_med: np.ndarray, opts: DetectionOptions
) -> np.ndarray:
    """(rank x window) True where the rank's own time (the whole the part belongs to) is materially
    above the cluster median too, and the part explains at least ``explain_share`` of that excess.

    A part that grows while the whole stays normal is not a straggler: the DDP backward measured to the
    last bucket launch picks up contention in the collective, a slower forward can be offset elsewhere.
    Where the whole was not measured the part is not held back (there is nothing to check it with)."""
    with np.errstate(invalid="ignore"):
        ex = whole - whole_med[None, :]
        material = (ex >= opts.floor_ns) & (ex >= opts.min_slowdown * whole_med[None, :])
        explains = part_excess >= opts.explain_share * ex
        ok = material & explains
    return np.where(np.isnan(whole), True, ok)


def _kernel_paging(grid: WindowGrid, r: int, fw: np.ndarray, opts: DetectionOptions) -> bool:
    """``kernel_paging`` over the rank's flagged windows ``fw`` (False where not recorded)."""
    sys_time, faults = grid.host.get("sys_cpu_ns"), grid.host.get("minor_faults")
    if sys_time is None or faults is None or not fw.size:
        return False
    return kernel_paging(grid.cpu[:, fw], sys_time[:, fw], faults[:, fw], r, opts)


def kernel_paging(cpu: np.ndarray, sys_time: np.ndarray, faults: np.ndarray, r: int, opts: DetectionOptions) -> bool:
    """The rank's extra CPU time is the kernel's, faulting in fresh pages (docs/detection.md, "Kind").

    ``cpu``, ``sys_time``, ``faults``: (rank x column) CPU time, its part in the kernel (window means)
    and minor page faults per step, over the columns in which row ``r`` was slow. True when the rank's
    system time over the cluster median accounts for ``explain_share`` of its CPU time over it, and it
    took more page faults per step than every other rank in most of the columns: the same work at a
    higher cost, paid in the kernel for memory that its allocator returned and mapped again. "Every other
    rank" leaves out the other ranks that are paging so themselves (materially slower in CPU time, most of
    it in the kernel): two such ranks do not hide each other's faults."""
    ok = ~np.isnan(cpu[r]) & ~np.isnan(sys_time[r]) & ~np.isnan(faults[r])
    if not ok.any():
        return False
    with np.errstate(all="ignore"):
        cpu_med = nan_median(cpu[:, ok], axis=0)
        cpu_ex = nan_median(cpu[:, ok] - cpu_med, axis=1)  # every rank's CPU time over the cluster median
        # the system time is sampled by the kernel's tick (a step holds 0 or 4 ms of it here): a few ticks a
        # column, a skewed count whose median across columns lies under its mean, so the mean is taken
        over = sys_time[:, ok] - nan_median(sys_time[:, ok], axis=0)
        seen = np.isfinite(over).sum(axis=1)  # (a rank with none: NaN, without numpy's empty-slice warning)
        sys_ex = np.where(seen > 0, np.nansum(over, axis=1) / np.maximum(seen, 1), np.nan)
        base = nan_median(cpu_med)
    # materially slower in CPU time, most of it in the kernel: the part-and-whole test of the phases
    paging = _shows_in_whole(sys_ex[:, None], (base + cpu_ex)[:, None], np.array([base]), opts)[:, 0]
    paging &= np.isfinite(cpu_ex)
    keep = ~paging
    keep[r] = False
    others = faults[keep][:, ok]
    if not others.shape[0] or np.isnan(others).all(axis=0).any():
        return False
    above = faults[r, ok] > np.nanmax(others, axis=0)
    return bool(cpu_ex[r] > 0 and sys_ex[r] >= opts.explain_share * cpu_ex[r] and above.sum() * 2 > above.size)


def _compute_or_host(
    grid: WindowGrid, r: int, fw: np.ndarray, opts: DetectionOptions, blocked: float | None
) -> tuple[str, str, float | None]:
    """The kind of a slow own time over the rank's flagged windows ``fw``: ``compute_or_host``
    (``blocked``: ``_blocked`` of the same windows)."""
    faults = grid.host.get("major_faults")
    fault_flags = None
    if faults is not None:
        flags, judged, _ = outlier_flags(faults, opts, floor=1.0)
        fault_flags = np.where(judged[r, fw], flags[r, fw], np.nan)
    on_device = bool(fw.size and grid.device[fw].all())
    delay, other = grid.host.get("self_run_delay_ns"), grid.host.get("other_ns")
    # the time outside the forward, backward and optimizer step: the input wait and the rest
    outside = None if other is None else np.nan_to_num(grid.metrics["data_ns"][:, fw]) + other[:, fw]
    vol = grid.host.get("vol_ctx_switches")
    switches = None if vol is None else switch_rise(vol[:, fw], r)
    return compute_or_host(grid.cpu[:, fw], grid.self_host[:, fw], r, opts, on_device=on_device,
                           fault_flags=fault_flags, blocked=blocked,
                           delay=delay[:, fw] if delay is not None else None, outside=outside,
                           switches=switches)  # fmt: skip


def compute_or_host(
    cpu: np.ndarray, wall: np.ndarray, r: int, opts: DetectionOptions, *, on_device: bool = False,
    fault_flags: np.ndarray | None = None, blocked: float | None = None, delay: np.ndarray | None = None,
    outside: np.ndarray | None = None, switches: float | None = None,
) -> tuple[str, str, float | None]:
    """The kind of a slow own time: (kind, basis, cpu share). docs/detection.md, "Kind".

    ``cpu`` and ``wall``: (rank x column) CPU time and host-clock self-time over the columns in which
    row ``r`` was slow (flagged windows of a straggler, blocks of an episode). ``fault_flags``: per
    column, 1 where the rank's major faults were an outlier, 0 where not, NaN where not judged.
    ``blocked``: how many more times per step than the others the rank blocked off its CPU there
    (``blocked_rise``), or None. A thread that blocks pays on waking what a preempted one pays (caches
    refilled), so CPU time grown by more than preemption costs says more work only where it did not.

    On the device clock it is the device's work (compute). On the host clock, the training thread's
    CPU time tells more work (CPU time grew by more than preemption costs, ``preempt_overhead`` of the
    wall time lost, or by ``explain_share`` of the wall-time excess taken against the share of wall time
    the other ranks got to run) from preemption or blocking (wall time grew, CPU time did not: host). Without CPU time, major page faults
    in most flagged windows say host; anything else is compute, and says it was judged on wall time.

    ``delay``: (rank x column) run-queue delay within the self-time (``self_run_delay_ns``), and
    ``outside``: the time outside the forward, backward and optimizer step (input wait and the rest), or
    None. Within those phases, host needs the wall time's excess that CPU time does not hold to be spent
    off the CPU: blocked more, or waiting for a CPU (``explain_share`` of it in run-queue delay). A rank
    whose excess lies in them and that did neither was not preempted: its CPU time missed its work,
    which happens where ranks spend different CPU time inside their collectives (a pipeline's stages:
    one send and receive a micro-batch at the ends, two inside); the kind is compute, basis
    ``not_preempted``. Outside them a wait can hide from the switch counts (a sleep's one switch among a
    DataLoader's tens of queue waits), so there it stays host. ``switches``: row ``r``'s median voluntary
    switches per step over the others' (unthresholded: ``blocked`` counts a rise of one or more); "did
    not block" needs it measured and not above zero, since a wait of one step blocks once a step and,
    over windows the rank was slow in only partly, the median rise is a fraction of one."""
    if on_device:
        return "compute", "device_clock", None
    ok = ~np.isnan(cpu[r]) & ~np.isnan(wall[r])
    if ok.sum() and (~np.isnan(cpu)).sum(axis=0)[ok].min() >= opts.min_ranks:
        cpu_ex = nan_median((cpu[r] - nan_median(cpu, axis=0))[ok])
        wall_ex = nan_median((wall[r] - nan_median(wall, axis=0))[ok])
        # On a shared host every rank runs for only a part of its wall time; more work lengthens the
        # wall time by the work divided by that part, so the share is taken against it.
        with np.errstate(invalid="ignore", divide="ignore"):
            others = np.delete(np.arange(cpu.shape[0]), r)
            runs = float(np.clip(nan_median((cpu[others] / wall[others])[:, ok]), 0.05, 1.0))
        if np.isfinite(wall_ex) and wall_ex > 0 and np.isfinite(runs):
            share = float(cpu_ex / wall_ex / runs)
            # CPU time that grew by more than preemption itself costs (context switches, caches refilled:
            # preempt_overhead of the wall time lost) is more work, even when the wall time grew more
            # still: a rank that computes more is also preempted more on a contended host.
            grew = bool(cpu_ex >= opts.floor_ns and cpu_ex >= opts.preempt_overhead * wall_ex and blocked is None)
            if grew or share >= opts.explain_share:
                return "compute", "cpu_time", share
            unblocked = blocked is None and switches is not None and switches <= 0
            if unblocked and _not_preempted(delay, outside, r, ok, wall_ex - max(cpu_ex, 0.0), opts):
                return "compute", "not_preempted", share
            return "host", "cpu_time", share
    if fault_flags is not None:
        seen = ~np.isnan(fault_flags)
        if seen.sum() and np.nansum(fault_flags) > seen.sum() / 2:
            return "host", "major_faults", None
    return "compute", "wall_time_only", None


def _not_preempted(delay: np.ndarray | None, outside: np.ndarray | None, r: int, ok: np.ndarray, off_cpu: float,
                   opts: DetectionOptions) -> bool:  # fmt: skip
    """Whether ``off_cpu``, row ``r``'s wall time its CPU time does not hold, lies in its timed compute
    phases (its excess ``outside`` them under ``explain_share`` of it) and its run-queue delay (``delay``)
    rose over the other ranks' by less than ``explain_share`` of it, medians over the columns ``ok``;
    False where either was not measured on enough ranks."""
    cols = np.flatnonzero(ok)
    for values in (delay, outside):
        if values is None or np.isnan(values[r, cols]).all() or (~np.isnan(values[:, cols])).sum(axis=0).min() < opts.min_ranks:
            return False
    rises = [_excess(values, r, cols) for values in (delay, outside)]
    return bool(all(np.isfinite(x) and x < opts.explain_share * off_cpu for x in rises))


def _in_gap(grid: WindowGrid, r: int, fw: np.ndarray) -> bool:
    """Most of the rank's flagged windows are of a loop without a DataLoader: its data wait is the gap
    between the optimizer step and the next forward."""
    if grid.data_gap is None or fw.size == 0:
        return False
    share = grid.data_gap[r, fw]
    return bool(np.isfinite(share).any() and nan_median(share) > 0.5)


def _worked_outside(grid: WindowGrid, r: int, fw: np.ndarray, opts: DetectionOptions) -> float | None:
    """A compute straggler whose excess lies outside its timed phases (a loop with a DataLoader: the
    rank's own code between them, such as a trainer's callbacks): over its flagged windows, its time
    outside every timed phase (``other_ns``) exceeds the cluster median's by at least ``explain_share``
    of its self-time's excess, and by ``floor_ns``. Returns its CPU time's excess as a share of that
    time's, or None (docs/detection.md, "The work between steps"; the episodes' ``worked_outside``)."""
    other = grid.host.get("other_ns")
    if other is None or fw.size == 0 or grid.device[fw].any() or not np.isfinite(other[r, fw]).any():
        return None  # on the device clock the time outside the phases holds the waits for the device
    with np.errstate(all="ignore"):
        ex_other = _excess(other, r, fw)
        ex_self = _excess(grid.self_host, r, fw)
        ex_cpu = _excess(grid.cpu, r, fw)
    if not held_outside(ex_other, ex_self, opts):
        return None
    return float(ex_cpu / ex_other) if np.isfinite(ex_cpu) else None


def _excess(values: np.ndarray, r: int, fw: np.ndarray) -> float:
    """Row ``r``'s median excess over the cluster median of ``values`` (rank x window) across the windows
    ``fw``."""
    return nan_median(values[r, fw] - _cluster_median(values[:, fw]))


def _held_by_input(grid: WindowGrid, r: int, fw: np.ndarray, opts: DetectionOptions) -> bool:
    """Over row ``r``'s flagged windows, its data wait's excess over the cluster median holds its
    self-time's (``held_outside``'s test: at least ``explain_share`` of it and ``floor_ns``). Live, a
    rank whose DataLoader workers slowed was told "host straggler: self-time 3.94x" and a window later
    "data straggler (was: host)"."""
    if fw.size == 0 or grid.device[fw].any():
        return False
    data = grid.metrics["data_ns"]
    if not np.isfinite(data[r, fw]).any():
        return False
    with np.errstate(all="ignore"):
        ex_data = _excess(data, r, fw)
        ex_self = _excess(grid.self_host, r, fw)
    return held_outside(ex_data, ex_self, opts)


def held_outside(other: float, self_time: float, opts: DetectionOptions) -> bool:
    """An excess (or growth) of a rank's self-time that its time outside every timed phase holds: that
    time's is at least ``explain_share`` of the self-time's and at least ``floor_ns`` (the one test of
    the straggler and episode rules on ``other_ns``, and of a self-time straggler's input wait,
    ``_held_by_input``; docs/detection.md, "The work between steps" and "Kind")."""
    return bool(np.isfinite(other) and np.isfinite(self_time) and self_time > 0
                and other >= opts.floor_ns and other >= opts.explain_share * self_time)  # fmt: skip


def _between_steps(
    grid: WindowGrid, r: int, fw: np.ndarray, opts: DetectionOptions
) -> tuple[str, str, float | None]:
    """The kind of a slow input gap (a loop without a DataLoader): gc, host_work, data or unknown, by the rule of
    ``attribution.gap_causes`` on the medians over the flagged windows of the gap's, the GC time's and
    the CPU time's excess over the cluster median and, as the noise bar, the other ranks' spread of
    CPU time (docs/detection.md, "The work between steps").
    Returns (kind, basis, CPU share of the gap's excess)."""
    from hyperacc.analysis.attribution import gap_causes

    gap = grid.metrics["data_ns"][:, fw]
    gap_ex = nan_median(gap[r] - nan_median(gap, axis=0))
    gc = grid.metrics["gc_ns"][:, fw]
    gc_ex = nan_median(gc[r] - nan_median(gc, axis=0)) if not np.isnan(gc[r]).all() else 0.0
    cpu = grid.cpu[:, fw]
    if np.isnan(cpu[r]).all() or not np.isfinite(gap_ex):
        return "data", "metric", None  # no CPU time: nothing tells work from waiting
    cpu_ex = nan_median(cpu[r] - nan_median(cpu, axis=0))
    others = np.delete(np.arange(cpu.shape[0]), r)

    def noise(v: np.ndarray) -> np.ndarray:  # the other ranks' spread, as robust deviations
        with np.errstate(invalid="ignore"):
            mad = nan_median(np.abs(v[others] - nan_median(v[others], axis=0)))
        return np.array([opts.signal_z * MAD_TO_SIGMA * np.nan_to_num(mad)])

    kind = str(gap_causes(np.array([gap_ex]), np.array([gc_ex]), np.array([cpu_ex]), noise(gc), noise(cpu), opts)[0])
    share = float(cpu_ex / gap_ex) if gap_ex > 0 and np.isfinite(cpu_ex) else None
    return kind, ("off_cpu" if kind == "data" else "cpu_time"), share


def _gc_heavy(grid: WindowGrid, r: int, fw: np.ndarray, opts: DetectionOptions) -> bool:
    """The rank's typical GC time per step is materially above the cluster's (``floor_ns`` and
    ``min_slowdown`` of the median busy time) in most of the windows around its flagged ones."""
    gc = grid.metrics["gc_ns"]
    if fw.size == 0 or np.isnan(gc[r]).all():
        return False
    with np.errstate(invalid="ignore"):
        excess = gc[r] - nan_median(gc, axis=0)
        material = (excess >= opts.floor_ns) & (excess >= opts.min_slowdown * nan_median(grid.busy, axis=0))
    seen = ~np.isnan(gc[r])
    return bool(seen.any() and 2 * material[seen].sum() > seen.sum())


def _culprit_confirmation(
    grid: WindowGrid, r: int, judged: np.ndarray, med: np.ndarray, opts: DetectionOptions, floor: float
) -> tuple[tuple[int, int, bool] | None, np.ndarray]:
    """The per-step culprit record (offline): the rank waited least in the collective in far more steps
    than an exchangeable rank would, P(Binomial(n, 1/R) >= c) < ``top_alpha`` / R and at least twice
    the chance share, and its self-time was materially above the median in most of its judged windows.

    Steps are many where windows are few, so this confirms a straggler in a run too short for the
    window rules; where no culprit record exists (live, or no collective timed) it confirms nothing."""
    none = (None, np.zeros(judged.shape[1], dtype=bool))
    if opts.top_alpha <= 0:
        return none
    cols = np.flatnonzero(judged[r] & (judged.sum(axis=0) >= opts.min_ranks))
    known = grid.culprit_known[r, cols]
    ok = ~np.isnan(known) & (known > 0)
    cols = cols[ok]
    if cols.size < 2:
        return none
    n = float(np.nansum(grid.culprit_known[r, cols]))
    c = float(np.nansum(grid.culprit[r, cols]))
    ranks = float(judged[:, cols].sum(axis=0).mean())
    p0 = 1.0 / ranks
    if n <= 0 or c < 2 * p0 * n or float(binom_sf(c, n, p0)) >= opts.top_alpha / ranks:
        return none
    values = grid.metrics["self_ns"][r, cols]
    with np.errstate(invalid="ignore"):
        ex = values - med[cols]
        material = (ex >= floor) & (values >= med[cols] * (1.0 + opts.min_slowdown))
    if material.sum() * 2 <= cols.size:
        return none
    flags = np.zeros(judged.shape[1], dtype=bool)
    flags[cols[material]] = True
    return (int(cols[-1]), int(cols[material][0]), _recent(material, opts)), flags


def _waited_for(grid: WindowGrid, r: int, flags: np.ndarray, judged: np.ndarray, opts: DetectionOptions) -> bool:
    """Over row ``r``'s flagged windows with a culprit record, it arrived last (waited least) in ``c`` of
    ``n`` steps with ``P(Binomial(n, 1/R) >= c) < top_alpha / R``; True where there is no record (live,
    or no collective timed) or the count tests are off. A rank a loaded host slowed by 1.3x in self-time
    in all 6 windows of a clean run was last in 31 % of its steps (25 % by chance): its excess was not
    on the job's path; the faulty ranks of the recordings were last in 72-99 %."""
    cols = np.flatnonzero(flags)
    if opts.top_alpha <= 0 or not cols.size:
        return True
    known = grid.culprit_known[r, cols]
    ok = ~np.isnan(known) & (known > 0)
    if not ok.any():
        return True
    n = float(np.sum(known[ok]))
    c = float(np.nansum(grid.culprit[r, cols[ok]]))
    ranks = max(float(judged[:, cols[ok]].sum(axis=0).mean()), 1.0)
    return bool(float(binom_sf(c, n, 1.0 / ranks)) < opts.top_alpha / ranks)


def _drop_hidden(found: dict[int, dict[str, tuple]], grid: WindowGrid) -> None:
    """Where no per-step culprit record exists (live), a rank found slow in some metric that, over the
    windows it was flagged in, waited in the collective longer than another rank found here by more than
    it was slow, is left out of that metric: the job waited for the other one, and this one's slowness was
    hidden in its wait (``_waits_more`` against that rank instead of the median rank). Live, a rank that
    shared a core with a rank spinning between its steps was told a "host straggler: backward time 1.27x"
    beside it (it waited 21.7 ms a step, the spinning rank 13.0 ms, its backward 0.9 ms slower); offline,
    the culprit record (``_waited_for``) left it out."""
    for r in list(found):
        if (np.nan_to_num(grid.culprit_known[r]) > 0).any():
            continue  # the culprit record decides (offline)
        for metric, (_, flags, _, values, med, _) in list(found[r].items()):
            if metric in ("launch_ns", "cpu_ns"):
                continue  # as for ``_waits_more``: timed outside the step, or work whatever the waits say
            if any(_waits_more(grid.comm_wait[r], grid.comm_wait[o], flags, values - med) for o in found if o != r):
                del found[r][metric]
        if not found[r]:
            del found[r]


def _culprit_evidence(s: Straggler, grid: WindowGrid, r: int, fw: np.ndarray) -> None:
    known = grid.culprit_known[r, fw]
    if fw.size == 0 or np.isnan(known).all() or np.nansum(known) <= 0:
        return
    s.culprit_known = int(np.nansum(known))
    s.culprit_steps = int(np.nansum(grid.culprit[r, fw]))
    judged = ~np.isnan(grid.metrics["self_ns"][:, fw])
    s.culprit_expected = float(1.0 / max(judged.sum(axis=0).mean(), 1.0))


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


def node_flags(
    grid: WindowGrid, opts: DetectionOptions, metric: str = "self_ns"
) -> tuple[dict[int, np.ndarray], np.ndarray, dict]:
    """Per node and window: every judged rank of the node (two or more) is slower than every other
    judged rank (full separation: the gap between the groups exceeds all the spread within them), and
    the gap between the node's median self-time and the rest's is material (``floor_ns`` and
    ``min_slowdown``). Returns ({node: flags (W,)}, judged (W,), {node: chance per window}): among
    exchangeable ranks, whatever their noise, a given group of m of R ranks holds the m slowest values
    with chance 1 / C(R, m), which the persistence test uses. Only a node that holds some window's
    slowest rank is tested (and has a chance); every other node's flags are all false. ``metric``:
    self-time, or CPU time (a node whose ranks all compute more, where a busy host hides it in wall
    time)."""
    values = grid.metrics[metric]
    present = ~np.isnan(values)
    node_ids, node_of = np.unique(grid.nodes, return_inverse=True)
    out: dict[int, np.ndarray] = {}
    chance: dict[int, np.ndarray] = {}
    judged = present.sum(axis=0) >= opts.min_ranks
    if node_ids.size < 2:
        return out, judged, chance
    n_w = values.shape[1]
    # Only a node that holds a window's slowest rank can be fully separated in it: the others are not
    # tested (at thousands of ranks, testing every node against the rest costs nodes x ranks).
    top = np.argmax(np.where(present, values, -np.inf), axis=0)
    leaders = {int(grid.nodes[r]) for w, r in enumerate(top) if present[r, w]}
    total = present.sum(axis=0)
    for n in node_ids:
        out[int(n)] = np.zeros(n_w, dtype=bool)
    for i in np.flatnonzero(np.isin(node_ids, list(leaders))):
        n = int(node_ids[i])
        sel = node_of == i
        m = present[sel].sum(axis=0)
        rest = present & ~sel[:, None]
        with np.errstate(invalid="ignore"):
            lo = np.where(present[sel], values[sel], np.inf).min(axis=0)
            hi = np.where(rest, values, -np.inf).max(axis=0)
            rest_med = nan_median(np.where(rest, values, np.nan), axis=0)
            gap = nan_median(values[sel], axis=0) - rest_med
            ok = (m >= 2) & (rest.sum(axis=0) >= 2) & judged & (lo > hi)
            ok &= (gap >= opts.floor_ns) & (gap >= opts.min_slowdown * rest_med)
        out[n] = ok
        chance[n] = np.array(
            [1.0 / math.comb(int(t), int(k)) if t >= k >= 1 else 1.0 for t, k in zip(total, m, strict=True)]
        )
    return out, judged, chance


def _slow_nodes(out: list[Straggler], grid: WindowGrid, opts: DetectionOptions, med_comm: np.ndarray) -> None:
    """Adds (or re-kinds) the ranks of each slow node (docs/detection.md, "Slow nodes"): on self-time,
    else on CPU time."""
    done: set[int] = set()
    for metric in ("self_ns", "cpu_ns"):
        if not np.isnan(grid.metrics[metric]).all():
            done |= _slow_nodes_on(out, grid, opts, med_comm, metric, done)


def _slow_nodes_on(
    out: list[Straggler], grid: WindowGrid, opts: DetectionOptions, med_comm: np.ndarray, metric: str,
    done: set[int],
) -> set[int]:  # fmt: skip
    flags, judged, chance = node_flags(grid, opts, metric)
    by_rank = {s.rank: s for s in out}
    self_vals = grid.metrics[metric]
    self_med = _cluster_median(self_vals)
    confirmed: set[int] = set()
    for node, f in flags.items():
        if not f.any() or node in done:
            continue
        js = np.flatnonzero(judged)
        mostly = np.zeros(f.shape, dtype=bool)
        mostly[js] = majority(f[js][None, :], np.ones((1, js.size), dtype=bool), 2 * opts.persist_n)[0]
        node_opts = dataclasses.replace(opts, top_alpha=opts.top_alpha / len(flags))  # Bonferroni over nodes
        conf = top_confirmation(f, None, opts=node_opts, p_one=chance[node], eligible=judged, gate=mostly)
        if conf is not None and js.size:
            conf = (conf[0], conf[1], bool(conf[2] and mostly[js[-1]]))
        if conf is None or f.sum() < opts.persist_k:
            continue
        confirmed.add(node)
        confirm_w, since_w, active = conf
        fw = np.flatnonzero(f)
        seen = int(judged.sum())
        # the node against the other nodes now, and in its own first judged windows (its baseline)
        sel = grid.nodes == node
        with np.errstate(invalid="ignore", divide="ignore"):
            rel = nan_median(self_vals[sel], axis=0) / nan_median(self_vals[~sel], axis=0)
        now = _finite_or_none(nan_median(rel[fw]))
        first = js[: opts.persist_n]
        baseline = _finite_or_none(nan_median(rel[first])) if first.size else None
        for r in np.flatnonzero(grid.nodes == node):
            rank = int(grid.ranks[r])
            existing = by_rank.get(rank)
            if existing is not None and existing.active:
                existing.kind = "node"
                existing.node_ratio, existing.node_baseline_ratio = now, baseline
                continue
            if existing is not None:  # an episode of the rank alone; the node is slow now
                out.remove(existing)
            with np.errstate(invalid="ignore", divide="ignore"):
                ratio = self_vals[r, fw] / self_med[fw]
            if metric == "cpu_ns":  # its ranks compute more
                rank_kind, basis, share = "compute", "cpu_time", None
            else:
                rank_kind, basis, share = _compute_or_host(grid, r, fw, opts, _blocked(grid, r, fw))
            s = Straggler(
                rank=rank, node=int(node), kind="node", metric=metric,
                slowdown=_finite_or_none(nan_median(ratio)), since_step=int(grid.first_step[since_w]),
                windows_flagged=int(fw.size), windows_seen=seen, confirmed_step=int(grid.last_step[confirm_w]),
                until_step=int(grid.last_step[fw[-1]]), active=active,
                excess_ns=_finite(nan_median(self_vals[r, fw] - self_med[fw])),
                self_slowdown=_finite_or_none(nan_median(ratio)),
                comm_wait_ns=_finite_or_none(nan_median(grid.comm_wait[r, fw])),
                cluster_comm_wait_ns=_finite_or_none(nan_median(med_comm[fw])),
                metrics=[metric], rank_kind=rank_kind, rule="node",
                clock="device" if grid.device[fw].all() else "host", kind_basis=basis, cpu_share=share,
                windows_since=int((np.flatnonzero(judged) >= since_w).sum()),
                node_ratio=now, node_baseline_ratio=baseline,
            )  # fmt: skip
            _culprit_evidence(s, grid, r, fw)
            out.append(s)
            by_rank[rank] = s
    out.sort(key=lambda s: s.rank)
    return confirmed


def _group_by_node(stragglers: list[Straggler], grid: WindowGrid, opts: DetectionOptions) -> None:
    """More than ``node_fraction`` of a node's ranks slow (and at least two): the node is the problem.

    Only with two or more nodes: in a one-node job there is no other node to be slower than."""
    node_ids, node_sizes = np.unique(grid.nodes, return_counts=True)
    if node_ids.size < 2:
        return
    size = dict(zip(node_ids.tolist(), node_sizes.tolist(), strict=True))
    slow: dict[int, int] = {}
    for s in stragglers:
        if s.active:
            slow[s.node] = slow.get(s.node, 0) + 1
    for s in stragglers:
        n = size.get(s.node, 1)
        if s.active and n >= 2 and slow[s.node] / n > opts.node_fraction:
            s.kind = "node"


def _cluster_median(values: np.ndarray) -> np.ndarray:
    if values.size == 0:
        return np.full(values.shape[1] if values.ndim == 2 else 0, np.nan)
    return nan_median(values, axis=0)


def _finite(x: float) -> float:
    x = float(x)
    return x if np.isfinite(x) else float("nan")


def _finite_or_none(x: float) -> float | None:
    x = float(x)
    return x if np.isfinite(x) else None

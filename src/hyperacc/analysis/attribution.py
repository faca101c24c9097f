"""A cause for every spike, from the phase that grew and the signals that coincided.

Pure function of one rank's step columns and the positions of its spikes. The order of the rules and
their thresholds are in docs/detection.md ("Attribution"). When nothing explains at least half of a
spike's excess and no signal coincided, the answer is ``unknown``: it never guesses.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from hyperacc.analysis.options import DetectionOptions
from hyperacc.analysis.robust import MAD_TO_SIGMA, nan_median

# Phase groups whose growth can explain a spike, and the cause each names.
_DATA_PHASES = ("data_ns", "h2d_ns")
_COMPUTE_PHASES = ("forward_ns", "backward_ns", "optimizer_ns")
_OTHER_PHASES = ("other_ns",)
PHASE_COLUMNS: tuple[str, ...] = _DATA_PHASES + _COMPUTE_PHASES + _OTHER_PHASES


def window_stats(values: np.ndarray, idx: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """(median, MAD) of ``values`` over the centred window around each position in ``idx``, NaN-aware."""
    values = np.asarray(values, dtype=np.float64)
    idx = np.asarray(idx, dtype=np.int64)
    if idx.size == 0:
        return np.empty(0), np.empty(0)
    window = max(1, min(int(window), values.size))
    half = window // 2
    padded = np.concatenate([np.full(half, np.nan), values, np.full(window - 1 - half, np.nan)])
    rows = sliding_window_view(padded, window)[idx]
    med = nan_median(rows, axis=1)
    mad = nan_median(np.abs(rows - med[:, None]), axis=1)
    return med, mad


def attribute_spikes(
    cols: Mapping[str, np.ndarray],
    idx: np.ndarray,
    excess: np.ndarray,
    duration: np.ndarray,
    opts: DetectionOptions,
) -> tuple[np.ndarray, np.ndarray]:
    """Cause and grown phase for each spike at positions ``idx`` of one rank's columns.

    ``excess`` is each spike's time above its baseline; ``duration`` the judged series (self-time), used
    with the step time to tell a higher rate of context switches from a longer step. Returns two object arrays: the cause
    (data, gc, allocator, page_faults, host, compute, host_work, unknown) and the phase that grew most (None when no single phase
    grew by a quarter of the excess).
    """
    idx = np.asarray(idx, dtype=np.int64)
    excess = np.asarray(excess, dtype=np.float64)
    n = idx.size
    causes = np.full(n, "unknown", dtype=object)
    phases = np.full(n, None, dtype=object)
    if n == 0:
        return causes, phases
    w = opts.spike_window
    need = opts.explain_share * excess

    def growth(name: str) -> np.ndarray:
        values = cols.get(name)
        if values is None:
            return np.full(n, np.nan)
        base, _ = window_stats(values, idx, w)
        return np.asarray(values, dtype=np.float64)[idx] - base

    g = {name: growth(name) for name in PHASE_COLUMNS}
    grown = np.vstack([np.nan_to_num(g[name], nan=-np.inf) for name in PHASE_COLUMNS])
    best = np.argmax(grown, axis=0)
    best_g = grown[best, np.arange(n)]
    # The phase named for an event grew by at least half of what explaining the spike needs.
    named = np.isfinite(best_g) & (best_g >= 0.5 * need) & (best_g > 0)
    phases[:] = [PHASE_COLUMNS[b] if ok else None for b, ok in zip(best, named, strict=True)]

    def group(names: tuple[str, ...]) -> np.ndarray:
        stacked = np.vstack([g[name] for name in names])
        return np.where(np.isnan(stacked).all(axis=0), np.nan, np.nansum(stacked, axis=0))

    groups = np.vstack([group(_DATA_PHASES), group(_COMPUTE_PHASES), group(_OTHER_PHASES)])
    filled = np.nan_to_num(groups, nan=-np.inf)
    top = np.argmax(filled, axis=0)  # 0 data, 1 compute, 2 the rest of the step
    explained = filled[top, np.arange(n)] >= need

    gc_grew = growth("gc_ns")
    gc_explains = np.nan_to_num(gc_grew, nan=0.0) >= need
    allocator = _elevated(cols, "alloc_retries", idx, w, opts) | _elevated(
        cols, "sync_all_streams", idx, w, opts
    )
    # Where the time went: a spike whose CPU time (or device time) grew by half of its excess is work;
    # one whose wall time grew without CPU time was preempted or blocked (docs/detection.md, "Kind").
    work_time = _work_growth(cols, idx, w)
    measured = ~np.isnan(work_time)
    did_work = measured & (np.nan_to_num(work_time, nan=0.0) >= need)
    # Without CPU time: major faults, or involuntary switches at a higher rate than the step's length
    # explains (a longer step collects proportionally more switches).
    step_ns = cols.get("step_ns")
    span = duration if step_ns is None else np.where(np.isnan(step_ns), duration, step_ns)
    host = _elevated(cols, "major_faults", idx, w, opts)
    host |= ~measured & _elevated_rate(cols, "invol_ctx_switches", span, idx, w, opts)
    host |= measured & ~did_work

    data = explained & (top == 0)
    work = explained & (top > 0)
    # Without a DataLoader the data wait is the whole gap between the optimizer step and the next forward
    # (``data_gap``): there it is input only when the rank waited off its CPU (docs/detection.md,
    # "The work between steps").
    between = data & _in_gap(cols, idx)
    at = idx[between]
    gap_kind = gap_causes(
        g["data_ns"][between], gc_grew[between], work_time[between], _noise(cols, "gc_ns", at, w, opts),
        _noise(cols, "cpu_ns", at, w, opts), opts,
    )  # fmt: skip
    signal = _elevated(cols, "major_faults", idx, w, opts) | _elevated_rate(cols, "invol_ctx_switches", span, idx, w, opts)
    gap_kind = np.where(np.isin(gap_kind, ("data", "unknown")) & signal[between], "host", gap_kind)
    # Off the CPU is input only if the rank blocked (a read, a queue, a sleep): where voluntary switches
    # were measured and did not rise, it was runnable and not running, which no input wait explains.
    gap_kind = np.where((gap_kind == "data") & ~_blocked(cols, idx, w, opts)[between], "unknown", gap_kind)
    # The rest of the step is the rank's own code between the timed phases (a loss, a hook, logging):
    # with no stall signal, that is compute on the host, and the event names the phase.
    causes[work] = "compute"
    causes[~explained & did_work] = "compute"  # CPU or device time grew where no phase was timed
    causes[(work | ~explained) & host] = "host"
    causes[(work | ~explained) & allocator] = "allocator"
    causes[data] = "data"
    causes[np.flatnonzero(between)] = gap_kind
    # Work whose extra CPU time is mostly the kernel's, faulting in fresh pages, is the memory's cost
    causes[np.isin(causes, ("compute", "host_work")) & _paging(cols, idx, w, opts)] = "page_faults"
    causes[gc_explains] = "gc"
    return causes, phases


def gap_causes(
    gap: np.ndarray, gc: np.ndarray, cpu: np.ndarray, gc_noise: np.ndarray, cpu_noise: np.ndarray,
    opts: DetectionOptions,
) -> np.ndarray:
    """The cause of excess time in the input gap of a loop without a DataLoader: gc, host_work or data.

    ``gap``, ``gc``, ``cpu``: the gap's, the GC time's and the training thread's CPU time's excess (over
    the rank's own rolling median for a spike, over the cluster median for a straggler); ``*_noise``: the
    least excess of each that is not noise. The rank *worked* in the gap when its CPU time grew with it
    by ``floor_ns``, by more than preemption itself costs (``preempt_overhead`` of the gap's excess) and
    by more than its noise; the collector ran longer when GC time grew by ``floor_ns`` and by more than
    its noise. Then:

    * ``gc`` when GC time grew and either explains ``explain_share`` of the gap or is the only signal;
    * ``host_work`` when the rank worked (its own code between ``optimizer.step()`` and the next forward);
    * ``data`` only when neither grew and the CPU time accounts for less than ``explain_share`` of the
      gap's excess: waiting off the CPU with no other signal;
    * ``unknown`` otherwise: the CPU time grew by half the gap or more, but within its noise, so neither
      work nor waiting is shown (a busy loop preempted on a loaded host; never called input).

    docs/detection.md, "The work between steps"."""
    gap, gc, cpu = (np.asarray(a, dtype=np.float64) for a in (gap, gc, cpu))
    g = np.nan_to_num(gc, nan=0.0)
    with np.errstate(invalid="ignore"):
        worked = (cpu >= opts.floor_ns) & (cpu >= opts.preempt_overhead * gap) & (cpu > np.nan_to_num(cpu_noise))
        collected = (g >= opts.floor_ns) & (g > np.nan_to_num(gc_noise))
        by_gc = collected & ((g >= opts.explain_share * gap) | ~worked)
        off_cpu = ~(cpu >= opts.explain_share * gap)  # an unmeasured CPU time (NaN) shows no work
    out = np.full(gap.shape, "unknown", dtype=object)
    out[off_cpu] = "data"
    out[worked] = "host_work"
    out[by_gc] = "gc"
    return out


# The most kernel time one minor page fault can account for: zeroing a 2 MB transparent huge page at
# about 8 GB/s. Kernel time beyond this per added fault is not paging (a write, a flush, another call).
PAGE_FAULT_MAX_NS = 250_000


def _paging(cols: Mapping[str, np.ndarray], idx: np.ndarray, w: int, opts: DetectionOptions) -> np.ndarray:
    """The spike's extra CPU time is mostly the kernel's, faulting in fresh memory pages (a large buffer
    made anew, memory the allocator handed back and takes again). Over the rolling medians: the training
    thread's system time grew by ``S >= explain_share x`` its CPU time's growth, ``S >= floor_ns`` and
    beyond its noise; its minor page faults rose (``_elevated``) by ``F`` with ``S <= F x
    PAGE_FAULT_MAX_NS`` (the faults can account for that kernel time); and it did not block more than
    usual (a minor fault never waits: a write flushed to storage does). False where a column was not
    recorded (docs/detection.md, "Attribution")."""
    if any(cols.get(name) is None for name in ("sys_cpu_ns", "cpu_ns", "minor_faults")):
        return np.zeros(idx.size, dtype=bool)
    sys_time, cpu, faults = (np.asarray(cols[name], dtype=np.float64) for name in ("sys_cpu_ns", "cpu_ns", "minor_faults"))
    sys_grew, cpu_grew, faults_grew = (v[idx] - window_stats(v, idx, w)[0] for v in (sys_time, cpu, faults))
    with np.errstate(invalid="ignore"):
        kernel = (sys_grew >= opts.floor_ns) & (sys_grew > _noise(cols, "sys_cpu_ns", idx, w, opts))
        kernel &= (sys_grew >= opts.explain_share * cpu_grew) & (sys_grew <= faults_grew * PAGE_FAULT_MAX_NS)
    blocked = _elevated(cols, "vol_ctx_switches", idx, w, opts)
    return kernel & _elevated(cols, "minor_faults", idx, w, opts) & ~blocked


def _blocked(cols: Mapping[str, np.ndarray], idx: np.ndarray, w: int, opts: DetectionOptions) -> np.ndarray:
    """The training thread blocked more than usual at each step: its voluntary context switches rose
    (``_elevated``); True where they were not measured (older records), so the rule abstains there."""
    values = cols.get("vol_ctx_switches")
    if values is None:
        return np.ones(idx.size, dtype=bool)
    unmeasured = np.isnan(np.asarray(values, dtype=np.float64)[idx])
    return unmeasured | _elevated(cols, "vol_ctx_switches", idx, w, opts)


def _in_gap(cols: Mapping[str, np.ndarray], idx: np.ndarray) -> np.ndarray:
    """Steps whose data wait is the input gap (no DataLoader fetch seen)."""
    gap = cols.get("data_gap")
    if gap is None:
        return np.zeros(idx.size, dtype=bool)
    return np.nan_to_num(np.asarray(gap, dtype=np.float64)[idx], nan=0.0) > 0.5


def _noise(cols: Mapping[str, np.ndarray], name: str, idx: np.ndarray, w: int, opts: DetectionOptions) -> np.ndarray:
    """The noise bar of a column around each step: ``signal_z`` robust deviations of its rolling window,
    so that a CPU time that wanders with the host is not taken for work."""
    values = cols.get(name)
    if values is None or idx.size == 0:
        return np.zeros(idx.size)
    _, mad = window_stats(np.asarray(values, dtype=np.float64), idx, w)
    return opts.signal_z * MAD_TO_SIGMA * mad


def _work_growth(cols: Mapping[str, np.ndarray], idx: np.ndarray, w: int) -> np.ndarray:
    """Growth of the rank's working time at each spike over its rolling median: the device's own time
    (``dev_step_ns - dev_comm_wait_ns``) where measured, plus the training thread's CPU time
    (``cpu_ns``); NaN where neither was measured at that step."""
    out = np.full(idx.size, np.nan)
    for name in ("cpu_ns", "dev_busy_ns"):
        if name == "dev_busy_ns":
            step, wait = cols.get("dev_step_ns"), cols.get("dev_comm_wait_ns")
            if step is None:
                continue
            values = np.asarray(step, dtype=np.float64)
            if wait is not None:
                values = values - np.nan_to_num(np.asarray(wait, dtype=np.float64), nan=0.0)
        else:
            raw = cols.get(name)
            if raw is None:
                continue
            values = np.asarray(raw, dtype=np.float64)
        if np.isnan(values[idx]).all():
            continue
        base, _ = window_stats(values, idx, w)
        grew = values[idx] - base
        out = np.where(np.isnan(out), grew, np.fmax(out, grew))
    return out


def _elevated(
    cols: Mapping[str, np.ndarray], name: str, idx: np.ndarray, w: int, opts: DetectionOptions
) -> np.ndarray:
    """A counter at least one count and ``signal_z`` robust deviations above its rolling median."""
    values = cols.get(name)
    if values is None:
        return np.zeros(idx.size, dtype=bool)
    values = np.asarray(values, dtype=np.float64)
    med, mad = window_stats(values, idx, w)
    with np.errstate(invalid="ignore"):
        return values[idx] - med >= np.maximum(opts.signal_z * MAD_TO_SIGMA * mad, 1.0)


def _elevated_rate(
    cols: Mapping[str, np.ndarray],
    name: str,
    duration: np.ndarray,
    idx: np.ndarray,
    w: int,
    opts: DetectionOptions,
) -> np.ndarray:
    """More context switches than the step's length explains at the rank's usual rate.

    A step that is longer for any reason collects proportionally more involuntary switches; only a
    higher *rate* says another process took the core away.
    """
    values = cols.get(name)
    if values is None:
        return np.zeros(idx.size, dtype=bool)
    values = np.asarray(values, dtype=np.float64)
    duration = np.asarray(duration, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        rate = np.where(duration > 0, values / duration, np.nan)
        base_rate, _ = window_stats(rate, idx, w)
        _, mad = window_stats(values, idx, w)
        expected = base_rate * duration[idx]
        return values[idx] - expected >= np.maximum(opts.signal_z * MAD_TO_SIGMA * mad, 1.0)

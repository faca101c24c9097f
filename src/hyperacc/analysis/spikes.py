"""Spikes within a rank, spike rates with Wilson intervals, and communication spikes of the cluster.

A spike is a step whose self-time exceeds the rank's own centred rolling median by more than
``spike_floor_ns`` and more than ``spike_floor_rel`` of the median, where that excess is significant:
more than ``spike_mad`` robust standard deviations (1.4826 x rolling MAD) of the self-time, or of one
of its phases that grew by the floors. Rules and defaults: docs/detection.md ("Spikes").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from hyperacc.analysis.options import DetectionOptions
from hyperacc.analysis.robust import MAD_TO_SIGMA, rolling_median, rolling_median_at


@dataclasses.dataclass
class SeriesSpikes:
    """Spike flags of one series (one entry per step of the input; NaN input is not judged)."""

    judged: np.ndarray  # bool
    spike: np.ndarray  # bool, only where judged
    baseline: np.ndarray  # rolling median (NaN where not judged)
    excess: np.ndarray  # value - baseline (NaN where not judged)


def spike_metric(cols: Mapping[str, np.ndarray], opts: DetectionOptions) -> np.ndarray:
    """The per-step series spikes are judged on: self-time, or ``busy_ns`` = step_ns - comm_wait_ns
    (everything the rank did except waiting for its peers, optimizer and the rest included)."""
    if opts.spike_metric == "busy_ns":
        return busy_ns(cols)
    return np.array(cols["self_ns"], dtype=np.float64)


def busy_ns(cols: Mapping[str, np.ndarray]) -> np.ndarray:
    """Per step: the step less the wait in collectives and the pacing delay, that is all of the rank's
    own work. Where no collective was timed, the whole step was its own."""
    step = np.asarray(cols["step_ns"], dtype=np.float64)
    wait = np.asarray(cols.get("comm_wait_ns", np.full(step.shape, np.nan)), dtype=np.float64)
    pace = cols.get("pace_delay_ns")
    own = np.where(np.isnan(wait), step, step - wait)
    if pace is not None:
        own = own - np.nan_to_num(np.asarray(pace, dtype=np.float64), nan=0.0)
    return own


def spike_parts(cols: Mapping[str, np.ndarray], opts: DetectionOptions) -> dict[str, np.ndarray]:
    """The phases (and GC pauses) inside the spike metric, each tested against its own baseline."""
    names = ["data_ns", "h2d_ns", "forward_ns", "backward_ns", "gc_ns"]
    if opts.spike_metric == "busy_ns":
        names += ["optimizer_ns", "other_ns"]
    return {n: np.asarray(cols[n], dtype=np.float64) for n in names if n in cols}


def detect_spikes(
    values: np.ndarray,
    opts: DetectionOptions,
    parts: Mapping[str, np.ndarray] | None = None,
    step_ns: np.ndarray | None = None,
) -> SeriesSpikes:
    """Steps that exceed the series' rolling median by both floors and a significant amount.

    Significant: the excess is more than ``spike_mad`` robust deviations of the series itself, or one
    of ``parts`` (the step's phases) grew by more than the floors and ``spike_mad`` of its own robust
    deviations. A phase is usually far steadier than the whole step (a data wait of 0.7 +- 0.05 ms in
    a step of 80 +- 15 ms), so a 60 ms stall stands out in it where it would not in the total.

    The relative floor is taken of the rank's typical whole step (rolling median of ``step_ns``) when
    given: a spike has to lengthen the step the cluster waits for, not just the rank's own share of it.
    """
    values = np.asarray(values, dtype=np.float64)
    judged = ~np.isnan(values)
    baseline = np.full(values.shape, np.nan)
    excess = np.full(values.shape, np.nan)
    spike = np.zeros(values.shape, dtype=bool)
    x = values[judged]
    if x.size < 3:
        judged[:] = False
        return SeriesSpikes(judged, spike, baseline, excess)
    base = rolling_median(x, opts.spike_window)
    resid = x - base
    # The floors only where a step is longer than the series' own floor: the whole step's median only
    # raises it (the scale is the higher of the two), so no other step can be longer than the floors.
    floor = np.full(x.shape, np.nan)
    over = np.flatnonzero(resid > np.maximum(float(opts.spike_floor_ns), opts.spike_floor_rel * base))
    scale = base[over]
    if step_ns is not None:
        st = np.asarray(step_ns, dtype=np.float64)[judged]
        st_ok = ~np.isnan(st)
        if st_ok.sum() >= 3:
            timed = st_ok[over]
            whole = np.full(over.size, np.nan)
            whole[timed] = rolling_median_at(st[st_ok], opts.spike_window, (np.cumsum(st_ok) - 1)[over[timed]])
            scale = np.where(np.isnan(whole), scale, np.fmax(whole, scale))
    floor[over] = np.maximum(float(opts.spike_floor_ns), opts.spike_floor_rel * scale)
    longer = np.zeros(x.shape, dtype=bool)
    longer[over] = resid[over] > floor[over]
    # the robust deviation only where a step is longer than the floors (the rest is no spike whatever it is)
    beyond = np.flatnonzero(longer)
    mad = rolling_median_at(np.abs(resid), opts.spike_window, beyond)
    hit = np.zeros(x.shape, dtype=bool)
    hit[beyond] = resid[beyond] > opts.spike_mad * MAD_TO_SIGMA * mad
    for part in (parts or {}).values():
        p = np.asarray(part, dtype=np.float64)[judged]
        ok = ~np.isnan(p)
        if ok.sum() < 3:
            continue
        cand = longer & ok & ~hit
        if not cand.any():
            continue
        pv = p[ok]
        p_base = rolling_median(pv, opts.spike_window)
        p_resid = pv - p_base
        need = np.flatnonzero(cand[ok])  # positions in the measured part's own series
        p_mad = rolling_median_at(np.abs(p_resid), opts.spike_window, need)
        grew = np.zeros(x.shape, dtype=bool)
        grew[np.flatnonzero(ok)[need]] = p_resid[need] > np.maximum(opts.spike_mad * MAD_TO_SIGMA * p_mad, floor[ok][need])
        hit |= cand & grew
    baseline[judged] = base
    excess[judged] = resid
    spike[judged] = hit
    return SeriesSpikes(judged, spike, baseline, excess)


@dataclasses.dataclass
class RankSpikes:
    """One rank's spikes with their causes (``judge_spikes``): what the window summaries, the spike
    rates and the events of the diagnosis are all made from."""

    series: SeriesSpikes  # per step of the judged columns
    values: np.ndarray  # the judged series (``spike_metric``)
    idx: np.ndarray  # positions of the spikes
    causes: np.ndarray  # object: the cause of each spike (docs/detection.md, "Attribution")
    phases: np.ndarray  # object: the phase that grew most, or None

    @property
    def excess(self) -> np.ndarray:
        return self.series.excess[self.idx]


def judge_spikes(cols: Mapping[str, np.ndarray], opts: DetectionOptions) -> RankSpikes:
    """Spikes of one rank's (post warm-up) step columns and the cause of each: the same sequence
    offline (``run_reduce.reduce_rank``) and live (``windows.WindowStream``)."""
    from hyperacc.analysis.attribution import attribute_spikes

    values = spike_metric(cols, opts)
    series = detect_spikes(values, opts, spike_parts(cols, opts), cols.get("step_ns"))
    idx = np.flatnonzero(series.spike)
    causes, phases = attribute_spikes(cols, idx, series.excess[idx], values, opts)
    return RankSpikes(series, values, idx, causes, phases)


def wilson_interval(
    successes: np.ndarray | int, trials: np.ndarray | int, z: float = 1.96
) -> tuple[np.ndarray, np.ndarray]:
    """Wilson score interval for a binomial rate (95 % by default); (0, 1) where there are no trials."""
    k = np.asarray(successes, dtype=np.float64)
    n = np.asarray(trials, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.where(n > 0, k / n, 0.0)
        denom = 1.0 + z * z / n
        centre = (p + z * z / (2 * n)) / denom
        half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
        lo = np.where(n > 0, np.clip(centre - half, 0.0, 1.0), 0.0)
        hi = np.where(n > 0, np.clip(centre + half, 0.0, 1.0), 1.0)
    # Exact ends: no successes means the lower bound is 0, all successes means the upper bound is 1.
    lo = np.where(k <= 0, 0.0, lo)
    hi = np.where((n > 0) & (k >= n), 1.0, hi)
    return lo, hi


def communication_spikes(
    comm_min: np.ndarray, self_spiked: np.ndarray, opts: DetectionOptions
) -> SeriesSpikes:
    """Steps on which the collective itself was slow.

    ``comm_min[s]`` is the least wait of any rank in step ``s`` (the last rank to arrive, the culprit):
    its wait is the collective's own cost, not waiting for a peer. When it spikes and no rank's
    self-time spiked in that step, the network or the collective is the cause.
    """
    result = detect_spikes(comm_min, opts)
    result.spike &= ~np.asarray(self_spiked, dtype=bool)
    return result

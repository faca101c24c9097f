"""One rank's steps reduced to findings (``reduce_rank``) and the cluster's running reduction of every
rank (``_Cluster``): what ``run_dir.diagnose`` reads the run into, one rank at a time."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from hyperacc.analysis.episodes import PER_BLOCK, RankBlocks, rank_blocks
from hyperacc.analysis.excess import cause_groups, cause_time, member_dispersion
from hyperacc.analysis.options import DetectionOptions
from hyperacc.analysis.periods import Period, spike_period
from hyperacc.analysis.robust import run_slice
from hyperacc.analysis.spikes import RankSpikes, SeriesSpikes, judge_spikes
from hyperacc.analysis.windows import RANK_CAUSES, summarize_windows

_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY_F = np.zeros(0)
_EMPTY_S = np.zeros(0, dtype=str)
# Per step, the least waits kept (analysis.whatif): the culprits taken away together are exact up to
# this many late ranks in one step (a node of 8 GPUs); about 100 bytes per step.
WAIT_LOWEST = 8
_SLICE = 1 << 16  # steps of a rank whose waits ``_Cluster`` inserts at once

_EVENT = tuple[float, int, int, int, "str | None", str]  # (excess_ns, rank, node, step, phase, cause)


@dataclasses.dataclass
class RankFindings:
    """What one rank contributes to the diagnosis (small: no per-step arrays beyond a few int columns)."""

    rank: int
    node: int
    steps: np.ndarray  # every recorded step (warm-up included)
    judged: np.ndarray  # steps judged for spikes
    spikes: np.ndarray  # steps that spiked (sorted) ...
    comm_steps: np.ndarray  # steps with a measured wait in the collective ...
    comm_wait: np.ndarray  # ... and that wait
    windows: dict[str, np.ndarray]  # window summaries of the rank's typical (non-spike) steps
    counts: dict[str, int]  # spikes per cause
    time_lost: dict[str, float]  # excess ns per cause
    events: list[_EVENT]  # the rank's largest spikes
    judged_count: int = 0  # steps judged for spikes (kept when the arrays are dropped)
    steps_seen: int = 0  # steps recorded, warm-up included (kept when the arrays are dropped)
    cpu_measured: bool = False  # the rank's records carry CPU time (cpu_ns)
    comm_clock: str = "host"  # the clock of comm_wait: host, or device where the rank measured it
    # For the coordination view (analysis.coordination); steps after the warm-up:
    timed_steps: np.ndarray = dataclasses.field(default_factory=lambda: _EMPTY)  # steps with a step time ...
    step_ns: np.ndarray = dataclasses.field(default_factory=lambda: _EMPTY_F)  # ... and that step time
    comm_step_ns: np.ndarray = dataclasses.field(default_factory=lambda: _EMPTY_F)  # step time at comm_steps
    # run-queue delay at comm_steps (NaN: not measured): how much the host's CPUs were contended there
    comm_run_delay: np.ndarray = dataclasses.field(default_factory=lambda: _EMPTY_F)
    self_median_ns: float = float("nan")  # median self-time (busy time where self-time was not measured)
    step_total_ns: float = 0.0  # summed step time
    blocks: RankBlocks | None = None  # per-block medians for the episodes (analysis.episodes)
    spike_causes: np.ndarray = dataclasses.field(default_factory=lambda: _EMPTY_S)  # ... and their causes
    spike_excess: np.ndarray = dataclasses.field(default_factory=lambda: _EMPTY_F)  # ... and their excess
    # the period of its spikes of each set of causes tested together (``PERIOD_SETS``; analysis.periods)
    periods: dict[tuple[str, ...], Period] = dataclasses.field(default_factory=dict)
    # chi-square, degrees of freedom and windows with a spike of its spike counts per window, per set
    # of causes tested together (analysis.excess.member_dispersion): how bursty each cause's spikes were
    dispersion: dict[tuple[str, ...], tuple[float, ...]] = dataclasses.field(default_factory=dict)
    cause_time: dict[str, float] = dataclasses.field(default_factory=dict)  # analysis.excess.cause_time

    @property
    def main_cause(self) -> str | None:
        return max(self.time_lost.items(), key=lambda kv: kv[1])[0] if self.time_lost else None


def reduce_rank(rank: int, node: int, cols: dict[str, np.ndarray], opts: DetectionOptions) -> RankFindings:
    """Pure reduction of one rank's columns (``columns.read_rank``) to its findings."""
    all_steps = cols["step"]
    cols = _post_warmup(cols, int(all_steps[0]) if all_steps.size else 0, opts)
    part = _reduce_part(rank, node, cols, opts, 0, cols["step"].size, measured=None)
    return _whole(part, all_steps, _self_median(cols), opts)


def _whole(part: RankFindings, all_steps: np.ndarray, self_median_ns: float, opts: DetectionOptions) -> RankFindings:
    """A rank's findings from those of its post-warm-up steps (``_reduce_part``): its recorded steps and
    what is judged over the whole rank. Its judged, waited and timed steps are, in the usual run, every
    step after the warm-up: then they are views of ``all_steps``, not three more copies of it (a rank of
    a week: 48 MB each, and several ranks are in flight)."""
    return dataclasses.replace(
        part, steps=all_steps, steps_seen=int(all_steps.size), self_median_ns=self_median_ns,
        dispersion=member_dispersion(part.windows, RANK_CAUSES), cause_time=cause_time(part.windows),
        judged=_tail_of(all_steps, part.judged), comm_steps=_tail_of(all_steps, part.comm_steps),
        timed_steps=_tail_of(all_steps, part.timed_steps), periods=_periods(part, opts),
    )  # fmt: skip


# The sets of causes whose spikes may recur on a period: each set a rank-specific cause tests together
# (``excess.cause_groups``, with CPU time measured or not), and the input gap's two causes of a rank
# found working there (``excess.working_gap_ranks``).
PERIOD_SETS: tuple[tuple[str, ...], ...] = tuple(
    sorted({tuple(sorted(m)) for cpu in (False, True) for m in cause_groups(RANK_CAUSES, cpu).values()}
           | {("data", "host_work")})
)  # fmt: skip


def _periods(f: RankFindings, opts: DetectionOptions) -> dict[tuple[str, ...], Period]:
    """The period of the rank's spikes of each of ``PERIOD_SETS`` that recur on one (analysis.periods)."""
    out: dict[tuple[str, ...], Period] = {}
    if f.spikes.size < opts.period_min_repeats:
        return out
    for key in PERIOD_SETS:
        sel = np.isin(f.spike_causes, key)
        if int(sel.sum()) < opts.period_min_repeats:
            continue
        found = spike_period(f.spikes[sel], f.judged, opts.period_min_repeats, opts.period_coverage,
                             opts.top_alpha, f.spike_excess[sel])  # fmt: skip
        if found is not None:
            out[key] = found
    return out


def period_of(f: RankFindings, members: tuple[str, ...]) -> Period | None:
    """The period of ``f``'s spikes of the causes ``members`` (one of ``PERIOD_SETS``), if they have one."""
    return f.periods.get(tuple(sorted(members)))


def _tail_of(steps: np.ndarray, subset: np.ndarray) -> np.ndarray:
    """``subset`` (sorted steps of ``steps``) as a view of ``steps``' tail where it is that tail."""
    tail = steps[steps.size - subset.size :] if 0 < subset.size <= steps.size else None
    return tail if tail is not None and tail.dtype == subset.dtype and np.array_equal(tail, subset) else subset


def _post_warmup(cols: dict[str, np.ndarray], first_step: int, opts: DetectionOptions) -> dict[str, np.ndarray]:
    """``cols`` from step ``first_step + warmup_steps`` on (the rank's first step: its warm-up)."""
    steps = cols["step"]
    if steps.size > 1 and bool(np.all(steps[1:] > steps[:-1])):
        # sorted (``read_rank``): the warm-up is a prefix, and the rest is a view, not a copy
        start = int(np.searchsorted(steps, first_step + opts.warmup_steps))
        return {k: v[start:] for k, v in cols.items()}
    keep = steps >= first_step + opts.warmup_steps if steps.size else np.zeros(0, dtype=bool)
    return {k: v[keep] for k, v in cols.items()}


def _reduce_part(
    rank: int, node: int, cols: dict[str, np.ndarray], opts: DetectionOptions, lo: int, hi: int,
    measured: dict[str, bool] | None,
) -> RankFindings:  # fmt: skip
    """The findings of rows ``[lo, hi)`` of a rank's post-warm-up columns (without what ``_whole`` adds), whose spikes are judged with
    the rows around them as their baselines' context (a chunk of a long rank, ``reduce_rank_chunks``;
    the whole rank, ``reduce_rank``). ``measured``: whether the whole rank measured the columns whose
    clock it chooses (``_MEASURED``); by default, from ``cols``."""
    cols = dict(cols)
    cols["node"] = np.full(cols["step"].size, node, dtype=np.int64)
    cols["rank"] = np.full(cols["step"].size, rank, dtype=np.int64)
    judged = judge_spikes(cols, opts)
    if lo != 0 or hi != cols["step"].size:
        cols = {k: v[lo:hi] for k, v in cols.items()}
        judged = _spikes_within(judged, lo, hi)
    sp, idx, causes, phases = judged.series, judged.idx, judged.causes, judged.phases
    # Stragglers are judged on typical steps: a spike is a transient, counted in the spike rates. The
    # same summary the live aggregation makes (warm-up already left out here).
    windows = summarize_windows(cols, opts, first_step=int(cols["step"][0]) - opts.warmup_steps
                                if cols["step"].size else None, spikes=judged)  # fmt: skip
    excess = sp.excess[idx]
    counts: dict[str, int] = {}
    lost: dict[str, float] = {}
    for cause in np.unique(causes) if idx.size else []:
        sel = causes == cause
        counts[str(cause)] = int(sel.sum())
        lost[str(cause)] = float(excess[sel].sum())
    steps = cols["step"]
    events = [
        (float(excess[i]), rank, node, int(steps[idx[i]]), phases[i], str(causes[i]))
        for i in np.argsort(-excess, kind="stable")[: opts.top_events]
    ]
    # The wait in collectives on the device clock where the rank measured it (on NCCL the host wait is
    # microseconds: the work completes when it is enqueued), else on the host clock.
    comm, clock = cols["comm_wait_ns"], "host"
    dev = cols.get("dev_comm_wait_ns")
    on_device = measured["dev_comm_wait_ns"] if measured is not None else dev is not None and bool(np.isfinite(dev).any())
    if dev is not None and on_device:
        comm, clock = dev, "device"
    ok = ~np.isnan(comm)
    step_ns = cols["step_ns"]
    timed = ~np.isnan(step_ns)
    run_delay = cols.get("run_delay_ns")
    return RankFindings(
        rank, node, _EMPTY, steps[sp.judged], steps[idx], steps[ok], comm[ok], windows, counts, lost, events,
        judged_count=int(sp.judged.sum()), cpu_measured=bool(np.isfinite(cols.get("cpu_ns", np.empty(0))).any()),
        comm_clock=clock, timed_steps=steps[timed], step_ns=step_ns[timed], comm_step_ns=step_ns[ok],
        comm_run_delay=run_delay[ok] if run_delay is not None else np.full(int(ok.sum()), np.nan),
        step_total_ns=float(step_ns[timed].sum()), blocks=rank_blocks(rank, node, cols, opts, measured=measured),
        spike_causes=np.asarray(causes, dtype=str), spike_excess=excess,
    )  # fmt: skip


def _spikes_within(judged: RankSpikes, lo: int, hi: int) -> RankSpikes:
    """``judged`` restricted to rows ``[lo, hi)`` of its columns."""
    s = judged.series
    sel = (judged.idx >= lo) & (judged.idx < hi)
    return RankSpikes(
        SeriesSpikes(s.judged[lo:hi], s.spike[lo:hi], s.baseline[lo:hi], s.excess[lo:hi]), judged.values[lo:hi],
        judged.idx[sel] - lo, judged.causes[sel], judged.phases[sel],
    )  # fmt: skip


# The columns whose being measured anywhere in a rank decides which clock its findings use: ``self_ns``
# or ``dev_self_ns`` for the self-time (``_self_median``, ``episodes.rank_blocks``), ``dev_comm_wait_ns``
# for the waits.
_MEASURED = ("self_ns", "dev_self_ns", "dev_comm_wait_ns")


def _measured(cols: dict[str, np.ndarray]) -> dict[str, bool]:
    return {n: n in cols and bool(np.isfinite(cols[n]).any()) for n in _MEASURED}


class _Remeasure(Exception):
    """A later chunk measured a column that the chunks before it did not: reduce again, knowing it."""

    def __init__(self, measured: dict[str, bool]) -> None:
        self.measured = measured


def reduce_rank_chunks(
    rank: int, node: int, chunks: Callable[[], Iterable[dict[str, np.ndarray]]], opts: DetectionOptions
) -> RankFindings | None:
    """``reduce_rank`` of a rank given as consecutive chunks of its columns (``columns.read_rank_chunks``),
    never holding more than two chunks and the per-step findings: a rank of a week. ``chunks()``
    gives the chunks again from the first (a later chunk that first measures a clock restarts the rank).
    None where the rank has no record.

    Each chunk's rows are judged with the ``4 x spike_window`` rows on each side as the context of their
    spike baselines (a centred rolling median, then a rolling MAD of the residuals: each looks
    ``spike_window - 1`` rows either way), and chunks end on window and episode-block boundaries, so
    that the findings equal ``reduce_rank``'s of the whole rank where every judged series (the step's
    metric, its phases) has a value in at least every fourth row around a boundary. Sums of floats
    (time lost, the total step time) are added chunk by chunk: equal up to rounding.
    """
    measured: dict[str, bool] | None = None
    while True:
        try:
            return _reduce_chunks(rank, node, chunks(), opts, measured)
        except _Remeasure as again:
            measured = again.measured


def _reduce_chunks(
    rank: int, node: int, chunks: Iterable[dict[str, np.ndarray]], opts: DetectionOptions,
    known: dict[str, bool] | None,
) -> RankFindings | None:  # fmt: skip
    context = 4 * opts.spike_window
    align = math.lcm(opts.window_steps, opts.episode_block_steps)
    parts: list[RankFindings] = []
    all_steps: list[np.ndarray] = []
    selfs: dict[str, list[np.ndarray]] = {"self_ns": [], "dev_self_ns": []}
    first: int | None = None
    buf: dict[str, np.ndarray] | None = None  # post-warm-up rows not yet reduced, after ``lo`` rows of context
    lo = 0
    measured = known

    def reduce(buf: dict[str, np.ndarray], lo: int, hi: int) -> None:
        """Rows ``[lo, hi)`` of ``buf``, with up to ``context`` rows around them."""
        start = max(0, lo - context)
        parts.append(_reduce_part(rank, node, {k: v[start:hi + context] for k, v in buf.items()}, opts,
                                  lo - start, hi - start, measured))  # fmt: skip

    for chunk in chunks:
        if first is None:
            first = int(chunk["step"][0])
        all_steps.append(chunk["step"])
        cols = _post_warmup(chunk, first, opts)
        seen = _measured(cols)
        if measured is None:
            measured = seen
        elif any(v and not measured[k] for k, v in seen.items()):
            raise _Remeasure({k: v or measured[k] for k, v in seen.items()})
        for name, values in selfs.items():
            v = cols.get(name)
            if v is not None and not (name == "dev_self_ns" and measured["self_ns"]):  # the host clock's
                values.append(v[np.isfinite(v)])
        buf = cols if buf is None else {k: np.concatenate([buf[k], v]) for k, v in cols.items() if k in buf}
        steps = buf["step"]
        # the rows that can be reduced now: up to a boundary with ``context`` rows after it
        if steps.size - lo <= 2 * context:
            continue
        upto = int(steps[steps.size - context - 1]) // align * align
        hi = int(np.searchsorted(steps, upto))
        if hi <= lo:
            continue
        reduce(buf, lo, hi)
        keep = max(0, hi - context)
        buf = {k: v[keep:] for k, v in buf.items()}
        lo = hi - keep
    if buf is None or measured is None:
        return None  # no record
    if buf["step"].size > lo or not parts:  # the rest; or no step after the warm-up: what they give
        reduce(buf, lo, buf["step"].size)
    del buf
    steps = np.concatenate(all_steps)
    return _merged(rank, node, parts, steps, selfs, measured, opts)


def _merged(
    rank: int, node: int, parts: list[RankFindings], all_steps: np.ndarray, selfs: dict[str, list[np.ndarray]],
    measured: dict[str, bool], opts: DetectionOptions,
) -> RankFindings:  # fmt: skip
    """One rank's findings from its chunks' (``_reduce_part``)."""

    def joined(name: str) -> np.ndarray:
        return np.concatenate([getattr(p, name) for p in parts])

    windows = {k: np.concatenate([p.windows[k] for p in parts]) for k in parts[0].windows}
    counts: dict[str, int] = {}
    lost: dict[str, float] = {}
    events: list[_EVENT] = []
    for p in parts:
        for c, n in p.counts.items():
            counts[c] = counts.get(c, 0) + n
        for c, x in p.time_lost.items():
            lost[c] = lost.get(c, 0.0) + x
        events += p.events
    # the whole rank's order: largest first, the earlier step first among equals (a stable sort)
    events = sorted(events, key=lambda e: (-e[0], e[3]))[: opts.top_events]
    self_values = [np.concatenate(v) for v in selfs.values() if v]
    self_median = next((float(np.median(v)) for v in self_values if v.size), float("nan"))
    clock = "device" if measured.get("dev_comm_wait_ns") else "host"
    part = RankFindings(
        rank, node, _EMPTY, joined("judged"), joined("spikes"), joined("comm_steps"), joined("comm_wait"), windows,
        counts, lost, events, judged_count=sum(p.judged_count for p in parts),
        cpu_measured=any(p.cpu_measured for p in parts), comm_clock=clock, timed_steps=joined("timed_steps"),
        step_ns=joined("step_ns"), comm_step_ns=joined("comm_step_ns"), comm_run_delay=joined("comm_run_delay"),
        step_total_ns=sum(p.step_total_ns for p in parts), blocks=_joined_blocks([p.blocks for p in parts]),
        spike_causes=joined("spike_causes"), spike_excess=joined("spike_excess"),
    )  # fmt: skip
    return _whole(part, all_steps, self_median, opts)


def _joined_blocks(parts: list[RankBlocks]) -> RankBlocks:
    """One rank's blocks from those of its chunks (a column some chunks did not measure is NaN there)."""
    first = parts[0]
    fields: dict[str, Any] = {"block": np.concatenate([b.block for b in parts]),
                              "steps": np.concatenate([b.steps for b in parts])}  # fmt: skip
    for name in PER_BLOCK:
        have = [getattr(b, name) for b in parts]
        if all(v is None for v in have):
            fields[name] = None
            continue
        fields[name] = np.concatenate(
            [v if v is not None else np.full(b.block.size, np.nan, dtype=np.float32) for v, b in zip(have, parts, strict=True)]
        )  # fmt: skip
    return dataclasses.replace(first, **fields)


def _self_median(cols: dict[str, np.ndarray]) -> float:
    """A rank's typical work per step: median self-time (host clock, else device clock)."""
    for name in ("self_ns", "dev_self_ns"):
        v = cols.get(name)
        if v is not None and np.isfinite(v).any():
            return float(np.nanmedian(v))
    return float("nan")


class _Cluster:
    """Per-step facts merged over ranks: who reported, who spiked, who waited least.

    Indexed sparsely: the arrays hold one entry per step some rank recorded (``steps``, sorted), so
    memory follows the records, not the step numbers (a step numbered 10**12 costs one entry).
    """

    _FILL = {"present": False, "judged": False, "spiked": 0, "wait_low": np.inf, "wait_rank": -1,
             "low_cause": -1, "step_max": np.nan, "comm_max": -np.inf, "comm_sum": 0.0, "comm_step_sum": 0.0,
             "comm_ranks": 0, "delay_sum": 0.0, "delay_ranks": 0}  # fmt: skip

    def __init__(self) -> None:
        self.steps = np.zeros(0, dtype=np.int64)  # every step any rank recorded, sorted
        self._first: int | None = None  # steps[0] where ``steps`` is every step from it on, without a gap
        self.present = np.zeros(0, dtype=bool)  # any record (warm-up included)
        self.judged = np.zeros(0, dtype=bool)  # any judged record
        self.spiked = np.zeros(0, dtype=np.int32)  # ranks whose own time spiked
        # The WAIT_LOWEST least waits in the collective and their ranks, least first (the last rank to
        # arrive, the culprit, is column 0), and the cause of that rank's spike at the step (an index
        # into ``causes``; -1: none): what the what-if replay takes away (analysis.whatif).
        # (ranks as int32, cause codes as int16: int64 took 42 bytes a step more, 0.25 GB for a week at
        # 10 steps/s)
        self.wait_low = np.zeros((0, WAIT_LOWEST))
        self.wait_rank = np.zeros((0, WAIT_LOWEST), dtype=np.int32)
        self.low_cause = np.zeros(0, dtype=np.int16)
        self.causes: list[str] = []
        # For the coordination view only (no detection rule reads them), after the warm-up:
        self.step_max = np.zeros(0)  # the cluster's step time (the slowest rank's), NaN: not measured
        self.comm_max = np.zeros(0)  # the largest wait
        self.comm_sum = np.zeros(0)  # summed wait of the ranks that measured one ...
        self.comm_step_sum = np.zeros(0)  # ... their summed step time ...
        self.comm_ranks = np.zeros(0, dtype=np.int32)  # ... and how many they are
        self.delay_sum = np.zeros(0)  # summed run-queue delay of the ranks that measured a wait and it ...
        self.delay_ranks = np.zeros(0, dtype=np.int32)  # ... and how many they are

    def _within(self, steps: np.ndarray) -> bool:
        """Whether every one of ``steps`` is a step held, known without a search: the usual run, whose
        steps have no gap, holds every integer between its first and last step."""
        return (self._first is not None and steps.size > 0 and int(steps.min()) >= self._first
                and int(steps.max()) < self._first + self.steps.size)  # fmt: skip

    def cover(self, steps: np.ndarray) -> None:
        """Make room for ``steps`` (sorted); existing facts keep their steps."""
        if self._within(steps):
            return
        pos = np.searchsorted(self.steps, steps)
        inside = pos < self.steps.size
        if inside.all() and np.array_equal(self.steps[pos], steps):
            return
        merged = np.union1d(self.steps, steps)
        where = np.searchsorted(merged, self.steps)
        for name, fill in self._FILL.items():
            old = getattr(self, name)
            new = np.full((merged.size, *old.shape[1:]), fill, dtype=old.dtype)
            new[where] = old
            setattr(self, name, new)
        self.steps = merged
        gapless = merged.size > 0 and int(merged[-1]) - int(merged[0]) + 1 == merged.size
        self._first = int(merged[0]) if gapless else None

    def index(self, steps: np.ndarray) -> np.ndarray:
        """Positions of ``steps`` (steps held) in the per-step arrays."""
        if self._within(steps):
            return steps.astype(np.int64, copy=False) - self._first
        return np.searchsorted(self.steps, steps)

    def add(self, f: RankFindings) -> None:
        self.cover(f.steps)
        self.present[self.index(f.steps)] = True
        self.judged[self.index(f.judged)] = True
        self.spiked[self.index(f.spikes)] += 1
        pos = self.index(f.comm_steps)
        self._add_wait(f, pos)
        self._add_coordination(f, pos)

    @property
    def self_spike(self) -> np.ndarray:
        """Whether some rank's own time spiked, per step."""
        return self.spiked > 0

    @property
    def comm_min(self) -> np.ndarray:
        """The least wait of any rank per step (inf: none measured)."""
        return self.wait_low[:, 0]

    @property
    def comm_rank(self) -> np.ndarray:
        """The rank that waited least per step (-1: none)."""
        return self.wait_rank[:, 0]

    def _add_wait(self, f: RankFindings, pos: np.ndarray) -> None:
        """Insert the rank's waits into the per-step least ``WAIT_LOWEST``, keeping them sorted."""
        run = run_slice(pos)
        last = self.wait_low[run if run is not None else pos, -1]
        lower = f.comm_wait < last  # only where it is among the least so far
        pos, wait = pos[lower], f.comm_wait[lower]
        if not pos.size:
            return
        # in slices: the tables' rows at ``pos`` are copied and rewritten, 2 x WAIT_LOWEST x 8 B per step
        # (a rank of a week, 6e6 steps, would take 1.5 GB of copies at once)
        at = np.concatenate([self._insert_wait(pos[i:i + _SLICE], wait[i:i + _SLICE], f.rank)
                             for i in range(0, pos.size, _SLICE)])  # fmt: skip
        if not at.size:
            return
        self.low_cause[at] = -1
        if f.spikes.size:
            codes = np.array([self._cause_code(str(c)) for c in f.spike_causes], dtype=np.int64)
            where = np.searchsorted(f.spikes, self.steps[at])
            hit = (where < f.spikes.size) & (f.spikes[np.minimum(where, f.spikes.size - 1)] == self.steps[at])
            self.low_cause[at[hit]] = codes[where[hit]]

    def _insert_wait(self, pos: np.ndarray, wait: np.ndarray, rank: int) -> np.ndarray:
        """Insert one rank's ``wait`` at the rows ``pos``; the rows where it is now the least."""
        low, ranks = self.wait_low[pos], self.wait_rank[pos]
        # each new wait goes after the kept ones that are not larger (j < WAIT_LOWEST: it is below the
        # last), and the ones after it shift right by one, the last dropped
        j = np.count_nonzero(low <= wait[:, None], axis=1)[:, None]
        keep = np.arange(WAIT_LOWEST)[None, :] < j
        for table, held, new in ((self.wait_low, low, wait[:, None]), (self.wait_rank, ranks, rank)):
            out = np.empty_like(held)
            out[:, 1:] = held[:, :-1]
            np.copyto(out, held, where=keep)
            np.put_along_axis(out, j, new, axis=1)
            table[pos] = out
        return pos[j[:, 0] == 0]  # the rank is now the last to arrive there

    def _cause_code(self, cause: str) -> int:
        if cause not in self.causes:
            self.causes.append(cause)
        return self.causes.index(cause)

    def _add_coordination(self, f: RankFindings, comm_pos: np.ndarray) -> None:
        """Per-step step time and waits for ``analysis.coordination`` (each step once per rank)."""
        tpos = self.index(f.timed_steps)
        _fold(np.fmax, self.step_max, tpos, f.step_ns)
        timed = ~np.isnan(f.comm_step_ns)
        _fold(np.maximum, self.comm_max, comm_pos, f.comm_wait)
        at = comm_pos[timed]
        _fold(np.add, self.comm_sum, at, f.comm_wait[timed])
        _fold(np.add, self.comm_step_sum, at, f.comm_step_ns[timed])
        _fold(np.add, self.comm_ranks, at, 1)
        delayed = ~np.isnan(f.comm_run_delay)
        _fold(np.add, self.delay_sum, comm_pos[delayed], f.comm_run_delay[delayed])
        _fold(np.add, self.delay_ranks, comm_pos[delayed], 1)

    @property
    def run_delay(self) -> np.ndarray:
        """The mean run-queue delay per step of the ranks that measured a wait and it (NaN: none)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.delay_ranks > 0, self.delay_sum / np.maximum(self.delay_ranks, 1), np.nan)

    def culprits(self, rank: np.ndarray, window: np.ndarray, window_steps: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The per-step culprit record at the window summaries' rows (``rank``, ``window``): the steps in
        which the rank waited least in its window, and the window's steps with a known culprit; None
        where no step has a known culprit."""
        valid = self.comm_rank >= 0
        if not valid.any():
            return None
        win = self.steps[valid] // window_steps
        culprit = self.comm_rank[valid].astype(np.int64)  # a key below: rank x windows may pass 2**31
        known_w, known_n = np.unique(win, return_counts=True)
        # (rank, window) pairs as one sortable key, the windows numbered densely (a step may be anything
        # within +-2**53): the summaries' windows, and the culprits' windows that are among them
        dense, at = np.unique(window, return_inverse=True)
        if not dense.size:
            return np.zeros(0), np.zeros(0)
        j = np.minimum(np.searchsorted(dense, win), dense.size - 1)
        kept = dense[j] == win
        keys, counts = np.unique(culprit[kept] * dense.size + j[kept], return_counts=True)
        pairs = _lookup(keys, counts, rank.astype(np.int64) * dense.size + at.reshape(-1))
        return pairs, _lookup(known_w, known_n, window)


def _lookup(keys: np.ndarray, values: np.ndarray, at: np.ndarray) -> np.ndarray:
    """``values`` of the sorted ``keys`` at ``at`` (0 where a key is absent), as float64."""
    if not keys.size:
        return np.zeros(at.size)
    i = np.minimum(np.searchsorted(keys, at), keys.size - 1)
    return np.where(keys[i] == at, values[i], 0).astype(np.float64)


def _fold(op: np.ufunc, out: np.ndarray, pos: np.ndarray, values: np.ndarray | int) -> None:
    """``op.at(out, pos, values)``, on a slice where ``pos`` is one run."""
    run = run_slice(pos)
    if run is not None:
        op(out[run], values, out=out[run])  # in place on the slice's view
    else:
        op.at(out, pos, values)

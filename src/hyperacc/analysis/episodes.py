"""Episodes: stretches in which one rank's self-time, relative to the cluster median of the same steps,
shifts up and later back (a transient fail-slow), found by change points (docs/detection.md,
"Episodes").

Two halves, so that the analysis can stream ranks:

* ``rank_blocks(cols, opts)`` reduces one rank's step columns to per-block medians (blocks of
  ``episode_block_steps`` steps, the same blocks on every rank): a few bytes per block, like the window
  summaries;
* ``detect_episodes(blocks, opts)`` takes every rank's blocks, divides each block by the cluster median
  of the same block, and runs a two-sided CUSUM per rank on the log ratio against the rank's own typical
  ratio, with a noise floor from the robust spread of the ratios (the rank's own, or the ranks' median
  where that is larger: the host-wide floor). Where the tracer recorded the run-queue delay within the
  self-time, the wall-time channel judges the self-time less that delay's rise (``unpreempted``). A
  segment is an episode when its shift is at least ``episode_min_effect`` and it lasts at least
  ``episode_min_steps``.

The sequential part runs over blocks, vectorised over ranks. The statistics the rules are written in
(ratios, noise floors, levels, the CUSUM) are in ``change_points.py``.

Why this module is a little over 500 lines: after the change points, ``detect_episodes`` keeps or
drops each segment and names its kind by the tests at the end of the file (``stands_out``,
``blocked_span``, ``waited_for_input``, ``worked_between``, ``more_work``); they are the episode rule of
docs/detection.md, each a few lines that read only the block columns, so they stay beside it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from hyperacc.analysis.attribution import gap_causes
from hyperacc.analysis.change_points import (
    LengthBars,
    WanderFloor,
    change_points,
    level_noise,
    log_ratio,
    noise_floor,
    outside_level,
    stretch_levels,
)
from hyperacc.analysis.options import DetectionOptions
from hyperacc.analysis.outliers import WindowGrid
from hyperacc.analysis.robust import MAD_TO_SIGMA, group_starts, loo_median, nan_median, run_slice
from hyperacc.analysis.stragglers import (
    Straggler,
    blocked_rise,
    compute_or_host,
    detect_stragglers,
    held_outside,
    kernel_paging,
)
from hyperacc.stats import last_axis_nan_median


@dataclasses.dataclass
class RankBlocks:
    """One rank's per-block medians (blocks ``b`` cover steps ``[b * B, (b + 1) * B)``)."""

    rank: int
    node: int
    block: np.ndarray  # (n,) int64 block numbers, sorted
    self_ns: np.ndarray  # (n,) float32 median self-time (host clock; NaN: too few steps measured)
    cpu_ns: np.ndarray  # (n,) float32 median CPU time of the training thread (NaN: not measured)
    steps: np.ndarray  # (n,) uint16 steps recorded in the block
    width: int = 5  # steps per block (``episode_block_steps``, doubled by ``BlockBudget`` on huge runs)
    # (n,) float32 median voluntary context switches per step (the training thread blocked); None or NaN:
    # not measured
    vol: np.ndarray | None = None
    # (n,) float32 median input wait per step (``data_ns``: the DataLoader's fetch, or the gap before the
    # forward); None or NaN: not measured
    data: np.ndarray | None = None
    # (n,) float32 median of ``data_gap`` per step: 1 where the input wait is the input gap of a loop
    # without a DataLoader (the time between ``optimizer.step()`` and the next forward); None: not known
    gap: np.ndarray | None = None
    # (n,) float32 mean CPU time in the kernel per step, and median minor page faults per step (the
    # ``page_faults`` kind, ``stragglers.kernel_paging``); None: not recorded
    sys: np.ndarray | None = None
    faults: np.ndarray | None = None
    # (n,) float32 median run-queue delay per step within the self-time (``run_delay_ns`` less
    # ``comm_run_delay_ns``: the training thread was ready to run and waited for a CPU); None or NaN: not
    # measured
    delay: np.ndarray | None = None
    # (n,) float32 median time outside every timed phase per step (``other_ns``: the rank's own code
    # between the phases, such as a trainer's callbacks, its logging, the loss, clipping); None or NaN:
    # not measured
    other: np.ndarray | None = None
    # (n,) float32 mean time per step in the garbage collector (``gc_ns``: pauses are rare and long, so a
    # mean, not a median); None or NaN: not measured
    gc: np.ndarray | None = None
    # (n,) float32 median step time per step, made for the live rule of the job's slowdowns only
    # (``rank_blocks(job=True)``; offline it reads the job's step time per step,
    # ``slowdowns.detect_slowdowns``); None: not made
    job_step: np.ndarray | None = None
    # (n,) float32 median of ``data_own`` per step: 1 where the DataLoader's fetch ran on the training
    # thread (no worker processes), so that a wait in it is the thread's own; None: not recorded
    own: np.ndarray | None = None

    def mapped(self, fn: Callable[[np.ndarray], np.ndarray], **fields: Any) -> RankBlocks:
        """These blocks with ``fn`` applied to every per-block column (``fields`` set as given)."""
        out = {name: fn(getattr(self, name)) for name in PER_BLOCK if getattr(self, name) is not None}
        return dataclasses.replace(self, **{**out, **fields})


# RankBlocks' per-block columns (besides ``block`` and ``steps``); the optional ones are None where the
# records did not measure them
PER_BLOCK = ("self_ns", "cpu_ns", "vol", "data", "gap", "sys", "faults", "delay", "other", "gc", "job_step", "own")


class BlockBudget:
    """Every rank's blocks, kept within ``episode_max_cells`` (ranks x blocks): past it, every block
    is widened x2 (``coarsened``) until they fit, so the memory of the episodes is bounded whatever the
    run's length and size (docs/detection.md, "Episodes", "At scale")."""

    def __init__(self, opts: DetectionOptions) -> None:
        self.max_cells = opts.episode_max_cells
        self.width = opts.episode_block_steps
        self.blocks: list[RankBlocks] = []
        self.cells = 0

    def add(self, b: RankBlocks) -> None:
        b = coarsened(b, self.width)
        self.blocks.append(b)
        self.cells += b.block.size
        while self.cells > self.max_cells and self.cells > len(self.blocks):
            self.width *= 2
            self.blocks = [coarsened(x, self.width) for x in self.blocks]
            self.cells = sum(x.block.size for x in self.blocks)


def coarsened(b: RankBlocks, width: int) -> RankBlocks:
    """``b`` in blocks of ``width`` steps (a multiple of its own): each wider block's value is the mean of
    the medians of the blocks it joins (an approximation of their median), its steps their sum."""
    if width <= b.width or not b.block.size:
        return b if width <= b.width else dataclasses.replace(b, width=width)
    joined = b.block // (width // b.width)  # sorted, as the blocks are: no np.unique's sort
    starts = group_starts(joined)
    new, row = joined[starts], np.repeat(np.arange(starts.size), np.diff(starts, append=joined.size))

    def mean(v: np.ndarray) -> np.ndarray:
        ok = np.isfinite(v)
        n = np.bincount(row[ok], minlength=new.size)
        total = np.bincount(row[ok], weights=v[ok].astype(np.float64), minlength=new.size)
        with np.errstate(all="ignore"):
            return np.where(n > 0, total / n, np.nan).astype(np.float32)

    steps = np.bincount(row, weights=b.steps.astype(np.float64), minlength=new.size)
    return b.mapped(mean, block=new, steps=np.minimum(steps, np.iinfo(np.uint16).max).astype(np.uint16), width=width)


@dataclasses.dataclass
class Episode:
    rank: int
    node: int
    kind: str  # compute | page_faults | host (the straggler rule's CPU-versus-wall split) | host_work (work between steps)
    #            | data (the growth was the DataLoader's fetch)
    metric: str  # self_ns
    slowdown: float | None  # the rank's self-time / the cluster median, median over the episode's blocks
    since_step: int  # first step of the first block of the shift
    until_step: int  # last step of the last block before the shift back (or of the run)
    confirmed_step: int  # last step of the block in which the CUSUM crossed its decision interval
    active: bool  # still shifted at the rank's last block (no shift back seen)
    steps: int  # until_step - since_step + 1
    excess_ns: float  # self-time minus the cluster median, median over the episode's blocks
    job_time_lost_ns: float  # that excess summed over the episode's steps
    shift: float  # the ratio's shift over the rank's own typical ratio
    noise: float  # the noise floor the CUSUM judged against (sigma of a block's log ratio)
    kind_basis: str = "cpu_time"
    cpu_share: float | None = None
    rule: str = "change_point"
    # how many more times per step the rank blocked off its CPU over the episode (voluntary context
    # switches, over its own level outside it and the other ranks' rise); None: not shown
    blocked_per_step: float | None = None
    # the shift was in the input gap of a loop without a DataLoader, and the rank's CPU time grew with it:
    # its own work between ``optimizer.step()`` and the next forward (kind ``host_work``)
    between_steps: bool = False
    # its mean GC time per step over the episode, and the other ranks' median of the same, where it grew by
    # ``floor_ns`` over both its own level outside the episode and the others' (the collector named)
    gc_ns: float | None = None
    cluster_gc_ns: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def rank_blocks(
    rank: int, node: int, cols: Mapping[str, np.ndarray], opts: DetectionOptions,
    measured: Mapping[str, bool] | None = None, job: bool = False,
) -> RankBlocks:  # fmt: skip
    """Per-block medians of one rank's post-warm-up steps (``cols`` sorted by step). ``measured``: for
    some of a rank's steps (a chunk, ``run_reduce``), whether the whole rank measured ``self_ns`` and
    ``dev_self_ns`` at all, which decides the self-time's clock; by default, from ``cols``. ``job``: also
    the step time (``job_step``: the live slowdown rule's)."""
    width = opts.episode_block_steps
    steps = np.asarray(cols["step"], dtype=np.int64)
    if steps.size == 0:
        empty = np.zeros(0, dtype=np.float32)
        return RankBlocks(rank, node, np.zeros(0, dtype=np.int64), empty, empty, np.zeros(0, dtype=np.uint16), width)
    blk = steps // width
    if steps.size > 1 and bool((np.diff(steps) > 0).all()):  # the usual case: sorted, one row per step
        first = group_starts(blk)
        uniq, row = blk[first], np.repeat(np.arange(first.size), np.diff(np.append(first, blk.size)))
    else:
        uniq, row = np.unique(blk, return_inverse=True)
    offset = steps - blk * width
    # the usual rank, no step missing: its cells are one contiguous run, filled by a copy, not a scatter
    run = run_slice(row * width + offset)

    def medians(name: str) -> np.ndarray:
        return medians_of(cols.get(name))

    def medians_of(v: np.ndarray | None) -> np.ndarray:
        grid = np.full((uniq.size, width), np.nan)
        if v is not None:
            if run is not None:
                grid.reshape(-1)[run] = v
            else:
                grid[row, offset] = np.asarray(v, dtype=np.float64)
        med, n = last_axis_nan_median(grid)
        # a block judged on fewer than half its steps is not judged
        return np.where(n * 2 >= width, med, np.nan).astype(np.float32)

    def anywhere(name: str) -> bool:
        if measured is not None:
            return measured[name]
        return name in cols and bool(np.isfinite(np.asarray(cols[name], dtype=float)).any())

    self_name = "self_ns" if anywhere("self_ns") else "dev_self_ns"
    count = np.bincount(row, minlength=uniq.size).astype(np.uint16)
    vol = medians("vol_ctx_switches") if "vol_ctx_switches" in cols else None
    data = medians("data_ns") if "data_ns" in cols else None
    gap = medians("data_gap") if data is not None and "data_gap" in cols else None
    own = medians("data_own") if data is not None and "data_own" in cols and np.isfinite(cols["data_own"]).any() else None
    paging = "minor_faults" in cols and "sys_cpu_ns" in cols and bool(np.isfinite(cols["minor_faults"]).any())
    sys_time = _block_means(cols["sys_cpu_ns"], row, uniq.size) if paging else None
    faults = medians("minor_faults") if paging else None
    delay = None
    if "run_delay_ns" in cols and "comm_run_delay_ns" in cols:
        # the delay within the self-time: the step's, less the part inside its collective waits
        within = np.asarray(cols["run_delay_ns"], dtype=np.float64) - np.asarray(cols["comm_run_delay_ns"], dtype=np.float64)
        delay = medians_of(within) if np.isfinite(within).any() else None
    # the time outside every timed phase, on the host clock only: where a device clock was recorded, a
    # rank's host waits there include its waits for the device (a `.item()`, a synchronize), which a
    # slower device lengthens
    on_device = anywhere("dev_self_ns")
    other = medians("other_ns") if "other_ns" in cols and not on_device and np.isfinite(cols["other_ns"]).any() else None
    gc = _block_means(cols["gc_ns"], row, uniq.size) if "gc_ns" in cols and np.isfinite(cols["gc_ns"]).any() else None
    job_step = medians("step_ns") if job and "step_ns" in cols else None
    return RankBlocks(rank, node, uniq, medians(self_name), medians("cpu_ns"), count, width, vol, data, gap,
                      sys_time, faults, delay, other, gc, job_step, own)  # fmt: skip


def _block_means(values: np.ndarray, row: np.ndarray, blocks: int) -> np.ndarray:
    """Mean per block of the steps that measured it (the kernel's tick-sampled system time: a mean, not a
    median, ``windows.summarize_windows``); NaN where none did."""
    v = np.asarray(values, dtype=np.float64)
    ok = np.isfinite(v)
    n = np.bincount(row[ok], minlength=blocks)
    with np.errstate(all="ignore"):
        return np.where(n > 0, np.bincount(row[ok], weights=v[ok], minlength=blocks) / n, np.nan).astype(np.float32)


def detect_episodes(blocks: Sequence[RankBlocks], opts: DetectionOptions, floor_effect: float = 0.5) -> list[Episode]:
    """Episodes of every rank, by rank and then step (rules: docs/detection.md, "Episodes").
    ``floor_effect``: how much of the minimum effect (in log) a segment must stand above the host's
    floor (half offline; live, judging with less of the run, the whole of it)."""
    ranks = [b for b in blocks if b.block.size]
    if len(ranks) < opts.min_ranks:
        return []
    width = max(b.width for b in ranks)
    ranks = [coarsened(b, width) for b in ranks]
    cols = np.unique(np.concatenate([b.block for b in ranks]))
    shape = (len(ranks), cols.size)
    # float32 (rank x block) matrices: about 35 bytes per cell in all while judging (8 more where the page
    # faults and system time were recorded, 12 more where the run-queue delay was)
    wall, cpu = np.full(shape, np.nan, dtype=np.float32), np.full(shape, np.nan, dtype=np.float32)
    count = np.zeros(shape, dtype=np.float32)
    vol = np.full(shape, np.nan, dtype=np.float32) if any(b.vol is not None for b in ranks) else None
    data = np.full(shape, np.nan, dtype=np.float32) if any(b.data is not None for b in ranks) else None
    gap = np.full(shape, np.nan, dtype=np.float32) if data is not None and any(b.gap is not None for b in ranks) else None
    thread = np.full(shape, np.nan, dtype=np.float32) if data is not None and any(b.own is not None for b in ranks) else None
    paging = all(b.sys is not None and b.faults is not None for b in ranks)
    sys_time = np.full(shape, np.nan, dtype=np.float32) if paging else None
    faults = np.full(shape, np.nan, dtype=np.float32) if paging else None
    delay = np.full(shape, np.nan, dtype=np.float32) if any(b.delay is not None for b in ranks) else None

    def outside(r: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Row ``r``'s time outside the timed phases: its blocks' positions among ``cols`` and their
        medians (made for a candidate segment only: no rank x block matrix of it is kept)."""
        b = ranks[r]
        return None if b.other is None else (np.searchsorted(cols, b.block), b.other)

    def collected(r: int, seg: np.ndarray) -> tuple[float, float] | None:
        """Row ``r``'s GC time per step over blocks ``seg`` (a contiguous range) and the other ranks' median
        of the same, where it grew by ``floor_ns`` over its own level outside them and stands that far above
        the others' (read from each rank's blocks for an episode only: no rank x block matrix of it)."""
        first, last = cols[seg[0]], cols[seg[-1]]

        def within(b: RankBlocks) -> slice:
            """Where the range lies in ``b``'s blocks."""
            i, j = np.searchsorted(b.block, [first, last + 1])
            return slice(int(i), int(j))

        def mean(v: np.ndarray) -> float:
            v = v[np.isfinite(v)]
            return float(v.mean()) if v.size else math.nan

        mine = ranks[r]
        if mine.gc is None:
            return None
        at = within(mine)
        level = mean(mine.gc[at])
        others = [m for i, b in enumerate(ranks) if i != r and b.gc is not None and math.isfinite(m := mean(b.gc[within(b)]))]
        rest = np.concatenate([mine.gc[: at.start], mine.gc[at.stop :]])
        rest = rest[np.isfinite(rest)]
        if not others or not math.isfinite(level) or not rest.size:
            return None
        typical = float(np.median(others))
        grown = level - float(np.median(rest))
        return (level, typical) if grown >= opts.floor_ns and level - typical >= opts.floor_ns else None

    for i, b in enumerate(ranks):
        pos = np.searchsorted(cols, b.block)
        wall[i, pos], cpu[i, pos], count[i, pos] = b.self_ns, b.cpu_ns, b.steps
        if vol is not None and b.vol is not None:
            vol[i, pos] = b.vol
        if data is not None and b.data is not None:
            data[i, pos] = b.data
        if gap is not None and b.gap is not None:
            gap[i, pos] = b.gap
        if thread is not None and b.own is not None:
            thread[i, pos] = b.own
        if sys_time is not None and faults is not None:
            sys_time[i, pos], faults[i, pos] = b.sys, b.faults
        if delay is not None and b.delay is not None:
            delay[i, pos] = b.delay
    wall[:, np.count_nonzero(np.isfinite(wall) & (wall > 0), axis=0) < opts.min_ranks] = np.nan
    cpu[:, np.count_nonzero(np.isfinite(cpu) & (cpu > 0), axis=0) < opts.min_ranks] = np.nan
    wall_ref = loo_median(wall)  # each rank's reference: the median of the other ranks
    cpu_ref = loo_median(cpu)
    # The wall self-time the change points judge: less what the host's preemption added, where measured
    judged = unpreempted(wall, cpu, delay)
    judged_ref = wall_ref if judged is wall else loo_median(judged)
    span = max(1, math.ceil(opts.episode_min_steps / width))  # the shortest episode, in blocks
    cpu_x = log_ratio(cpu, cpu_ref)
    cpu_sigma = noise_floor(cpu_x, opts) if np.isfinite(cpu_x).any() else None
    with np.errstate(all="ignore"):
        cpu_own = np.where(cpu > 0, np.log(cpu), np.nan)  # each rank's own CPU time, not against the others
    own_sigma = noise_floor(cpu_own, opts) if cpu_sigma is not None else None

    def own_cpu(r: int, seg: np.ndarray) -> bool:
        """Row ``r``'s own CPU-time level over blocks ``seg`` shifted by the minimum effect (docs/detection.md,
        "A compute episode shows in CPU time too")."""
        return own_sigma is None or has_effect(cpu_own[r], seg, segment_shift(cpu_own[r], seg), float(own_sigma[r]), opts)

    def more_cpu(r: int, seg: np.ndarray) -> bool:
        """The same, and its CPU time against the other ranks' too (a wall-time segment's test)."""
        if cpu_sigma is None:
            return True
        ratio = has_effect(cpu_x[r], seg, segment_shift(cpu_x[r], seg), float(cpu_sigma[r]), opts)
        return ratio and own_cpu(r, seg)

    found: list[Episode] = []
    # Wall self-time is what the job waits for; CPU time is immune to preemption, so on a busy host,
    # whose preemption makes every rank's wall time wander, a rank that computes more still shows.
    for channel, values, ref in (("self_ns", judged, judged_ref), ("cpu_ns", cpu, cpu_ref)):
        x = cpu_x if channel == "cpu_ns" else log_ratio(values, ref)
        if not np.isfinite(x).any():
            continue
        host_bar = opts.z_threshold * level_noise(x)
        length_bars = LengthBars(x, span, opts.z_threshold) if channel == "self_ns" else None
        stretches = stretch_levels(x, span)
        segments = []
        points = change_points(x, opts)
        # each rank's own shifts, left out of its level when another rank's segment is judged against it
        shifted = {r: np.concatenate([np.arange(p[1], p[2] + 1) for p in points if p[0] == r]) for r in {p[0] for p in points}}
        for r, b0, b1, confirm, active, sigma in points:
            seg = np.arange(b0, b1 + 1)
            shift = segment_shift(x[r], seg)
            # The CUSUM's range runs to the last block above its drift k on either side, so one noisy
            # block a few blocks off extends it; the edge blocks nearer the rank's level outside the
            # segment than the segment's own belong outside. An open episode keeps its end, unless its
            # last blocks, as many as the shortest episode's, are all back so: it ended, and the rank's
            # level stayed a little above its earlier one (a CI run's 8x fail-slow of 200-259 stayed open
            # to step 299 over blocks of 1.15x)
            trimmed = edges_trimmed(x[r], seg, shift)
            ended = active and int(seg[-1]) - int(trimmed[-1]) >= span
            seg = trimmed if ended or not active else edges_trimmed(x[r], seg, shift, keep_end=True)
            active = active and not ended
            if seg[0] != b0 or seg[-1] != b1:
                b0, b1 = int(seg[0]), int(seg[-1])
                confirm = max(confirm, b0)
                shift = segment_shift(x[r], seg)
            # the minimum effect within two standard errors of the segment's level (a plateau of exactly
            # min_effect is measured on either side of it); the host-wide bar without that allowance
            effect = has_effect(x[r], seg, shift, sigma, opts)
            if (cols[b1] - cols[b0] + 1) * width < opts.episode_min_steps or not effect:
                continue
            if channel == "cpu_ns" and not own_cpu(r, seg):
                continue  # its ratio rose as the others' CPU time fell (the host moved its load), not its own
            segments.append((r, b0, b1, confirm, active, sigma, seg, shift))
        # The host-wide bar is the wander preemption gives every rank's wall time; a rank that blocked
        # off its CPU once more per step over the segment (a read, a lock, a sleep), more than any
        # other rank ever did (other fail-slows aside: ``WanderFloor``), did not wander there:
        # preemption switches a thread involuntarily.
        waits = _blocked_spans(vol, segments, span) if channel == "self_ns" and vol is not None else {}
        pending: list[tuple[Episode, int, int, int, np.ndarray, float]] = []  # judged against the floor last
        for i, (r, b0, b1, confirm, active, sigma, seg, shift) in enumerate(segments):
            waited = waits.get(i)
            # The wall time's wander at the segment's own length: a plateau of tens of steps against
            # stretches as long, not against one block's spread. Cleared by that alone, it must also stand
            # the whole minimum effect above the host's floor below (not half of it).
            by_length = not (shift >= host_bar or waited is not None)
            if by_length and not (length_bars is not None and shift >= length_bars.at(seg.size)):
                continue
            blocked = None
            if waited is not None:
                # It waited from the first to the last block in which it blocked more; the wall time's
                # wander at the edges of the change points' range is the host's.
                seg, blocked = waited
                # A wait in a DataLoader's fetch is for the rank's producer (its loader workers), which a
                # loaded host starves one rank at a time: the data rules judge that input. Without a
                # DataLoader the input time is the gap between steps, and with one of no workers the fetch
                # runs on the rank's own thread: there the thread blocked itself (its reads, a lock, a
                # sleep), judged here, as any other wait.
                if data is not None and waited_for_input(wall[r], data[r], seg) and not in_gap(gap, r, seg) \
                        and not in_gap(thread, r, seg):
                    continue
                b0, b1 = int(seg[0]), int(seg[-1])
                confirm = max(confirm, b0)
                shift = segment_shift(x[r], seg)
                if (cols[b1] - cols[b0] + 1) * width < opts.episode_min_steps:
                    continue
            # Grown outside its timed phases with no more run-queue delay (``waited_outside``): its own code
            # between the phases waited off the CPU, which the switch counts cannot show on a DataLoader job
            # (the loader's queue waits are tens a step, a sleep's one is lost among them). It waited over
            # the blocks whose time outside the phases grew (``outside_span``), as a blocked span does; where
            # the counts showed a span too, that one, the loader's waits wandering around it, is narrowed so.
            own_wait = channel == "self_ns" and waited_outside(outside(r), delay, wall[r], r, seg, cols.size, opts)
            if own_wait:
                seg = outside_span(outside(r), seg, cols.size)
                b0, b1 = int(seg[0]), int(seg[-1])
                confirm = max(confirm, b0)
                shift = segment_shift(x[r], seg)
                if (cols[b1] - cols[b0] + 1) * width < opts.episode_min_steps:
                    continue
            # A change point needs a "before": a rank slow from its first judged steps has no baseline
            # to shift from (warm-up that lasts longer on one rank looks the same); it is the straggler
            # rules' business, which report one that recovers as an episode of their own.
            if baseline_steps(x[r, :b0], count[r, :b0]) < opts.episode_min_steps:
                continue
            # The rank's own shift, not the host's: when a busy loop moves between cores, several ranks'
            # ratios move at once (one up, another down) over the same blocks. A rank seen blocking has
            # shown that by its switch counts, which preemption does not raise (``blocked_span``); its
            # wall time need only have moved the minimum effect beyond the other ranks' median shift: at
            # 4 ranks the spread of 3 other shifts is no measure, and the host's answer to a rank leaving
            # its core (the others' levels moving 2x over the fault's own steps) widened it past a 2x wait.
            # So has a rank that waited outside its timed phases (``own_wait``, above): preemption spreads
            # over the phases by their length, and the time outside them is about 1 % of a step.
            if not stands_out(x, r, seg, opts, blocked=blocked is not None or own_wait, shifted=shifted):
                continue
            # Beyond the host's own wander at this length: above the highest stretch of the same
            # length anywhere else in the run, any rank, by half the minimum effect. On a busy host a
            # clean rank's CPU time moves between two levels 1.4-1.5x apart for tens of steps, one rank
            # after another; a level that only one rank ever reaches is no fault either, if it is no
            # higher than what the others reached. This holds for a rank seen blocking too: a thread
            # that waits for a producer the host starves (its loader workers) blocks more, and on a busy
            # host the ranks' waits wander so (4 DataLoader ranks beside a busy loop: 2-3x for 50-100 steps).
            # (judged after every other test, below: ``WanderFloor``)
            margin = math.log(opts.episode_min_effect) * (1.0 if by_length else floor_effect)
            own = stretch_levels(x[r : r + 1, seg] - outside_level(x[r], seg), span, level=False)
            excess = wall[r, seg] - wall_ref[r, seg]
            if not nan_median(excess) >= opts.floor_ns:  # the job did not wait for it
                continue
            # Blocked more per step than the others over the segment (a span of its own, or the counts'
            # median where the wall time alone cleared the host-wide bar): waking cost it CPU time too.
            rise = blocked if blocked is not None or vol is None else blocked_rise(vol[:, seg], r)
            kind, basis, share = compute_or_host(cpu[:, seg], wall[:, seg], r, opts, blocked=rise)
            if kind == "compute" and basis == "cpu_time" and not more_cpu(r, seg):
                # More work lengthens the CPU time at least as much as the wall time, by ratio ((c + x) / c
                # >= (w + x) / w, as c <= w; equal where the rank ran the same share of its wall time as
                # before): a wall-time episode whose CPU time did not shift by the minimum effect is not
                # its work. On short steps preemption alone grows CPU time past ``preempt_overhead`` of the
                # wall time lost (caches refilled): judged as the host's.
                kind, share = "host", None
            if kind == "compute" and sys_time is not None and faults is not None and kernel_paging(
                cpu[:, seg], sys_time[:, seg], faults[:, seg], r, opts
            ):
                kind, basis = "page_faults", "sys_cpu_time"
            if kind == "host" and rise is None and _measured(vol, r, seg):
                # Slower in wall time only, neither blocking nor computing more: preempted. The host moves
                # its load among the ranks for tens of steps at a time (a clean rank here 4-5x for 10 steps
                # under a busy loop), so a transient of it is the host's wander; a lasting one is the
                # straggler rules' host straggler. Unless the time it waited for a CPU says it was not:
                # its growth outside the timed phases, off the CPU, with no more run-queue delay, is a
                # wait of its own code (a sleep or a read in a trainer's callback), whose one switch a
                # step a DataLoader's queue hides among its tens.
                if not waited_outside(outside(r), delay, wall[r], r, seg, cols.size, opts):
                    continue
                basis = "off_cpu"
            between = None
            fetch = False  # the growth is a DataLoader's fetch (input, named as the straggler rule names it)
            gap_wait = False  # the growth is a wait off the CPU between steps of a loop without a DataLoader
            if data is not None and waited_for_input(wall[r], data[r], seg):
                # The input gap of a loop without a DataLoader that grew with the rank's CPU time, more than
                # preemption explains, is its own work between steps (the rule of ``attribution.gap_causes``
                # beside the CPU-versus-wall split), not an input wait.
                between = worked_between(data, gap, cpu, r, seg, opts) if kind == "compute" else None
                waiting = blocked is not None or rise is not None
                gap_wait = between is None and waiting and kind == "host" and in_gap(gap, r, seg)
                if between is None and blocked is None and rise is not None and not gap_wait and not in_gap(thread, r, seg):
                    continue  # as for a blocked span: a wait in the input fetch is for the data rules
                fetch = gap is not None and nan_median(gap[r, seg]) <= 0.5
            basis_work = "cpu_time"
            if kind == "compute" and between is None and not fetch and not gap_wait:
                # Its CPU work grew outside the timed phases (a loop with a DataLoader: the rank's own
                # code between them, a trainer's callbacks, its logging): its own work between steps too
                between = worked_outside(outside(r), wall[r], cpu[r], seg, cols.size, opts)
                basis_work = "outside_phases"
            if between is not None:
                kind, basis, share = "host_work", basis_work, between
            elif fetch:
                # slower in its DataLoader's fetch (preprocessing on the training thread, a slow read that
                # did not block more): its input path, the data straggler's kind; its CPU share kept only
                # where its CPU time grew with it (said: it works in its fetch), as the straggler rule does
                kind, basis, share = "data", "input_fetch", share if kind == "compute" else None
            elif gap_wait:
                # blocked off its CPU between steps, its CPU time not grown with the gap: it waits for its
                # input (``attribution.gap_causes``: "data"), as the straggler rule names such a rank
                kind, basis = "data", "off_cpu"
            if channel == "cpu_ns":
                # A starved rank's CPU time grows too (caches refilled, a shared core): on a busy host
                # 1.25-1.9x while its wall time grew 3-10x. More work is CPU time grown by more than
                # preemption costs for the wall time the rank lost (the straggler rule's bound).
                if not more_work(cpu, wall, cpu_ref, wall_ref, r, seg, opts) >= host_bar:
                    continue
            with np.errstate(all="ignore"):
                slowdown = float(nan_median(wall[r, seg] / wall_ref[r, seg]))
            gc_ns, cluster_gc_ns = collected(r, seg) or (None, None)
            pending.append((Episode(
                rank=ranks[r].rank, node=ranks[r].node, kind=kind, metric=channel,
                slowdown=_finite_or_none(slowdown),
                since_step=int(cols[b0] * width), until_step=int(cols[b1] * width + width - 1),
                confirmed_step=int(cols[confirm] * width + width - 1), active=active,
                steps=int((cols[b1] - cols[b0] + 1) * width), excess_ns=float(nan_median(excess)),
                between_steps=between is not None or gap_wait,
                job_time_lost_ns=float(np.nansum(np.maximum(excess, 0) * count[r, seg])),
                shift=float(np.exp(shift)), noise=float(sigma), kind_basis=basis, cpu_share=share,
                blocked_per_step=rise if kind == "host" else None, gc_ns=gc_ns, cluster_gc_ns=cluster_gc_ns,
            ), r, b0, b1, own, margin))  # fmt: skip
        # Every fail-slow of the run is judged against the host's wander without the others' clear ones.
        floor = WanderFloor(stretches, span, [(r, b0, b1, _peak(own)) for _, r, b0, b1, own, _ in pending],
                            math.log(opts.episode_min_effect))  # fmt: skip
        found += [e for e, r, b0, b1, own, margin in pending if floor.above(r, b0, b1, own, margin)]
    return _merged(found)


def _peak(own: np.ndarray) -> float:
    """The highest of a segment's stretches (-inf where none was judged)."""
    with np.errstate(all="ignore"):
        return float(np.nanmax(own, initial=-np.inf))


def _blocked_spans(vol: np.ndarray, segments: Sequence[tuple], span: int) -> dict[int, tuple[np.ndarray, float]]:
    """The segments (by index) in which their rank blocked (``blocked_span``) above the wander of the
    switch counts (``WanderFloor``, a switch per step, other ranks' clear waits aside)."""
    spans = {i: blocked_span(vol, seg[0], seg[6], span) for i, seg in enumerate(segments)}
    spans = {i: found for i, found in spans.items() if found is not None}
    if not spans:
        return {}
    floor = WanderFloor(stretch_levels(vol, span), span,
                        [(segments[i][0], int(sp[0]), int(sp[-1]), _peak(mine)) for i, (sp, _, mine) in spans.items()],
                        1.0)  # fmt: skip
    return {i: (sp, own) for i, (sp, own, mine) in spans.items()
            if floor.above(segments[i][0], int(sp[0]), int(sp[-1]), mine, 1.0)}  # fmt: skip


def recovered_stragglers(
    stragglers: Sequence[Mapping[str, Any]], found: Sequence[Episode], window_steps: int
) -> list[int]:
    """Ranks the window rules still call stragglers whose change points show them back: an episode of the
    rank that began with the straggler (no later than one window after its ``since_step``: the windows
    place an onset to within a window) and whose shift back was confirmed (the CUSUM's ``D > h``), and
    no episode of the rank still open. Windows of 50 steps say "still slow" up to two windows after a
    rank came back; the change point says when. An episode that began later is a further shift on top
    of the straggler's own (a rank 3x slow since the start, 5x for 25 steps): its end is the rank back
    at its straggler level, not at the cluster's."""
    out = []
    for s in stragglers:
        mine = [e for e in found if e.rank == s["rank"] and e.until_step >= s["since_step"]]
        if any(began_with(e.since_step, s["since_step"], window_steps) for e in mine) and not any(e.active for e in mine):
            out.append(int(s["rank"]))
    return out


def began_with(since_step: int, straggler_since: int, window_steps: int) -> bool:
    """An episode from ``since_step`` began with a straggler confirmed since ``straggler_since``: no later
    than one window after it (the windows place an onset to within a window)."""
    return since_step <= straggler_since + window_steps


def merge_episodes(
    found: Sequence[Episode], stragglers: Sequence[Mapping[str, Any]], recovered: Sequence[Mapping[str, Any]],
    window_steps: int,
) -> list[dict[str, Any]]:
    """The ``episodes`` of the diagnosis: change-point episodes, less those of a rank that is a straggler
    over the same steps (it stays a straggler) unless the episode began later than the straggler (more
    than one window after its ``since_step``) and ended: a further shift on top of the straggler's own,
    and the stragglers that recovered (window rules) that no change-point episode already covers, with
    the job time they lost (their excess over their steps)."""

    out = [e.to_dict() for e in found]
    out = [e for e in out if not any(_covered(e, s, window_steps) for s in stragglers)]
    for s in recovered:
        if not any(_overlaps(s, e) for e in out):
            lost = max(float(s.get("excess_ns") or 0.0), 0.0) * (s["until_step"] - s["since_step"] + 1)
            out.append({**s, "steps": s["until_step"] - s["since_step"] + 1, "job_time_lost_ns": lost})
    return sorted(out, key=lambda e: (e["rank"], e["since_step"]))


def _overlaps(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return a["rank"] == b["rank"] and a["since_step"] <= b["until_step"] and b["since_step"] <= a["until_step"]


def _covered(e: Mapping[str, Any], s: Mapping[str, Any], window_steps: int) -> bool:
    """Episode ``e`` is straggler ``s``'s own: of its rank, and still open, or over its steps and begun with
    it. Any other episode of the rank is listed beside the straggler."""
    if e["rank"] != s["rank"]:
        return False
    return e["active"] or (_overlaps(e, s) and began_with(e["since_step"], s["since_step"], window_steps))


def stragglers_beside_episodes(
    found: Sequence[Straggler], episodes: Sequence[Mapping[str, Any]], grid: WindowGrid, opts: DetectionOptions
) -> list[Straggler]:
    """The window rules judged again for each active straggler that has an episode listed beside it (a
    further shift on top of its own, or one apart from it): without the windows that overlap that
    episode, as if its rank had not summarised them. A fault of 60 steps on a rank slightly slow
    otherwise must not make it a persistent straggler, nor set its slowdown. The other ranks keep their
    verdicts. ``episodes`` are dicts with ``rank``, ``since_step``, ``until_step`` and ``active``; the
    grid is changed in place (docs/detection.md, "A straggler beside an episode")."""
    rows = {int(r): i for i, r in enumerate(grid.ranks)}
    again: set[int] = set()
    for s in found:
        if not s.active:
            continue
        mine = s.to_dict()
        for e in episodes:
            if e["rank"] == s.rank and not _covered(e, mine, opts.window_steps):
                grid.leave_out(rows[s.rank], e["since_step"], e["until_step"])
                again.add(s.rank)
    if not again:
        return list(found)
    judged = {s.rank: s for s in detect_stragglers(grid, opts) if s.rank in again}
    return sorted([s for s in found if s.rank not in again] + list(judged.values()), key=lambda s: s.rank)


def _merged(found: list[Episode]) -> list[Episode]:
    """One episode per stretch of a rank: where the two channels overlap, the CPU-time one (its range
    is not blurred by preemption), confirmed at the earlier of the two, but not before its own onset
    (the other channel's wider range may have been confirmed before it)."""
    out: list[Episode] = []
    for e in sorted(found, key=lambda e: (e.rank, e.metric != "cpu_ns", e.since_step)):
        same = [o for o in out if o.rank == e.rank and o.since_step <= e.until_step and e.since_step <= o.until_step]
        if same:
            if same[0].since_step <= e.confirmed_step < same[0].confirmed_step:
                same[0].confirmed_step = e.confirmed_step
            continue
        out.append(e)
    return sorted(out, key=lambda e: (e.rank, e.since_step))


def stands_out(x: np.ndarray, r: int, seg: np.ndarray, opts: DetectionOptions, blocked: bool = False,
               shifted: Mapping[int, np.ndarray] | None = None) -> bool:  # fmt: skip
    """Row ``r`` shifted over blocks ``seg`` while the other ranks did not: its shift (median over the
    blocks, less its typical ratio) is a ``z_threshold`` outlier (median/MAD, MAD at least
    ``min_mad_rel``) above the other ranks' shifts over the same blocks; ``blocked`` (the rank's switch
    counts already show the shift is its own): at least ``log(episode_min_effect)`` above their median.
    A rank's typical ratio is its level outside ``seg`` and outside its own ``shifted`` blocks (its
    change points' segments): another rank's fail-slow elsewhere in the run does not move its level."""
    shifted = shifted or {}
    with np.errstate(all="ignore"):
        levels = [outside_level(row, np.union1d(seg, shifted[i]) if i in shifted else seg) for i, row in enumerate(x)]
        moved = nan_median(x[:, seg], axis=1) - np.array(levels)
    others = np.delete(moved, r)
    others = others[np.isfinite(others)]
    if others.size == 0 or not np.isfinite(moved[r]):
        return False
    center = float(np.median(others))
    if blocked:
        return bool(moved[r] - center >= math.log(opts.episode_min_effect))
    spread = max(MAD_TO_SIGMA * float(np.median(np.abs(others - center))), opts.min_mad_rel)
    return bool(moved[r] - center >= opts.z_threshold * spread)


def has_effect(row: np.ndarray, seg: np.ndarray, shift: float, sigma: float, opts: DetectionOptions) -> bool:
    """A shift of ``row`` (a rank's log ratios) over blocks ``seg`` reaches ``episode_min_effect`` within
    two standard errors of the segment's level (``sigma``: one block's noise), so a plateau of exactly the
    minimum effect is found on either side of it."""
    judged = max(int(np.isfinite(row[seg]).sum()), 1)
    return bool(shift + 2.0 * sigma / math.sqrt(judged) >= math.log(opts.episode_min_effect))


def segment_shift(row: np.ndarray, seg: np.ndarray) -> float:
    """A rank's level over blocks ``seg`` (median log ratio) above its level outside them."""
    return float(nan_median(row[seg]) - outside_level(row, seg))


_TRIM_ROUNDS = 20


def edges_trimmed(row: np.ndarray, seg: np.ndarray, shift: float, keep_end: bool = False) -> np.ndarray:
    """Blocks ``seg`` of ``row`` (a rank's log ratios) less the leading and trailing blocks whose value is
    nearer the rank's level outside ``seg`` than the level inside (under half of its shift, or not
    judged); ``keep_end``: keep the trailing ones. Unchanged when no block is nearer the shifted level.

    The level inside starts at ``shift`` (the median over all of ``seg``) and is measured again on the
    blocks nearer it than the level outside, until it stays the same (at most ``_TRIM_ROUNDS`` times): a
    long tail of blocks near the outside level pulls the median over ``seg`` down, and with it the bar
    that should cut that tail (a 5x fault of 12 blocks whose CUSUM range ran 11 blocks past it, over
    blocks of 1.0-1.8x, kept them all against the first bar)."""
    if not shift > 0:
        return seg
    y = np.nan_to_num(row[seg] - outside_level(row, seg), nan=-np.inf)  # the blocks against the level outside
    lo, hi, level = 0, seg.size, shift
    for _ in range(_TRIM_ROUNDS):
        inside = np.flatnonzero(y[lo:hi] >= level / 2) + lo
        if not inside.size:
            break
        lo, hi = int(inside[0]), hi if keep_end else int(inside[-1]) + 1
        again = float(np.median(y[inside]))  # the level of the blocks nearer the shifted one
        if again == level:
            break
        level = again
    return seg[lo:hi]


def _measured(vol: np.ndarray | None, r: int, seg: np.ndarray) -> bool:
    """Row ``r``'s voluntary context switches were recorded over most of blocks ``seg``."""
    return vol is not None and np.isfinite(vol[r, seg]).sum() * 2 >= seg.size


def blocked_span(vol: np.ndarray, r: int, seg: np.ndarray, span_blocks: int,
                 ) -> tuple[np.ndarray, float, np.ndarray] | None:  # fmt: skip
    """Where row ``r`` of ``vol`` (rank x block medians of voluntary context switches per step: the
    training thread blocked) shows it waiting within blocks ``seg``: the span, how many more times per
    step it blocked there, and its stretches of ``span_blocks`` blocks over the span against its level
    outside it; None when it did not.

    The span runs from the first to the last block of ``seg`` in which the rank blocked at least half a
    switch per step more than at its own level outside ``seg``, widened over the blocks next to it that
    did too. Over the span, its rise (median, over its outside level) less the other ranks' median rise
    over the same blocks must be at least one switch per step; the caller then asks its highest stretch
    to stand a switch per step above every other stretch of that length (``WanderFloor`` on
    ``stretch_levels`` of ``vol``): a thread that waits for a producer the host starves (a loader
    worker, a thread holding the interpreter lock) blocks more too, and on a busy host every rank's
    waits wander so. A wait in the collective is a voluntary switch
    too, but a slow rank arrives last and waits less, so the collective can only lower a slow rank's
    count, never raise it; preemption switches a thread involuntarily, never voluntarily."""
    level = outside_level(vol[r], seg)
    span = _widened(np.nan_to_num(vol[r] - level, nan=0.0) >= 0.5, seg)
    if span is None:
        return None
    with np.errstate(all="ignore"):
        rise = nan_median(vol[:, span], axis=1) - np.array([outside_level(row, span) for row in vol])
    others = np.delete(rise, r)
    others = others[np.isfinite(others)]
    if not np.isfinite(rise[r]) or others.size == 0:
        return None
    own = float(rise[r] - np.median(others))
    if not (rise[r] >= 1.0 and own >= 1.0):
        return None
    return span, own, stretch_levels(vol[r : r + 1, span] - level, span_blocks, level=False)


def unpreempted(wall: np.ndarray, cpu: np.ndarray, delay: np.ndarray | None) -> np.ndarray:
    """Each (rank, block)'s self-time less the rise of its run-queue delay over the rank's own typical
    delay (what the host's preemption added), never below its CPU time; ``wall`` itself where the delay
    was not measured (docs/detection.md, "Episodes", "The run-queue delay")."""
    if delay is None or not np.isfinite(delay).any():
        return wall
    with np.errstate(all="ignore"):
        typical = last_axis_nan_median(delay)[0][:, None]
        rise = np.nan_to_num(np.maximum(delay - typical, 0), nan=0.0)
        least = np.where(np.isfinite(cpu), np.minimum(cpu, wall), wall)
        return np.where(np.isfinite(wall), np.maximum(wall - rise, least), wall).astype(np.float32)


def waited_for_input(wall: np.ndarray, data: np.ndarray, seg: np.ndarray) -> bool:
    """A rank's wall self-time grew over blocks ``seg`` (median, over its level outside them) mostly by
    its input wait (``data``: the same of its ``data_ns``, at least half the growth)."""
    with np.errstate(all="ignore"):
        grown = nan_median(wall[seg]) - outside_level(wall, seg)
        fetched = nan_median(data[seg]) - outside_level(data, seg)
    return bool(grown > 0 and fetched * 2 >= grown)


def in_gap(gap: np.ndarray | None, r: int, seg: np.ndarray) -> bool:
    """Row ``r``'s input time over blocks ``seg`` is the gap of a loop without a DataLoader (most steps);
    with ``data_own``'s blocks, a DataLoader fetch on the training thread."""
    return gap is not None and bool(nan_median(gap[r, seg]) > 0.5)


def worked_between(data: np.ndarray, gap: np.ndarray | None, cpu: np.ndarray, r: int, seg: np.ndarray,
                   opts: DetectionOptions) -> float | None:  # fmt: skip
    """Row ``r`` worked in the input gap over blocks ``seg``: its input time there is the gap of a loop
    without a DataLoader (``gap``, most of its steps), and ``attribution.gap_causes`` calls the gap's
    growth ``host_work``, the CPU time having grown with it (each over the rank's own level outside the
    blocks; the noise bar from the other ranks' spread of the same growth of CPU time). Returns the CPU
    time's growth as a share of the gap's, or None (a DataLoader's fetch, a wait off the CPU, or no
    evidence either way: the data rules judge it)."""
    if not in_gap(gap, r, seg):
        return None
    with np.errstate(all="ignore"):
        fetched = nan_median(data[r, seg]) - outside_level(data[r], seg)
        grown = np.array([nan_median(cpu[i, seg]) - outside_level(cpu[i], seg) for i in range(cpu.shape[0])])
    others = np.delete(grown, r)
    others = others[np.isfinite(others)]
    if not (np.isfinite(fetched) and fetched > 0 and np.isfinite(grown[r])) or others.size == 0:
        return None
    noise = opts.signal_z * MAD_TO_SIGMA * float(np.median(np.abs(others - np.median(others))))
    cause = gap_causes(np.array([fetched]), np.array([np.nan]), grown[r : r + 1], np.array([0.0]),
                       np.array([noise]), opts)[0]  # fmt: skip
    return float(grown[r] / fetched) if cause == "host_work" else None


def _placed(other: tuple[np.ndarray, np.ndarray], blocks: int) -> np.ndarray:
    """A rank's medians of ``other_ns`` (``other``: their positions among the ``blocks`` judged, and the
    values) as a row of ``blocks``, NaN where the rank has no block."""
    row = np.full(blocks, np.nan, dtype=np.float32)
    row[other[0]] = other[1]
    return row


def grew_outside(other: tuple[np.ndarray, np.ndarray] | None, wall: np.ndarray, seg: np.ndarray, blocks: int,
                 opts: DetectionOptions) -> tuple[float, float] | None:  # fmt: skip
    """A rank's time outside every timed phase (``other``: the positions of its blocks among the
    ``blocks`` judged, and its medians of ``other_ns`` there) grew over blocks ``seg`` by at least
    ``explain_share`` of its self-time's growth (``wall``), and by ``floor_ns``, each over the rank's own
    level outside the blocks: the forward, backward and optimizer step did not hold the growth, its own
    code between them did. Returns (that time's growth, the self-time's), or None."""
    if other is None:
        return None
    row = _placed(other, blocks)
    with np.errstate(all="ignore"):
        grown = nan_median(row[seg]) - outside_level(row, seg)
        wall_grown = nan_median(wall[seg]) - outside_level(wall, seg)
    return (float(grown), float(wall_grown)) if held_outside(grown, wall_grown, opts) else None


def worked_outside(other: tuple[np.ndarray, np.ndarray] | None, wall: np.ndarray, cpu: np.ndarray,
                   seg: np.ndarray, blocks: int, opts: DetectionOptions) -> float | None:  # fmt: skip
    """A rank's compute episode over blocks ``seg`` lies outside its timed phases (``grew_outside``): its
    own work between steps (docs/detection.md, "The work between steps"). Returns the CPU time's growth
    as a share of the time outside the phases', or None."""
    grew = grew_outside(other, wall, seg, blocks, opts)
    if grew is None:
        return None
    with np.errstate(all="ignore"):
        cpu_grown = nan_median(cpu[seg]) - outside_level(cpu, seg)
    return float(cpu_grown / grew[0]) if np.isfinite(cpu_grown) else None


def outside_span(other: tuple[np.ndarray, np.ndarray] | None, seg: np.ndarray, blocks: int) -> np.ndarray:
    """The blocks over which a rank's time outside its timed phases (``other``, as for ``grew_outside``)
    grew: from the first to the last block of ``seg`` at least half the segment's growth (median, over the
    rank's own level outside ``seg``) above that level, widened over the blocks next to them that are too
    (the change points' range may start or end a block off). ``seg`` itself where nothing grew."""
    if other is None:
        return seg
    row = _placed(other, blocks)
    with np.errstate(all="ignore"):
        level = outside_level(row, seg)
        grown = nan_median(row[seg]) - level
    if not (np.isfinite(grown) and grown > 0):
        return seg
    span = _widened(np.nan_to_num(row - level, nan=0.0) >= grown / 2, seg)
    return seg if span is None else span


def _widened(more: np.ndarray, seg: np.ndarray) -> np.ndarray | None:
    """The blocks from the first to the last of ``seg`` where ``more`` (a row of booleans) holds, widened
    over the blocks next to them where it holds too (the change points' range may start or end a block
    off); None where it holds in none of ``seg``."""
    up = np.flatnonzero(more[seg])
    if not up.size:
        return None
    first, last = int(seg[up[0]]), int(seg[up[-1]])
    while first > 0 and more[first - 1]:
        first -= 1
    while last + 1 < more.size and more[last + 1]:
        last += 1
    return np.arange(first, last + 1)


def waited_outside(other: tuple[np.ndarray, np.ndarray] | None, delay: np.ndarray | None, wall: np.ndarray,
                   r: int, seg: np.ndarray, blocks: int, opts: DetectionOptions) -> bool:  # fmt: skip
    """A rank's wall-time episode over blocks ``seg`` whose CPU time did not grow was not preemption: it
    grew outside its timed phases (``grew_outside``) while its run-queue delay within the self-time
    (``delay``, the time it was ready to run and waited for a CPU) grew by less than ``explain_share``
    of the self-time's growth (over its own level outside the blocks). Preemption is that delay; so the
    thread waited off its CPU, in its own code between the phases. False where either column was not
    measured."""
    grew = grew_outside(other, wall, seg, blocks, opts) if delay is not None else None
    if grew is None or delay is None:
        return False
    with np.errstate(all="ignore"):
        delay_grown = nan_median(delay[r, seg]) - outside_level(delay[r], seg)
    return bool(np.isfinite(delay_grown) and delay_grown < opts.explain_share * grew[1])


def baseline_steps(x: np.ndarray, count: np.ndarray) -> int:
    """The judged steps before a segment (``x``: its rank's log ratios of the blocks before it, NaN: not
    judged; ``count``: the steps recorded in those blocks)."""
    return int(count[np.isfinite(x)].sum())


def more_work(cpu: np.ndarray, wall: np.ndarray, cpu_others: np.ndarray, wall_others: np.ndarray, r: int,
              seg: np.ndarray, opts: DetectionOptions) -> float:  # fmt: skip
    """Row ``r``'s CPU time over blocks ``seg`` beyond the other ranks' median (``cpu_others``:
    ``loo_median(cpu)``) and beyond what preemption costs for the wall time it lost
    (``preempt_overhead`` x its wall-time excess over ``wall_others``), as the log of its ratio over the
    others' CPU time (median over the blocks; NaN: not judged)."""
    with np.errstate(all="ignore"):
        cpu_ref = cpu_others[r, seg]
        wall_ex = np.maximum(wall[r, seg] - wall_others[r, seg], 0.0)
        grown = nan_median(cpu[r, seg] - cpu_ref - opts.preempt_overhead * wall_ex)
        return float(np.log((nan_median(cpu_ref) + grown) / nan_median(cpu_ref)))


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None

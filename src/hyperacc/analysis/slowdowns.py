"""Slowdowns of the whole job: stretches in which the job's own step time shifts up and later back,
whoever caused it (docs/detection.md, "Slowdowns of the job").

The episode rules (``episodes.py``) judge each rank against the other ranks of the same steps, so that
the host's wander, which moves every rank, cancels. That makes them blind to what moves several ranks at
once: another process that takes the cores of some ranks (it preempts them: their CPU time is flat, so
the rank rules call it the host's wander), a slower collective, storage that every rank waits for. The
job waits all the same. Here the series is the job's: the step time of its slowest rank
(``run_reduce._Cluster.step_max``, after the warm-up), in the episodes' blocks, against its own level:

* **Blocks.** The median of the job's step time over each block of ``episode_block_steps`` steps (the
  episodes' blocks; a block with fewer than half its steps timed is not judged); ``x`` = its log.
* **Change points.** The two-sided CUSUM of ``change_points.change_points`` on ``x`` less its median,
  with ``k = log(episode_min_effect) / 2``, ``h = episode_h x sigma`` and ``sigma`` the robust spread of
  ``x``'s successive differences (at least ``min_mad_rel``); the edges trimmed as an episode's
  (``episodes.edges_trimmed``).
* **A slowdown** lasts at least ``episode_min_steps`` steps, its shift over the job's level outside it is
  at least ``log(episode_min_effect)`` within two standard errors and ``z_threshold`` x the noise of
  stretches of its own length (``LengthBars``), it has ``episode_min_steps`` judged steps before it (or,
  offline, it is the run's first judged steps and has as many after it: ``from_start``), its
  highest stretch of ``episode_min_steps`` steps stands half the minimum effect above every stretch as
  long elsewhere in the run (``WanderFloor``: the job's own wander at that length, other slowdowns that
  clear it aside), and it costs at least ``floor_ns`` a step. The ``top_events`` costliest are kept.
* **Who and what.** Over the slowdown against outside it, each rank's own rise of self-time, CPU time,
  run-queue delay, input wait and GC time (block medians; ``RankBlocks``). Where no rank's self-time
  rose by ``explain_share`` of the job's rise: ``communication`` where the wait of the last rank to
  arrive (the collective's own time) rose by that much, else ``in_turn`` (the ranks took turns to be the
  slow one), ``unknown`` where the waits were not measured; else the job waited for the ranks whose rise is at least
  ``explain_share`` of the largest (``ranks``; all of them: ``shared``). Their kind, by the first of
  their median rises that holds ``explain_share`` of their self-time's: ``gc``, ``data``,
  ``preempted`` (the run-queue delay: ready to run, no CPU for it), ``compute`` (CPU time); else
  ``host`` where what neither explains holds it (off the CPU: a read, a lock), ``compute_or_host``
  where the two together do, ``unknown`` where nothing measured does.

Pure functions over arrays; ``run_dir.diagnose`` feeds them and drops a slowdown that a rank's episode
or straggler already explains (``explained``).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from hyperacc.analysis.change_points import (
    LengthBars,
    WanderFloor,
    change_points,
    outside_level,
    stretch_levels,
)
from hyperacc.analysis.episodes import RankBlocks, edges_trimmed, has_effect, segment_shift
from hyperacc.analysis.options import DetectionOptions
from hyperacc.stats import last_axis_nan_median, nan_median


@dataclasses.dataclass(frozen=True)
class Slowdown:
    since_step: int  # first step of the first block of the shift
    until_step: int  # last step of the last block before the shift back (or of the run)
    confirmed_step: int  # last step of the block in which the CUSUM crossed its decision interval
    active: bool  # still shifted at the job's last block
    steps: int
    slowdown: float  # the job's step time over its level outside, median over the blocks
    step_ns: float  # the job's step time over the slowdown (median of its blocks)
    baseline_ns: float  # ... and outside it
    job_time_lost_ns: float  # the step time over the baseline, summed over the slowdown's steps
    kind: str  # preempted | compute | data | gc | host | compute_or_host | unknown | communication | in_turn
    ranks: list[int]  # the ranks the job waited for (module docstring)
    shared: bool  # every judged rank
    self_rise_ns: float | None  # their median rise of self-time per step (None: no rank)
    cause_rise_ns: float | None  # ... and of what the kind names (run-queue delay, CPU, input, GC)
    cpu_rise_ns: float | None  # ... of CPU time (None: not measured)
    delay_rise_ns: float | None  # ... of run-queue delay (None: not measured)
    noise: float  # sigma of a block's log step time
    # the nodes all of whose judged ranks are ``ranks`` and no other, where the job has more than one node
    # and not all of them are (a node's noisy neighbour, its storage): told as the node's
    nodes: list[int] = dataclasses.field(default_factory=list)
    # from the run's first judged step, with no level before it: slow against the level after it (a node
    # that another process still held when the job began); offline only
    from_start: bool = False
    # ``in_turn``: what the ranks did more by turns (a ``_KINDS`` name), where over every judged rank its
    # rise holds ``explain_share`` of their self-time's (medians over the ranks); None: nothing did
    turns_of: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def job_blocks(steps: np.ndarray, step_ns: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """The blocks (``step // width``, sorted; only those holding a timed step, so a run numbered from
    10**12 costs its blocks, not a dense array) and the job's median step time in each, over the steps
    timed (``step_ns`` finite); NaN where fewer than half a block's steps were.

    ``steps`` strictly increasing (the cluster's): each step has its own place in a (block x width)
    matrix, whose rows' medians are a sort of ``width`` values each (0.3 s for a week of 6 million steps,
    against 2.8 s for one sort of them all)."""
    steps = np.asarray(steps)
    ok = np.isfinite(step_ns)
    block = steps[ok] // width
    values = np.asarray(step_ns, dtype=np.float64)[ok]
    uniq, row = np.unique(block, return_inverse=True)
    grid = np.full((uniq.size, width), np.nan)
    grid[row, steps[ok] - block * width] = values
    med, count = last_axis_nan_median(grid)
    med[count * 2 < width] = np.nan
    return uniq.astype(np.int64), med


def detect_slowdowns(
    steps: np.ndarray, step_ns: np.ndarray, ranks: Sequence[RankBlocks], opts: DetectionOptions,
    least_wait: np.ndarray | None = None,
) -> list[Slowdown]:  # fmt: skip
    """The job's slowdowns (module docstring). ``steps`` (strictly increasing), ``step_ns``: the job's
    step time per step (NaN: not timed); ``ranks``: every rank's blocks, for who and what;
    ``least_wait``: the least wait in the collective of any rank per step (the last rank to arrive's:
    the collective's own time; inf or NaN: not measured)."""
    width = max([opts.episode_block_steps, *(b.width for b in ranks)])
    block, value = job_blocks(steps, step_ns, width)

    def lost(since: int, until: int, outside: float) -> float:
        timed = (steps >= since) & (steps <= until) & np.isfinite(step_ns)
        return float(np.clip(step_ns[timed] - outside, 0.0, None).sum())

    return slowdowns_of_blocks(block, value, width, ranks, opts, lost,
                               lambda since, until: _collective_rise(steps, least_wait, since, until), from_start=True)  # fmt: skip


def slowdowns_of_blocks(
    block: np.ndarray, value: np.ndarray, width: int, ranks: Sequence[RankBlocks], opts: DetectionOptions,
    lost: Callable[[int, int, float], float] | None = None, collective: Callable[[int, int], float] | None = None,
    floor_effect: float = 0.5, from_start: bool = False,
) -> list[Slowdown]:  # fmt: skip
    """The rule over the job's blocks already made: ``block`` (sorted block numbers), ``value`` (the job's
    step time in each; NaN: not judged), ``width`` steps a block. ``lost(since, until, level)``: the job
    time over ``level`` in steps ``since..until`` (default: from the blocks); ``collective(since, until)``:
    the rise of the last rank's wait there (default: not measured); ``floor_effect``: how much of the
    minimum effect (in log) a slowdown's highest stretch must stand above the job's wander elsewhere
    (``WanderFloor``; live, with less of the run to learn the wander from, all of it); ``from_start``:
    whether a slowdown over the first judged blocks, with no level before it, is found against the level
    after it (offline; live, the history's first blocks are not the run's)."""
    if np.count_nonzero(np.isfinite(value)) < 3:
        return []
    if lost is None:
        def lost(since: int, until: int, outside: float) -> float:
            at = (block * width >= since) & (block * width <= until) & np.isfinite(value)
            return float(np.clip(value[at] - outside, 0.0, None).sum()) * width
    with np.errstate(all="ignore"):
        x = np.where(value > 0, np.log(value), np.nan)[None, :]
    span = max(1, math.ceil(opts.episode_min_steps / width))
    bars = LengthBars(x, span, opts.z_threshold)
    found = []
    for _, b0, b1, confirm, active, sigma in change_points(x, opts):
        if (int(block[b1]) - int(block[b0]) + 1) * width < opts.episode_min_steps:
            continue  # too short already (trimming only shortens it): no median of the whole row for it
        seg = np.arange(b0, b1 + 1)
        shift = segment_shift(x[0], seg)
        seg = edges_trimmed(x[0], seg, shift, keep_end=active)
        shift = segment_shift(x[0], seg)
        b0, b1 = int(seg[0]), int(seg[-1])
        if (int(block[b1]) - int(block[b0]) + 1) * width < opts.episode_min_steps or not has_effect(x[0], seg, shift, sigma, opts):
            continue
        start = bool(np.count_nonzero(np.isfinite(x[0, :b0])) * width < opts.episode_min_steps)
        if start and not (from_start and not active
                          and np.count_nonzero(np.isfinite(x[0, b1 + 1:])) * width >= opts.episode_min_steps):
            continue  # no "before" to shift from, and no "after" where one may stand for it
        if shift < bars.at(seg.size, outside=(b0, b1)):
            continue  # within the job's own wander at this length
        own = stretch_levels(x[:, seg] - outside_level(x[0], seg), span, level=False)
        peak = float(np.nanmax(own, initial=-np.inf)) if own.size else -math.inf
        found.append((b0, b1, max(int(confirm), b0), bool(active), float(sigma), seg, shift, own, peak, start))
    if not found:
        return []
    margin = math.log(opts.episode_min_effect) * floor_effect
    floor = WanderFloor(stretch_levels(x, span), span, [(0, f[0], f[1], f[8]) for f in found], margin)
    kept = []
    for b0, b1, confirm, active, sigma, seg, shift, own, _, start in found:
        if not floor.above(0, b0, b1, own, margin):
            continue
        inside, outside = float(np.nanmedian(value[seg])), float(np.nanmedian(np.delete(value, seg)))
        if not inside - outside >= opts.floor_ns:
            continue  # too little time a step to matter (the episodes' own floor)
        since, until = int(block[b0]) * width, int(block[b1]) * width + width - 1
        kept.append((lost(since, until, outside), since, until, int(block[confirm]) * width + width - 1, active,
                     sigma, shift, inside, outside, start))  # fmt: skip
    # who and what (a pass over every rank's blocks each) for the ``top_events`` costliest only: bounded
    # work at any number of ranks and slowdowns
    out = []
    for job_lost, since, until, confirmed, active, sigma, shift, inside, outside, start in sorted(
            heapq.nlargest(opts.top_events, kept), key=lambda k: k[1]):  # fmt: skip
        rise = collective(since, until) if collective is not None else math.nan
        who = _who(ranks, since, until, inside - outside, opts, rise)
        out.append(Slowdown(
            since_step=since, until_step=until, confirmed_step=confirmed, active=active, steps=until - since + 1,
            slowdown=float(math.exp(shift)), step_ns=inside, baseline_ns=outside, job_time_lost_ns=job_lost,
            noise=sigma, from_start=start, **who,
        ))  # fmt: skip
    return out


def ranks_job_blocks(ranks: Sequence[RankBlocks], upto: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The job's blocks from its ranks' own (those with ``job_step``, the live blocks): the block numbers
    (through ``upto``) and the job's step time in each, the median of the ranks' medians (in lockstep every
    rank's step lasts as long as the slowest one's; NaN: no rank's)."""
    have = [b for b in ranks if b.job_step is not None and b.block.size]
    if not have:
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    first = have[0].block
    if upto is None and all(np.array_equal(b.block, first) for b in have):  # the usual case: stacked
        return first, nan_median(np.stack([b.job_step for b in have]), axis=0)
    block = np.unique(np.concatenate([b.block for b in have]))
    if upto is not None:
        block = block[block <= upto]
    step = np.full((len(have), block.size), np.nan)
    for i, b in enumerate(have):
        at = np.searchsorted(block, b.block)
        ok = (at < block.size) & (block[np.minimum(at, block.size - 1)] == b.block)
        step[i, at[ok]] = b.job_step[ok]
    return block, nan_median(step, axis=0)


_RISES = 64  # ranks whose blocks are stacked at once (``_rises``)
_STACK_BLOCKS = 2_000  # ... where they have at most this many blocks


def _rises(ranks: Sequence[RankBlocks], since: int, until: int) -> dict[int, dict[str, float]]:
    """Each rank's rise (``median_rise``) of self-time and of what ``_KINDS`` name over steps
    ``since..until``, for the ranks with blocks both inside and outside. Where ranks have the same few
    blocks (the live history: 200), ``_RISES`` of them are stacked and their medians taken in one pass (a
    pass per rank and column took 0.8 s at 1,024 ranks of 200 blocks, the stacked passes 0.12 s); with
    many blocks (offline) the pass per rank is the faster (1.4 s at 1,000 ranks of 20,000 blocks, stacked
    2.4 s: the copies cost more than the calls)."""
    columns = ("self_ns", *(c for _, c in _KINDS))
    out: dict[int, dict[str, float]] = {}
    for i in range(0, len(ranks), _RISES):
        chunk = ranks[i:i + _RISES]
        first = chunk[0]
        alike = [first.block.size <= _STACK_BLOCKS and b.width == first.width and np.array_equal(b.block, first.block)
                 for b in chunk]  # fmt: skip
        groups = [[b for b, a in zip(chunk, alike, strict=True) if a]] + [[b] for b, a in zip(chunk, alike, strict=True) if not a]
        for group in groups:
            if not group:
                continue
            start = group[0].block * group[0].width
            inside = (start >= since) & (start <= until)
            if not (inside.any() and (~inside).any()):
                continue
            if len(group) == 1:
                (b,) = group
                out[b.rank] = {c: math.nan if getattr(b, c) is None else
                               median_rise(np.asarray(getattr(b, c), dtype=np.float64), inside) for c in columns}  # fmt: skip
                continue
            values = {}
            for c in columns:
                have = [getattr(b, c) is not None for b in group]
                m = np.full((len(group), inside.size), np.nan)
                if any(have):
                    m[have] = np.stack([getattr(b, c) for b, h in zip(group, have, strict=True) if h])
                values[c] = nan_median(m[:, inside], axis=1) - nan_median(m[:, ~inside], axis=1)
            for j, b in enumerate(group):
                out[b.rank] = {c: float(values[c][j]) for c in columns}
    return out


def median_rise(v: np.ndarray, inside: np.ndarray) -> float:
    """The median of ``v``'s finite values where ``inside`` less their median elsewhere (NaN: none on
    either side)."""
    ok = np.isfinite(v)
    a, o = v[ok & inside], v[ok & ~inside]
    return float(np.median(a) - np.median(o)) if a.size and o.size else math.nan


# What a slowdown's ranks did more, in the order tried: the first whose rise holds ``explain_share`` of
# their self-time's rise names the kind (docs/detection.md, "Slowdowns of the job")
_KINDS = (("gc", "gc"), ("data", "data"), ("preempted", "delay"), ("compute", "cpu_ns"))


def _collective_rise(steps: np.ndarray, least_wait: np.ndarray | None, since: int, until: int) -> float:
    """The least wait's rise over steps ``since..until`` (``median_rise``; NaN: not measured)."""
    if least_wait is None:
        return math.nan
    return median_rise(np.asarray(least_wait, dtype=np.float64), (steps >= since) & (steps <= until))


def _who(ranks: Sequence[RankBlocks], since: int, until: int, rise: float, opts: DetectionOptions,
         collective: float = math.nan) -> dict[str, Any]:  # fmt: skip
    """The ranks the job waited for over steps ``since..until`` (``rise``: the job's rise of step time;
    ``collective``: the rise of the last rank's wait, the collective's own time) and what they did more."""
    rises = _rises(ranks, since, until)
    judged = {r: v for r, v in rises.items() if math.isfinite(v["self_ns"])}
    top = max((v["self_ns"] for v in judged.values()), default=math.nan)
    none = {"ranks": [], "shared": False, "self_rise_ns": None, "cause_rise_ns": None, "cpu_rise_ns": None,
            "delay_rise_ns": None}
    if not top >= opts.explain_share * rise:
        # No rank slowed throughout. Either the collective itself did (the last rank to arrive waited
        # longer too), or the ranks took turns to be the last one, each slow at some steps only.
        if len(judged) < 2 or not math.isfinite(collective):
            return {"kind": "unknown", **none}
        if collective >= opts.explain_share * rise:
            return {"kind": "communication", **none}
        return {"kind": "in_turn", **none, **_turns(judged, opts)}
    # the ranks that slowed about as much as the most (the slowest rank's step is the job's: the others'
    # rises may each be under half of the job's and still be the same slowdown)
    slow = sorted(r for r, v in judged.items() if v["self_ns"] >= max(opts.explain_share * top, opts.floor_ns))
    self_rise = float(np.median([judged[r]["self_ns"] for r in slow]))
    part = {c: _median_over(judged, slow, c) for _, c in _KINDS}
    held = _held_part(part, self_rise, opts)
    if held is not None:
        kind, cause = held
    else:  # no one part holds half of it
        cpu, delay = part["cpu_ns"], part["delay"]
        off = self_rise - cpu - (delay if math.isfinite(delay) else 0.0)
        if off >= opts.explain_share * self_rise:  # NaN where the CPU time was not measured
            kind, cause = "host", None  # off the CPU, and not for want of one
        elif np.nansum([max(cpu, 0.0), max(delay, 0.0)]) >= opts.explain_share * self_rise:
            kind, cause = "compute_or_host", None  # some more work, some more waiting for a CPU
        else:
            kind, cause = "unknown", None
    return {"kind": kind, "ranks": slow, "shared": len(slow) == len(judged) and len(judged) > 1,
            "self_rise_ns": self_rise, "cause_rise_ns": cause, "cpu_rise_ns": _finite(part["cpu_ns"]),
            "delay_rise_ns": _finite(part["delay"]), "nodes": _whole_nodes(ranks, judged, slow)}  # fmt: skip


def _turns(judged: Mapping[int, Mapping[str, float]], opts: DetectionOptions) -> dict[str, Any]:
    """What ranks slow by turns did more: over every judged rank, the median rise of self-time and the
    first of ``_KINDS`` whose median rise holds ``explain_share`` of it (each rank slow at some steps
    only, its median rise is a part of the job's). A busy process moving between the cores of unbound
    ranks raised each one's run-queue delay in turn (an outside job: +0.5 to +4.9 ms a step on its 4 ranks
    while the job's step time rose 17 ms)."""
    everyone = sorted(judged)
    self_rise = _median_over(judged, everyone, "self_ns")
    if not self_rise >= opts.floor_ns:
        return {}
    part = {c: _median_over(judged, everyone, c) for _, c in _KINDS}
    held = _held_part(part, self_rise, opts)
    if held is None:
        return {}
    return {"turns_of": held[0], "self_rise_ns": self_rise, "cause_rise_ns": held[1],
            "cpu_rise_ns": _finite(part["cpu_ns"]), "delay_rise_ns": _finite(part["delay"])}  # fmt: skip


def _held_part(part: Mapping[str, float], self_rise: float, opts: DetectionOptions) -> tuple[str, float] | None:
    """The first of ``_KINDS`` whose rise (``part``, by column) holds ``explain_share`` of ``self_rise``,
    with that rise; None where none does."""
    for name, column in _KINDS:
        if part[column] >= opts.explain_share * self_rise:
            return name, part[column]
    return None


def _whole_nodes(ranks: Sequence[RankBlocks], judged: Mapping[int, Any], slow: Sequence[int]) -> list[int]:
    """The nodes whose judged ranks are exactly ``slow`` (all of each, none elsewhere), where the job has
    more than one node and not every node is one of them; else none."""
    node_of = {b.rank: b.node for b in ranks if b.rank in judged}
    members: dict[int, set[int]] = {}
    for rank, node in node_of.items():
        members.setdefault(node, set()).add(rank)
    hit = {node_of[r] for r in slow}
    if len(members) < 2 or len(hit) == len(members) or set().union(*(members[n] for n in hit)) != set(slow):
        return []
    return sorted(hit)


def _median_over(judged: Mapping[int, Mapping[str, float]], ranks: Sequence[int], column: str) -> float:
    """The median of ``column``'s rise over ``ranks``, where more than half of them measured it (NaN else)."""
    values = [judged[r][column] for r in ranks if math.isfinite(judged[r][column])]
    return float(np.median(values)) if 2 * len(values) > len(ranks) else math.nan


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


def explained(slowdown: Mapping[str, Any], culprits: Sequence[Mapping[str, Any]]) -> bool:
    """Whether rank findings (episodes, stragglers: ``rank``, ``since_step``, ``until_step``) already
    explain a slowdown: one of its ranks (any rank, where it names none) has a finding that overlaps at
    least half of its steps."""
    lo, hi = slowdown["since_step"], slowdown["until_step"]
    named = set(slowdown["ranks"])
    for c in culprits:
        if named and c["rank"] not in named:
            continue
        overlap = min(hi, c["until_step"]) - max(lo, c["since_step"]) + 1
        if 2 * overlap >= hi - lo + 1:
            return True
    return False

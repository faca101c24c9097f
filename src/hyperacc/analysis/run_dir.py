"""Diagnose a run directory: reduce each rank to small findings, merge them, then judge.

Ranks are read and reduced one at a time by a small pool of threads (pyarrow and numpy release the
GIL), at most ``workers + 1`` ranks in flight, and merged in rank order by the calling thread. Memory is
bounded: the ranks in flight (steps x ~21 float64 each), per-step arrays for the cluster (about 60
bytes per step, 40 of them for the coordination view) and the window summaries (ranks x windows rows
of ~17 float32: 140 MB for 1,000 ranks x 100,000 steps at 50-step windows, plus the rank x window
matrices the straggler rules judge).
Rules: docs/detection.md.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import os
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa

from hyperacc import store, theory
from hyperacc.analysis.columns import RankSource, RunLayout, discover, read_rank
from hyperacc.analysis.coordination import RUNTIME_CAUSES, coordination, distribution, failure_modes, to_dict
from hyperacc.analysis.diagnosis import Diagnosis, explain
from hyperacc.analysis.excess import cause_groups, grouped, rank_excess
from hyperacc.analysis.options import CAUSES, DetectionOptions
from hyperacc.analysis.projection import project
from hyperacc.analysis.resources import ResourceOptions, resource_findings
from hyperacc.analysis.spikes import communication_spikes, judge_spikes, wilson_interval
from hyperacc.analysis.stragglers import detect_stragglers, judged_windows
from hyperacc.analysis.windows import RANK_CAUSES, concat_windows, summarize_windows

_EVENT = tuple[float, int, int, int, "str | None", str]  # (excess_ns, rank, node, step, phase, cause)


@dataclasses.dataclass
class RankFindings:
    """What one rank contributes to the diagnosis (small: no per-step arrays beyond a few int columns)."""

    rank: int
    node: int
    steps: np.ndarray  # every recorded step (warm-up included)
    judged: np.ndarray  # steps judged for spikes
    spikes: np.ndarray  # steps that spiked
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
    self_median_ns: float = float("nan")  # median self-time (busy time where self-time was not measured)
    step_total_ns: float = 0.0  # summed step time

    @property
    def main_cause(self) -> str | None:
        return max(self.time_lost.items(), key=lambda kv: kv[1])[0] if self.time_lost else None


def reduce_rank(rank: int, node: int, cols: dict[str, np.ndarray], opts: DetectionOptions) -> RankFindings:
    """Pure reduction of one rank's columns (``columns.read_rank``) to its findings."""
    all_steps = cols["step"]
    keep = all_steps >= all_steps[0] + opts.warmup_steps if all_steps.size else np.zeros(0, dtype=bool)
    cols = {k: v[keep] for k, v in cols.items()}
    cols["node"] = np.full(cols["step"].size, node, dtype=np.int64)
    cols["rank"] = np.full(cols["step"].size, rank, dtype=np.int64)
    judged = judge_spikes(cols, opts)
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
        for i in np.argsort(-excess)[: opts.top_events]
    ]
    # The wait in collectives on the device clock where the rank measured it (on NCCL the host wait is
    # microseconds: the work completes when it is enqueued), else on the host clock.
    comm, clock = cols["comm_wait_ns"], "host"
    dev = cols.get("dev_comm_wait_ns")
    if dev is not None and np.isfinite(dev).any():
        comm, clock = dev, "device"
    ok = ~np.isnan(comm)
    step_ns = cols["step_ns"]
    timed = ~np.isnan(step_ns)
    return RankFindings(
        rank, node, all_steps, steps[sp.judged], steps[idx], steps[ok], comm[ok], windows, counts, lost, events,
        judged_count=int(sp.judged.sum()), steps_seen=int(all_steps.size),
        cpu_measured=bool(np.isfinite(cols.get("cpu_ns", np.empty(0))).any()), comm_clock=clock,
        timed_steps=steps[timed], step_ns=step_ns[timed], comm_step_ns=step_ns[ok],
        self_median_ns=_self_median(cols), step_total_ns=float(step_ns[timed].sum()),
    )  # fmt: skip


def _self_median(cols: dict[str, np.ndarray]) -> float:
    """A rank's typical work per step: median self-time, else median step time less the wait."""
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

    _FILL = {"present": False, "judged": False, "self_spike": False, "comm_min": np.inf, "comm_rank": -1,
             "step_max": np.nan, "comm_max": -np.inf, "comm_sum": 0.0, "comm_step_sum": 0.0, "comm_ranks": 0}

    def __init__(self) -> None:
        self.steps = np.zeros(0, dtype=np.int64)  # every step any rank recorded, sorted
        self.present = np.zeros(0, dtype=bool)  # any record (warm-up included)
        self.judged = np.zeros(0, dtype=bool)  # any judged record
        self.self_spike = np.zeros(0, dtype=bool)
        self.comm_min = np.zeros(0)
        self.comm_rank = np.zeros(0, dtype=np.int64)
        # For the coordination view only (no detection rule reads them), after the warm-up:
        self.step_max = np.zeros(0)  # the cluster's step time (the slowest rank's), NaN: not measured
        self.comm_max = np.zeros(0)  # the largest wait
        self.comm_sum = np.zeros(0)  # summed wait of the ranks that measured one ...
        self.comm_step_sum = np.zeros(0)  # ... their summed step time ...
        self.comm_ranks = np.zeros(0, dtype=np.int64)  # ... and how many they are

    def cover(self, steps: np.ndarray) -> None:
        """Make room for ``steps`` (sorted); existing facts keep their steps."""
        pos = np.searchsorted(self.steps, steps)
        inside = pos < self.steps.size
        if inside.all() and np.array_equal(self.steps[pos], steps):
            return
        merged = np.union1d(self.steps, steps)
        where = np.searchsorted(merged, self.steps)
        for name, fill in self._FILL.items():
            old = getattr(self, name)
            new = np.full(merged.size, fill, dtype=old.dtype)
            new[where] = old
            setattr(self, name, new)
        self.steps = merged

    def index(self, steps: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.steps, steps)

    def add(self, f: RankFindings) -> None:
        self.cover(f.steps)
        self.present[self.index(f.steps)] = True
        self.judged[self.index(f.judged)] = True
        self.self_spike[self.index(f.spikes)] = True
        pos = self.index(f.comm_steps)
        better = f.comm_wait < self.comm_min[pos]
        self.comm_min[pos[better]] = f.comm_wait[better]
        self.comm_rank[pos[better]] = f.rank
        self._add_coordination(f, pos)

    def _add_coordination(self, f: RankFindings, comm_pos: np.ndarray) -> None:
        """Per-step step time and waits for ``analysis.coordination`` (each step once per rank)."""
        tpos = self.index(f.timed_steps)
        np.fmax.at(self.step_max, tpos, f.step_ns)
        timed = ~np.isnan(f.comm_step_ns)
        np.maximum.at(self.comm_max, comm_pos, f.comm_wait)
        np.add.at(self.comm_sum, comm_pos[timed], f.comm_wait[timed])
        np.add.at(self.comm_step_sum, comm_pos[timed], f.comm_step_ns[timed])
        np.add.at(self.comm_ranks, comm_pos[timed], 1)

    def culprits(self, window_steps: int) -> tuple[dict[tuple[int, int], int], dict[int, int]]:
        """The per-step culprit record by window: ({(rank, window): steps it waited least}, {window:
        steps with a known culprit})."""
        valid = self.comm_rank >= 0
        steps = self.steps[valid]
        win = steps // window_steps
        rank = self.comm_rank[valid]
        pairs, counts = np.unique(np.stack([rank, win]), axis=1, return_counts=True) if rank.size else (
            np.zeros((2, 0), dtype=np.int64), np.zeros(0, dtype=np.int64))  # fmt: skip
        known_w, known_n = np.unique(win, return_counts=True)
        return (
            {(int(r), int(w)): int(c) for (r, w), c in zip(pairs.T, counts, strict=True)},
            dict(zip(known_w.tolist(), known_n.tolist(), strict=True)),
        )


def diagnose(
    run_dir: str | os.PathLike | Sequence[str | os.PathLike], workers: int | None = None,
    batch_size: int | None = None, **options: Any,
) -> Diagnosis:  # fmt: skip
    """Stragglers, spikes, causes and projection of a run directory (docs/detection.md).

    ``run_dir``: one run directory, or the run directories of one job's agents (merged after checking
    that they belong together, ``columns.merge_layouts``). ``batch_size``: samples per rank and step,
    for the throughput in samples/s. ``workers``: threads reading and reducing ranks (default: up to 2,
    bounded by the CPUs). Raises
    ``store.RunDirError`` when the directory is not a run directory or holds no step records; ranks
    that wrote nothing readable are reported in ``missing_ranks``.
    """
    opts = DetectionOptions.from_mapping(options)
    layout = discover(run_dir)
    if not layout.sources:
        raise store.RunDirError(
            f"{layout.run_dir} holds no step records (steps/rank-*/seg-*.parquet); was the job traced "
            "(`hyperacc run --run-dir ...`) and did it run at least one step?"
        )
    workers = workers if workers is not None else max(1, min(2, os.cpu_count() or 1))
    groups = _by_node(layout.sources)
    order = [(node, src) for node, sources in groups.items() for src in sources]

    cluster = _Cluster()
    windows: list[dict[str, np.ndarray]] = []
    findings: list[RankFindings] = []
    events: list[_EVENT] = []
    nodes = _Nodes(opts)
    unread: list[int] = []
    for (node, src), f in zip(order, _reduced(order, opts, workers), strict=True):
        if f is None:
            unread.append(src.rank)
            continue
        cluster.add(f)
        windows.append(_held(f.windows))
        nodes.add(node, f.judged, f.spikes)
        for item in f.events:
            _keep_top(events, item, opts.top_events)
        # Keep the small tallies, drop the per-step arrays.
        findings.append(dataclasses.replace(f, steps=_EMPTY, judged=_EMPTY, spikes=_EMPTY, comm_steps=_EMPTY,
                                            comm_wait=_EMPTY, windows={}, events=[], timed_steps=_EMPTY,
                                            step_ns=_EMPTY_F, comm_step_ns=_EMPTY_F))  # fmt: skip
    if not findings:
        raise store.RunDirError(
            f"no segment under {layout.run_dir / 'steps'} could be read; see the warnings above"
        )

    summaries = concat_windows(windows)
    windows.clear()
    # The per-step comparisons of waits (culprit record, communication spikes) never mix clocks: with
    # ranks on both, they are left out.
    one_clock = len({f.comm_clock for f in findings}) == 1
    if one_clock:
        _add_culprits(summaries, cluster, opts.window_steps)
    found = detect_stragglers(summaries, opts)
    # A straggler is what is still slow at the end; one that recovered is an episode of the run.
    stragglers = [s.to_dict() for s in found if s.active]
    episodes = [s.to_dict() for s in found if not s.active]
    windows_judged = judged_windows(summaries, opts)
    del summaries
    groups = cause_groups(RANK_CAUSES, cpu_measured=all(f.cpu_measured for f in findings))
    rank_causes = [
        e.to_dict()
        for e in rank_excess(
            [f.rank for f in findings], [f.node for f in findings], [f.judged_count for f in findings],
            grouped({c: [f.counts.get(c, 0) for f in findings] for c in RANK_CAUSES}, groups),
            grouped({c: [f.time_lost.get(c, 0.0) for f in findings] for c in RANK_CAUSES}, groups), opts,
        )
    ]  # fmt: skip
    if one_clock:
        comm_spike, comm_n, comm_lost = _communication(cluster, opts, events, {f.rank: f.node for f in findings})
    else:
        comm_spike, comm_n, comm_lost = np.zeros(cluster.present.size, dtype=bool), 0, 0.0
    spike_steps = int((cluster.self_spike | comm_spike).sum())
    judged_steps = int(cluster.judged.sum())

    node_rows, p_node, node_event_spikes = nodes.finish()
    rank_steps = sum(f.judged_count for f in findings)
    rank_spikes = sum(sum(f.counts.values()) for f in findings)
    p_rank = (rank_spikes - node_event_spikes) / rank_steps if rank_steps else 0.0

    node_sizes = _node_sizes(layout, findings)
    n_nodes = len(node_sizes)
    rpn = opts.ranks_per_node or max(node_sizes.values(), default=1)
    projection = project(p_rank, rpn, opts.target, [n_nodes, *opts.projection_nodes], p_node=p_node)
    multi_nodes = sum(1 for n in node_sizes.values() if n >= 2)
    clear = (1.0 - theory.cluster_spike_probability(p_rank, nodes=len(findings))) * (
        1.0 - p_node
    ) ** multi_nodes
    projection["current"] = {
        "nodes": n_nodes,
        "ranks": len(findings),
        "measured": spike_steps / judged_steps if judged_steps else 0.0,
        "predicted": 1.0 - clear,  # from the per-rank and per-node rates, assuming independence
    }

    causes = _causes(findings, comm_n, comm_lost)
    d = Diagnosis(
        run_dir=layout.name,
        world_size=layout.world_size,
        nodes=n_nodes,
        steps=int(cluster.present.sum()),
        missing_ranks=sorted(set(layout.missing_ranks) | set(unread)),
        stragglers=stragglers,
        spikes={
            "per_rank": _per_rank(findings),
            "per_node": _rate_rows(node_rows, ("node",)),
            "cluster": {
                "steps": judged_steps,
                "spike_steps": spike_steps,
                "rate": spike_steps / judged_steps if judged_steps else 0.0,
            },
            "events": [
                {"rank": r, "node": n, "step": s, "excess_ns": int(e), "phase": ph, "cause": c}
                for e, r, n, s, ph, c in heapq.nlargest(opts.top_events, events)
            ],
        },
        causes=causes,
        projection=projection,
        options=dataclasses.asdict(opts),
        ranks_analyzed=len(findings),
        rank_causes=rank_causes,
        episodes=episodes,
        windows_judged=windows_judged,
        steps_per_rank=max((int(f.steps_seen) for f in findings), default=0),
        coordination=_coordination_view(cluster, findings, layout, causes, one_clock, batch_size),
        resources=_resources_view(layout, opts),
    )
    explain(d)
    return d


def _coordination_view(
    cluster: _Cluster, findings: list[RankFindings], layout: RunLayout, causes: list[dict[str, Any]],
    one_clock: bool, batch_size: int | None,
) -> dict[str, Any]:  # fmt: skip
    """Step-time distribution, coordination cost and failure modes (``analysis.coordination``; no rule
    of the straggler or spike detection reads them)."""
    ranks = len(findings)
    dist = distribution(cluster.step_max, batch_size * ranks if batch_size else None)
    coord = None
    if one_clock:
        wait_min = np.where(np.isfinite(cluster.comm_min), cluster.comm_min, np.nan)
        wait_max = np.where(np.isfinite(cluster.comm_max), cluster.comm_max, np.nan)
        coord = coordination(cluster.comm_step_sum, cluster.comm_sum, wait_min, wait_max, cluster.comm_ranks)
    trend = _spread_trend(cluster) if coord is not None else []
    # Locality: each rank's median self-time against its node's median, by local rank, on each node
    by_node: dict[int, list[RankFindings]] = defaultdict(list)
    for f in findings:
        if np.isfinite(f.self_median_ns) and f.rank in layout.metas:
            by_node[f.node].append(f)
    by_local: dict[int, list[float]] = defaultdict(list)
    for members in by_node.values():
        if len(members) < 2:
            continue
        med = float(np.median([f.self_median_ns for f in members]))
        for f in members:
            if med > 0:
                by_local[layout.metas[f.rank].local_rank].append(f.self_median_ns / med)
    # A rank's spike holds the whole cluster's step: time lost is measured against the job's wall time
    # (the sum of the cluster's step times), not against the summed time of every rank.
    total = float(np.nansum(cluster.step_max))
    runtime = {c["cause"]: c["time_lost_ns"] / total for c in causes if c["cause"] in RUNTIME_CAUSES} if total else {}
    modes = failure_modes(coord, by_local or None, runtime or None)
    return to_dict({
        "distribution": dist, "cost": coord, "spread_trend": trend, "failure_modes": modes,
        "clock": findings[0].comm_clock if one_clock and findings else "mixed",
        "batch_size": batch_size,
    })  # fmt: skip


def _spread_trend(cluster: _Cluster, bins: int = 20) -> list[dict[str, float]]:
    """Median arrival spread and collective cost in up to ``bins`` consecutive step ranges."""
    ok = (cluster.comm_ranks >= 2) & np.isfinite(cluster.comm_min) & np.isfinite(cluster.comm_max)
    steps = cluster.steps[ok]
    if steps.size < 2:
        return []
    spread = (cluster.comm_max - cluster.comm_min)[ok]
    own = cluster.comm_min[ok]
    parts = np.array_split(np.arange(steps.size), min(bins, steps.size))
    return [{"first_step": int(steps[p[0]]), "last_step": int(steps[p[-1]]),
             "spread_p50_ns": float(np.median(spread[p])), "collective_p50_ns": float(np.median(own[p]))}
            for p in parts if p.size]  # fmt: skip


def _resources_view(layout: RunLayout, opts: DetectionOptions) -> dict[str, Any]:
    """Memory creep and imbalance from ``RUN_DIR/resources`` (``analysis.resources``)."""
    table = store.read_resources(layout.run_dirs or [layout.run_dir])
    cols = {name: table.column(name).cast(pa.float64(), safe=False).to_numpy(zero_copy_only=False)
            for name in table.column_names if name != "node"}  # ns of wall clock keep ~0.3 us as float64
    return resource_findings(cols, ResourceOptions(detection=opts))


_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY_F = np.zeros(0)


def _reduced(
    order: list[tuple[int, RankSource]], opts: DetectionOptions, workers: int
) -> Iterator[RankFindings | None]:
    """Findings of each rank in ``order``, computed ``workers`` at a time, yielded in order."""

    def one(node: int, src: RankSource) -> RankFindings | None:
        cols = read_rank(src.segments)
        if cols["step"].size == 0:
            return None
        return reduce_rank(src.rank, node, cols, opts)

    if workers <= 1:
        for node, src in order:
            yield one(node, src)
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hyperacc-analyze") as pool:
        pending: collections.deque[Future] = collections.deque()
        items: Iterable[tuple[int, RankSource]] = iter(order)
        for node, src in items:
            pending.append(pool.submit(one, node, src))
            if len(pending) > workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _held(summary: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What ``diagnose`` keeps of a rank's window summaries until every rank is read: float32 (a median
    of nanoseconds to 7 digits, half the memory), without the spike tallies (the findings carry them)
    and without the columns of clocks and counters this rank never measured (a column some rank lacks
    is dropped for all, so the device clock is used only where every rank has it)."""
    out = {}
    for k, v in summary.items():
        if k.startswith(("spikes_", "lost_ns_")) or k == "judged_steps":
            continue
        if k.startswith(("dev_", "cpu_")) and np.isnan(v).all():
            continue
        out[k] = v.astype(np.float32) if v.dtype == np.float64 else v
    return out


def _add_culprits(summaries: dict[str, np.ndarray], cluster: _Cluster, window_steps: int) -> None:
    """Fills the offline-only culprit columns of the window summaries from the per-step record."""
    if not summaries["rank"].size:
        return
    per_pair, known = cluster.culprits(window_steps)
    if not known:
        return
    pairs = zip(summaries["rank"].tolist(), summaries["window"].tolist(), strict=True)
    summaries["culprit_steps"] = np.array([per_pair.get((r, w), 0) for r, w in pairs], dtype=np.float64)
    summaries["culprit_known"] = np.array([known.get(w, 0) for w in summaries["window"].tolist()],
                                          dtype=np.float64)  # fmt: skip


def _keep_top(events: list[_EVENT], item: _EVENT, n: int) -> None:
    if len(events) < n:
        heapq.heappush(events, item)
    elif item > events[0]:
        heapq.heapreplace(events, item)


def _communication(
    cluster: _Cluster, opts: DetectionOptions, events: list[_EVENT], node_of: dict[int, int]
) -> tuple[np.ndarray, int, float]:
    """Cluster steps where the collective itself spiked (the culprit's own wait grew, no rank was late).

    They are the cluster's, not a rank's: counted in the cluster spike fraction and the causes, listed as
    events on the rank that waited least, and left out of per-rank rates.
    """
    comm_min = np.where(np.isfinite(cluster.comm_min), cluster.comm_min, np.nan)
    sp = communication_spikes(comm_min, cluster.self_spike, opts)
    idx = np.flatnonzero(sp.spike)
    for i in idx:
        rank = int(cluster.comm_rank[i])
        item = (
            float(sp.excess[i]),
            rank,
            node_of.get(rank, -1),
            int(cluster.steps[i]),
            "comm_wait_ns",
            "communication",
        )
        _keep_top(events, item, opts.top_events)
    return sp.spike, int(idx.size), float(sp.excess[idx].sum())


class _Nodes:
    """Per-node spike rows and node-wide events, one node at a time (ranks arrive grouped by node).

    A node's step spikes when any of its ranks spikes. A host-wide event hits most ranks of a node in the
    same step: with two or more ranks, more than ``node_fraction`` of them (theory's ``p_node``).
    """

    def __init__(self, opts: DetectionOptions) -> None:
        self.opts = opts
        self.rows: list[tuple[int, int, int]] = []
        self.wide_steps = self.node_steps = self.in_events = 0
        self._node: int | None = None
        self._judged: list[np.ndarray] = []
        self._spikes: list[np.ndarray] = []

    def add(self, node: int, judged: np.ndarray, spikes: np.ndarray) -> None:
        if node != self._node:
            self._close()
            self._node = node
        self._judged.append(judged)
        self._spikes.append(spikes)

    def _close(self) -> None:
        if self._node is None or not self._judged:
            return
        seen, hits = _node_steps(self._judged, self._spikes)
        self.rows.append((self._node, seen, int(np.count_nonzero(hits))))
        if len(self._judged) >= 2:
            wide = hits > self.opts.node_fraction * len(self._judged)
            self.wide_steps += int(wide.sum())
            self.node_steps += seen
            self.in_events += int(hits[wide].sum())
        self._judged, self._spikes = [], []

    def finish(self) -> tuple[list[tuple[int, int, int]], float, int]:
        """(per-node rows, node-wide spike rate, rank spikes inside node-wide events)."""
        self._close()
        self._node = None
        return self.rows, (self.wide_steps / self.node_steps if self.node_steps else 0.0), self.in_events


def _node_steps(judged: list[np.ndarray], spikes: list[np.ndarray]) -> tuple[int, np.ndarray]:
    """(steps judged on any rank of a node, ranks spiking in each of those steps), indexed sparsely."""
    judged = [j for j in judged if j.size]
    if not judged:
        return 0, np.zeros(0, dtype=np.int64)
    seen = np.unique(np.concatenate(judged))
    hits = np.bincount(np.searchsorted(seen, np.concatenate(spikes)), minlength=seen.size)
    return int(seen.size), hits


def _causes(findings: list[RankFindings], comm_n: int, comm_lost: float) -> list[dict[str, Any]]:
    count: dict[str, int] = defaultdict(int)
    lost: dict[str, float] = defaultdict(float)
    for f in findings:
        for cause, n in f.counts.items():
            count[cause] += n
            lost[cause] += f.time_lost[cause]
    if comm_n:
        count["communication"] += comm_n
        lost["communication"] += comm_lost
    total = sum(lost.values())
    rows = [
        {
            "cause": c,
            "spikes": count[c],
            "time_lost_ns": int(lost[c]),
            "share": lost[c] / total if total else 0.0,
        }
        for c in CAUSES
        if count.get(c)
    ]
    return sorted(rows, key=lambda r: -r["time_lost_ns"])


def _by_node(sources: dict[int, RankSource]) -> dict[int, list[RankSource]]:
    groups: dict[int, list[RankSource]] = defaultdict(list)
    for src in sources.values():
        if src.node is None:  # no metadata: the records say which node
            cols = read_rank(src.segments[:1], ("rank", "node", "step"))
            src.node = int(cols["node"][0]) if cols["node"].size else -1
        groups[src.node].append(src)
    return {n: sorted(g, key=lambda s: s.rank) for n, g in sorted(groups.items())}


def _node_sizes(layout: RunLayout, findings: list[RankFindings]) -> dict[int, int]:
    """Ranks per node: those with records, plus missing ranks the metadata places."""
    sizes: dict[int, int] = defaultdict(int)
    seen = set()
    for f in findings:
        sizes[f.node] += 1
        seen.add(f.rank)
    for rank, meta in layout.metas.items():
        if rank not in seen:
            sizes[meta.node] += 1
    return dict(sizes)


def _per_rank(findings: list[RankFindings]) -> list[dict[str, Any]]:
    """Per-rank spike rates, with the rate of each cause (``by_cause``) and its interval."""
    rows = _rate_rows(
        [(f.rank, f.node, f.judged_count, sum(f.counts.values()), f.main_cause) for f in findings],
        ("rank", "node"),
    )
    for row, f in zip(rows, findings, strict=True):
        causes = sorted(f.counts)
        if not causes:
            row["by_cause"] = {}
            continue
        lo, hi = wilson_interval(
            np.array([f.counts[c] for c in causes]), np.full(len(causes), f.judged_count)
        )
        row["by_cause"] = {
            c: {
                "spikes": f.counts[c],
                "rate": f.counts[c] / f.judged_count if f.judged_count else 0.0,
                "ci_low": float(lo[i]),
                "ci_high": float(hi[i]),
                "time_lost_ns": int(f.time_lost[c]),
            }
            for i, c in enumerate(causes)
        }
    return rows


def _rate_rows(rows: list[tuple], keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """Rate rows with 95 % Wilson intervals from (keys..., steps, spikes[, cause]) tuples."""
    if not rows:
        return []
    k = len(keys)
    steps = np.array([r[k] for r in rows], dtype=np.float64)
    spikes = np.array([r[k + 1] for r in rows], dtype=np.float64)
    lo, hi = wilson_interval(spikes, steps)
    out = []
    for i, r in enumerate(rows):
        row: dict[str, Any] = {key: int(r[j]) for j, key in enumerate(keys)}
        row.update(
            steps=int(steps[i]),
            spikes=int(spikes[i]),
            rate=float(spikes[i] / steps[i]) if steps[i] else 0.0,
            ci_low=float(lo[i]),
            ci_high=float(hi[i]),
        )
        if len(r) > k + 2:
            row["cause"] = r[k + 2]
        out.append(row)
    return out

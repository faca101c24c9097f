"""Diagnose a run directory: reduce each rank to small findings, merge them, then judge.

Ranks are read and reduced one at a time by a small pool of threads (pyarrow and numpy release the
GIL), at most ``workers + 1`` ranks in flight, and merged in rank order by the calling thread. Memory:
the ranks in flight (steps x ~21 float64 each, or a chunk of ``rank_chunk_steps`` rows of a longer
rank, and its per-step findings, about 88 bytes per step), per-step arrays for the cluster (about 160
bytes per step of the run, 96 of them the least waits and their ranks) and the window summaries and episode blocks
(bounded by ``window_max_cells`` and ``episode_max_cells``). docs/detection.md, "Scale", has the figures.
Rules: docs/detection.md.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import logging
import os
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from hyperacc import store, theory
from hyperacc.analysis.cluster import reduce_source, reduced_on_cluster
from hyperacc.analysis.columns import RankSource, RunLayout, discover, read_rank, release_freed, step_bounds
from hyperacc.analysis.diagnosis import Diagnosis, explain
from hyperacc.analysis.episodes import (
    BlockBudget,
    detect_episodes,
    merge_episodes,
    recovered_stragglers,
    stragglers_beside_episodes,
)
from hyperacc.analysis.excess import (
    CAUSE_TIME,
    cause_groups,
    group_dispersion,
    grouped,
    rank_excess,
    working_gap_ranks,
)
from hyperacc.analysis.options import DetectionOptions
from hyperacc.analysis.outliers import window_grid
from hyperacc.analysis.periods import spike_period
from hyperacc.analysis.projection import project
from hyperacc.analysis.robust import rolling_median_at
from hyperacc.analysis.run_reduce import (
    _EMPTY,
    _EMPTY_F,
    _EMPTY_S,
    _EVENT,
    RankFindings,
    _Cluster,
    period_of,
)
from hyperacc.analysis.run_views import _causes, _coordination_view, _per_rank, _rate_rows, _resources_view
from hyperacc.analysis.slowdowns import Slowdown, detect_slowdowns, explained
from hyperacc.analysis.spikes import communication_spikes
from hyperacc.analysis.stragglers import detect_stragglers, judged_windows
from hyperacc.analysis.whatif import Culprit, what_if
from hyperacc.analysis.windows import RANK_CAUSES, concat_windows, within_budget

log = logging.getLogger(__name__)


def diagnose(
    run_dir: str | os.PathLike | Sequence[str | os.PathLike], workers: int | None = None,
    batch_size: int | None = None, cluster: str | None = None, **options: Any,
) -> Diagnosis:  # fmt: skip
    """Stragglers, spikes, causes and projection of a run directory (docs/detection.md).

    ``run_dir``: one run directory, or the run directories of one job's agents (merged after checking
    that they belong together, ``columns.merge_layouts``). ``batch_size``: samples per rank and step,
    for the throughput in samples/s. ``workers``: threads reading and reducing ranks (default: up to 2,
    bounded by the CPUs). ``cluster``: the address of a Dask scheduler (``tcp://host:8786``) whose workers
    read and reduce the ranks instead, from the shared file system the run directory is on
    (``analysis.cluster``; same result). Raises
    ``store.RunDirError`` when the directory is not a run directory or holds no step records; ranks
    that wrote nothing readable are reported in ``missing_ranks``.
    """
    opts = DetectionOptions.from_mapping(options)
    scheduler = cluster  # ``cluster`` names the cross-rank tallies below
    layout = discover(run_dir)
    if not layout.sources:
        raise store.RunDirError(
            f"{layout.run_dir} holds no step records (steps/rank-*/seg-*.parquet); was the job traced "
            "(`hyperacc run --run-dir ...`) and did it run at least one step?"
        )
    opts = _windows_within_budget(opts, layout)
    workers = workers if workers is not None else max(1, min(2, os.cpu_count() or 1))
    groups = _by_node(layout.sources)
    order = [(node, src) for node, sources in groups.items() for src in sources]

    cluster = _Cluster()
    windows: list[dict[str, np.ndarray]] = []
    findings: list[RankFindings] = []
    blocks = BlockBudget(opts)
    events: list[_EVENT] = []
    nodes = _Nodes(opts)
    unread: list[int] = []
    if scheduler:
        reduced = reduced_on_cluster(order, opts, scheduler)
    else:
        reduced = _reduced(order, opts, workers)
    # one rank's findings at a time: taken with ``next``, as a ``zip`` or ``enumerate`` of ``reduced``
    # would still hold the last rank's while the next one is reduced
    reduced = iter(reduced)
    for i, (node, src) in enumerate(order):
        f = next(reduced)
        if i % _RELEASE_EVERY == _RELEASE_EVERY - 1 or (f is not None and f.steps_seen > opts.rank_chunk_steps):
            release_freed()  # what reading the last ranks freed, before it adds up
        if f is None:
            unread.append(src.rank)
            continue
        cluster.add(f)
        windows.append(_held(f.windows))
        if f.blocks is not None:
            blocks.add(f.blocks)
        nodes.add(node, f.judged, f.spikes)
        for item in f.events:
            _keep_top(events, item, opts.top_events)
        # Keep the small tallies, drop the per-step arrays.
        findings.append(dataclasses.replace(f, steps=_EMPTY, judged=_EMPTY, spikes=_EMPTY, comm_steps=_EMPTY,
                                            comm_wait=_EMPTY, windows={}, events=[], timed_steps=_EMPTY,
                                            step_ns=_EMPTY_F, comm_step_ns=_EMPTY_F, comm_run_delay=_EMPTY_F, blocks=None,
                                            spike_causes=_EMPTY_S, spike_excess=_EMPTY_F))  # fmt: skip
        del f  # not held while the next rank is reduced (a rank of a week: 0.8 GB)
    if not findings:
        raise store.RunDirError(
            f"no segment under {layout.run_dir / 'steps'} could be read; see the warnings above"
        )

    # Change points per rank: transient fail-slows too short for the window rules, and the precise
    # range of a straggler that recovered (docs/detection.md, "Episodes"). Judged first, so that the
    # blocks go before the window rules' matrices are made, and those matrices are still there to judge
    # a straggler again without an episode beside it (each pair was a peak of memory).
    release_freed()
    changes = detect_episodes(blocks.blocks, opts)
    # the job's own step time, for what moves several ranks at once (docs/detection.md, "Slowdowns")
    try:
        job_slowdowns = detect_slowdowns(cluster.steps, cluster.step_max, blocks.blocks, opts, cluster.comm_min)
    except Exception:  # the newest rule: a fault in it leaves the rest of the analysis whole
        log.warning("the slowdown rule failed; the diagnosis goes on without it", exc_info=True)
        job_slowdowns = []
    del blocks
    release_freed()
    summaries = concat_windows(windows)
    windows.clear()
    # The per-step comparisons of waits (culprit record, communication spikes) never mix clocks: with
    # ranks on both, they are left out.
    one_clock = len({f.comm_clock for f in findings}) == 1
    if one_clock:
        _add_culprits(summaries, cluster, opts.window_steps)
    # pivoted once for the window rules and their count; the summaries go before the rules' own
    # matrices are made
    grid = window_grid(summaries, opts)
    del summaries
    found = detect_stragglers(grid, opts)
    windows_judged = judged_windows(grid, opts)
    found = stragglers_beside_episodes(found, [e.to_dict() for e in changes], grid, opts)
    del grid
    # A straggler is what is still slow at the end; one that recovered is an episode of the run.
    stragglers = [s.to_dict() for s in found if s.active]
    back = recovered_stragglers(stragglers, changes, opts.window_steps)
    stragglers = [s for s in stragglers if s["rank"] not in back]
    episodes = merge_episodes(changes, stragglers, [s.to_dict() for s in found if not s.active], opts.window_steps)
    working = working_gap_ranks(stragglers + episodes)
    # (at most top_events, the costliest: ``detect_slowdowns``)
    slowdowns = [s for s in map(Slowdown.to_dict, job_slowdowns) if not explained(s, stragglers + episodes)]
    for f in findings:
        if f.rank in working:
            for tally in (f.counts, f.time_lost):
                if "data" in tally:
                    tally["host_work"] = tally.get("host_work", 0) + tally.pop("data")
            f.cause_time.pop("data", None)  # its input gap was its own work: no time of the cause
            moved = f.dispersion.pop(("data",), None)
            if moved is not None:  # pooled with its own: the chi-squares of two tallies, summed
                had = f.dispersion.get(("host_work",), (0.0, 0.0, 0.0))
                f.dispersion[("host_work",)] = tuple(x + y for x, y in zip(had, moved, strict=True))
    events[:] = [(e, r, n, s, ph, "host_work" if r in working and c == "data" else c) for e, r, n, s, ph, c in events]
    heapq.heapify(events)
    groups = cause_groups(RANK_CAUSES, cpu_measured=all(f.cpu_measured for f in findings))
    rank_causes = [
        e.to_dict()
        for e in rank_excess(
            [f.rank for f in findings], [f.node for f in findings], [f.judged_count for f in findings],
            grouped({c: [f.counts.get(c, 0) for f in findings] for c in RANK_CAUSES}, groups),
            grouped({c: [f.time_lost.get(c, 0.0) for f in findings] for c in RANK_CAUSES}, groups), opts,
            dispersion=group_dispersion([f.dispersion for f in findings], groups),
            times={c: [f.cause_time.get(c, np.nan) for f in findings] for c in CAUSE_TIME if groups.get(c) == (c,)},
        )
    ]  # fmt: skip
    by_rank = {f.rank: f for f in findings}
    for e in rank_causes:  # where its spikes of the cause recur every N steps (analysis.periods)
        members = groups[e["cause"]] + (("data",) if e["cause"] == "host_work" and e["rank"] in working else ())
        found = period_of(by_rank[e["rank"]], members)
        e["period"] = found.to_dict() if found is not None else None
    if one_clock:
        comm_spike, comm_n, comm_lost = _communication(cluster, opts, events, {f.rank: f.node for f in findings})
    else:
        comm_spike, comm_n, comm_lost = np.zeros(cluster.present.size, dtype=bool), 0, 0.0
    stalls = _stalls(events, sum(sum(f.time_lost.values()) for f in findings) + comm_lost,
                     float(np.nansum(cluster.step_max)), opts)  # fmt: skip
    what_if = (
        _what_if(cluster, stragglers, episodes, rank_causes, groups, working, stalls) if one_clock else None
    )
    if stalls and what_if is not None and stalls[0]["job_time_lost_ns"] < opts.stall_share * what_if["job_ns"]:
        # the job did not wait for it (another rank was as late at that step): not the job's stall
        stalls = []
        what_if = _what_if(cluster, stragglers, episodes, rank_causes, groups, working, stalls)
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
                "period": _job_period(cluster, findings, opts),
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
        slowdowns=slowdowns,
        windows_judged=windows_judged,
        steps_per_rank=max((int(f.steps_seen) for f in findings), default=0),
        coordination=_coordination_view(cluster, findings, layout, causes, one_clock, batch_size),
        resources=_resources_view(layout, opts),
        what_if=what_if,
        stalls=stalls,
    )
    explain(d)
    return d


def _stalls(events: list[_EVENT], lost_ns: float, job_ns: float, opts: DetectionOptions) -> list[dict[str, Any]]:
    """The costliest spike of a rank's own time, where it alone lost at least ``explain_share`` of the time
    lost to all spikes and ``stall_share`` of the job's wall time (the sum of the cluster's step times):
    one stall (a blocking read on a shared file system, a lock, a sleep) that the rates of spikes do not
    show (docs/detection.md, "A stall"). At most one spike can hold that share. ``job_share`` is the
    rank's excess here; the what-if replaces it with what the job lost (``job_time_lost_ns``), and a stall
    the job did not wait for that much is dropped."""
    own = [e for e in events if e[5] != "communication"]
    if not own or not job_ns > 0:
        return []
    excess, rank, node, step, phase, cause = max(own)
    if excess < opts.stall_share * job_ns or excess < opts.explain_share * lost_ns:
        return []
    return [{"rank": rank, "node": node, "step": step, "excess_ns": int(excess), "phase": phase, "cause": cause,
             "job_share": excess / job_ns, "job_ns": job_ns, "spike_share": excess / lost_ns if lost_ns else 1.0}]  # fmt: skip




def _windows_within_budget(opts: DetectionOptions, layout: RunLayout) -> DetectionOptions:
    """``windows.within_budget`` for this run: its ranks, and the steps of its first and last rank. Read
    only where the steps their first and last segments span (Parquet statistics, or two small record
    files) could make more windows than the budget holds: not for most runs."""
    sources = list(layout.sources.values())
    ends = (sources[0], sources[-1])
    span = 0
    for src in ends:
        bounds = [b for b in (step_bounds(src.segments[:1]), step_bounds(src.segments[-1:])) if b]
        if bounds:
            span = max(span, max(b[1] for b in bounds) - min(b[0] for b in bounds) + 1)
    if len(sources) * (-(-span // opts.window_steps) + 1) <= opts.window_max_cells:
        return opts
    steps = [read_rank(src.segments, ("step",))["step"] for src in ends]
    wide = within_budget(opts, len(sources), steps)
    if wide is not opts:
        log.warning(
            "%d ranks x up to %d steps make more than window_max_cells (%d) windows of %d steps: the straggler "
            "rules judge windows of %d steps (docs/detection.md, \"Windows\")",
            len(sources), max(s.size for s in steps), opts.window_max_cells, opts.window_steps, wide.window_steps,
        )  # fmt: skip
    return wide


_RELEASE_EVERY = 64  # ranks read between two ``release_freed``


def _reduced(
    order: list[tuple[int, RankSource]], opts: DetectionOptions, workers: int
) -> Iterator[RankFindings | None]:
    """Findings of each rank in ``order``, computed ``workers`` at a time, yielded in order."""

    def one(node: int, src: RankSource) -> RankFindings | None:
        return reduce_source(node, src, opts)

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


def _job_period(cluster: _Cluster, findings: list[RankFindings], opts: DetectionOptions) -> dict[str, Any] | None:
    """The period of the steps in which more than half of the ranks spiked at once: work the whole job
    does every N steps (an evaluation, a checkpoint every rank writes, logging), which no rank does more
    than the others, so that no rank-specific cause names it (docs/detection.md, "Periodic spikes")."""
    ranks = len(findings)
    if ranks < 2:
        return None
    found = spike_period(cluster.steps[2 * cluster.spiked > ranks], cluster.steps[cluster.judged],
                         opts.period_min_repeats, opts.period_coverage, opts.top_alpha)  # fmt: skip
    if found is None:
        return None
    # what those steps cost the job: the cluster's step time (the slowest rank's) over its centred rolling
    # median, at the steps on the period that spiked
    timed = np.flatnonzero(np.isfinite(cluster.step_max))
    step_ns = cluster.step_max[timed]
    spiked = 2 * cluster.spiked[timed] > ranks
    at = np.flatnonzero(spiked & ((cluster.steps[timed] - found.first) % found.every == 0))
    base = rolling_median_at(step_ns, opts.spike_window, at)
    lost = float(np.clip(step_ns[at] - base, 0.0, None).sum())
    return {**found.to_dict(), "lost_ns": lost, "job_ns": float(step_ns.sum()), "causes": _period_causes(found, findings)}


def _period_causes(found: Any, findings: list[RankFindings]) -> list[str] | None:
    """The causes of the job's periodic spikes: the set of causes (``PERIOD_SETS``) whose spikes recur on
    the same period and phase on more than half of the ranks (every rank's collector on one cadence, or
    every rank's evaluation); None where no set does."""
    votes: collections.Counter[tuple[str, ...]] = collections.Counter()
    phase = found.first % found.every
    for f in findings:
        for key, p in f.periods.items():
            if p.every == found.every and p.first % p.every == phase:
                votes[key] += 1
    if not votes:
        return None
    key, n = max(votes.items(), key=lambda kv: (kv[1], -len(kv[0])))
    return list(key) if 2 * n > len(findings) else None


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
    found = cluster.culprits(summaries["rank"], summaries["window"], window_steps)
    if found is not None:
        summaries["culprit_steps"], summaries["culprit_known"] = found


def _what_if(
    cluster: _Cluster, stragglers: list[dict[str, Any]], episodes: list[dict[str, Any]],
    rank_causes: list[dict[str, Any]], groups: dict[str, tuple[str, ...]], working: set[int],
    stalls: list[dict[str, Any]],
) -> dict[str, Any] | None:  # fmt: skip
    """The job time each culprit cost (analysis.whatif): every straggler from its onset to the end, every
    episode over its range, every rank-specific spike cause at the rank's spikes of that cause, a stall
    at its step."""
    last = int(cluster.steps[-1]) if cluster.steps.size else 0
    culprits = [Culprit("straggler", s["rank"], s["since_step"], last) for s in stragglers]
    culprits += [Culprit("episode", e["rank"], e["since_step"], e["until_step"]) for e in episodes]
    for e in rank_causes:
        names = set(groups.get(e["cause"], (e["cause"],)))
        if e["cause"] == "host_work" and e["rank"] in working:
            names.add("data")  # the input gap of a rank working in it was relabelled above
        codes = tuple(i for i, c in enumerate(cluster.causes) if c in names)
        culprits.append(Culprit("spikes", e["rank"], 0, last, causes=codes, label=e["cause"]))
    culprits += [Culprit("stall", s["rank"], s["step"], s["step"]) for s in stalls]
    out = what_if(cluster.steps, cluster.step_max, cluster.wait_low, cluster.wait_rank, cluster.low_cause, culprits)
    if out is not None:  # an episode's job time lost is the replay's figure, where there is one
        for e, row in zip(episodes, out["culprits"][len(stragglers):], strict=False):
            e["job_time_lost_ns"] = row["saved_ns"]
        for s, row in zip(stalls, out["culprits"][len(culprits) - len(stalls):], strict=True):
            s["job_time_lost_ns"], s["job_share"], s["job_ns"] = row["saved_ns"], row["saved_frac"], out["job_ns"]
    return out


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
        self._ranks = 0  # ranks of the node so far
        self._seen = np.zeros(0, dtype=np.int64)  # steps judged on any of them, sorted
        self._spikes: list[np.ndarray] = []  # their spikes (a few per hundred steps)

    def add(self, node: int, judged: np.ndarray, spikes: np.ndarray) -> None:
        if node != self._node:
            self._close()
            self._node = node
        self._ranks += 1
        self._seen = _union(self._seen, judged)
        self._spikes.append(spikes)

    def _close(self) -> None:
        if self._node is None or not self._ranks:
            return
        seen = self._seen
        hits = np.bincount(np.searchsorted(seen, np.concatenate(self._spikes)), minlength=seen.size)
        self.rows.append((self._node, int(seen.size), int(np.count_nonzero(hits))))
        if self._ranks >= 2:
            wide = hits > self.opts.node_fraction * self._ranks
            self.wide_steps += int(wide.sum())
            self.node_steps += int(seen.size)
            self.in_events += int(hits[wide].sum())
        self._ranks, self._seen, self._spikes = 0, np.zeros(0, dtype=np.int64), []

    def finish(self) -> tuple[list[tuple[int, int, int]], float, int]:
        """(per-node rows, node-wide spike rate, rank spikes inside node-wide events)."""
        self._close()
        self._node = None
        return self.rows, (self.wide_steps / self.node_steps if self.node_steps else 0.0), self.in_events


def _union(seen: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """The sorted steps of ``seen`` or ``steps`` (sorted): held once per node, not once per rank."""
    if not steps.size or np.array_equal(steps, seen):
        return seen  # the usual node: every rank judged the same steps
    if not seen.size and bool((np.diff(steps) > 0).all()):
        return steps
    return np.union1d(seen, steps)


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



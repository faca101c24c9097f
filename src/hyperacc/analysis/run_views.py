"""The parts of a run's diagnosis document that ``run_dir.diagnose`` writes from what it reduced: the
coordination view (spread and its trend), the resources view, time lost per cause, per-rank rows and
spike-rate rows."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import pyarrow as pa

from hyperacc import store
from hyperacc.analysis.columns import RunLayout
from hyperacc.analysis.coordination import RUNTIME_CAUSES, coordination, distribution, failure_modes, to_dict
from hyperacc.analysis.options import CAUSES, DetectionOptions
from hyperacc.analysis.resources import ResourceOptions, resource_findings
from hyperacc.analysis.run_reduce import RankFindings, _Cluster
from hyperacc.analysis.spikes import wilson_interval


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
        coord = coordination(cluster.comm_step_sum, cluster.comm_sum, wait_min, wait_max, cluster.comm_ranks,
                             cluster.run_delay)
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

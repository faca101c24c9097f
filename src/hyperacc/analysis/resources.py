"""Findings over each rank's resource samples (``RUN_DIR/resources``, sampled off the training thread):
memory that creeps up over the run, and ranks that hold or use much more than the others.

Pure: columns in (``rank``, ``t_ns``, ``rss_bytes``, ``cpu_ns``, ``cuda_*_bytes`` as numpy arrays, NaN
where not measured), findings out. Rules, formulas and defaults: docs/detection.md, "Resources".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from hyperacc.analysis.options import DetectionOptions
from hyperacc.analysis.outliers import cross_rank_outliers
from hyperacc.stats import nan_median

MIB = float(1 << 20)
MEMORY = ("rss_bytes", "cuda_allocated_bytes", "cuda_reserved_bytes")
_WORD = {"rss_bytes": "RSS", "cuda_allocated_bytes": "CUDA allocated", "cuda_reserved_bytes": "CUDA reserved",
         "cuda_peak_bytes": "CUDA peak", "cpu_util": "CPU utilisation"}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ResourceOptions:
    """Thresholds of the resource rules (docs/detection.md, "Resources"). The imbalance test is the
    cross-rank outlier rule of ``detection`` (its thresholds, its ``outlier_rule`` and ``min_ranks``)."""

    min_samples: int = 10  # samples a rank needs before its growth is judged
    min_span_s: float = 20.0  # ... and the seconds they must span
    creep_min_bytes: float = 256 * MIB  # growth over the run below this is never creep ...
    creep_min_rel: float = 0.10  # ... nor below this share of the rank's starting level
    min_excess: float = 0.10  # imbalance: an outlier by the rule, and this much above the median rank
    max_pairs_points: int = 200  # Theil-Sen slope over at most this many evenly spaced samples
    detection: DetectionOptions = dataclasses.field(default_factory=DetectionOptions)

    def __post_init__(self) -> None:
        if self.min_samples < 3 or self.max_pairs_points < 3:
            raise ValueError("min_samples and max_pairs_points must be at least 3")
        for name in ("min_span_s", "creep_min_bytes", "creep_min_rel", "min_excess"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if not isinstance(self.detection, DetectionOptions):
            raise ValueError(f"detection must be a DetectionOptions, got {type(self.detection).__name__}")


def theil_sen(t: np.ndarray, y: np.ndarray, max_points: int = 200) -> float:
    """Median of the pairwise slopes (robust to spikes and to a few bad samples); NaN with < 3 points."""
    ok = np.isfinite(t) & np.isfinite(y)
    t, y = t[ok], y[ok]
    if t.size < 3:
        return math.nan
    if t.size > max_points:
        pick = np.linspace(0, t.size - 1, max_points).round().astype(np.int64)
        t, y = t[pick], y[pick]
    i, j = np.triu_indices(t.size, k=1)
    dt = t[j] - t[i]
    keep = dt > 0
    if not keep.any():
        return math.nan
    return float(np.median((y[j] - y[i])[keep] / dt[keep]))


@dataclasses.dataclass(frozen=True)
class Creep:
    rank: int
    metric: str  # rss_bytes | cuda_allocated_bytes | cuda_reserved_bytes
    start_bytes: float  # median of the first tenth of the samples
    growth_bytes: float  # robust slope x span
    slope_bytes_per_s: float
    span_s: float
    creep: bool

    def text(self) -> str:
        return (f"rank {self.rank}: {_WORD[self.metric]} grew {self.growth_bytes / MIB:+.0f} MiB over {self.span_s:.0f} s "
                f"({self.slope_bytes_per_s / MIB * 60:+.1f} MiB/min) from {self.start_bytes / MIB:.0f} MiB")  # fmt: skip


def memory_creep(t_ns: np.ndarray, values: np.ndarray, rank: int, metric: str,
                 opts: ResourceOptions) -> Creep | None:  # fmt: skip
    """One rank's growth of one memory figure; None when too few samples or too short a span."""
    ok = np.isfinite(t_ns) & np.isfinite(values)
    t, y = t_ns[ok] / 1e9, values[ok]
    if t.size < opts.min_samples:
        return None
    span = float(t.max() - t.min())
    if span < opts.min_span_s:
        return None
    slope = theil_sen(t, y, opts.max_pairs_points)
    start = float(np.median(y[: max(3, t.size // 10)]))
    end = float(np.median(y[-max(3, t.size // 10) :]))
    growth = slope * span
    bar = max(opts.creep_min_bytes, opts.creep_min_rel * start)
    # Creep is growth by the robust slope that is also there at the end (not a transient peak).
    creep = bool(growth >= bar and end - start >= bar)
    return Creep(rank, metric, start, growth, slope, span, creep)


@dataclasses.dataclass(frozen=True)
class Imbalance:
    metric: str  # rss_bytes | cpu_util | cuda_peak_bytes
    median: float  # over the ranks
    rank: int
    value: float
    z: float
    excess: float  # value / median - 1

    def text(self) -> str:
        def show(v: float) -> str:
            return f"{v:.2f} cores" if self.metric == "cpu_util" else f"{v / MIB:.0f} MiB"

        return (f"rank {self.rank}: {_WORD[self.metric]} {show(self.value)}, {self.excess:+.0%} over the median rank "
                f"({show(self.median)}; modified z {self.z:.1f})")  # fmt: skip


def imbalance(per_rank: Mapping[int, float], metric: str, opts: ResourceOptions) -> list[Imbalance]:
    """Ranks far above the others by the cross-rank outlier rule (``outliers.cross_rank_outliers`` with
    ``opts.detection``; docs/detection.md, "The cross-rank outlier rule") and at least ``min_excess`` above
    the median rank; empty with fewer than ``min_ranks`` ranks."""
    ranks = [r for r, v in per_rank.items() if math.isfinite(v)]
    if len(ranks) < opts.detection.min_ranks:
        return []
    v = np.array([per_rank[r] for r in ranks], dtype=np.float64)
    flagged, z, ratio, _ = cross_rank_outliers(v, opts.detection, 0.0)
    med = float(nan_median(v))
    out = []
    for i, r in enumerate(ranks):
        excess = float(ratio[i]) - 1.0 if med > 0 else math.inf
        if flagged[i] and excess >= opts.min_excess:
            out.append(Imbalance(metric, med, r, float(v[i]), float(z[i]), excess))
    return sorted(out, key=lambda x: -x.excess)


def resource_findings(cols: Mapping[str, np.ndarray], opts: ResourceOptions | None = None) -> dict[str, Any]:
    """Memory creep per rank and imbalance across ranks from the resource columns of a run.

    Returns ``{"samples", "ranks", "per_rank": [...], "creep": [...], "imbalance": [...], "findings":
    [text], "judged": {...}}``; ``judged`` says which rules had enough data (else "not enough samples").
    """
    opts = opts or ResourceOptions()
    rank = np.asarray(cols.get("rank", np.zeros(0)), dtype=np.int64)
    t = np.asarray(cols.get("t_ns", np.zeros(0)), dtype=np.float64)
    out: dict[str, Any] = {"samples": int(rank.size), "ranks": 0, "per_rank": [], "creep": [], "imbalance": [],
                           "findings": [], "judged": {}}  # fmt: skip
    if not rank.size:
        out["judged"] = {"creep": "no resource samples", "imbalance": "no resource samples"}
        return out
    level: dict[str, dict[int, float]] = {"rss_bytes": {}, "cpu_util": {}, "cuda_peak_bytes": {}}
    creeps: list[Creep] = []
    judged_creep = 0
    for r in np.unique(rank).tolist():
        sel = rank == r
        order = np.argsort(t[sel], kind="stable")
        tr = t[sel][order]
        row: dict[str, Any] = {"rank": int(r), "samples": int(sel.sum())}
        for metric in MEMORY:
            y = np.asarray(cols.get(metric, np.full(rank.size, np.nan)), dtype=np.float64)[sel][order]
            if not np.isfinite(y).any():
                continue
            row[f"{metric}_median"] = float(np.nanmedian(y))
            row[f"{metric}_last"] = float(y[np.isfinite(y)][-1])
            c = memory_creep(tr, y, int(r), metric, opts)
            if c is not None:
                judged_creep += 1
                row[f"{metric}_growth"] = c.growth_bytes
                if c.creep:
                    creeps.append(c)
            if metric == "rss_bytes":
                level["rss_bytes"][int(r)] = row[f"{metric}_median"]
        peak = np.asarray(cols.get("cuda_peak_bytes", np.full(rank.size, np.nan)), dtype=np.float64)[sel]
        if np.isfinite(peak).any():
            row["cuda_peak_bytes"] = float(np.nanmax(peak))
            level["cuda_peak_bytes"][int(r)] = row["cuda_peak_bytes"]
        cpu = np.asarray(cols.get("cpu_ns", np.full(rank.size, np.nan)), dtype=np.float64)[sel][order]
        ok = np.isfinite(cpu) & np.isfinite(tr)
        if ok.sum() >= 2 and tr[ok][-1] > tr[ok][0]:
            # cores busy on average: CPU time over wall time between the first and the last sample
            row["cpu_util"] = float((cpu[ok][-1] - cpu[ok][0]) / (tr[ok][-1] - tr[ok][0]))
            level["cpu_util"][int(r)] = row["cpu_util"]
        out["per_rank"].append(row)
    out["ranks"] = len(out["per_rank"])
    out["creep"] = [dataclasses.asdict(c) for c in creeps]
    # A rank whose memory creeps ends above the others too: its creep is the finding, not an imbalance.
    crept = {(c.rank, "rss_bytes") for c in creeps if c.metric == "rss_bytes"}
    imb = [i for metric, values in level.items() for i in imbalance(values, metric, opts)
           if (i.rank, i.metric) not in crept]  # fmt: skip
    out["imbalance"] = [dataclasses.asdict(i) for i in imb]
    out["findings"] = [f"memory creep on {c.text()}" for c in creeps] + [f"imbalance: {i.text()}" for i in imb]
    out["judged"] = {
        "creep": f"{judged_creep} rank series judged" if judged_creep else
        f"not enough samples (each rank needs {opts.min_samples} over {opts.min_span_s:g} s)",
        "imbalance": "judged" if out["ranks"] >= opts.detection.min_ranks else
        f"not enough ranks ({out['ranks']}, the rule needs {opts.detection.min_ranks})",
    }  # fmt: skip
    return out

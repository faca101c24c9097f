"""Every threshold of the detection rules, in one place, with the defaults of docs/detection.md."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from hyperacc.options import check, check_fields, load
from hyperacc.theory import DEFAULT_TARGET

SECTION = "detection"

# Window metrics judged for stragglers, and the straggler kind each one names. Forward and backward
# are judged where the summaries carry them: a slow forward stands out more clearly than the whole
# self-time on a machine whose other ranks share the cores. CPU time (step schema 2) is immune to
# preemption: a rank that computes more shows it even where the host's noise hides it in wall time.
STRAGGLER_METRICS: tuple[str, ...] = (
    "self_ns", "forward_ns", "backward_ns", "cpu_ns", "data_ns", "launch_ns", "gc_ns",
)  # fmt: skip
METRIC_KIND: dict[str, str] = {
    "cpu_ns": "compute",
    "self_ns": "compute",
    "forward_ns": "compute",
    "backward_ns": "compute",
    "data_ns": "data",
    "launch_ns": "launch",
    "gc_ns": "gc",
}
# How messages name each judged metric (the diagnosis, the live detector).
METRIC_WORD: dict[str, str] = {
    "self_ns": "self-time",
    "forward_ns": "forward time",
    "backward_ns": "backward time",
    "cpu_ns": "CPU time",
    "data_ns": "data wait",
    "launch_ns": "launch latency",
    "gc_ns": "GC time",
}
# ``host_work``: the rank's own CPU work in the input gap of a loop without a DataLoader (between
# ``optimizer.step()`` and the next forward; docs/detection.md, "The work between steps").
CAUSES: tuple[str, ...] = ("data", "gc", "allocator", "page_faults", "host", "communication", "compute", "host_work", "unknown")


def outlier_rule_text(opts: DetectionOptions, floor_ns: float) -> str:
    """The cross-rank outlier rule in words, with the thresholds in force (for captions and notes: what a
    reader is told is the rule that ran). Formula and defaults: docs/detection.md, "Stragglers"."""
    z, fence = f"modified z > {opts.z_threshold:g}", f"above the other ranks' Q3 + {opts.iqr_k:g} IQR"
    material = f"{100 * opts.min_slowdown:g} % and {floor_ns / 1e3:g} us over the median"
    if opts.outlier_rule == "and":
        return f"{z}, {fence}, {material}"
    return f"{z} or {fence}; either way {material}"


@dataclasses.dataclass(frozen=True)
class DetectionOptions:
    """Thresholds of the detection rules (docs/detection.md names each one).

    Validated on construction: a value that is not a finite number of the right kind and range raises
    ``hyperacc.options.OptionsError`` (a ``ValueError``) with a message that names the option and what
    is allowed.
    """

    # -- eligibility
    warmup_steps: int = 10  # first steps of every rank are left out (compilation, allocation, caches)
    window_steps: int = 50  # straggler windows: steps [w*window_steps, (w+1)*window_steps)
    window_max_cells: int = 4_000_000  # ranks x windows judged offline; past it windows widen x2 (memory bound)
    min_window_samples: int = 10  # a rank's window needs this many measured steps to be judged
    min_ranks: int = 4  # a window is judged only when this many ranks reported it
    rank_chunk_steps: int = 250_000  # a rank spanning more steps is read and reduced in chunks (memory bound)
    # -- outlier ranks (per window, per metric): docs/detection.md, "The cross-rank outlier rule"
    z_threshold: float = 3.5  # modified z-score (median/MAD)
    iqr_k: float = 1.5  # Tukey upper fence Q3 + k * IQR
    outlier_rule: str = "and"  # "and": MAD z and IQR fence must agree; "or": either one
    min_mad_rel: float = 0.01  # MAD floored at 1 % of the cluster median
    min_slowdown: float = 0.05  # and at least 5 % above the cluster median
    floor_ns: int = 200_000  # and at least 0.2 ms above it (self, data, gc per step)
    launch_floor_ns: int = 200  # launch probe (mean ns per enqueued op): at least 0.2 us above the median
    # -- persistence
    persist_k: int = 3  # outlier in k ...
    persist_n: int = 5  # ... of the rank's last n judged windows
    top_alpha: float = 1e-3  # significance of every count test against exchangeable ranks (0: those tests off)
    top_min_windows: int = 4  # rank order: slowest in at least this many windows
    # -- episodes: a rank's self-time against the cluster median shifts up and back (change points)
    episode_block_steps: int = 5  # per-rank medians over blocks of this many steps
    episode_min_effect: float = 1.3  # the shift at least this ratio (over the rank's own typical ratio) ...
    episode_min_steps: int = 20  # ... for at least this many steps
    episode_h: float = 5.0  # CUSUM decision interval, in noise sigmas of one block's log ratio
    episode_max_cells: int = 10_000_000  # ranks x blocks kept; past it blocks widen x2 (memory bound)
    # -- node grouping
    node_fraction: float = 0.5  # more than this share of a node's ranks slow: a node problem
    # -- spikes within a rank
    spike_metric: str = "busy_ns"  # "busy_ns" (step_ns - comm_wait_ns: all its own work) or "self_ns"
    spike_window: int = 101  # centred rolling median, in steps
    spike_mad: float = 5.0  # excess > spike_mad * 1.4826 * rolling MAD ...
    spike_floor_ns: int = 1_000_000  # ... and > 1 ms ...
    spike_floor_rel: float = 0.25  # ... and > 25 % of the rank's typical step
    # -- attribution
    explain_share: float = 0.5  # a phase, a pause or CPU time must account for half of an excess
    signal_z: float = 3.5  # a counter coincides when it is this far above its rolling median (MAD z)
    preempt_overhead: float = 0.05  # the most CPU time preemption costs per unit of wall time it takes
    # -- rank-specific causes (a rank's spikes of one cause above the other ranks' floor)
    excess_ratio: float = 2.0  # the rank's rate of the cause at least this many times the others' ...
    excess_min_spikes: int = 3  # ... from at least this many spikes (and significant at top_alpha)
    # -- periodic spikes (work every N steps: a checkpoint, an evaluation, logging)
    period_min_repeats: int = 4  # spikes on one phase of the period, at least ...
    period_coverage: float = 0.75  # ... and at least this share of the judged steps on it (top_alpha / P)
    # -- a stall: one spike that lost most of the time lost to spikes, and this share of the job's time
    stall_share: float = 0.02
    # -- output and projection
    top_events: int = 50
    target: float = DEFAULT_TARGET  # tolerated share of cluster steps that spike (hyperacc.theory)
    projection_nodes: tuple[int, ...] = (8, 64, 256, 1024)
    ranks_per_node: int | None = None  # None: measured (ranks of the largest node)

    def __post_init__(self) -> None:
        check_fields(self, SECTION)
        for name, least in _INT_BOUNDS.items():
            value = getattr(self, name)
            if value is not None:
                check(SECTION, name, value, value >= least, f">= {least}")
        for name, (least, most, closed) in _FLOAT_BOUNDS.items():
            v = getattr(self, name)
            lo = f">= {least:g}" if closed else f"> {least:g}"
            hi = "" if most == math.inf else f" and <= {most:g}"
            check(SECTION, name, v, (v >= least if closed else v > least) and v <= most, lo + hi)
        check(SECTION, "target", self.target, self.target < 1.0, "a probability > 0 and < 1")
        check(SECTION, "outlier_rule", self.outlier_rule, self.outlier_rule in ("and", "or"), "'and' or 'or'")
        check(SECTION, "spike_metric", self.spike_metric, self.spike_metric in ("self_ns", "busy_ns"),
              "'self_ns' or 'busy_ns'")  # fmt: skip
        check(SECTION, "persist_k", self.persist_k, self.persist_k <= self.persist_n,
              f"<= persist_n ({self.persist_n})")  # fmt: skip
        check(SECTION, "min_ranks", self.min_ranks, self.min_ranks >= 3,
              ">= 3: with two ranks no robust test can tell which one is slow")  # fmt: skip
        nodes = self.projection_nodes
        check(SECTION, "projection_nodes", nodes, all(n >= 1 for n in nodes), ">= 1 (every node count)")

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> DetectionOptions:
        """Unset options (None) keep their defaults."""
        return load(cls, {k: v for k, v in options.items() if v is not None}, SECTION)

    @property
    def steps_to_confirm(self) -> int:
        """The fewest steps per rank (warm-up included) in which the window rules can confirm anything:
        ``persist_k`` windows of ``window_steps``, after the warm-up."""
        return self.warmup_steps + self.persist_k * self.window_steps


# Integer options and their least allowed value.
_INT_BOUNDS: dict[str, int] = {
    "warmup_steps": 0,
    "window_steps": 1,
    "window_max_cells": 1,
    "min_window_samples": 1,
    "min_ranks": 3,
    "rank_chunk_steps": 1,
    "floor_ns": 0,
    "launch_floor_ns": 0,
    "persist_k": 1,
    "persist_n": 1,
    "top_min_windows": 1,
    "episode_block_steps": 1,
    "episode_min_steps": 1,
    "episode_max_cells": 1,
    "spike_window": 3,
    "spike_floor_ns": 0,
    "excess_min_spikes": 1,
    "period_min_repeats": 2,
    "top_events": 1,
    "ranks_per_node": 1,
}
# Float options: (least, greatest, whether the least itself is allowed).
_FLOAT_BOUNDS: dict[str, tuple[float, float, bool]] = {
    "z_threshold": (0.0, math.inf, False),
    "iqr_k": (0.0, math.inf, True),
    "min_mad_rel": (0.0, math.inf, True),
    "min_slowdown": (0.0, math.inf, True),
    "top_alpha": (0.0, 1.0, True),
    "node_fraction": (0.0, 1.0, True),
    "episode_min_effect": (1.0, math.inf, False),
    "episode_h": (0.0, math.inf, False),
    "spike_mad": (0.0, math.inf, False),
    "spike_floor_rel": (0.0, math.inf, True),
    "explain_share": (0.0, 1.0, False),
    "preempt_overhead": (0.0, 1.0, True),
    "signal_z": (0.0, math.inf, False),
    "excess_ratio": (1.0, math.inf, True),
    "period_coverage": (0.0, 1.0, False),
    "stall_share": (0.0, 1.0, False),
    "target": (0.0, 1.0, False),
}


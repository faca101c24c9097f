"""Every threshold of the detection rules, in one place, with the defaults of docs/detection.md."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hyperacc.theory import DEFAULT_TARGET

# Window metrics judged for stragglers, and the straggler kind each one names. Forward and backward
# are judged where the summaries carry them (offline): a slow forward stands out more clearly than the
# whole self-time on a machine whose other ranks share the cores.
STRAGGLER_METRICS: tuple[str, ...] = ("self_ns", "forward_ns", "backward_ns", "data_ns", "launch_ns", "gc_ns")
METRIC_KIND: dict[str, str] = {
    "self_ns": "compute",
    "forward_ns": "compute",
    "backward_ns": "compute",
    "data_ns": "data",
    "launch_ns": "launch",
    "gc_ns": "gc",
}
CAUSES: tuple[str, ...] = ("data", "gc", "allocator", "host", "communication", "compute", "unknown")


@dataclasses.dataclass(frozen=True)
class DetectionOptions:
    """Thresholds of the detection rules (docs/detection.md names each one)."""

    # -- eligibility
    warmup_steps: int = 10  # first steps of every rank are left out (compilation, allocation, caches)
    window_steps: int = 50  # straggler windows: steps [w*window_steps, (w+1)*window_steps)
    min_window_samples: int = 10  # a rank's window needs this many measured steps to be judged
    min_ranks: int = 4  # a window is judged only when this many ranks reported it
    # -- outlier ranks (per window, per metric)
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
    top_alpha: float = 1e-3  # rank-order persistence: slowest rank in so many windows that p < alpha (0: off)
    top_min_windows: int = 4  # and slowest in at least this many windows
    # -- node grouping
    node_fraction: float = 0.5  # more than this share of a node's ranks slow: a node problem
    # -- spikes within a rank
    spike_metric: str = "busy_ns"  # "busy_ns" (step_ns - comm_wait_ns: all its own work) or "self_ns"
    spike_window: int = 101  # centred rolling median, in steps
    spike_mad: float = 5.0  # excess > spike_mad * 1.4826 * rolling MAD ...
    spike_floor_ns: int = 1_000_000  # ... and > 1 ms ...
    spike_floor_rel: float = 0.25  # ... and > 25 % of the rank's typical step
    # -- attribution
    explain_share: float = 0.5  # a phase or a pause must account for half of a spike's excess
    signal_z: float = 3.5  # a counter coincides when it is this far above its rolling median (MAD z)
    # -- output and projection
    top_events: int = 50
    target: float = DEFAULT_TARGET  # tolerated share of cluster steps that spike (hyperacc.theory)
    projection_nodes: tuple[int, ...] = (8, 64, 256, 1024)
    ranks_per_node: int | None = None  # None: measured (ranks of the largest node)

    def __post_init__(self) -> None:
        if self.outlier_rule not in ("and", "or"):
            raise ValueError(f"outlier_rule must be 'and' or 'or' (got {self.outlier_rule!r})")
        if self.spike_metric not in ("self_ns", "busy_ns"):
            raise ValueError(f"spike_metric must be 'self_ns' or 'busy_ns' (got {self.spike_metric!r})")
        if not 1 <= self.persist_k <= self.persist_n:
            raise ValueError(f"need 1 <= persist_k <= persist_n (got k={self.persist_k}, n={self.persist_n})")
        if self.window_steps < 1 or self.spike_window < 3:
            raise ValueError("window_steps must be >= 1 and spike_window >= 3")
        if not 0.0 < self.target < 1.0:
            raise ValueError(f"target must be a probability in (0, 1) (got {self.target})")
        if self.min_ranks < 3:
            raise ValueError(
                "min_ranks must be >= 3: with two ranks no robust test can tell which one is slow"
            )

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> DetectionOptions:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown detection option(s) {unknown}; known: {', '.join(sorted(known))}")
        return cls(**{k: v for k, v in options.items() if v is not None})

"""Tracer settings: a frozen dataclass, read from Python keywords or from the ``HYPERACC_TRACE`` JSON.

Every setting and its default is described in docs/tracing.md, "Settings".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hyperacc.options import OptionsError, check, check_fields, load, parse_json

ENV_OPTIONS = "HYPERACC_TRACE"
# Set by ``hyperacc run`` for its ranks: the node agent (that process, ``hyperacc.agent``) rolls the
# ranks' record segments into Parquet, so a rank never loads pyarrow for it.
ENV_NODE_AGENT = "HYPERACC_NODE_AGENT"
ENV_RUN_DIR = "HYPERACC_RUN_DIR"
SECTION = "trace"

TraceConfigError = OptionsError  # the name before the one options error; public, kept as an alias


@dataclasses.dataclass(frozen=True)
class TraceOptions:
    capacity: int = 8192  # rows in the per-rank step ring buffer
    flush_every_s: float = 5.0  # a Parquet segment at most this often (and when the ring is half full)
    probe_every: int = 100  # launch-latency probe every K steps (0: off)
    probe_ops: int = 32  # tiny ops enqueued per probe
    window: int = 50  # steps per window summary sent to the analyzer (0: no live aggregation)
    grace_s: float = 30.0  # rank 0 waits this long for a window's late ranks, then reports them missing
    # Piggyback every rank's arrival/wait on the DDP gradient all-reduce. Off by default: the longer
    # buffer changes the summation order of some gradient elements (last bit) at more than 2 ranks.
    inband: bool = False
    agree_timeout_s: float = 30.0  # ranks wait this long at attach for all ranks to agree on the exchange
    signals: bool = True  # GC, CPU time, page faults, context switches, allocator counters
    host_syncs: bool = False  # count device syncs (CUDA only; switches torch's sync debug mode to warn)
    alloc_every: int = 10  # read CUDA allocator counters every N steps
    device_timing: bool = True  # on CUDA, step, self-time and collective wait from CUDA events
    device_phases: bool = False  # on CUDA, forward and backward from CUDA events too (4 events a step)
    handle_sigterm: bool = True  # flush on SIGTERM, then run the previous handler
    resources_every_s: float = 1.0  # sample memory and CPU this often, off the training thread (0: off)
    # Compaction (docs/tracing.md, "Storage"): once this many small segments wait, the flusher rolls
    # them into the rank's file of the period (0: off); a period is compact_period_s of wall clock and
    # at least compact_min_rows rows, whichever is longer.
    compact_every: int = 32
    compact_period_s: float = 3600.0
    compact_min_rows: int = 100_000

    def __post_init__(self) -> None:
        check_fields(self, SECTION)
        for name, ok, allowed in (
            ("capacity", self.capacity >= 16, ">= 16"),
            ("flush_every_s", self.flush_every_s > 0, "> 0"),
            ("probe_every", self.probe_every >= 0, ">= 0 (0 switches the probe off)"),
            ("probe_ops", self.probe_ops >= 1, ">= 1"),
            ("window", self.window >= 0, ">= 0 (0 switches live aggregation off)"),
            ("grace_s", self.grace_s >= 0, ">= 0"),
            ("agree_timeout_s", self.agree_timeout_s >= 0, ">= 0"),
            ("resources_every_s", self.resources_every_s >= 0, ">= 0 (0 switches resource sampling off)"),
            ("alloc_every", self.alloc_every >= 1, ">= 1"),
            ("compact_every", self.compact_every >= 0, ">= 0 (0 switches compaction off)"),
            ("compact_period_s", self.compact_period_s >= 0, ">= 0"),
            ("compact_min_rows", self.compact_min_rows >= 0, ">= 0"),
        ):
            check(SECTION, name, getattr(self, name), ok, allowed)

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> TraceOptions:
        return load(cls, raw, SECTION, plain=True) if raw else cls()

    @classmethod
    def from_json(cls, text: str | None) -> TraceOptions:
        if text is None or not text.strip():
            return cls()
        return cls.from_mapping(parse_json(text, ENV_OPTIONS, '{"window": 50, "probe_every": 100}'))

    def replace(self, **changes: Any) -> TraceOptions:
        return self.from_mapping({**dataclasses.asdict(self), **changes})

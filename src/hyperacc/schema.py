"""The one data model every layer shares: per-rank step records, events and window summaries.

A measured run (the tracer), an imported run (torch.profiler traces) and a simulated run all produce
these columns, so the same analysis reads all three.

Run directory layout (``RUN_DIR``)::

    meta/rank-00003.json              RankMeta of each rank (written at start-up)
    steps/rank-00003/seg-000001.parquet   STEP_SCHEMA rows, appended segment by segment
    events/rank-00003/seg-000001.parquet  EVENT_SCHEMA rows (stabilizer actions, pacing changes, ...)
    resources/rank-00003/seg-000001.parquet  RESOURCE_SCHEMA rows (memory, CPU; about once a second)
    live/windows/seg-000001.parquet       every rank's window summaries, as rank 0 gathered them
    chaos/rank-00003.jsonl            ground truth of injected faults (hyperacc.chaos)

Times are integer nanoseconds. A value that was not measured is null in Parquet (and -1 in the
tracer's preallocated buffers before it is written).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pyarrow as pa

# Phases of a step, in the order they happen. ``other`` is the rest of the step.
PHASES: tuple[str, ...] = ("data", "h2d", "forward", "backward", "comm_wait", "optimizer", "other")

STEP_SCHEMA = pa.schema(
    [
        pa.field("rank", pa.int32(), nullable=False),
        pa.field("node", pa.int32(), nullable=False),  # torchrun GROUP_RANK
        pa.field("step", pa.int64(), nullable=False),
        pa.field("t_start_ns", pa.int64()),  # wall clock (time.time_ns) at step start
        pa.field("step_ns", pa.int64()),  # whole step, boundary to boundary
        pa.field("self_ns", pa.int64()),  # work before entering the gradient collective(s)
        # phase durations (see PHASES)
        pa.field("data_ns", pa.int64()),
        pa.field("h2d_ns", pa.int64()),
        pa.field("forward_ns", pa.int64()),
        pa.field("backward_ns", pa.int64()),
        pa.field("comm_wait_ns", pa.int64()),  # time inside the gradient collective(s)
        pa.field("optimizer_ns", pa.int64()),
        pa.field("other_ns", pa.int64()),
        # cause signals, per step (deltas over the step)
        pa.field("gc_ns", pa.int64()),  # total GC pause time in the step
        pa.field("gc_count", pa.int32()),  # collections in the step
        pa.field("gc_max_gen", pa.int8()),  # highest generation collected, -1 if none
        pa.field("major_faults", pa.int64()),
        pa.field("invol_ctx_switches", pa.int64()),
        pa.field("alloc_retries", pa.int64()),  # CUDA allocator num_alloc_retries delta
        pa.field("device_allocs", pa.int64()),  # CUDA allocator num_device_alloc delta
        pa.field("sync_all_streams", pa.int64()),  # CUDA allocator num_sync_all_streams delta
        pa.field("host_syncs", pa.int64()),
        pa.field("launch_ns", pa.int64()),  # launch-latency probe, only on probe steps
        # in-band exchange: the minimum wait over all ranks in the previous step's collective,
        # as seen by this rank; lets a single rank's file name the culprit of a step.
        pa.field("min_wait_rank", pa.int32()),
        # pacing state (hyperacc.pacing)
        pa.field("pace_on", pa.bool_()),
        pa.field("pace_delay_ns", pa.int64()),
        pa.field("spread_ns", pa.int64()),
        # -- added in schema 2 (readers treat a column a segment lacks as not measured)
        # CPU time (user + system) of the training thread over the step: a rank that computes more
        # spends more CPU; one that was preempted or blocked spends more wall time, not more CPU.
        pa.field("cpu_ns", pa.int64()),
        # Device clock (CUDA events on the step's stream); null where not measured on the device.
        pa.field("dev_step_ns", pa.int64()),
        pa.field("dev_self_ns", pa.int64()),
        pa.field("dev_comm_wait_ns", pa.int64()),
        pa.field("dev_forward_ns", pa.int64()),
        pa.field("dev_backward_ns", pa.int64()),
        pa.field("micro_steps", pa.int32()),  # backward passes in the step (gradient accumulation)
        pa.field("collectives", pa.int32()),  # collective calls (and DDP bucket rounds) timed in the step
        pa.field("data_gap", pa.bool_()),  # data_ns is the input gap: no DataLoader fetch was seen
    ]
)

STEP_COLUMNS: tuple[str, ...] = tuple(STEP_SCHEMA.names)

EVENT_SCHEMA = pa.schema(
    [
        pa.field("rank", pa.int32(), nullable=False),
        pa.field("step", pa.int64()),
        pa.field("t_ns", pa.int64()),  # wall clock
        pa.field("kind", pa.string(), nullable=False),  # e.g. gc_collect, malloc_trim, pace_on, spike
        pa.field("duration_ns", pa.int64()),
        pa.field("value", pa.float64()),
        pa.field("detail", pa.string()),
    ]
)

# Resources of one rank, sampled off the training thread (about once a second): what the process holds
# and uses, for memory creep and imbalance across ranks.
RESOURCE_SCHEMA = pa.schema(
    [
        pa.field("rank", pa.int32(), nullable=False),
        pa.field("node", pa.int32(), nullable=False),
        pa.field("t_ns", pa.int64(), nullable=False),  # wall clock of the sample
        pa.field("step", pa.int64()),  # the step in progress (or the next one) when sampled
        pa.field("rss_bytes", pa.int64()),  # resident set size of the process
        pa.field("cpu_ns", pa.int64()),  # process CPU time (user + system, all threads), cumulative
        pa.field("cuda_allocated_bytes", pa.int64()),  # torch.cuda.memory_allocated
        pa.field("cuda_reserved_bytes", pa.int64()),  # torch.cuda.memory_reserved
        pa.field("cuda_peak_bytes", pa.int64()),  # torch.cuda.max_memory_allocated since the start
    ]
)

# Per-window, per-rank summary that travels to the analyzer while training runs.
WINDOW_SCHEMA = pa.schema(
    [
        pa.field("rank", pa.int32(), nullable=False),
        pa.field("node", pa.int32(), nullable=False),
        pa.field("window", pa.int64(), nullable=False),
        pa.field("first_step", pa.int64()),
        pa.field("last_step", pa.int64()),
        pa.field("steps", pa.int64()),
        pa.field("self_ns_median", pa.float64()),
        pa.field("data_ns_median", pa.float64()),
        pa.field("comm_wait_ns_median", pa.float64()),
        pa.field("launch_ns_median", pa.float64()),
        pa.field("gc_ns_sum", pa.float64()),
        pa.field("step_ns_median", pa.float64()),
    ]
)


@dataclasses.dataclass(frozen=True)
class RankMeta:
    rank: int
    local_rank: int
    node: int
    world_size: int
    local_world_size: int
    hostname: str
    pid: int
    backend: str = "gloo"
    device: str = "cpu"
    source: str = "tracer"  # tracer | kineto | simulator

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RankMeta:
        raw = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})


def rank_name(rank: int) -> str:
    return f"rank-{rank:05d}"


def meta_path(run_dir: str | os.PathLike, rank: int) -> Path:
    return Path(run_dir) / "meta" / f"{rank_name(rank)}.json"


def steps_dir(run_dir: str | os.PathLike, rank: int) -> Path:
    return Path(run_dir) / "steps" / rank_name(rank)


def events_dir(run_dir: str | os.PathLike, rank: int) -> Path:
    return Path(run_dir) / "events" / rank_name(rank)


def resources_dir(run_dir: str | os.PathLike, rank: int) -> Path:
    return Path(run_dir) / "resources" / rank_name(rank)


def live_windows_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "live" / "windows"


def chaos_path(run_dir: str | os.PathLike, rank: int) -> Path:
    return Path(run_dir) / "chaos" / f"{rank_name(rank)}.jsonl"

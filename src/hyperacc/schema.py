"""The one data model every layer shares: per-rank step records, events and window summaries.

A measured run (the tracer), an imported run (torch.profiler traces) and a simulated run all produce
these columns, so the same analysis reads all three.

Run directory layout (``RUN_DIR``)::

    meta/rank-00003.json              RankMeta of each rank (written at start-up)
    steps/rank-00003/seg-000001.rec   STEP_SCHEMA rows, one plain record segment per flush
    steps/rank-00003/seg-000001-000040.parquet   the same rows once compacted (one file per period)
    events/rank-00003/seg-*           EVENT_SCHEMA rows (stabilizer actions, pacing changes, ...)
    resources/rank-00003/seg-*        RESOURCE_SCHEMA rows (memory, CPU; about once a second)
    live/windows/seg-*.parquet        every rank's window summaries, as rank 0 gathered them
    chaos/rank-00003.jsonl            ground truth of injected faults (hyperacc.chaos)

A rank writes plain records (``hyperacc.records``: no pyarrow in a training rank); the node agent
(``hyperacc run``), or the rank itself when no agent runs, rolls them into Parquet
(``store.compact``). Every reader reads both (``store.read_segment``).

Times are integer nanoseconds. A value that was not measured is null in Parquet (and -1 in the
tracer's preallocated buffers and its plain records, ``hyperacc.records``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

# Phases of a step, in the order they happen. ``other`` is the rest of the step.
PHASES: tuple[str, ...] = ("data", "h2d", "forward", "backward", "comm_wait", "optimizer", "other")

_STEP_FIELDS: tuple[tuple[str, str, bool], ...] = (
    ("rank", "int32", False),
    ("node", "int32", False),  # torchrun GROUP_RANK
    ("step", "int64", False),
    ("t_start_ns", "int64", True),  # wall clock (time.time_ns) at step start
    ("step_ns", "int64", True),  # whole step, boundary to boundary
    ("self_ns", "int64", True),  # work before entering the gradient collective(s)
    # phase durations (see PHASES)
    ("data_ns", "int64", True),
    ("h2d_ns", "int64", True),
    ("forward_ns", "int64", True),
    ("backward_ns", "int64", True),
    ("comm_wait_ns", "int64", True),  # time inside the gradient collective(s)
    ("optimizer_ns", "int64", True),
    ("other_ns", "int64", True),
    # cause signals, per step (deltas over the step)
    ("gc_ns", "int64", True),  # total GC pause time in the step
    ("gc_count", "int32", True),  # collections in the step
    ("gc_max_gen", "int8", True),  # highest generation collected, -1 if none
    ("major_faults", "int64", True),
    ("invol_ctx_switches", "int64", True),
    ("alloc_retries", "int64", True),  # CUDA allocator num_alloc_retries delta
    ("device_allocs", "int64", True),  # CUDA allocator num_device_alloc delta
    ("sync_all_streams", "int64", True),  # CUDA allocator num_sync_all_streams delta
    ("host_syncs", "int64", True),
    ("launch_ns", "int64", True),  # launch-latency probe, only on probe steps
    # in-band exchange: the minimum wait over all ranks in the previous step's collective,
    # as seen by this rank; lets a single rank's file name the culprit of a step.
    ("min_wait_rank", "int32", True),
    # pacing state (hyperacc.pacing)
    ("pace_on", "bool_", True),
    ("pace_delay_ns", "int64", True),
    ("spread_ns", "int64", True),
    # -- added in schema 2 (readers treat a column a segment lacks as not measured)
    # CPU time (user + system) of the training thread over the step: a rank that computes more
    # spends more CPU; one that was preempted or blocked spends more wall time, not more CPU.
    ("cpu_ns", "int64", True),
    # Device clock (CUDA events on the step's stream); null where not measured on the device.
    ("dev_step_ns", "int64", True),
    ("dev_self_ns", "int64", True),
    ("dev_comm_wait_ns", "int64", True),
    ("dev_forward_ns", "int64", True),
    ("dev_backward_ns", "int64", True),
    ("micro_steps", "int32", True),  # backward passes in the step (gradient accumulation)
    ("collectives", "int32", True),  # collective calls (and DDP bucket rounds) timed in the step
    ("data_gap", "bool_", True),  # data_ns is the input gap: no DataLoader fetch was seen
    # voluntary context switches of the training thread over the step: it blocked (a read, a queue, a
    # sleep), as a wait for input does and preemption does not
    ("vol_ctx_switches", "int64", True),
    # minor page faults of the training thread over the step, and the part of its CPU time spent in the
    # kernel: a rank whose allocator returns its large blocks and maps them again every step (glibc's
    # default thresholds) pays for each fresh page in the kernel, the same work at a higher CPU time
    ("minor_faults", "int64", True),
    ("sys_cpu_ns", "int64", True),
    # time the training thread was ready to run but waited for a CPU over the step (the kernel's
    # run-queue delay, /proc/self/task/TID/schedstat): what the host's preemption added to the step's
    # wall time, so that wall = CPU time + this + time blocked (a read, a queue, a sleep); over the whole
    # step, the wait in the collective included
    ("run_delay_ns", "int64", True),
    # the part of it inside the step's waits in DDP's gradient all-reduce (``DDPWait``: from the graph's
    # end to the buckets reduced): a thread woken there waits for a CPU before the step's self-time goes
    # on, so ``run_delay_ns - comm_run_delay_ns`` is the delay within the self-time; null where not timed
    ("comm_run_delay_ns", "int64", True),
    # the step's DataLoader fetch ran on the training thread (``num_workers`` 0: the dataset and the
    # collate run there, so a wait in the fetch is the thread's own read, lock or sleep, not a worker the
    # host starved); 0 where it came from worker processes, null where no fetch was seen
    ("data_own", "bool_", True),
)

STEP_COLUMNS: tuple[str, ...] = tuple(f[0] for f in _STEP_FIELDS)
# Columns the analysis reads (a subset of STEP_SCHEMA).
ANALYSIS_COLUMNS: tuple[str, ...] = (
    "rank", "node", "step", "step_ns", "self_ns",
    "data_ns", "h2d_ns", "forward_ns", "backward_ns", "comm_wait_ns", "optimizer_ns", "other_ns",
    "gc_ns", "major_faults", "invol_ctx_switches", "alloc_retries", "sync_all_streams", "launch_ns",
    "pace_delay_ns", "cpu_ns", "dev_step_ns", "dev_self_ns", "dev_comm_wait_ns", "dev_forward_ns",
    "dev_backward_ns", "data_gap", "vol_ctx_switches", "minor_faults", "sys_cpu_ns", "run_delay_ns",
    "comm_run_delay_ns", "data_own",
)  # fmt: skip

# Columns where -1 is a value, not "not measured" (``gc_max_gen``: no collection in the step).
NEG_ONE_IS_VALUE = frozenset({"gc_max_gen"})

_EVENT_FIELDS: tuple[tuple[str, str, bool], ...] = (
    ("rank", "int32", False),
    ("step", "int64", True),
    ("t_ns", "int64", True),  # wall clock
    ("kind", "string", False),  # e.g. gc_collect, malloc_trim, pace_on, spike
    ("duration_ns", "int64", True),
    ("value", "float64", True),
    ("detail", "string", True),
)

# Resources of one rank, sampled off the training thread (about once a second): what the process holds
# and uses, for memory creep and imbalance across ranks.
_RESOURCE_FIELDS: tuple[tuple[str, str, bool], ...] = (
    ("rank", "int32", False),
    ("node", "int32", False),
    ("t_ns", "int64", False),  # wall clock of the sample
    ("step", "int64", True),  # the step in progress (or the next one) when sampled
    ("rss_bytes", "int64", True),  # resident set size of the process
    ("cpu_ns", "int64", True),  # process CPU time (user + system, all threads), cumulative
    ("cuda_allocated_bytes", "int64", True),  # torch.cuda.memory_allocated
    ("cuda_reserved_bytes", "int64", True),  # torch.cuda.memory_reserved
    ("cuda_peak_bytes", "int64", True),  # torch.cuda.max_memory_allocated since the start
)

# Per-window, per-rank summary that travels to the analyzer while training runs.
_WINDOW_FIELDS: tuple[tuple[str, str, bool], ...] = (
    ("rank", "int32", False),
    ("node", "int32", False),
    ("window", "int64", False),
    ("first_step", "int64", True),
    ("last_step", "int64", True),
    ("steps", "int64", True),
    ("self_ns_median", "float64", True),
    ("data_ns_median", "float64", True),
    ("comm_wait_ns_median", "float64", True),
    ("launch_ns_median", "float64", True),
    ("gc_ns_sum", "float64", True),
    ("step_ns_median", "float64", True),
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
    agent: str = ""  # the node agent (``hyperacc run``, "host:pid") that compacts this rank's records
    store: str = ""  # "MASTER_ADDR:MASTER_PORT": the job's c10d store, where node agents meet
    run_id: str = ""  # TORCHELASTIC_RUN_ID
    restart_count: int = 0  # TORCHELASTIC_RESTART_COUNT when this rank started
    nodes: int = 0  # GROUP_WORLD_SIZE: nodes (agents) in the job; 0 where unknown

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


def window_gathered_detail(missing: list[int]) -> str:
    """The detail of a ``window_gathered`` event (its value is the number of ranks that reported): the
    ranks missing from the window. Not the ranks that reported: at 4,096 ranks that list made 23 KB an
    event, most of what a long job's first look at ``live/events`` parsed."""
    return json.dumps({"missing": missing})


def live_windows_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "live" / "windows"


def live_events_dir(run_dir: str | os.PathLike) -> Path:
    """The node agent's live verdicts (``live_finding``, ``window_gathered``), EVENT_SCHEMA rows."""
    return Path(run_dir) / "live" / "events"


def chaos_path(run_dir: str | os.PathLike, rank: int) -> Path:
    return Path(run_dir) / "chaos" / f"{rank_name(rank)}.jsonl"


# The Arrow schemas are built on first use (PEP 562): a training rank writes plain records
# (``hyperacc.records``) and never imports pyarrow; readers, the node agent and the analysis do.
_FIELDS = {
    "STEP_SCHEMA": _STEP_FIELDS,
    "EVENT_SCHEMA": _EVENT_FIELDS,
    "RESOURCE_SCHEMA": _RESOURCE_FIELDS,
    "WINDOW_SCHEMA": _WINDOW_FIELDS,
}


def fields(name: str) -> tuple[tuple[str, str, bool], ...]:
    """(column, Arrow type name, nullable) of one schema (``"STEP_SCHEMA"``, ...), without pyarrow."""
    return _FIELDS[name]


def __getattr__(name: str) -> object:
    if name not in _FIELDS:
        raise AttributeError(f"module 'hyperacc.schema' has no attribute {name!r}")
    import pyarrow as pa

    value = pa.schema([pa.field(n, getattr(pa, t)(), nullable=null) for n, t, null in _FIELDS[name]])
    globals()[name] = value
    return value

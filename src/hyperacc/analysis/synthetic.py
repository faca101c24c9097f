"""Synthetic run directories with known faults, for testing and benchmarking the analysis.

The model is a synchronous data-parallel step: each rank loads data, computes forward and backward
(its self-time), then waits in the gradient all-reduce for the last rank to arrive; so every rank's step
time is the same and the slow rank is the one that waits least. Faults are injected with a seeded
generator and recorded as ground truth in the same format as ``hyperacc.chaos``
(``RUN_DIR/chaos/rank-XXXXX.jsonl``).

Ranks are generated one at a time (two passes with the same seed: one for the arrival of the last rank
per step, one to write), so a 1,000 x 100,000 run is written in bounded memory.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from hyperacc import store
from hyperacc.schema import STEP_SCHEMA, RankMeta, chaos_path

MS = 1_000_000


@dataclasses.dataclass(frozen=True)
class SyntheticFault:
    """``kind``: slowdown (compute x (1+factor) from ``start_step``), data_stall, gc, compute_spike,
    host (preemption: the rank loses the core for ``ms``, with extra context switches and no CPU time),
    comm (the collective itself is slow for everyone; ``ranks`` is ignored), launch (probe x
    (1+factor)). ``every`` > 0: a spike kind hits every ``every`` steps from ``start_step`` instead of
    at random with ``rate`` (work a loop does on a fixed period: a checkpoint, an evaluation); ``end_step`` > 0 ends it before that
    step. The CPU
    time of each step (``cpu_ns``) is the work done: phases less what a host fault took."""

    kind: str
    ranks: tuple[int, ...] = ()
    rate: float = 0.0
    ms: float = 0.0
    factor: float = 0.0
    start_step: int = 0
    every: int = 0
    end_step: int = 0  # > 0: the fault stops before this step (a fail-slow that ends)


@dataclasses.dataclass(frozen=True)
class SyntheticRun:
    ranks: int = 8
    steps: int = 2000
    ranks_per_node: int = 4
    seed: int = 0
    data_ms: float = 2.0
    forward_ms: float = 10.0
    backward_ms: float = 20.0
    optimizer_ms: float = 3.0
    other_ms: float = 1.0
    collective_ms: float = 2.0
    noise: float = 0.03  # lognormal sigma of each phase
    launch_every: int = 100  # the tracer's probe: every K steps, the same steps on every rank
    launch_ns: float = 4000.0  # mean host time to enqueue one tiny op
    segment_steps: int = 500
    faults: tuple[SyntheticFault, ...] = ()
    missing: tuple[int, ...] = ()  # ranks that write metadata but no records


def write_run(run_dir: str | os.PathLike, spec: SyntheticRun) -> Path:
    """Write ``spec`` as a run directory (metadata, step segments, chaos ground truth)."""
    root = Path(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    arrival = last_arrival(spec)
    for rank in range(spec.ranks):
        write_rank(root, spec, rank, arrival)
    return root


def last_arrival(spec: SyntheticRun) -> np.ndarray:
    """Per step, the self-time of the last rank to reach the all-reduce (one rank generated at a time)."""
    arrival = np.zeros(spec.steps)
    for rank in range(spec.ranks):
        if rank not in spec.missing:
            arrival = np.maximum(arrival, _rank_self(spec, rank)[0])
    return arrival


def write_rank(root: Path, spec: SyntheticRun, rank: int, arrival: np.ndarray) -> None:
    """Metadata, step segments and ground truth of one rank (ranks can be written in parallel)."""
    node = rank // spec.ranks_per_node
    store.write_meta(
        root,
        RankMeta(rank, rank % spec.ranks_per_node, node, spec.ranks, spec.ranks_per_node, f"synthetic-{node}", 0,
                 source="simulator"),
    )  # fmt: skip
    if rank in spec.missing:
        return
    comm_fault = _comm_delay(spec)
    self_ns, phases, signals, truth = _rank_self(spec, rank)
    rng = np.random.default_rng([spec.seed, rank, 7])
    collective = spec.collective_ms * MS * rng.lognormal(0.0, spec.noise, spec.steps) + comm_fault
    comm_wait = arrival - self_ns + collective
    optimizer = spec.optimizer_ms * MS * rng.lognormal(0.0, spec.noise, spec.steps)
    other = spec.other_ms * MS * rng.lognormal(0.0, spec.noise, spec.steps)
    step_ns = arrival + collective + optimizer + other
    signals = {**signals, "cpu_ns": signals["cpu_ns"] + optimizer + other}
    cols = {
        "rank": np.full(spec.steps, rank, dtype=np.int32),
        "node": np.full(spec.steps, node, dtype=np.int32),
        "step": np.arange(spec.steps, dtype=np.int64),
        "t_start_ns": np.cumsum(step_ns).astype(np.int64),
        "step_ns": step_ns,
        "self_ns": self_ns,
        "comm_wait_ns": comm_wait,
        "optimizer_ns": optimizer,
        "other_ns": other,
        **phases,
        **signals,
    }
    writer = store.step_writer(root, rank)
    for lo in range(0, spec.steps, spec.segment_steps):
        writer.write(_table({k: v[lo : lo + spec.segment_steps] for k, v in cols.items()}))
    if comm_fault.any() and rank == 0:
        truth += [
            {"rank": -1, "node": -1, "step": int(s), "kind": "comm", "magnitude_ms": float(comm_fault[s] / MS)}
            for s in np.flatnonzero(comm_fault)
        ]  # fmt: skip
    _write_truth(root, rank, node, truth)


def _rank_self(
    spec: SyntheticRun, rank: int
) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray], list]:
    n = spec.steps
    rng = np.random.default_rng([spec.seed, rank])
    steps = np.arange(n)
    data = spec.data_ms * MS * rng.lognormal(0.0, spec.noise, n)
    h2d = 0.5 * MS * rng.lognormal(0.0, spec.noise, n)
    forward = spec.forward_ms * MS * rng.lognormal(0.0, spec.noise, n)
    backward = spec.backward_ms * MS * rng.lognormal(0.0, spec.noise, n)
    gc_ns = np.zeros(n)
    invol = rng.poisson(2.0, n).astype(np.float64)
    faults_major = np.zeros(n)
    probe = steps % spec.launch_every == 0
    launch = np.where(probe, spec.launch_ns * rng.lognormal(0.0, spec.noise, n), np.nan)
    truth: list[dict] = []
    lost_cpu = np.zeros(n)
    node = rank // spec.ranks_per_node
    for i, f in enumerate(spec.faults):
        if f.kind == "comm" or rank not in f.ranks:
            continue
        frng = np.random.default_rng([spec.seed, rank, 1000 + i])
        during = (steps >= f.start_step) & ((steps < f.end_step) if f.end_step > 0 else True)
        hit = (frng.random(n) < f.rate) & during
        if f.every:
            hit = during & ((steps - f.start_step) % f.every == 0)
        if f.kind == "slowdown":
            on = during
            forward = np.where(on, forward * (1 + f.factor), forward)
            backward = np.where(on, backward * (1 + f.factor), backward)
            truth.append({"rank": rank, "node": node, "step": f.start_step, "kind": "slowdown", "magnitude_ms": 0.0,
                          "detail": {"factor": f.factor}})  # fmt: skip
        elif f.kind == "launch":
            launch = launch * (1 + f.factor)
            truth.append({"rank": rank, "node": node, "step": 0, "kind": "launch", "magnitude_ms": 0.0,
                          "detail": {"factor": f.factor}})  # fmt: skip
        elif f.kind in ("data_stall", "gc", "compute_spike", "host"):
            extra = np.where(hit, f.ms * MS, 0.0)
            if f.kind == "data_stall":
                data = data + extra
            elif f.kind == "gc":
                forward = forward + extra
                gc_ns = gc_ns + extra
            elif f.kind == "compute_spike":
                backward = backward + extra
            else:
                forward = forward + extra
                lost_cpu = lost_cpu + extra
                invol = invol + np.where(hit, 40.0, 0.0)
            kind = {"gc": "gc_pause", "compute_spike": "spike"}.get(f.kind, f.kind)
            truth += [{"rank": rank, "node": node, "step": int(s), "kind": kind, "magnitude_ms": f.ms}
                      for s in np.flatnonzero(hit)]  # fmt: skip
    self_ns = data + h2d + forward + backward
    phases = {"data_ns": data, "h2d_ns": h2d, "forward_ns": forward, "backward_ns": backward}
    # CPU time of the training thread: the work it did (a host fault takes wall time, not CPU time; a data
    # stall waits; GC pauses and slowdowns are work)
    cpu = h2d + forward + backward - lost_cpu
    signals = {
        "gc_ns": gc_ns,
        "gc_count": (gc_ns > 0).astype(np.int32),
        "major_faults": faults_major,
        "invol_ctx_switches": invol,
        "launch_ns": launch,
        "cpu_ns": cpu,
    }
    return self_ns, phases, signals, truth


def _comm_delay(spec: SyntheticRun) -> np.ndarray:
    delay = np.zeros(spec.steps)
    for i, f in enumerate(spec.faults):
        if f.kind == "comm":
            rng = np.random.default_rng([spec.seed, 99, i])
            steps = np.arange(spec.steps)
            during = (steps >= f.start_step) & ((steps < f.end_step) if f.end_step > 0 else True)
            delay += np.where((rng.random(spec.steps) < f.rate) & during, f.ms * MS, 0.0)
    return delay


def _table(cols: dict[str, np.ndarray]) -> pa.Table:
    arrays = {}
    for field in STEP_SCHEMA:
        v = cols.get(field.name)
        if v is None:
            arrays[field.name] = pa.nulls(len(cols["step"]), type=field.type)
        elif pa.types.is_integer(field.type) and v.dtype.kind == "f":
            arrays[field.name] = pa.array(np.rint(np.nan_to_num(v)).astype(np.int64), mask=np.isnan(v)).cast(
                field.type
            )
        else:
            arrays[field.name] = pa.array(v).cast(field.type)
    return pa.table(arrays, schema=STEP_SCHEMA)


def _write_truth(root: Path, rank: int, node: int, rows: Sequence[dict]) -> None:
    path = chaos_path(root, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))

"""Export a run directory as a Chrome / Perfetto trace (the JSON "Trace Event Format").

Open the file in https://ui.perfetto.dev or chrome://tracing. Layout (docs/presentation.md, "Timeline
export"): one process per rank ("rank 3 (node 0)"), and in each

- ``steps``: one slice per step, with every measured column in its arguments;
- ``phases``: the step's phases as slices. The run directory stores phase *durations*, not start
  times, so they are laid end to end in phase order from the step start;
- ``comm wait``: the time inside the gradient collective(s), in its own track so waits stand out. When
  the phases add up to more than the step (a Kineto import, where collectives overlap backward on the
  GPU) it is drawn ending at the step end;
- ``signals``: instant events for spikes (with their cause, from the diagnosis or ``spike`` events)
  and for GC pauses (from ``gc_ns``/``gc_count``/``gc_max_gen``);
- ``collectives``: collective kernels of a Kineto import (``collective`` events);
- ``hyperacc``: stabilizer and pacing events (any other event kind), slices when they have a duration.

Timestamps are microseconds from the earliest exported step; ``otherData.t0_unix_ns`` gives the wall
clock of zero. The file is written as it is built (one rank in memory at a time).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hyperacc import store
from hyperacc.analysis.columns import discover, read_rank

log = logging.getLogger(__name__)

_PHASE_ORDER = ("data", "h2d", "forward", "backward", "comm_wait", "optimizer", "other")
_COLUMNS = (
    "rank", "node", "step", "t_start_ns", "step_ns", "self_ns",
    *(f"{p}_ns" for p in _PHASE_ORDER),
    "gc_ns", "gc_count", "gc_max_gen", "major_faults", "invol_ctx_switches", "alloc_retries",
    "host_syncs", "launch_ns", "min_wait_rank", "pace_on", "pace_delay_ns", "spread_ns",
)  # fmt: skip

# thread ids inside each rank's process
TID_STEPS, TID_PHASES, TID_WAIT, TID_SIGNALS, TID_COLLECTIVES, TID_HYPERACC = 1, 2, 3, 4, 5, 6
_THREADS = {
    TID_STEPS: "steps",
    TID_PHASES: "phases",
    TID_WAIT: "comm wait",
    TID_SIGNALS: "signals",
    TID_COLLECTIVES: "collectives",
    TID_HYPERACC: "hyperacc",
}
# Trace-viewer reserved colour names, so phases look the same in every export.
_PHASE_COLOUR = {
    "data": "thread_state_iowait",
    "h2d": "rail_load",
    "forward": "good",
    "backward": "rail_animation",
    "comm_wait": "terrible",
    "optimizer": "rail_idle",
    "other": "generic_work",
}


class ExportError(ValueError):
    """The export cannot be written; the message says what to change."""


@dataclasses.dataclass
class ChromeExport:
    path: Path
    ranks: int
    steps: int  # step records exported (all ranks)
    trace_events: int
    bytes: int


def parse_steps(text: str | None) -> tuple[int | None, int | None]:
    """``"A:B"`` -> (A, B): steps A (inclusive) to B (exclusive); either side may be empty."""
    if not text:
        return None, None
    parts = text.split(":")
    try:
        if len(parts) != 2:
            raise ValueError
        lo = int(parts[0]) if parts[0].strip() else None
        hi = int(parts[1]) if parts[1].strip() else None
    except ValueError:
        raise ExportError(f"--steps {text!r}: expected A:B (first step, end step exclusive), e.g. 100:200") from None
    if any(v is not None and abs(v) > store.MAX_STEP for v in (lo, hi)):
        raise ExportError(f"--steps {text!r}: step numbers lie within +-2**53")
    if lo is not None and hi is not None and hi <= lo:
        raise ExportError(f"--steps {text!r}: the end ({hi}) must be after the start ({lo})")
    return lo, hi


def parse_ranks(text: str | None) -> tuple[int, ...] | None:
    """``"0-7,12"`` -> (0, 1, ..., 7, 12): the ranks to export (None: every rank)."""
    if not text or not text.strip():
        return None
    out: set[int] = set()
    try:
        for part in text.split(","):
            a, sep, b = part.strip().partition("-")
            lo, hi = int(a), int(b) if sep else int(a)
            if not 0 <= lo <= hi < store.MAX_RANKS:
                raise ValueError
            out.update(range(lo, hi + 1))
    except ValueError:
        raise ExportError(f"--ranks {text!r}: expected ranks and ranges from 0, e.g. 0-7,12") from None
    return tuple(sorted(out))


def export_chrome(
    run_dir: str | os.PathLike | Sequence[str | os.PathLike],
    out: str | os.PathLike,
    *,
    steps: tuple[int | None, int | None] = (None, None),
    ranks: Sequence[int] | None = None,
    diagnosis: Mapping[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
) -> ChromeExport:
    """Writes the trace of ``run_dir`` (steps ``[A, B)`` and ``ranks`` when given) to ``out``.

    ``diagnosis`` is ``Diagnosis.to_dict()``; its ``spikes.events`` mark spikes with their cause.
    ``progress(rank)`` is called after each rank. Memory is bounded by one rank's records and events:
    each rank is read, written and dropped before the next. The trace is written to ``out.tmp`` and
    renamed into place; an error or an interrupt (KeyboardInterrupt, SystemExit) removes it.
    """
    layout = discover(run_dir)
    if not layout.sources:
        raise ExportError(f"{layout.name} holds no step records; nothing to export")
    lo, hi = steps
    spikes = _spikes_by_rank(diagnosis, lo, hi)
    chosen = sorted(layout.sources) if ranks is None else [r for r in sorted(set(ranks)) if r in layout.sources]
    if not chosen:
        raise ExportError(f"--ranks: none of {_ranks_text(ranks or ())} has step records in {layout.name} "
                          f"(ranks with records: {_ranks_text(sorted(layout.sources))})")  # fmt: skip

    # t0: earliest start over the window, from Parquet data of each rank (one rank in memory at a time)
    t0 = math.inf
    records = 0
    for r in chosen:
        cols = _read_rank(layout.sources[r].segments, ("step", "t_start_ns"))
        records += cols["step"].size
        cols = _window(cols, lo, hi)
        if cols["t_start_ns"].size and np.isfinite(cols["t_start_ns"]).any():
            t0 = min(t0, float(np.nanmin(cols["t_start_ns"])))
        table = _rank_event_table(layout.run_dirs, r, lo, hi)  # an event may precede the first exported step
        t = table.column("t_ns").drop_null() if table is not None else []
        if len(t):
            t0 = min(t0, float(pc.min(t).as_py()))
    if not records:  # as analyze and report: a run without one readable record is an error, not a trace
        raise store.RunDirError(f"no segment under {layout.run_dir / 'steps'} could be read; see the warnings above")
    if not math.isfinite(t0):
        t0 = 0.0

    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    n_events = 0
    n_steps = 0
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write('{"displayTimeUnit":"ms","otherData":')
            f.write(json.dumps({"producer": "hyperacc export", "run_dir": layout.name, "t0_unix_ns": int(t0),
                                "steps": [lo, hi]}))  # fmt: skip
            f.write(',"traceEvents":[\n')
            writer = _Writer(f)
            for r in chosen:
                cols = _window(_read_rank(layout.sources[r].segments, _COLUMNS), lo, hi)
                meta = layout.metas.get(r)
                node = meta.node if meta else (int(cols["node"][0]) if cols["node"].size else 0)
                _rank_process(writer, r, node, meta.hostname if meta else None)
                n_steps += _rank_steps(writer, r, cols, t0, spikes.get(r, {}))
                _rank_events(writer, r, _rank_event_table(layout.run_dirs, r, lo, hi), t0)
                del cols
                if progress is not None:
                    progress(r)
            n_events = writer.count
            f.write("\n]}\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # a full disk or an interrupt leaves no half-written trace
            tmp.unlink(missing_ok=True)
        raise
    return ChromeExport(path, len(chosen), n_steps, n_events, path.stat().st_size)


class _Writer:
    def __init__(self, f: IO[str]) -> None:
        self.f = f
        self.count = 0

    def __call__(self, ev: dict) -> None:
        if self.count:
            self.f.write(",\n")
        self.f.write(json.dumps(ev, separators=(",", ":")))
        self.count += 1


def _read_rank(paths, columns) -> dict[str, np.ndarray]:
    """One rank's columns, sorted by step, the last record of a step kept: ``analysis.columns.read_rank``,
    the reader ``analyze`` and ``report`` use, so all three skip the same segments and rows.

    Wall-clock nanoseconds (~1.7e18) do not fit float64 exactly; microsecond timestamps do not need
    them to.
    """
    return read_rank(paths, columns)


def _window(cols: dict[str, np.ndarray], lo: int | None, hi: int | None) -> dict[str, np.ndarray]:
    if lo is None and hi is None:
        return cols
    s = cols["step"]
    keep = np.ones(s.size, dtype=bool)
    if lo is not None:
        keep &= s >= lo
    if hi is not None:
        keep &= s < hi
    return {k: v[keep] for k, v in cols.items()}


def _rank_process(emit: _Writer, rank: int, node: int, host: str | None) -> None:
    label = f"rank {rank} (node {node}" + (f", {host})" if host else ")")
    emit({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": label}})
    emit({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
    for tid, name in _THREADS.items():
        emit({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}})
        emit({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid, "args": {"sort_index": tid}})


def _num(v: float) -> float | int | None:
    if v is None or not math.isfinite(v):
        return None
    return int(v) if float(v).is_integer() else float(v)


def _rank_steps(emit: _Writer, rank: int, cols: dict[str, np.ndarray], t0: float, spikes: dict) -> int:
    n = cols["step"].size
    if not n:
        return 0
    step_ns = np.nan_to_num(cols["step_ns"], nan=0.0)
    start = cols["t_start_ns"]
    if not np.isfinite(start).all():
        # no wall clock (e.g. a simulated run): lay steps end to end
        start = np.concatenate(([0.0], np.cumsum(step_ns)[:-1])) + t0
    ts = (start - t0) / 1e3  # µs
    names = [c for c in _COLUMNS if c not in ("rank", "node", "step", "t_start_ns")]
    phase = {p: cols[f"{p}_ns"] for p in _PHASE_ORDER}
    for i in range(n):
        step = int(cols["step"][i])
        t = float(ts[i])
        dur = float(step_ns[i]) / 1e3
        args = {"step": step, **{k: _num(cols[k][i]) for k in names if math.isfinite(cols[k][i])}}
        emit({"ph": "X", "name": f"step {step}", "cat": "step", "pid": rank, "tid": TID_STEPS, "ts": t,
              "dur": dur, "args": args})  # fmt: skip
        values = {p: float(phase[p][i]) for p in _PHASE_ORDER if math.isfinite(phase[p][i]) and phase[p][i] > 0}
        overlapping = sum(values.values()) > step_ns[i] * 1.001
        cursor = t
        for p in _PHASE_ORDER:
            d = values.get(p)
            if d is None:
                continue
            d_us = d / 1e3
            if p == "comm_wait":
                at = t + dur - d_us if overlapping else cursor
                emit({"ph": "X", "name": "comm wait", "cat": "comm_wait", "pid": rank, "tid": TID_WAIT, "ts": at,
                      "dur": d_us, "cname": _PHASE_COLOUR[p], "args": {"step": step, "ms": d / 1e6}})  # fmt: skip
                if overlapping:
                    continue
            else:
                emit({"ph": "X", "name": p, "cat": "phase", "pid": rank, "tid": TID_PHASES, "ts": cursor,
                      "dur": d_us, "cname": _PHASE_COLOUR[p], "args": {"step": step, "ms": d / 1e6}})  # fmt: skip
            cursor += d_us
        gc_ns = cols["gc_ns"][i]
        if math.isfinite(gc_ns) and gc_ns > 0:
            gen = cols["gc_max_gen"][i]
            count = cols["gc_count"][i]
            label = f"gc pause {gc_ns / 1e6:.1f} ms" + (f" (gen {int(gen)})" if math.isfinite(gen) and gen >= 0 else "")
            emit({"ph": "i", "s": "t", "name": label, "cat": "gc", "pid": rank, "tid": TID_SIGNALS, "ts": t,
                  "args": {"step": step, "gc_ns": int(gc_ns), "gc_count": _num(count), "gc_max_gen": _num(gen)}})  # fmt: skip
        spike = spikes.get(step)
        if spike is not None:
            cause = spike.get("cause") or "unknown"
            emit({"ph": "i", "s": "p", "name": f"spike: {cause}", "cat": "spike", "pid": rank, "tid": TID_SIGNALS,
                  "ts": t + dur, "args": {"step": step, **spike}})  # fmt: skip
    return n


def _spikes_by_rank(diagnosis: Mapping[str, Any] | None, lo: int | None, hi: int | None) -> dict[int, dict]:
    out: dict[int, dict[int, dict]] = {}
    if not diagnosis:
        return out
    for ev in (diagnosis.get("spikes") or {}).get("events") or []:
        step = ev.get("step")
        if step is None or (lo is not None and step < lo) or (hi is not None and step >= hi):
            continue
        out.setdefault(int(ev.get("rank", 0)), {})[int(step)] = {
            "cause": ev.get("cause"),
            "phase": ev.get("phase"),
            "excess_ms": (ev.get("excess_ns") or 0) / 1e6,
        }
    return out


def _ranks_text(ranks: Sequence[int]) -> str:
    shown = ", ".join(map(str, list(ranks)[:8]))
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "") if shown else "none"


def _rank_event_table(run_dirs: Sequence[Path], rank: int, lo: int | None, hi: int | None) -> pa.Table | None:
    """One rank's events in the step window (read from whichever run directory holds them)."""
    tables = [t for d in run_dirs for t in store.read_rank_events(d, rank) if t.num_rows]
    if not tables:
        return None
    table = pa.concat_tables(tables)
    if lo is not None or hi is not None:
        s = table.column("step").cast(pa.float64()).to_numpy(zero_copy_only=False)  # null -> NaN
        keep = np.isfinite(s)
        if lo is not None:
            keep &= s >= lo
        if hi is not None:
            keep &= s < hi
        table = table.filter(pa.array(keep))
    return table


def _rank_events(emit: _Writer, rank: int, table: pa.Table | None, t0: float) -> None:
    if table is None or table.num_rows == 0:
        return
    for row in table.to_pylist():
        t_ns = row.get("t_ns")
        if t_ns is None:
            continue
        ts = (t_ns - t0) / 1e3
        kind = row["kind"]
        dur = row.get("duration_ns")
        args = {k: row[k] for k in ("step", "value", "detail") if row.get(k) is not None}
        if kind == "collective":
            emit({"ph": "X", "name": row.get("detail") or "collective", "cat": "collective", "pid": rank,
                  "tid": TID_COLLECTIVES, "ts": ts, "dur": (dur or 0) / 1e3, "cname": "terrible", "args": args})  # fmt: skip
        elif kind == "memory_peak":
            emit({"ph": "C", "name": "device memory (bytes)", "pid": rank, "ts": ts,
                  "args": {row.get("detail") or "device": row.get("value") or 0}})  # fmt: skip
        elif kind == "spike":
            emit({"ph": "i", "s": "p", "name": f"spike: {row.get('detail') or 'unknown'}", "cat": "spike",
                  "pid": rank, "tid": TID_SIGNALS, "ts": ts, "args": args})  # fmt: skip
        elif dur:
            emit({"ph": "X", "name": kind, "cat": "hyperacc", "pid": rank, "tid": TID_HYPERACC, "ts": ts,
                  "dur": dur / 1e3, "args": args})  # fmt: skip
        else:
            emit({"ph": "i", "s": "t", "name": kind, "cat": "hyperacc", "pid": rank, "tid": TID_HYPERACC,
                  "ts": ts, "args": args})  # fmt: skip

"""The per-rank step tracer: phases and cause signals of every step, written as Parquet segments.

Recording (the training thread) fills one preallocated int64 row per step and commits it to a ring
buffer by advancing a counter; a background flusher thread copies committed rows out, converts them
to STEP_SCHEMA and writes one segment through ``hyperacc.store`` every few seconds. The training
thread never waits for the flusher: there is one producer and one consumer, and the flusher detects
rows it was overtaken on (counted as dropped) instead of locking. docs/tracing.md describes what is
recorded and how.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from time import perf_counter_ns
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import torch

from hyperacc import store
from hyperacc.schema import EVENT_SCHEMA, PHASES, STEP_SCHEMA, RankMeta
from hyperacc.trace.columns import (
    COMM_WAIT_NS,
    LAUNCH_NS,
    MEASURED_PHASES,
    NCOLS,
    NEG_ONE_IS_VALUE,
    OTHER_NS,
    PACE_DELAY_NS,
    PHASE_COL,
    SELF_NS,
    STEP,
    STEP_NS,
    T_START,
)
from hyperacc.trace.failsafe import switch_off
from hyperacc.trace.options import TraceOptions
from hyperacc.trace.probe import LaunchProbe
from hyperacc.trace.signals import StepSignals

log = logging.getLogger("hyperacc.trace")

F = TypeVar("F", bound=Callable[..., Any])
Sink = Callable[[pa.Table], None]

_current: Tracer | None = None
_CPU = torch.device("cpu")


def current() -> Tracer | None:
    """The tracer most recently started in this process (None if none, or it was closed)."""
    return _current


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


class StepRing:
    """Preallocated rows with one writer (training thread) and one reader (flusher), no lock.

    Rows are Python lists of ints: copying a finished row in (``buf[slot][:] = row``) is a single
    C-level slice assignment, atomic under the GIL and cheaper than filling a numpy row. The writer
    fills ``buf[head % capacity]`` then advances ``head``; rows below ``ready`` are final (on CUDA rows
    wait for their device times). The reader copies ``[tail, ready)`` and then discards any row the
    writer may have overwritten while it copied.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.buf: list[list[int]] = [[-1] * NCOLS for _ in range(capacity)]
        self.head = 0
        self.ready = 0
        self.tail = 0
        self.dropped = 0

    def take(self, writer_stopped: bool = False) -> np.ndarray:
        ready, tail, cap = self.ready, self.tail, self.capacity
        if ready - tail > cap:
            self.dropped += ready - tail - cap
            tail = ready - cap
        if ready <= tail:
            return np.zeros((0, NCOLS), np.int64)
        buf = self.buf
        rows = np.array([buf[i % cap] for i in range(tail, ready)], dtype=np.int64)
        # The writer may be filling row ``head`` (slot of ``head - cap``) right now: every row with an
        # index <= head - cap may have been overwritten during the copy (< head - cap once it stopped).
        stale = self.head - cap + (0 if writer_stopped else 1) - tail
        if stale > 0:
            self.dropped += min(stale, len(rows))
            rows = rows[stale:]
        self.tail = ready
        return rows


class _Phase:
    """``with tracer.phase("forward"):`` or ``@tracer.phase("forward")``; preallocated, one per phase."""

    __slots__ = ("name", "_tracer", "_col", "_t0", "_ev")

    def __init__(self, tracer: Tracer, name: str, col: int) -> None:
        self.name = name
        self._tracer = tracer
        self._col = col
        self._t0 = 0
        self._ev = -1

    def __enter__(self) -> _Phase:
        dev = self._tracer._dev
        if dev is not None:
            self._ev = dev.mark()
        self._t0 = perf_counter_ns()
        return self

    def __exit__(self, *exc: object) -> bool:
        t1 = perf_counter_ns()
        tr = self._tracer
        if tr._open:
            row, col = tr._row, self._col
            v = row[col]
            row[col] = t1 - self._t0 if v < 0 else v + t1 - self._t0
            dev = tr._dev
            if dev is not None:
                dev.pair(col, self._ev, dev.mark())
        return False

    def __call__(self, fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


class _StepScope:
    """``with tracer.step():`` or ``@tracer.step()``; preallocated."""

    __slots__ = ("_tracer", "index")

    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer
        self.index: int | None = None

    def __enter__(self) -> _StepScope:
        self._tracer.begin_step(self.index)
        return self

    def __exit__(self, *exc: object) -> bool:
        self._tracer.end_step()
        return False

    def __call__(self, fn: F) -> F:
        tracer = self._tracer

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            tracer.begin_step()
            try:
                return fn(*args, **kwargs)
            finally:
                tracer.end_step()

        return wrapper  # type: ignore[return-value]


class Tracer:
    """Records every step of one rank under ``run_dir`` (docs/tracing.md).

    Explicit use::

        tracer = Tracer("runs/exp1")
        for batch in loader:
            with tracer.step():
                with tracer.phase("forward"):
                    loss = model(batch)
                ...
        tracer.close()

    ``hyperacc.trace.install_auto`` drives the same tracer from global hooks instead.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        rank: int | None = None,
        *,
        node: int | None = None,
        world_size: int | None = None,
        local_rank: int | None = None,
        local_world_size: int | None = None,
        options: TraceOptions | dict[str, Any] | None = None,
        **overrides: Any,
    ) -> None:
        global _current
        if isinstance(options, dict) or options is None:
            options = TraceOptions.from_mapping(options or {})
        if overrides:
            options = options.replace(**overrides)
        self.options = options
        self.run_dir = Path(run_dir)
        dist_rank, dist_world = _dist_rank_world()
        self.rank = rank if rank is not None else _env_int("RANK", dist_rank if dist_rank >= 0 else 0)
        self.world_size = world_size if world_size is not None else _env_int("WORLD_SIZE", max(dist_world, 1))
        self.node = node if node is not None else _env_int("GROUP_RANK", 0)
        self.local_rank = local_rank if local_rank is not None else _env_int("LOCAL_RANK", 0)
        self.local_world_size = (
            local_world_size if local_world_size is not None else _env_int("LOCAL_WORLD_SIZE", 1)
        )

        self._ring = StepRing(options.capacity)
        self._row: list[int] = [-1] * NCOLS
        self._blank: list[int] = [-1] * NCOLS
        self._open = False
        self._on = True  # recording switch: off after an internal error or close()
        self._t0 = 0
        self._next_step = 0
        self._phases = {name: _Phase(self, name, col) for name, col in PHASE_COL.items()}
        self._scope = _StepScope(self)
        self._events: deque[tuple[Any, ...]] = deque()
        self._sinks: list[list[Any]] = []  # [fn, enabled]
        self._write_on = True
        self._closed = False
        self._events_closed = False
        self._flush_lock = threading.RLock()  # flusher vs close(); never taken by the training thread
        self._meta_backend = ""

        # CUDA is picked up lazily: creating events before the script chose its device would open a
        # context on GPU 0 from every rank.
        self._cuda_possible = options.device_timing and _cuda_available()
        self._dev: Any = None
        self._device: Any = None
        self._cuda_seen = False

        self.signals: StepSignals | None = None
        if options.signals:
            try:
                self.signals = StepSignals(alloc_every=options.alloc_every)
            except Exception as exc:  # noqa: BLE001
                switch_off("cause signals", exc)
        self.probe = LaunchProbe(options.probe_every, options.probe_ops) if options.probe_every else None

        from hyperacc.trace.collectives import ExplicitCollectives
        from hyperacc.trace.inband import InBand

        self.inband = InBand(self)
        self.explicit = ExplicitCollectives(self)
        self.aggregator: Any = None

        self._write_meta()
        self._stop = threading.Event()
        self._flusher = threading.Thread(target=self._flush_loop, name="hyperacc-trace-flush", daemon=True)
        self._flusher.start()
        if options.window > 0 and self.world_size > 0:
            try:
                from hyperacc.trace.aggregate import WindowAggregator

                self.aggregator = WindowAggregator(
                    self.rank,
                    self.node,
                    self.world_size,
                    window=options.window,
                    grace_s=options.grace_s,
                    on_finding=self._on_finding,
                    on_window=self._on_window,
                )
                self.add_sink(self.aggregator.on_steps)
            except Exception as exc:  # noqa: BLE001
                switch_off("window aggregation", exc)
        atexit.register(self.close)
        try:
            from hyperacc import harness

            harness.at_finish(self.close)
        except (ImportError, AttributeError):
            pass
        if options.handle_sigterm:
            self._install_sigterm()
        _current = self

    # ------------------------------------------------------------------ public recording API

    def step(self, step: int | None = None) -> _StepScope:
        """Context manager (or decorator) around one training step; ``step`` defaults to a counter."""
        self._scope.index = step
        return self._scope

    def phase(self, name: str) -> _Phase:
        """Context manager (or decorator) timing a phase of the current step (adds up if repeated)."""
        try:
            return self._phases[name]
        except KeyError:
            known = ", ".join(p for p in PHASES if p != "other")
            raise ValueError(
                f"unknown phase {name!r}; use one of {known} (the rest of the step is 'other')"
            ) from None

    def begin_step(self, step: int | None = None) -> None:
        if not self._on:
            return
        try:
            if self._open:
                self.end_step()
            s = self._next_step if step is None else step
            row = self._row
            row[:] = self._blank
            row[STEP] = s
            if self._cuda_possible and not self._cuda_seen:
                self._pick_up_cuda()
            probe = self.probe
            if probe is not None and s % probe.every == 0:
                row[LAUNCH_NS] = probe.measure(self._device or _CPU)
            if self.signals is not None:
                self.signals.begin()
            dev = self._dev
            if dev is not None:
                dev.resolve(self._ring.buf, self._ring.capacity)
                dev.begin_step()
                self._advance_ready()
            self._t0 = row[T_START] = perf_counter_ns()  # wall clock derived by the flusher
            self._open = True
        except Exception as exc:  # noqa: BLE001 - the tracer never stops training
            self._fail("step recording", exc)

    def end_step(self) -> None:
        if not self._open:
            return
        t1 = perf_counter_ns()
        self._open = False
        try:
            row = self._row
            row[STEP_NS] = t1 - self._t0
            if self.inband._open:
                self.inband.take_step(row, self._t0)
            explicit = self.explicit
            if explicit.count or explicit.first_entry >= 0:
                explicit.take_step(row, self._t0)
            if self.signals is not None:
                self.signals.end(row)
            ring = self._ring
            index = ring.head
            ring.buf[index % ring.capacity][:] = row
            ring.head = index + 1
            dev = self._dev
            if dev is None:
                ring.ready = index + 1
            else:
                dev.end_step(index)
                self._advance_ready()
            self._next_step = row[STEP] + 1
        except Exception as exc:  # noqa: BLE001
            self._fail("step recording", exc)

    def add_phase(self, name: str, duration_ns: int) -> None:
        """Add ``duration_ns`` to a phase of the current step (for times measured elsewhere)."""
        if self._open:
            col = PHASE_COL[name]
            v = self._row[col]
            self._row[col] = duration_ns if v < 0 else v + duration_ns

    def record_event(
        self,
        kind: str,
        step: int | None = None,
        duration_ns: int | None = None,
        value: float | None = None,
        detail: str | None = None,
    ) -> None:
        """An event row (EVENT_SCHEMA): stabilizer actions, pacing changes, live findings."""
        if self._events_closed:
            return
        if step is None:
            step = self.current_step
        self._events.append((step, time.time_ns(), kind, duration_ns, value, detail))

    def add_sink(self, fn: Sink) -> None:
        """Call ``fn(table)`` from the flusher thread with every new table of step records.

        A sink that raises is switched off with one log line; the others and the tracer go on.
        """
        self._sinks.append([fn, True])

    def attach_ddp(self, model: Any) -> Any:
        """Time (and, unless disabled, exchange in-band) this DDP model's gradient collectives."""
        self.inband.attach(model)
        return self.inband

    @property
    def current_step(self) -> int:
        return int(self._row[STEP]) if self._open else self._next_step

    @property
    def dropped_rows(self) -> int:
        return self._ring.dropped

    @property
    def recording(self) -> bool:
        return self._on

    # ------------------------------------------------------------------ internals

    def _fail(self, part: str, exc: BaseException) -> None:
        self._on = False
        self._open = False
        switch_off(part, exc)

    def _pick_up_cuda(self) -> None:
        if not torch.cuda.is_initialized():
            return
        self._cuda_seen = True
        self._device = torch.device("cuda", torch.cuda.current_device())
        if self.signals is not None:
            self.signals.enable_cuda()
            if self.options.host_syncs and self.signals.syncs is None:
                from hyperacc.trace.signals import HostSyncCounter

                try:
                    self.signals.syncs = HostSyncCounter()
                except Exception as exc:  # noqa: BLE001
                    switch_off("host-sync counter", exc)
        try:
            from hyperacc.trace.device import CudaStepTimer

            self._dev = CudaStepTimer()
        except Exception as exc:  # noqa: BLE001
            switch_off("CUDA event timing", exc)

    def _advance_ready(self) -> None:
        ring = self._ring
        pending = self._dev.oldest_pending_row()
        ring.ready = ring.head if pending is None else pending

    def _on_finding(self, step: int, message: str) -> None:
        self.record_event("live_finding", step, detail=message)

    def _on_window(self, window: int, received: list[int], missing: list[int]) -> None:
        detail = json.dumps({"received": received, "missing": missing})
        self.record_event("window_gathered", window * self.options.window, value=len(received), detail=detail)

    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            previous = signal.getsignal(signal.SIGTERM)
        except (ValueError, OSError):
            return

        def on_sigterm(signum: int, frame: Any) -> None:
            self.close()
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_IGN:
                return
            else:  # SIG_DFL (or unknown): terminate as if we had never been here
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)

        try:
            signal.signal(signal.SIGTERM, on_sigterm)
        except (ValueError, OSError) as exc:
            switch_off("SIGTERM flush", exc)

    def _write_meta(self) -> None:
        backend = _dist_backend()
        self._meta_backend = backend
        meta = RankMeta(
            rank=self.rank,
            local_rank=self.local_rank,
            node=self.node,
            world_size=self.world_size,
            local_world_size=self.local_world_size,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            backend=backend or "unknown",
            device=str(self._device) if self._device is not None else "cpu",
        )
        try:
            store.write_meta(self.run_dir, meta)
        except Exception as exc:  # noqa: BLE001
            self._write_on = False
            switch_off(f"writing to {self.run_dir}", exc)

    # ------------------------------------------------------------------ flushing (background thread)

    def _flush_loop(self) -> None:
        last = time.monotonic()
        poll = min(0.25, self.options.flush_every_s)
        half = self._ring.capacity // 2
        while not self._stop.wait(poll):
            ring = self._ring
            now = time.monotonic()
            if now - last >= self.options.flush_every_s or ring.ready - ring.tail >= half:
                last = now
                self.flush()

    def flush(self) -> None:
        """Write the rows and events recorded so far (any thread; serialised with close)."""
        with self._flush_lock:
            try:
                rows = self._ring.take(writer_stopped=self._closed)
            except Exception as exc:  # noqa: BLE001
                switch_off("step flushing", exc)
                return
            if self._write_on and not self._meta_backend and _dist_backend():
                self._write_meta()  # the process group exists now: record its backend
            table = self.rows_to_table(rows) if len(rows) else None
            if table is not None and self._write_on:
                try:
                    if not hasattr(self, "_step_writer"):
                        self._step_writer = store.step_writer(self.run_dir, self.rank)
                    self._step_writer.write(table)
                except Exception as exc:  # noqa: BLE001
                    self._write_on = False
                    switch_off(f"writing step records to {self.run_dir}", exc)
            if table is not None:
                for sink in self._sinks:
                    if sink[1]:
                        try:
                            sink[0](table)
                        except Exception as exc:  # noqa: BLE001
                            sink[1] = False
                            switch_off(f"sink {getattr(sink[0], '__qualname__', sink[0])!s}", exc)
            self._flush_events()

    def _flush_events(self) -> None:
        events = self._events
        if not events:
            return
        batch = []
        while events:
            batch.append(events.popleft())
        if not self._write_on:
            return
        cols = list(zip(*batch, strict=True))
        table = pa.table(
            {
                "rank": pa.array([self.rank] * len(batch), pa.int32()),
                "step": pa.array(cols[0], pa.int64()),
                "t_ns": pa.array(cols[1], pa.int64()),
                "kind": pa.array(cols[2], pa.string()),
                "duration_ns": pa.array(cols[3], pa.int64()),
                "value": pa.array(cols[4], pa.float64()),
                "detail": pa.array(cols[5], pa.string()),
            },
            schema=EVENT_SCHEMA,
        )
        try:
            if not hasattr(self, "_event_writer"):
                self._event_writer = store.event_writer(self.run_dir, self.rank)
            self._event_writer.write(table)
        except Exception as exc:  # noqa: BLE001
            self._write_on = False
            switch_off(f"writing events to {self.run_dir}", exc)

    def rows_to_table(self, rows: np.ndarray) -> pa.Table:
        """Committed int64 rows -> a STEP_SCHEMA table (derives ``other_ns`` and a missing ``self_ns``)."""
        n = len(rows)
        # t_start: perf_counter_ns while recording (one clock read per step), wall clock on disk
        started = rows[:, T_START] >= 0
        rows[:, T_START] = np.where(started, rows[:, T_START] + (time.time_ns() - perf_counter_ns()), -1)
        step_ns = rows[:, STEP_NS]
        timed = step_ns >= 0
        phases = rows[:, list(MEASURED_PHASES)]
        measured = np.where(phases > 0, phases, 0).sum(axis=1)
        rows[:, OTHER_NS] = np.where(timed, np.maximum(step_ns - measured, 0), -1)
        # Without any gradient collective in the step, all of it was the rank's own work.
        no_self = timed & (rows[:, SELF_NS] < 0)
        if no_self.any():
            own = step_ns - np.maximum(rows[:, COMM_WAIT_NS], 0) - np.maximum(rows[:, PACE_DELAY_NS], 0)
            rows[:, SELF_NS] = np.where(no_self, np.maximum(own, 0), rows[:, SELF_NS])
        arrays = []
        for j, field in enumerate(STEP_SCHEMA):
            if field.name == "rank":
                arrays.append(pa.array(np.full(n, self.rank, np.int32)))
            elif field.name == "node":
                arrays.append(pa.array(np.full(n, self.node, np.int32)))
            else:
                col = rows[:, j]
                mask = None if field.name in NEG_ONE_IS_VALUE or not field.nullable else col == -1
                if mask is not None and not mask.any():
                    mask = None
                values = col.astype(field.type.to_pandas_dtype()) if field.type != pa.bool_() else col > 0
                arrays.append(pa.array(values, type=field.type, mask=mask))
        return pa.Table.from_arrays(arrays, schema=STEP_SCHEMA)

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Stop recording, flush everything, release hooks. Idempotent; safe from a signal handler."""
        global _current
        if self._closed:
            return
        self._closed = True
        self._on = False
        self._open = False
        self._stop.set()
        if self._flusher.is_alive() and self._flusher is not threading.current_thread():
            self._flusher.join(timeout=10)
        if self._dev is not None:
            try:
                self._dev.resolve(self._ring.buf, self._ring.capacity, wait=True)
                self._ring.ready = self._ring.head
            except Exception as exc:  # noqa: BLE001
                switch_off("CUDA event timing", exc)
                self._ring.ready = self._ring.head
        self.flush()
        self.inband.close()
        self.explicit.close()
        if self.aggregator is not None:
            try:
                self.aggregator.close()
            except Exception as exc:  # noqa: BLE001
                switch_off("window aggregation", exc)
            self.flush()  # live findings logged while closing
        if self.signals is not None:
            self.signals.close()
        self._events_closed = True
        if self._ring.dropped:
            log.warning(
                "hyperacc trace: %d step records were dropped (the flusher fell behind); "
                "raise the capacity option",
                self._ring.dropped,
            )
        if _current is self:
            _current = None

    def __enter__(self) -> Tracer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cuda_available() -> bool:
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


def _dist_rank_world() -> tuple[int, int]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:  # noqa: BLE001
        pass
    return -1, 0


def _dist_backend() -> str:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return str(dist.get_backend())
    except Exception:  # noqa: BLE001
        pass
    return ""

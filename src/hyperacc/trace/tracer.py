"""The per-rank step tracer: phases, waits and cause signals of every step, written as Parquet segments.

Recording (the training thread) fills one preallocated int64 row per step: the step clock
(``step_clock.StepClock``) charges each phase its exclusive time, the gradient collectives' hooks
(``inband.Exchange``) and the wrapped collectives (``collectives.CollectiveClock``) hand it the
exposed waits, the cause signals (``signals.StepSignals``) add their deltas, and on CUDA the device
timer (``device.DeviceTimer``) adds the device-clock columns once they can be read without waiting.
The finished row is committed to a ring (``ring.StepRing``) by advancing a counter; a background
flusher thread copies committed rows out and writes them as one plain record segment
(``hyperacc.records``: numpy and json, no pyarrow in a training rank) every few seconds; the node agent
(``hyperacc run``), or this rank's flusher when no agent runs, rolls them into Parquet. The training thread never waits for the flusher. docs/tracing.md
describes what is recorded and how.

Why this module is over 500 lines: it is the per-step path's one file (the row that every step fills,
``begin_step``/``end_step``), kept beside the thread that drains it and the shutdown that must see
both, so that one step can be read in one sitting; the parts it drives live in their own modules (map:
``hyperacc/trace/__init__.py``).
"""

from __future__ import annotations

import functools
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
import torch

from hyperacc import process, records
from hyperacc.schema import PHASES, RankMeta, events_dir, resources_dir, steps_dir, window_gathered_detail
from hyperacc.trace.collectives import CollectiveClock
from hyperacc.trace.columns import (
    DEV_COMM_WAIT_NS,
    DEV_SELF_NS,
    LAUNCH_NS,
    NCOLS,
    PACE_DELAY_NS,
    STEP,
    STEP_NS,
    T_START,
)
from hyperacc.trace.failsafe import switch_off
from hyperacc.trace.inband import Exchange
from hyperacc.trace.options import ENV_NODE_AGENT, TraceOptions
from hyperacc.trace.probe import LaunchProbe
from hyperacc.trace.resources import ResourceSampler
from hyperacc.trace.ring import StepRing, finish_rows
from hyperacc.trace.signals import StepSignals
from hyperacc.trace.step_clock import BACKWARD, COMM, FORWARD, KIND_BY_NAME, StepClock

log = logging.getLogger("hyperacc.trace")

F = TypeVar("F", bound=Callable[..., Any])
Sink = Callable[[Any], None]  # called with a pyarrow.Table of STEP_SCHEMA
RowSink = Callable[[np.ndarray], None]  # called with int64 rows, columns as trace/columns.py

_current: Tracer | None = None
_CPU = torch.device("cpu")
# Backward passes in one open step after which the flusher says the step boundary is not seen
# (``Tracer._check_boundaries``); gradient accumulation runs far fewer micro-steps per update.
UNENDED_MICRO_STEPS = 1000


def current() -> Tracer | None:
    """The tracer most recently started in this process (None if none, or it was closed)."""
    return _current


_start_hooks: list[Callable[[Tracer], None]] = []


def on_tracer_start(fn: Callable[[Tracer], None]) -> None:
    """Call ``fn(tracer)`` at the end of every later ``Tracer(...)`` in this process (once per ``fn``).

    The extension point for the layers above trace/: the live window aggregation
    (``hyperacc.analysis.live_aggregate.install``) attaches itself here, so that the measuring layer
    never imports the analysing one. ``fn`` runs on the creating thread; an exception switches that
    extension off with one log line.
    """
    if fn not in _start_hooks:
        _start_hooks.append(fn)


class _Phase:
    """``with tracer.phase("forward"):`` or ``@tracer.phase("forward")``; preallocated, one per phase."""

    __slots__ = ("name", "_tracer", "_kind")

    def __init__(self, tracer: Tracer, name: str, kind: int) -> None:
        self.name = name
        self._tracer = tracer
        self._kind = kind

    def __enter__(self) -> _Phase:
        tr = self._tracer
        if tr._on:
            tr.clock.enter(self._kind, perf_counter_ns())
        return self

    def __exit__(self, *exc: object) -> bool:
        tr = self._tracer
        if tr._on:
            try:
                tr.clock.exit(self._kind, perf_counter_ns())
            except Exception as e:  # noqa: BLE001 - the tracer never stops training
                tr._fail("step recording", e)
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
        tracer.attach_ddp(ddp_model)
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
        self.rank = rank if rank is not None else process.env_int("RANK", max(dist_rank, 0))
        self.world_size = (
            world_size if world_size is not None else process.env_int("WORLD_SIZE", max(dist_world, 1))
        )
        self.node = node if node is not None else process.env_int("GROUP_RANK", 0)
        self.local_rank = local_rank if local_rank is not None else process.env_int("LOCAL_RANK", 0)
        self.local_world_size = (
            local_world_size if local_world_size is not None else process.env_int("LOCAL_WORLD_SIZE", 1)
        )
        self.thread_id = threading.get_ident()  # the training thread

        self._ring = StepRing(options.capacity)
        self._row: list[int] = [-1] * NCOLS
        self._blank: list[int] = [-1] * NCOLS
        self._open = False
        self._on = True  # recording switch: off after an internal error or close()
        self._t0 = 0
        self._next_step = 0
        # (steps counted before, step resumed at) of the last ``resume_at``: the live switches agreed in
        # the attempt's own count from 0 move with it (``remediation.live``)
        self.resumed: tuple[int, int] | None = None
        self._ended_at = -1  # perf_counter_ns of the last step's end (contiguous steps share it)
        self.clock = StepClock()
        self.clock.on_end = self._boundary
        self._fill_exchange = False  # the first DDP model's timer has columns of its own (in-band, pacing)
        self._phases = {name: _Phase(self, name, KIND_BY_NAME[name]) for name in PHASES if name != "other"}
        self._scope = _StepScope(self)
        self._events: deque[tuple[Any, ...]] = deque()
        self._sinks: list[list[Any]] = []  # [fn, enabled, takes rows (not a table)]
        self._write_on = True
        self._closed = False
        self._unended_said = False
        # Called first by ``close(stopping)``, with the step still open (automatic mode ends a last
        # step whose update its hooks could not see); ``close`` runs from ``hyperacc.process``'s exit
        # hooks too, so the owner of the tracer may never see it.
        self.before_close: list[Callable[[bool], None]] = []
        self._closing = False
        self._terminate_after_close: Callable[[], None] | None = None
        self._events_closed = False
        self._flush_lock = threading.RLock()  # flusher vs close(); never taken by the training thread
        self._meta_backend = ""
        self._step_writer: records.RecordWriter | None = None
        self._event_writer: records.RecordWriter | None = None
        self._resource_writer: records.RecordWriter | None = None
        self._compact_on = not os.environ.get(ENV_NODE_AGENT)  # under an agent, the agent compacts
        self._compacted: dict[int, int] = {}  # id(writer) -> its segments written at the last compaction

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
        self.probe = LaunchProbe(options.probe_ops) if options.probe_every else None
        self.resources: ResourceSampler | None = None
        if options.resources_every_s > 0:
            try:
                self.resources = ResourceSampler(self.rank, self.node, options.resources_every_s)
            except Exception as exc:  # noqa: BLE001
                switch_off("resource sampling", exc)

        self.inband = Exchange(want=options.inband, agree_timeout_s=options.agree_timeout_s)
        self.inband.next_row = self._next_row
        self.inband.device_values = self._device_values
        self.inband.waits = self.signals
        self.collectives = CollectiveClock(self.clock, self.thread_id)
        self.aggregator: Any = None

        self._write_meta()
        self._stop = threading.Event()
        self._flusher = threading.Thread(target=self._flush_loop, name="hyperacc-trace-flush", daemon=True)
        self._flusher.start()
        for start in tuple(_start_hooks):  # e.g. the live window aggregation, registered from above trace/
            try:
                start(self)
            except Exception as exc:  # noqa: BLE001
                switch_off(f"tracer extension {getattr(start, '__qualname__', start)!s}", exc)
        process.at_exit(self.close)
        if options.handle_sigterm:
            self._install_sigterm()
        _current = self

    # ------------------------------------------------------------------ public recording API

    def step(self, step: int | None = None) -> _StepScope:
        """Context manager (or decorator) around one training step; ``step`` defaults to a counter."""
        self._scope.index = step
        return self._scope

    def phase(self, name: str) -> _Phase:
        """Context manager (or decorator) timing a phase of the current step.

        Phases nest: each is charged its own time, less the phases inside it. A phase entered several
        times in a step adds up.
        """
        try:
            return self._phases[name]
        except KeyError:
            known = ", ".join(p for p in PHASES if p != "other")
            raise ValueError(
                f"unknown phase {name!r}; use one of {known} (the rest of the step is 'other')"
            ) from None

    def begin_step(self, step: int | None = None, *, contiguous: bool = False) -> None:
        """Open a step (closing the one still open). ``contiguous``: it starts where the last one ended."""
        if not self._on:
            return
        try:
            if self._open:
                self.end_step()
                contiguous = True
            s = self._next_step if step is None else step
            row = self._row
            row[:] = self._blank
            row[STEP] = s
            if self._cuda_possible and not self._cuda_seen:
                self._pick_up_cuda()
            probe = self.probe
            if probe is not None and s % self.options.probe_every == 0:
                row[LAUNCH_NS] = probe.measure(self._device or _CPU)
                contiguous = False  # the probe ran between the two steps
            if self.signals is not None:
                self.signals.begin(contiguous and self._ended_at >= 0)
            dev = self._dev
            if dev is not None:
                dev.resolve(self._ring.buf, self._ring.capacity)
                dev.begin_step()
                self._advance_ready()
            t0 = perf_counter_ns()
            self._t0 = row[T_START] = t0  # wall clock derived by the flusher
            self.clock.begin(t0)
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
            self.clock.fill(row, t1)
            if self._fill_exchange:
                self.inband.fill(row)
            if self.signals is not None:
                self.signals.end(row)
            ring = self._ring
            index = ring.commit(row)
            dev = self._dev
            if dev is None:
                ring.ready = index + 1
            else:
                dev.end_step(index)
                self._advance_ready()
            self._next_step = row[STEP] + 1
            self._ended_at = t1
        except Exception as exc:  # noqa: BLE001
            self._fail("step recording", exc)

    def resume_at(self, step: int) -> None:
        """Number the next step ``step``: a job resumed from a checkpoint saved after ``step`` steps goes
        on with the step numbers of the run it continues, on every rank alike, instead of from 0
        (``hyperacc.elastic.Checkpointer.resume`` calls this). A step still open (work before the
        resumed loop: the checkpoint's own load) is dropped, not recorded under a step number of the run
        it continues. Where a run directory holds a step twice (the steps an interrupted attempt ran
        past its last checkpoint, run again), readers keep the later record."""
        if int(step) < 0:
            raise ValueError(f"resume_at needs the number of steps already done, >= 0 (got {step})")
        self._open = False
        self.resumed = (self._next_step, int(step))
        self._next_step = int(step)

    def add_phase(self, name: str, duration_ns: int) -> None:
        """Add ``duration_ns`` to a phase of the current step (for times measured elsewhere)."""
        if self._open and self._on:
            self.clock.add(KIND_BY_NAME[name], int(duration_ns))

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
        """Call ``fn(table)`` from the flusher thread with every new ``pyarrow.Table`` of step records
        (STEP_SCHEMA). The first such sink makes this rank load pyarrow; ``add_row_sink`` does not.

        A sink that raises is switched off with one log line; the others and the tracer go on.
        """
        self._sinks.append([fn, True, False])

    def add_row_sink(self, fn: RowSink) -> None:
        """Call ``fn(rows)`` from the flusher thread with every new block of step records as written: an
        int64 matrix, columns as ``hyperacc.trace.columns`` (-1: not measured). Do not keep the array."""
        self._sinks.append([fn, True, True])

    def attach_aggregator(self, aggregator: Any) -> None:
        """Feed ``aggregator.on_rows`` every new block of step records and close it with the tracer."""
        self.aggregator = aggregator
        self.add_row_sink(aggregator.on_rows)

    def attach_ddp(self, model: Any) -> Exchange:
        """Time this DDP model's gradient collectives (and exchange in-band when asked and agreed)."""
        before = len(self.inband.models)
        self.inband.attach(model)
        if len(self.inband.models) > before:
            self.clock.wait_sources.append(self.inband.models[-1].collect)
        self._fill_exchange = self.inband.fills_rows
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

    @property
    def step_open(self) -> bool:
        return self._open

    # ------------------------------------------------------------------ internals

    def _boundary(self, t: int) -> None:
        """The step clock's deferred boundary (automatic mode): end this step, open the next."""
        self.end_step()
        self.begin_step(contiguous=True)

    def _fail(self, part: str, exc: BaseException) -> None:
        self._on = False
        self._open = False
        self.collectives.on = False
        switch_off(part, exc)

    def _next_row(self) -> int:
        return self._ring.head

    def _device_values(self, index: int) -> tuple[int, int]:
        """(arrival, wait) on the device clock of a committed row, once its events were read back."""
        ring = self._ring
        if index < 0 or index >= ring.ready or ring.head - index >= ring.capacity:
            return -1, -1
        values = ring.buf[index % ring.capacity]
        own, wait = int(values[DEV_SELF_NS]), int(values[DEV_COMM_WAIT_NS])
        delay = max(int(values[PACE_DELAY_NS]), 0)
        return (own + delay if own >= 0 else -1), wait

    def _pick_up_cuda(self) -> None:
        if not torch.cuda.is_initialized():
            return
        self._cuda_seen = True
        self._device = torch.device("cuda", torch.cuda.current_device())
        if self.resources is not None:
            self.resources.cuda_device = self._device
        if self.signals is not None:
            self.signals.enable_cuda()
            if self.options.host_syncs and self.signals.syncs is None:
                from hyperacc.trace.signals import HostSyncCounter

                try:
                    self.signals.syncs = HostSyncCounter()
                except Exception as exc:  # noqa: BLE001
                    switch_off("host-sync counter", exc)
        try:
            from hyperacc.trace.device import DeviceTimer

            self._dev = DeviceTimer()
            self.clock.device = self._dev
            kinds = 1 << COMM
            if self.options.device_phases:
                kinds |= (1 << FORWARD) | (1 << BACKWARD)
            self.clock.device_kinds = kinds
            self.inband.set_device(self._dev)
        except Exception as exc:  # noqa: BLE001
            switch_off("CUDA event timing", exc)

    def _advance_ready(self) -> None:
        ring = self._ring
        pending = self._dev.oldest_pending_row()
        ring.ready = ring.head if pending is None else pending

    def live_finding(self, step: int, message: str) -> None:
        """A live detector's finding, kept as a ``live_finding`` event (the aggregator's thread)."""
        self.record_event("live_finding", step, detail=message)

    def window_gathered(self, window: int, received: list[int], missing: list[int]) -> None:
        """Rank 0 processed a window: how many reported and who did not (``window_gathered`` event)."""
        detail = window_gathered_detail(missing)
        self.record_event("window_gathered", window * self.options.window, value=len(received), detail=detail)

    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            previous = signal.getsignal(signal.SIGTERM)
        except (ValueError, OSError):
            return

        def chain(signum: int, frame: Any) -> None:
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_IGN:
                return
            else:  # SIG_DFL (or unknown): terminate as if we had never been here
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)

        def on_sigterm(signum: int, frame: Any) -> None:
            if self._closing and not self._closed:
                # The signal interrupted close() on this thread: let it finish, then terminate.
                self._terminate_after_close = functools.partial(chain, signum, frame)
                return
            self.close(stopping=True)
            chain(signum, frame)

        try:
            signal.signal(signal.SIGTERM, on_sigterm)
        except (ValueError, OSError) as exc:
            switch_off("SIGTERM flush", exc)

    def _write_meta(self) -> None:
        backend = _dist_backend()
        self._meta_backend = backend
        here = process.place()
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
            agent=os.environ.get(ENV_NODE_AGENT, ""),
            store=f"{here.master_addr}:{here.master_port}" if here.master_addr and here.master_port else "",
            run_id=here.run_id,
            restart_count=here.restart_count,
            nodes=here.nodes or 0,
        )
        try:
            records.write_meta(self.run_dir, meta)
        except Exception as exc:  # noqa: BLE001
            self._write_on = False
            switch_off(f"writing to {self.run_dir}", exc)

    # ------------------------------------------------------------------ flushing (background thread)

    def _flush_loop(self) -> None:
        last = time.monotonic()
        poll = min(0.25, self.options.flush_every_s)
        half = self._ring.capacity // 2
        while not self._stop.wait(poll):
            self._sample_resources()
            self._check_boundaries()
            ring = self._ring
            now = time.monotonic()
            if now - last >= self.options.flush_every_s or ring.ready - ring.tail >= half:
                last = now
                self.flush()
                self.compact()

    def _check_boundaries(self) -> None:
        """Say once if a step stays open across ``UNENDED_MICRO_STEPS`` backward passes: the loop's
        step boundary is not seen (automatic mode ends a step at a ``torch.optim`` optimizer's step
        or, failing that, at the next forward after a watched parameter changed; an update the hooks
        cannot see of parameters that are not watched ends neither), so no step is recorded. A racy
        read of two ints of the training thread's clock."""
        clock = self.clock
        if self._unended_said or not clock.step_open or clock.micro < UNENDED_MICRO_STEPS:
            return
        self._unended_said = True
        log.warning(
            "hyperacc trace: step %d has run %d backward passes without a step boundary, so no step is "
            "recorded: automatic tracing ends a step at a torch.optim optimizer's step() or at the next "
            "forward after a plain parameter changed, and saw neither (docs/tracing.md, \"Trainers and "
            "loops\")",
            self.current_step,
            clock.micro,
        )

    def compact(self, *, final: bool = False) -> None:
        """Roll this rank's small segments into its Parquet file of the period (``store.compact``), once
        ``compact_every`` of a kind are waiting (all of them when ``final``). Only when no node agent
        does it (``hyperacc run`` sets ``HYPERACC_NODE_AGENT``): this loads pyarrow in the rank. Off
        the training thread: the flusher, and ``close`` after the last step."""
        every = self.options.compact_every
        if not every or not self._write_on or not self._compact_on:
            return
        with self._flush_lock:
            for writer in (self._step_writer, self._event_writer, self._resource_writer):
                if writer is None or (writer.written - self._compacted.get(id(writer), 0) < every and not final):
                    continue
                try:
                    from hyperacc import schema, store

                    store.compact(writer.directory, getattr(schema, writer.schema), every=1 if final else every,
                                  period_s=self.options.compact_period_s,
                                  min_rows=self.options.compact_min_rows)  # fmt: skip
                    self._compacted[id(writer)] = writer.written
                except Exception as exc:  # noqa: BLE001
                    self._compact_on = False
                    switch_off(f"compacting segments in {writer.directory}", exc)
                    return

    def flush(self) -> None:
        """Write the rows and events recorded so far (any thread; serialised with close)."""
        with self._flush_lock:
            try:
                rows = self._ring.take(writer_stopped=self._closing)
            except Exception as exc:  # noqa: BLE001
                switch_off("step flushing", exc)
                return
            if self._write_on and not self._meta_backend and _dist_backend():
                self._write_meta()  # the process group exists now: record its backend
            if len(rows):
                finish_rows(rows, self.rank, self.node)
                if self._write_on:
                    try:
                        if self._step_writer is None:
                            self._step_writer = records.RecordWriter(steps_dir(self.run_dir, self.rank), "STEP_SCHEMA")
                        self._step_writer.write_int64(rows)
                    except Exception as exc:  # noqa: BLE001
                        self._write_on = False
                        switch_off(f"writing step records to {self.run_dir}", exc)
                self._feed_sinks(rows)
            self._flush_events()
            self._flush_resources()

    def _feed_sinks(self, rows: np.ndarray) -> None:
        table = None
        for sink in self._sinks:
            if not sink[1]:
                continue
            try:
                if sink[2]:
                    sink[0](rows)
                else:
                    if table is None:
                        table = records.rows_table("STEP_SCHEMA", records.columns_of("STEP_SCHEMA"), rows)
                    sink[0](table)
            except Exception as exc:  # noqa: BLE001
                sink[1] = False
                switch_off(f"sink {getattr(sink[0], '__qualname__', sink[0])!s}", exc)

    def _sample_resources(self) -> None:
        sampler = self.resources
        if sampler is None:
            return
        try:
            sampler.maybe_sample(self.current_step)
        except Exception as exc:  # noqa: BLE001
            self.resources = None
            switch_off("resource sampling", exc)

    def _flush_resources(self) -> None:
        sampler = self.resources
        if sampler is None or not self._write_on:
            return
        try:
            rows = sampler.take()
            if rows is not None:
                if self._resource_writer is None:
                    self._resource_writer = records.RecordWriter(resources_dir(self.run_dir, self.rank),
                                                                 "RESOURCE_SCHEMA")  # fmt: skip
                self._resource_writer.write_int64(rows)
        except Exception as exc:  # noqa: BLE001
            self.resources = None
            switch_off("resource sampling", exc)

    def _flush_events(self) -> None:
        events = self._events
        if not events:
            return
        batch = []
        while events:
            step, t_ns, kind, duration_ns, value, detail = events.popleft()
            batch.append((self.rank, _int(step), t_ns, str(kind), _int(duration_ns),  # EVENT_SCHEMA's order
                          None if value is None else float(value), None if detail is None else str(detail)))  # fmt: skip
        if not self._write_on:
            return
        try:
            if self._event_writer is None:
                self._event_writer = records.RecordWriter(events_dir(self.run_dir, self.rank), "EVENT_SCHEMA")
            self._event_writer.write_json(batch)
        except Exception as exc:  # noqa: BLE001
            self._write_on = False
            switch_off(f"writing events to {self.run_dir}", exc)

    # ------------------------------------------------------------------ shutdown

    def close(self, *, stopping: bool = False) -> None:
        """Stop recording, flush everything, release hooks. Idempotent.

        Safe from a signal handler: a SIGTERM that arrives while ``close`` runs lets it finish (every
        recorded row reaches disk) and then terminates the process as the signal would have.
        ``stopping``: the job is being stopped (Ctrl-C, SIGTERM): rank 0 does not wait for the other
        ranks' last window summaries, which will not come.
        """
        global _current
        if self._closing:
            return
        self._closing = True
        for fn in self.before_close:
            try:
                fn(stopping)
            except Exception as exc:  # noqa: BLE001
                switch_off(f"closing {getattr(fn, '__qualname__', fn)!s}", exc)
        self._on = False
        self._open = False
        try:
            self._stop.set()
            if self._flusher.is_alive() and self._flusher is not threading.current_thread():
                self._flusher.join(timeout=10)
            if self.resources is not None:
                self.resources.due_now()  # a last sample: short runs get at least one
                self._sample_resources()
            if self._dev is not None:
                try:
                    self._dev.resolve(self._ring.buf, self._ring.capacity, wait=True)
                except Exception as exc:  # noqa: BLE001
                    switch_off("CUDA event timing", exc)
                self._ring.ready = self._ring.head
            self.flush()
            self.inband.close()
            self.collectives.close()
            if self.aggregator is not None:
                try:
                    self.aggregator.close(wait=not stopping)
                except Exception as exc:  # noqa: BLE001
                    switch_off("window aggregation", exc)
                self.flush()  # live findings logged while closing
            if self.signals is not None:
                self.signals.close()
            self._events_closed = True
            if not stopping:
                self.compact(final=True)  # a finished run: one file per rank-period
            if self._ring.dropped:
                log.warning(
                    "hyperacc trace: %d step records were dropped (the flusher fell behind); "
                    "raise the capacity option",
                    self._ring.dropped,
                )
        finally:
            self._closed = True
            if _current is self:
                _current = None
            terminate, self._terminate_after_close = self._terminate_after_close, None
            if terminate is not None:
                terminate()

    def __enter__(self) -> Tracer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


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

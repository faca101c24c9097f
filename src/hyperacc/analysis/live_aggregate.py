"""Per-window summaries of every rank, gathered by rank 0 while training runs, off the critical path.

Each rank turns its step records into one row per window of ``window`` steps, the summary ``hyperacc
analyze`` makes of the same steps (``analysis.windows.WindowStream``: WINDOW_SCHEMA plus the phase and
CPU-time medians and the spike tallies by cause). The rows
travel through the job's c10d store (a separate TCPStore client to torchrun's store, so the training
thread's own store connection is never shared), from a background thread: each rank appends its row
to one key per window and bumps a counter. Rank 0's background thread polls the counter; a window is
processed once every rank has reported, or ``grace_s`` after its first report, in which case the
ranks still absent are reported as missing. Nothing here can block training: a dead or slow store
only delays or (after one log line) stops the summaries. Rank 0 hands each window's table to
``hyperacc.analysis.live.LiveDetector`` (when that module is present) and logs every line it returns.
``install()`` makes every later tracer of the process start one (the tracer itself never imports
this layer). docs/tracing.md, "Live aggregation".
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from hyperacc import process
from hyperacc.analysis.options import DetectionOptions
from hyperacc.analysis.window_store import (
    DONE_KEPT,
    OUTBOX_ROWS,
    STORE_ERRORS,
    Backoff,
    connect_store,
    decode_frames,
    publish_rows,
)
from hyperacc.analysis.windows import SUMMARY_COLUMNS, WindowStream, row_columns, rows_columns, step_columns
from hyperacc.trace.failsafe import switch_off
from hyperacc.trace.options import ENV_NODE_AGENT

log = logging.getLogger("hyperacc.live")


def _prefix() -> str:
    here = process.place()
    return f"hyperacc/windows/{here.run_id}/{here.restart_count}/"


def _default_detector(world_size: int, nodes: int, window: int, recovered: Callable[[int, int], bool] | None,
                      beside: Callable[[], Sequence[Mapping[str, Any]]] | None) -> Any:  # fmt: skip
    try:
        from hyperacc.analysis.live import LiveDetector
    except ImportError:
        return None
    return LiveDetector(world_size, nodes, recovered=recovered, beside=beside, window_steps=window)



class WindowGatherer:
    """Every rank's window rows -> one judged table per window, in window order.

    Rows come from a c10d store (``gather(store)``: every rank, or every node agent, published them with
    ``publish_rows``) or directly (``offer(rows)``: a node agent that holds every rank of the job). A
    window is judged once every rank not known to be missing has reported, or ``grace_s`` after its own
    first report: each window's grace runs from its own first row, so a silent rank never makes the
    windows wait in turn, and once a rank was missing from a judged window the next ones do not wait for
    it (it counts again as soon as it reports). The ranks absent from a judged window are reported as
    missing (``on_window``; one log line when that set changes). Each window's rows go to the live
    detector (``hyperacc.analysis.live.LiveDetector`` unless given), whose lines are logged and passed to
    ``on_finding``; ``on_judged`` runs after it with the window's columns (live remediation). With ``run_dir`` the rows are kept
    under ``RUN_DIR/live/windows`` every few seconds, compacted with ``compaction`` unless a node
    agent does that.
    """

    def __init__(
        self,
        world_size: int,
        *,
        window: int = 50,
        grace_s: float = 30.0,
        nodes: int | Callable[[], int] = 1,
        detector: Any = None,
        on_finding: Callable[[int, str], None] | None = None,
        on_window: Callable[[int, list[int], list[int]], None] | None = None,
        on_judged: Callable[[Any, dict[str, np.ndarray], int], None] | None = None,
        run_dir: str | os.PathLike | None = None,
        compaction: tuple[int, float, int] = (0, 0.0, 0),
        compacts: bool = True,
        recovered: Callable[[int, int], bool] | None = None,
        beside: Callable[[], Sequence[Mapping[str, Any]]] | None = None,
    ) -> None:
        self.world_size = world_size
        self.window = window
        self.grace_s = grace_s
        self.nodes = nodes
        self.recovered, self.beside = recovered, beside  # the default detector's (``LiveDetector``)
        self.on_finding = on_finding
        self.on_window = on_window
        self.on_judged = on_judged
        self._detector = detector
        self._detector_made = detector is not None
        self._rows: dict[int, list[dict[str, Any]]] = {}  # offered rows by window (direct input)
        self._first_seen: dict[int, float] = {}  # window -> when its first row was seen
        self._next: int | None = None  # the next window to judge
        self._known = -1  # the highest window known to have begun
        self._missing_reported: frozenset[int] = frozenset()
        self.windows_processed = 0
        # the gathered rows under RUN_DIR/live/windows (what `hyperacc watch` shows of a job of many ranks)
        self.run_dir = run_dir
        self._gathered: list[dict[str, np.ndarray]] = []  # judged windows' columns
        self._gathered_at = time.monotonic()
        self._writer: Any = None
        # (every, period_s, min_rows) of store.compact, the tracer's compaction settings: one gathered
        # file every few seconds would otherwise grow the folder by some 17,000 files a day
        self._compaction = compaction if compacts else (0, 0.0, 0)
        self._compacted = 0

    @property
    def pending(self) -> bool:
        """Windows begun and not judged yet."""
        return self._next is not None and self._next <= self._known

    # ------------------------------------------------------------------ input

    def offer(self, rows: list[dict[str, Any]]) -> None:
        """Window rows given directly (a node agent holding every rank)."""
        now = time.monotonic()
        for row in rows:
            w = int(row["window"])
            if self._next is not None and w < self._next:
                continue  # its window was judged without it (late beyond the grace)
            self._rows.setdefault(w, []).append(row)
            self._first_seen.setdefault(w, now)
            self._known = max(self._known, w)
        if self._next is None and self._rows:
            self._next = min(self._rows)

    def note(self, w: int) -> None:
        """A window this process published to the store itself (where to start gathering)."""
        self._known = max(self._known, w)
        if self._next is None:
            self._next = w

    # ------------------------------------------------------------------ judging

    def gather(self, store: Any = None, *, final: bool = False, final_grace_s: float = 2.0) -> None:
        """Judge every window that is complete or whose grace ran out (from ``store``, else from what was
        offered). ``final``: the job is ending, a window waits at most ``final_grace_s``."""
        grace = min(self.grace_s, final_grace_s) if final else self.grace_s
        while self._next is not None:
            w = self._next
            now = time.monotonic()
            count = self._count(store, w, now)
            if count == 0:
                later = [t for v, t in self._first_seen.items() if v > w]
                if not later or now - min(later) < grace:
                    return  # nobody has reached this window yet
                self._next = w + 1  # every rank skipped it (a restart): go on to the next
                continue
            first = self._first_seen.setdefault(w, now)
            expected = self.world_size - len(self._missing_reported)
            if count < expected and now - first < grace:
                return
            rows = self._take(store, w)
            self._first_seen.pop(w, None)
            self._next = w + 1
            self._process(w, rows)

    def _count(self, store: Any, w: int, now: float) -> int:
        if store is None:
            return len(self._rows.get(w, ()))
        count = int(store.add(f"w{w}/n", 0))
        if count:
            self._first_seen.setdefault(w, now)
        # the windows after it that have begun: each waits its own grace, not its predecessor's
        v = w + 1
        while v <= self._known + 1:
            if v not in self._first_seen:
                if not store.check([f"w{v}/n"]):
                    break
                self._first_seen[v] = now
                self._known = max(self._known, v)
            v += 1
        return count

    def _take(self, store: Any, w: int) -> dict[str, np.ndarray]:
        """Window ``w``'s rows as columns (``windows.rows_columns``), taken out of the store or the offers."""
        if store is None:
            return rows_columns(self._rows.pop(w, []))
        cols: dict[str, np.ndarray] = {}
        if store.check([f"w{w}"]):
            cols = decode_frames(store.get(f"w{w}"), f"window {w}'s rows in the c10d store")
        store.set(f"w{w}/done", "1")
        for key in (f"w{w}", f"w{w}/n", f"w{w - DONE_KEPT}/done"):
            store.delete_key(key)
        return cols

    def _process(self, w: int, cols: dict[str, np.ndarray]) -> None:
        received = sorted(set(cols["rank"].tolist())) if cols else []
        missing = sorted(set(range(self.world_size)) - set(received))
        self.windows_processed += 1
        if frozenset(missing) != self._missing_reported:
            self._missing_reported = frozenset(missing)
            if missing:
                log.warning(
                    "hyperacc live: window %d: no summary from rank(s) %s (late or stopped)",
                    w,
                    _ranges(missing),
                )
            else:
                log.warning("hyperacc live: window %d: every rank reports again", w)
        if self.on_window is not None:
            self.on_window(w, received, missing)
        if not cols:
            return
        self._keep(cols)
        if not self._detector_made:
            self._detector_made = True
            nodes = self.nodes() if callable(self.nodes) else self.nodes
            self._detector = _default_detector(self.world_size, nodes, self.window, self.recovered, self.beside)
        if self._detector is None:
            return
        first_step = int(cols["first_step"].min())
        for message in self._detector.update(cols) or []:
            log.warning("hyperacc live: %s", message)
            if self.on_finding is not None:
                self.on_finding(first_step, str(message))
        if self.on_judged is not None:
            self.on_judged(self._detector, cols, first_step)

    # ------------------------------------------------------------------ the gathered rows on disk

    def _keep(self, cols: dict[str, np.ndarray]) -> None:
        if self.run_dir is None:
            return
        self._gathered.append(cols)
        if time.monotonic() - self._gathered_at >= 5.0:
            self.write_gathered()

    def write_gathered(self) -> None:
        """Write the rows gathered since the last write (every 5 s, and at the end)."""
        if not self._gathered or self.run_dir is None:
            return
        from hyperacc import records
        from hyperacc.schema import live_windows_dir

        parts, self._gathered = self._gathered, []
        self._gathered_at = time.monotonic()
        try:
            if self._writer is None:
                self._writer = records.RecordWriter(live_windows_dir(self.run_dir), "WINDOW_SCHEMA")
            present = {c for cols in parts for c in cols}
            columns = [c for c in SUMMARY_COLUMNS if c in present]
            self._writer.write_json([row for cols in parts for row in _json_rows(cols, columns)], columns)
        except Exception as exc:  # noqa: BLE001 - the live file is a convenience; training never waits
            self.run_dir = None
            switch_off("writing gathered windows", exc)
            return
        self.compact(final=False)

    def compact(self, *, final: bool) -> None:
        """Roll the gathered files into one per period (``store.compact``, as a rank's own segments)."""
        every, period_s, min_rows = self._compaction
        writer = self._writer
        if not every or writer is None or (writer.written - self._compacted < every and not final):
            return
        from hyperacc import store

        try:
            store.compact(writer.directory, None, every=1 if final else every, period_s=period_s, min_rows=min_rows)
            self._compacted = writer.written
        except Exception as exc:  # noqa: BLE001
            self._compaction = (0, 0.0, 0)
            switch_off(f"compacting gathered windows in {writer.directory}", exc)

    def close(self) -> None:
        """Write what is left (and compact it, where this process compacts)."""
        self.write_gathered()
        if self.run_dir is not None:
            self.compact(final=True)


class WindowAggregator:
    """One rank's part of live aggregation without a node agent: publishes its window summaries; on rank
    0 also gathers everyone's and runs detection (a ``WindowGatherer``)."""

    def __init__(
        self,
        rank: int,
        node: int,
        world_size: int,
        *,
        window: int = 50,
        grace_s: float = 30.0,
        store: Any = None,
        detector: Any = None,
        nodes: int | None = None,
        on_finding: Callable[[int, str], None] | None = None,
        on_window: Callable[[int, list[int], list[int]], None] | None = None,
        on_judged: Callable[[Any, dict[str, np.ndarray], int], None] | None = None,
        poll_s: float = 0.5,
        prefix: str | None = None,
        run_dir: str | os.PathLike | None = None,
        compaction: tuple[int, float, int] = (0, 0.0, 0),
    ) -> None:
        self.rank, self.node, self.world_size = rank, node, world_size
        self.window = window
        self.grace_s = grace_s
        self.poll_s = poll_s
        self.prefix = _prefix() if prefix is None else prefix
        self._store = store
        self._store_given = store is not None
        self.gatherer = (
            WindowGatherer(world_size, window=window, grace_s=grace_s,
                           nodes=nodes if nodes is not None else _node_count(world_size), detector=detector,
                           on_finding=on_finding, on_window=on_window, on_judged=on_judged, run_dir=run_dir,
                           compaction=compaction, compacts=not os.environ.get(ENV_NODE_AGENT))
            if rank == 0 else None
        )  # fmt: skip
        # the rank's own rows: the summary ``hyperacc analyze`` makes of the same steps (analysis.windows)
        self._stream = WindowStream(DetectionOptions(window_steps=window))
        self._outbox: deque[dict[str, Any]] = deque(maxlen=OUTBOX_ROWS)
        self._on = True
        self._own_last = -1
        self._backoff = Backoff(f"rank {rank}'s window summaries")
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hyperacc-trace-windows", daemon=True)
        self._thread.start()

    @property
    def on_judged(self) -> Any:
        return self.gatherer.on_judged if self.gatherer is not None else None

    @on_judged.setter
    def on_judged(self, fn: Any) -> None:
        if self.gatherer is not None:
            self.gatherer.on_judged = fn

    @property
    def windows_processed(self) -> int:
        return self.gatherer.windows_processed if self.gatherer is not None else 0

    # ------------------------------------------------------------------ input (tracer's flusher thread)

    def on_steps(self, table: Any) -> None:
        """Sink for a ``pyarrow.Table`` of new step records: completed windows go to the outbox."""
        if self._on and table.num_rows:
            self._add(step_columns(table, self.rank, self.node))

    def on_rows(self, rows: np.ndarray) -> None:
        """Sink for new step records as the tracer writes them (``Tracer.add_row_sink``)."""
        if self._on and len(rows):
            self._add(row_columns(rows))

    def _add(self, columns: dict[str, np.ndarray]) -> None:
        rows = self._stream.add(columns)
        if rows:
            self._outbox.extend(rows)
            self._wake.set()

    # ------------------------------------------------------------------ background thread

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.poll_s)
            self._wake.clear()
            self._tick(final=False)

    def _tick(self, final: bool) -> None:
        if not self._on or not self._backoff.ready():
            return
        try:
            if self._store is None:
                self._store = self._connect()
            self._publish()
            if self.gatherer is not None:
                self.gatherer.gather(self._store, final=final)
            self._backoff.succeeded()
        except STORE_ERRORS as exc:  # unreachable: try again later, the rows wait in the outbox
            if not self._store_given:
                self._store = None
            self._backoff.failed(exc)
        except Exception as exc:  # noqa: BLE001 - an internal error stops the summaries, never training
            self._on = False
            switch_off("window aggregation through the c10d store", exc)

    def _connect(self) -> Any:
        import torch.distributed as dist

        base = connect_store()
        if base is None:
            if self.world_size > 1:
                raise RuntimeError(
                    "no c10d store reachable (MASTER_ADDR/MASTER_PORT unset, no process group)"
                )
            base = dist.HashStore()  # a single process: rank 0 is everyone
        return dist.PrefixStore(self.prefix, base)

    def _publish(self) -> None:
        if not self._outbox:
            return
        rows = list(self._outbox)
        windows = publish_rows(self._store, rows)
        for _ in rows:
            self._outbox.popleft()
        self._own_last = max(self._own_last, windows[-1])
        if self.gatherer is not None:
            for w in windows:
                self.gatherer.note(w)

    # ------------------------------------------------------------------ end

    def close(self, wait: bool = True) -> None:
        """Publish what is complete; rank 0 waits briefly (<= 2 s) for the others' last windows, unless
        ``wait`` is False (the job is being stopped: the others will not send theirs). A store that did
        not answer is not tried again."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        if not self._on:
            return
        self._outbox.extend(self._stream.close())
        gatherer = self.gatherer
        deadline = time.monotonic() + (min(self.grace_s, 2.0) if gatherer is not None and wait else 0.0)
        while not self._backoff.down:
            self._tick(final=True)
            if gatherer is None or not gatherer.pending or not self._on or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if gatherer is not None:
            gatherer.close()
        if not self._store_given and self._store is not None:
            self._store = None


def start_window_aggregation(tracer: Any) -> None:
    """Attach a ``WindowAggregator`` to a new tracer whose ``window`` option asks for one."""
    options = tracer.options
    if options.window <= 0 or tracer.world_size <= 0:
        return
    if os.environ.get(ENV_NODE_AGENT):
        return  # hyperacc run's node agent summarises this rank's windows from its records (hyperacc.agent)
    try:
        aggregator = WindowAggregator(
            tracer.rank,
            tracer.node,
            tracer.world_size,
            window=options.window,
            grace_s=options.grace_s,
            on_finding=tracer.live_finding,
            on_window=tracer.window_gathered,
            run_dir=tracer.run_dir if tracer.rank == 0 else None,
            compaction=(options.compact_every, options.compact_period_s, options.compact_min_rows),
        )
        tracer.attach_aggregator(aggregator)
    except Exception as exc:  # noqa: BLE001
        switch_off("window aggregation", exc)


def install() -> None:
    """Every ``Tracer`` created in this process from now on aggregates windows live (its ``window`` option).

    ``hyperacc run`` (bootstrap) and the framework callbacks call this before they start the tracer; a
    script that builds its own ``Tracer`` calls it first to get live windows. Idempotent.
    """
    from hyperacc.trace.tracer import on_tracer_start

    on_tracer_start(start_window_aggregation)


def _node_count(world_size: int) -> int:
    return process.place().node_count(world_size)


def _json_rows(cols: dict[str, np.ndarray], columns: list[str]) -> list[list[Any]]:
    """Judged columns -> rows of JSON values for the gathered-windows file (None where not measured)."""
    n = len(cols["rank"])
    lists = []
    for c in columns:
        v = cols.get(c)
        if v is None:
            lists.append([None] * n)
        elif v.dtype.kind == "f":
            lists.append([None if x != x else x for x in v.tolist()])  # NaN -> None
        else:
            lists.append(v.tolist())
    return [list(r) for r in zip(*lists, strict=True)]


def _ranges(ranks: list[int]) -> str:
    out: list[str] = []
    start = prev = ranks[0]
    for r in ranks[1:] + [None]:  # type: ignore[list-item]
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(out)

"""Live Prometheus metrics from step records (prometheus-client).

``MetricsSink`` turns tables of step records (``STEP_SCHEMA``) into metrics. It is a sink for
``Tracer.add_sink``: the tracer calls it from its flusher thread with each new table, so nothing here
runs on the training thread, and an error inside it logs one line and switches the sink off.

Two ways to serve (docs/presentation.md, "Live metrics", lists every metric):

- per rank: each rank registers a sink on its tracer and serves on ``base_port + local_rank``;
- aggregated on rank 0: rank 0 runs a ``RunDirFollower`` that reads every rank's new segments from
  the run directory and feeds one sink, served on one port.

Spikes are judged with the analysis' own rule (``hyperacc.analysis.spikes.detect_spikes``, centred
rolling median) and attributed with ``attribute_spikes``; a step is judged once half a window of later
steps has arrived, so the counters lag by ``spike_window // 2`` steps and agree with ``hyperacc analyze``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from hyperacc import store
from hyperacc.analysis.attribution import attribute_spikes
from hyperacc.analysis.live import LiveDetector
from hyperacc.analysis.options import DetectionOptions
from hyperacc.analysis.spikes import detect_spikes, spike_metric, spike_parts
from hyperacc.analysis.windows import concat_windows, summarize_windows, window_table
from hyperacc.schema import EVENT_SCHEMA, STEP_SCHEMA
from hyperacc.trace.failsafe import one_line

log = logging.getLogger(__name__)

# Step-time buckets: 1 ms to 60 s, roughly x2 apart (covers a tiny CPU model to a large LLM step).
STEP_BUCKETS: tuple[float, ...] = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 60.0,
)  # fmt: skip
PHASES = ("data", "h2d", "forward", "backward", "comm_wait", "optimizer", "other")
CULPRIT_WINDOW = 100  # steps over which the culprit share is measured

# The step columns the straggler verdict behind ``hyperacc_straggler`` reads: its kind needs what `analyze`
# reads for it (the CPU time, the switches, the page faults, the input gap), or it says less than `analyze`.
_SIGNALS = (
    "step_ns", "self_ns", "comm_wait_ns", "data_ns", "h2d_ns", "forward_ns", "backward_ns", "optimizer_ns",
    "other_ns", "gc_ns", "major_faults", "invol_ctx_switches", "alloc_retries", "sync_all_streams", "launch_ns",
    "cpu_ns", "vol_ctx_switches", "minor_faults", "sys_cpu_ns", "data_gap",
)  # fmt: skip


def _f64(table: pa.Table, name: str) -> np.ndarray:
    if name not in table.column_names:
        return np.full(table.num_rows, np.nan)
    return table.column(name).cast(pa.float64()).to_numpy(zero_copy_only=False)


class _RankState:
    """Recent rows of one rank: for the centred spike rule and for the open straggler window."""

    def __init__(self) -> None:
        self.cols: dict[str, np.ndarray] = {c: np.empty(0) for c in ("step", "node", *_SIGNALS)}
        self.judged_upto = 0  # index into cols of the first step not yet judged
        self.seen = 0  # steps seen in total (for warm-up)
        self.culprits: list[int] = []
        self.open: dict[str, np.ndarray] = {}  # judged, typical rows of windows not complete yet


class MetricsSink:
    """Prometheus metrics from step records; call it with each new table (``Tracer.add_sink``)."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        world_size: int | None = None,
        nodes: int | None = None,
        options: DetectionOptions | None = None,
        buckets: Iterable[float] = STEP_BUCKETS,
        judges: bool = True,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        # whether the sink judges stragglers from the windows of the ranks it is fed; False where it sees
        # only part of the job (one node of several): the straggler gauge is then set from the job-wide
        # verdicts (``set_stragglers``) or left out
        self.judges = judges
        self.world_size = world_size
        self.nodes = nodes
        self.opts = options or DetectionOptions()
        self._detector: LiveDetector | None = None
        self._flagged: dict[int, str] = {}
        self._nodes_seen: set[int] = set()
        self._lock = threading.Lock()  # the follower and a tracer may both feed one sink
        self._ranks: dict[int, _RankState] = {}
        self._reporter: int | None = None  # the rank whose in-band culprit view is counted
        self.enabled = True
        r = self.registry
        self.step_seconds = Histogram(
            "hyperacc_step_seconds", "Step time, boundary to boundary.", ["rank"], buckets=tuple(buckets), registry=r
        )
        self.self_seconds_total = Counter(
            "hyperacc_self_seconds", "Self-time (work before entering the gradient collective).", ["rank"], registry=r
        )
        self.phase_seconds_total = Counter(
            "hyperacc_phase_seconds", "Time spent in each phase of the step.", ["rank", "phase"], registry=r
        )
        self.spikes_total = Counter("hyperacc_spikes", "Spikes (steps far above the rank's rolling median), by cause.",
                                    ["rank", "cause"], registry=r)  # fmt: skip
        self.spike_seconds_total = Counter("hyperacc_spike_seconds", "Time lost to spikes (excess over the baseline).",
                                           ["rank", "cause"], registry=r)  # fmt: skip
        self.gc_seconds_total = Counter("hyperacc_gc_pause_seconds", "Python GC pause time.", ["rank"], registry=r)
        self.gc_collections_total = Counter("hyperacc_gc_collections", "Python GC collections.", ["rank"], registry=r)
        self.culprit_steps_total = Counter(
            "hyperacc_culprit_steps", "Steps in which this rank arrived last at the collective (least wait).",
            ["rank"], registry=r,
        )  # fmt: skip
        self.culprit_share = Gauge("hyperacc_culprit_share",
                                   f"Share of the last {CULPRIT_WINDOW} steps in which this rank was the culprit.",
                                   ["rank"], registry=r)  # fmt: skip
        self.straggler = Gauge("hyperacc_straggler", "1 while the analysis confirms the rank as a straggler of this kind.",
                               ["rank", "kind"], registry=r)  # fmt: skip
        self.job_slowdown = Gauge("hyperacc_job_slowdown",
                                  "The job's step time over its level while a live slowdown of the whole job is "
                                  "going on (its kind: what its ranks did more), else 0.", ["kind"], registry=r)
        self._slowdown_kind: str | None = None
        self.pacing_enabled = Gauge("hyperacc_pacing_enabled", "1 while pacing delays this rank.", ["rank"], registry=r)
        self.pace_delay_seconds_total = Counter("hyperacc_pace_delay_seconds", "Delay added by pacing.", ["rank"],
                                                registry=r)  # fmt: skip
        self.spread_seconds = Gauge("hyperacc_arrival_spread_seconds", "Arrival spread at the collective, last step.",
                                    ["rank"], registry=r)  # fmt: skip
        self.last_step = Gauge("hyperacc_last_step", "Last step recorded.", ["rank"], registry=r)
        self.stabilizer_actions_total = Counter("hyperacc_stabilizer_actions", "Stabilizer and pacing actions, by kind.",
                                                ["rank", "action"], registry=r)  # fmt: skip
        self.stabilizer_seconds_total = Counter("hyperacc_stabilizer_seconds", "Time the stabilizer actions took.",
                                                ["rank", "action"], registry=r)  # fmt: skip

    # ------------------------------------------------------------------ sink entry points

    def __call__(self, table: pa.Table) -> None:
        """Update from a table of step records (any ranks, any order)."""
        self._guard(self._update_steps, table)

    def observe_events(self, table: pa.Table) -> None:
        """Update from a table of events (``EVENT_SCHEMA``): stabilizer and pacing actions."""
        self._guard(self._update_events, table)

    def observe_windows(self, table: pa.Table) -> None:
        """Update the straggler flags from window summaries (``WINDOW_SCHEMA``) of all ranks."""
        self._guard(self._update_windows, table)

    def _guard(self, fn: Callable[[pa.Table], None], table: pa.Table) -> None:
        if not self.enabled or table.num_rows == 0:
            return
        try:
            with self._lock:
                fn(table)
        except Exception as exc:  # never let metrics break the tracer's flusher
            self.enabled = False
            log.warning("hyperacc metrics switched off after an internal error: %s", one_line(exc))

    # ------------------------------------------------------------------ updates

    def _update_steps(self, table: pa.Table) -> None:
        ranks = table.column("rank").to_numpy(zero_copy_only=False)
        uniq = np.unique(ranks)
        windows = []
        for rank in uniq:
            sub = table.filter(pa.array(ranks == rank)) if len(uniq) > 1 else table
            sub = sub.sort_by("step")
            typical = self._rank_rows(int(rank), sub)
            windows.append(self._close_windows(int(rank), typical))
        done = concat_windows([w for w in windows if w is not None])
        if done["rank"].size and self.judges:
            self._update_windows(window_table(done))

    def _close_windows(self, rank: int, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """Summaries of the rank's windows that the newly judged rows completed, over typical steps
        (spikes left out, warm-up left out), with the analysis' own code."""
        st = self._ranks[rank]
        if not rows["step"].size:
            return None
        rows = {**rows, "rank": np.full(rows["step"].size, rank, dtype=np.int64)}
        self._nodes_seen.update(np.unique(rows["node"]).astype(int).tolist())
        cols = {k: np.concatenate([st.open[k], v]) for k, v in rows.items()} if st.open else rows
        w = self.opts.window_steps
        win = cols["step"].astype(np.int64) // w
        closed = win < win.max()
        st.open = {k: v[~closed] for k, v in cols.items()}
        if not closed.any():
            return None
        done = {k: v[closed] for k, v in cols.items()}
        for k in ("step", "rank", "node"):
            done[k] = done[k].astype(np.int64)
        return summarize_windows(done, window_steps=w, min_samples=self.opts.min_window_samples)

    def _update_windows(self, table: pa.Table) -> None:
        if self._detector is None:
            ranks = table.column("rank").to_numpy(zero_copy_only=False)
            world = self.world_size or max(len(self._ranks), int(ranks.max()) + 1)
            nodes = self.nodes or max(len(self._nodes_seen), 1)
            fields = {f.name for f in dataclasses.fields(DetectionOptions)}
            self._detector = LiveDetector(world, nodes, **{k: getattr(self.opts, k) for k in fields})
        for line in self._detector.update(table):
            log.info("%s", line)
        self._flag(self._detector.confirmed)

    def set_stragglers(self, confirmed: dict[int, str]) -> None:
        """The straggler gauge from verdicts judged elsewhere over the whole job (rank -> kind): a node
        agent's sink that sees only its node (``judges`` False) takes the live windows' verdicts of the
        agent that holds rank 0."""
        with self._lock:
            self._flag(confirmed)

    def set_job_slowdown(self, going: tuple[float, str] | None) -> None:
        """The job slowdown gauge from the judging agent's live rule: (ratio, kind) while one is going on."""
        with self._lock:
            if self._slowdown_kind is not None and (going is None or going[1] != self._slowdown_kind):
                self.job_slowdown.labels(self._slowdown_kind).set(0.0)
            if going is not None:
                self.job_slowdown.labels(going[1]).set(float(going[0]))
            self._slowdown_kind = going[1] if going is not None else None

    def _flag(self, confirmed: dict[int, str]) -> None:
        for rank, kind in self._flagged.items():
            if confirmed.get(rank) != kind:
                self.straggler.labels(str(rank), kind).set(0.0)
        for rank, kind in confirmed.items():
            self.straggler.labels(str(rank), kind).set(1.0)
        self._flagged = dict(confirmed)

    def _rank_rows(self, rank: int, t: pa.Table) -> dict[str, np.ndarray]:
        lbl = str(rank)
        step_s = _f64(t, "step_ns") / 1e9
        hist = self.step_seconds.labels(lbl)
        for v in step_s[np.isfinite(step_s)].tolist():
            hist.observe(v)
        self._add(self.self_seconds_total.labels(lbl), _f64(t, "self_ns"))
        for p in PHASES:
            self._add(self.phase_seconds_total.labels(lbl, p), _f64(t, f"{p}_ns"))
        self._add(self.gc_seconds_total.labels(lbl), _f64(t, "gc_ns"))
        gcc = _f64(t, "gc_count")
        self.gc_collections_total.labels(lbl).inc(float(np.nansum(gcc)) if np.isfinite(gcc).any() else 0.0)
        self._add(self.pace_delay_seconds_total.labels(lbl), _f64(t, "pace_delay_ns"))
        pace = _f64(t, "pace_on")
        if np.isfinite(pace).any():
            self.pacing_enabled.labels(lbl).set(float(pace[np.isfinite(pace)][-1]))
        spread = _f64(t, "spread_ns")
        if np.isfinite(spread).any():
            self.spread_seconds.labels(lbl).set(float(spread[np.isfinite(spread)][-1]) / 1e9)
        steps = t.column("step").to_numpy(zero_copy_only=False)
        self.last_step.labels(lbl).set(float(steps.max()))
        self._culprits(rank, _f64(t, "min_wait_rank"))
        return self._spikes(rank, t)

    @staticmethod
    def _add(counter, values_ns: np.ndarray) -> None:
        ok = np.isfinite(values_ns)
        counter.inc(float(np.maximum(values_ns[ok], 0).sum()) / 1e9 if ok.any() else 0.0)

    def _culprits(self, rank: int, min_wait_rank: np.ndarray) -> None:
        """Counts each step's culprit as one rank saw it in-band (``min_wait_rank``)."""
        if self._reporter is None and np.isfinite(min_wait_rank).any():
            self._reporter = rank
        if rank != self._reporter:
            return
        st = self._ranks.setdefault(rank, _RankState())
        culprits = [int(c) for c in min_wait_rank[np.isfinite(min_wait_rank)].tolist() if c >= 0]
        for c in culprits:
            self.culprit_steps_total.labels(str(c)).inc()
        st.culprits = (st.culprits + culprits)[-CULPRIT_WINDOW:]
        if not st.culprits:
            return
        world = max(self.world_size or 0, max(st.culprits) + 1)
        counts = np.bincount(np.asarray(st.culprits), minlength=world)
        for r in range(len(counts)):
            self.culprit_share.labels(str(r)).set(counts[r] / len(st.culprits))

    def _spikes(self, rank: int, t: pa.Table) -> dict[str, np.ndarray]:
        """Judges the rows that have half a window of later steps; returns those that did not spike."""
        opts = self.opts
        st = self._ranks.setdefault(rank, _RankState())
        new = {"step": t.column("step").to_numpy(zero_copy_only=False).astype(np.float64),
               "node": t.column("node").to_numpy(zero_copy_only=False).astype(np.float64)}  # fmt: skip
        new.update({c: _f64(t, c) for c in _SIGNALS})
        skip = max(0, opts.warmup_steps - st.seen)  # the analysis leaves each rank's first steps out
        st.seen += t.num_rows
        if skip:
            new = {k: v[skip:] for k, v in new.items()}
        st.cols = {k: np.concatenate([st.cols[k], new[k]]) for k in st.cols}
        half = opts.spike_window // 2
        n = st.cols["step"].size
        ready = n - half  # rows before this index have half a window of later steps
        if ready <= st.judged_upto:
            return {k: v[:0] for k, v in st.cols.items()}
        # the same sequence as the offline analysis (hyperacc.analysis.run_dir)
        values = spike_metric(st.cols, opts)
        result = detect_spikes(values, opts, spike_parts(st.cols, opts), st.cols["step_ns"])
        idx = np.flatnonzero(result.spike[st.judged_upto : ready]) + st.judged_upto
        if idx.size:
            causes, _ = attribute_spikes(st.cols, idx, result.excess[idx], values, opts)
            for cause, excess in zip(causes.tolist(), result.excess[idx].tolist(), strict=True):
                self.spikes_total.labels(str(rank), cause).inc()
                self.spike_seconds_total.labels(str(rank), cause).inc(max(excess, 0.0) / 1e9)
        span = slice(st.judged_upto, ready)
        typical = result.judged[span] & ~result.spike[span]
        out = {k: v[span][typical] for k, v in st.cols.items()}
        st.judged_upto = ready
        # keep a full window of context before the first unjudged row
        drop = max(0, st.judged_upto - opts.spike_window)
        if drop:
            st.cols = {k: v[drop:] for k, v in st.cols.items()}
            st.judged_upto -= drop
        return out

    def _update_events(self, table: pa.Table) -> None:
        kinds = table.column("kind").to_pylist()
        ranks = table.column("rank").to_pylist()
        durs = table.column("duration_ns").to_pylist()
        for rank, kind, dur in zip(ranks, kinds, durs, strict=True):
            if kind in ("collective", "memory_peak", "spike"):
                continue  # imported profiler detail and analysis output, not actions
            self.stabilizer_actions_total.labels(str(rank), kind).inc()
            if dur:
                self.stabilizer_seconds_total.labels(str(rank), kind).inc(dur / 1e9)


def serve(sink: MetricsSink, port: int, addr: str = "127.0.0.1"):
    """Serves ``sink``'s metrics over HTTP at ``addr:port`` (``/metrics``) from a daemon thread.

    Returns the server (``.shutdown()`` stops it), or None when it cannot listen there (the port is
    taken, the address is not this host's): one warning, and training goes on without the endpoint.
    Binds to loopback by default; pass ``0.0.0.0`` for a scraper on another host.
    """
    try:
        server, _thread = start_http_server(port, addr=addr, registry=sink.registry)
    except (OSError, OverflowError, ValueError) as exc:
        log.warning("hyperacc metrics: cannot serve on %s:%s (%s); training goes on without this endpoint",
                    addr, port, getattr(exc, "strerror", None) or exc)  # fmt: skip
        return None
    return server


class RunDirFollower:
    """Feeds a sink with every rank's new segments from a run directory (aggregation on rank 0).

    A background thread reads every rank's new ``steps`` and ``events`` rows every ``interval`` seconds
    (``store.SegmentCursor``: each row once, also across compactions) and hands them to the sink.
    Segments are checked as every reader checks them (``store.open_segment``): one that does not fit its
    schema or cannot be read is skipped with one warning.
    """

    def __init__(self, run_dir: str | Path, sink: MetricsSink, interval: float = 2.0,
                 ranks: Callable[[int], bool] | None = None) -> None:  # fmt: skip
        self.run_dir = Path(run_dir)
        self.sink = sink
        self.interval = interval
        self.ranks = ranks  # only the ranks it is true of (a node agent's own), before any folder is read
        self._cursors: dict[Path, store.SegmentCursor] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hyperacc-metrics-follower", daemon=True)

    def start(self) -> RunDirFollower:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval + 5)
        self.poll()  # the segments written last

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.poll()
            except Exception as exc:  # a follower error must not end rank 0
                log.warning("hyperacc metrics follower stopped after an internal error: %s", one_line(exc))
                return

    def poll(self) -> int:
        """Reads the segments not seen yet; returns how many were fed."""
        fed = 0
        for kind in ("steps", "events"):
            schema = STEP_SCHEMA if kind == "steps" else EVENT_SCHEMA
            for _, rank_dir in store.rank_dirs(self.run_dir, kind, keep=self.ranks):
                cursor = self._cursors.get(rank_dir)
                if cursor is None:
                    cursor = self._cursors[rank_dir] = store.SegmentCursor(rank_dir)
                # each row once, across compactions; a segment that does not fit is skipped with a warning
                for table in cursor.read_new(schema=schema):
                    if kind == "steps":
                        self.sink(table)
                    else:
                        self.sink.observe_events(table)
                    fed += 1
        return fed


class RunDirEndpoint:
    """The endpoint of ``hyperacc run --metrics-port``: on rank 0, every rank's metrics from the run
    directory (a ``RunDirFollower`` feeding one ``MetricsSink``), served on ``HOST:PORT``.

    Off the training thread entirely (the follower's thread and the HTTP server's); a port already
    taken is one warning and training goes on (``serve``).
    """

    def __init__(self, run_dir: str | Path, address: str, *, world_size: int | None = None,
                 interval: float = 2.0, ranks: Callable[[int], bool] | None = None,
                 judges: bool = True) -> None:  # fmt: skip
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"metrics address must be HOST:PORT with a port 1-65535 (got {address!r})")
        self.sink = MetricsSink(world_size=world_size, judges=judges)
        self.server = serve(self.sink, int(port), host.strip("[]"))
        self.follower = RunDirFollower(run_dir, self.sink, interval=interval, ranks=ranks).start() if self.server else None

    def close(self) -> None:
        if self.follower is not None:
            self.follower.stop()
        if self.server is not None:
            self.server.shutdown()
            self.server = None

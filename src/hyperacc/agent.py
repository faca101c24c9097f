"""The node agent's work on the run directory: what ``hyperacc run`` does for the ranks of its node, so
that a training rank keeps to timing and writing its records (docs/tracing.md, "Live aggregation" and
"Compaction").

- ``LiveNode``: live windows. Reads the step records its ranks flushed, summarises each rank's windows,
  and either judges them (the agent that holds rank 0: the live detector, ``live/windows``,
  ``live/events``, live remediation decisions) or sends its node's rows to that agent.
- ``Compactor``: each rank writes one plain record segment per flush (``hyperacc.records``, numpy and
  json: no pyarrow in the rank); a thread rolls them into Parquet, one file per rank and period
  (``store.compact`` with the tracer's ``compact_every``, ``compact_period_s`` and ``compact_min_rows``),
  every few seconds while the job runs and once more, everything, when torchrun has exited.
- ``MetricsEndpoint``: ``hyperacc run --metrics-port``, the Prometheus metrics of its ranks.

``hyperacc run`` tells its ranks with ``HYPERACC_NODE_AGENT`` so that they do neither themselves; a rank
traced without ``hyperacc run`` compacts its own segments from its flusher thread, and rank 0 gathers
the windows, as before. Which ranks: those whose metadata (``meta/rank-N.json``) names this agent
("host:pid" of the ``hyperacc run`` process, which every rank records), so that the agents of a
multi-node job sharing one run directory never work on the same folder, even where two nodes report
the same host name. Nothing here can touch the job: it runs in the agent's process, and an error
switches the failing part off with one log line; the ranks' records stay readable as they are.

Why this module is about 650 lines: its three parts run on the same periodic-thread scaffold
(``_Periodic``) and decide the same way which ranks are this agent's; ``LiveNode`` is most of it, and
its store handling (``analysis.window_store``, ``live_episodes.send_blocks`` / ``BlockInbox``) and
judging (``analysis.live_aggregate``, ``analysis.live_episodes``) already live beside the analysis
they serve.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hyperacc import records
from hyperacc.analysis.window_store import STORE_ERRORS, connect_store
from hyperacc.schema import live_events_dir, live_windows_dir, rank_name, window_gathered_detail
from hyperacc.trace.failsafe import one_line

log = logging.getLogger("hyperacc.agent")

KINDS = (("steps", "STEP_SCHEMA"), ("events", "EVENT_SCHEMA"), ("resources", "RESOURCE_SCHEMA"))

# Window rows a node agent keeps while the job's store does not answer (the newest; older ones dropped).
OUTBOX_ROWS = 4096

# How long the leader waits after the job for the other nodes' last windows (at most the window grace).
FINAL_WAIT_S = 10.0

# The other nodes' agents send their ranks' blocks to the leader at most this many times a second in all
# (each at most every nodes / BLOCK_KEYS_PER_S s): a check, a get and a delete per key cost the leader
# about 0.24 ms a key (bench/live_aggregation.py), so its reading stays near 25 ms a second at any size
BLOCK_KEYS_PER_S = 100.0

# The leader judges live episodes again only after this many times the CPU its last judgement took
# (at most 1/(1 + EPISODE_DUTY) of a core; a judgement took 0.15 s at 1,024 ranks and 0.59 s at 4,096 here,
# bench/live_aggregation.py)
EPISODE_DUTY = 9.0


class _Periodic:
    """A pass over the run directory every ``poll_s`` on a thread of the agent, and a final one after
    the job (``stop``)."""

    thread_name = "hyperacc-agent"
    run_dir: Path
    poll_s: float
    on: bool
    _stop: threading.Event
    meta_cache: Any = None  # the run directory's store.MetaCache, one for all parts of a NodeAgent

    def metas(self) -> dict[int, Any]:
        """The ranks' metadata, read again only when it changed (``store.MetaCache``)."""
        if self.meta_cache is None:
            from hyperacc import store

            self.meta_cache = store.MetaCache(self.run_dir)
        return self.meta_cache.read()
    _thread: threading.Thread | None

    def start(self) -> None:
        if self.on:
            self._thread = threading.Thread(target=self._loop, name=self.thread_name, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """After the job: stop the thread, then one final pass over everything that is left."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        self.pass_once(final=True)
        self._finish()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.pass_once(final=False)

    def pass_once(self, *, final: bool) -> Any:
        raise NotImplementedError

    def _finish(self) -> None:
        """After the final pass."""


class Compactor(_Periodic):
    """Rolls the record segments of this host's ranks into Parquet (``run``: a background thread)."""

    thread_name = "hyperacc-agent-compact"

    def __init__(self, run_dir: str | Path, *, every: int, period_s: float, min_rows: int,
                 poll_s: float = 5.0, agent: str) -> None:  # fmt: skip
        self.run_dir = Path(run_dir)
        self.every, self.period_s, self.min_rows = every, period_s, min_rows
        self.poll_s = poll_s
        self.agent = agent
        self.on = every > 0
        self.compacted = 0  # files written
        self._ranks: set[int] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_trace_json(cls, run_dir: str | Path, trace_json: str | None, *, agent: str) -> Compactor:
        from hyperacc.trace.options import TraceOptions

        opts = TraceOptions.from_json(trace_json) if trace_json else TraceOptions()
        return cls(run_dir, every=opts.compact_every, period_s=opts.compact_period_s, min_rows=opts.compact_min_rows,
                   agent=agent)  # fmt: skip

    def local_ranks(self) -> set[int]:
        """The ranks whose metadata names this agent (read again for ranks not yet seen: restarts)."""
        try:
            metas = self.metas()
        except Exception:  # noqa: BLE001 - unreadable metadata: nothing new to compact this time
            return self._ranks
        self._ranks |= {rank for rank, meta in metas.items() if meta.agent == self.agent}
        return self._ranks

    def pass_once(self, *, final: bool) -> int:
        """Compact every local rank's folders once; returns the files written."""
        if not self.on:
            return 0
        from hyperacc import schema, store

        written = 0
        every = 1 if final else self.every
        try:
            local = sorted(self.local_ranks())
            for rank in local:
                for kind, schema_name in KINDS:
                    folder = self.run_dir / kind / rank_name(rank)
                    if not folder.is_dir():
                        continue
                    out = store.compact(folder, getattr(schema, schema_name), every=every,
                                        period_s=self.period_s, min_rows=self.min_rows)  # fmt: skip
                    written += out is not None
            windows = live_windows_dir(self.run_dir)
            if 0 in local and windows.is_dir():  # rank 0's gathered window summaries, columns as written
                written += store.compact(windows, None, every=every, period_s=self.period_s,
                                         min_rows=self.min_rows) is not None  # fmt: skip
            events = live_events_dir(self.run_dir)
            if 0 in local and events.is_dir():  # the live verdicts of this agent (LiveNode)
                written += store.compact(events, schema.EVENT_SCHEMA, every=every, period_s=self.period_s,
                                         min_rows=self.min_rows) is not None  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - the ranks' segments stay readable as they are
            self.on = False
            log.warning("hyperacc run: compaction of %s switched off (%r); the records stay as written",
                        self.run_dir, exc)  # fmt: skip
        self.compacted += written
        return written


class LiveNode(_Periodic):
    """Live window aggregation for the ranks of this host, in the node agent (``run``: a background thread).

    Every ``poll_s`` it reads the step records its ranks flushed since the last pass (``SegmentCursor``,
    each row once across compactions), turns each rank's steps into window summaries exactly as offline
    (``WindowStream``), and then:

    - where this agent holds every rank of the job, judges the windows itself (``WindowGatherer.offer``);
    - otherwise publishes its node's rows to a TCPStore that the agent holding rank 0 serves (one append
      and one count per window for the whole node; ``_agents_store``), and that agent gathers every
      node's rows from there.

    The agent that holds rank 0 runs the live detector, keeps the gathered rows under
    ``RUN_DIR/live/windows``, writes its findings and who reported each window as events under
    ``RUN_DIR/live/events`` and, with ``--remediate``, takes the live remediation decisions
    (``remediation.live``), which the ranks learn from the store. The ranks do none of this
    (``analysis.live_aggregate.start_window_aggregation`` is skipped under a node agent). An unreachable
    store is retried with backoff; any other error switches live aggregation off with one log line.
    """

    thread_name = "hyperacc-agent-live"
    # Live episodes (analysis.live_episodes): the change-point rule over the ranks' blocks as they are
    # flushed, judged by the agent that holds rank 0 (the other nodes' agents send it their ranks'
    # blocks); only episodes with CPU-time or blocking evidence are said live (docs/detection.md,
    # "Episodes", Live).
    # A class attribute so that a deployment can switch them off.
    live_episodes = True

    def __init__(self, run_dir: str | Path, *, agent: str, window: int, grace_s: float, poll_s: float = 1.0,
                 remediate: str | None = None) -> None:  # fmt: skip
        from hyperacc.analysis.window_store import Backoff

        self.run_dir = Path(run_dir)
        self.agent = agent
        self.window, self.grace_s, self.poll_s = window, grace_s, poll_s
        self._steps_seen: deque[tuple[float, int]] = deque(maxlen=16)  # (wall-clock s, step) of records read
        self.remediate = remediate  # HYPERACC_REMEDIATE as the ranks get it
        self.on = window > 0
        self._cursors: dict[int, Any] = {}
        self._streams: dict[int, Any] = {}
        self._last_step: dict[int, int] = {}
        self._metas: dict[int, Any] = {}
        self._held: list[dict[str, Any]] = []  # rows read before the job's shape is known
        self._gatherer: Any = None
        self._store: Any = None  # a follower's client of the leader's store (multi-node)
        self._served: Any = None  # the leader's own store, where the node agents meet
        self._address = ""  # where the leader's store is, "host:port"
        self._advertised = False  # said in the job's store
        self._job: Any = None  # the job's own store
        self._backoff = Backoff("node agent's window summaries")
        self._events: Any = None
        self._remediation: Any = None
        self._blocks: dict[int, Any] = {}  # rank -> its BlockStream (live episodes)
        self._new_blocks: list[Any] = []  # blocks read and not yet judged (the leader) or published
        self._episodes: Any = None  # the leader's LiveEpisodes; False: switched off
        self._judge_after = 0.0  # monotonic time before which the episodes are not judged again
        self._blocks_due = 0.0  # a follower: monotonic time from which it sends its blocks again
        self._inbox: Any = None  # the leader's live_episodes.BlockInbox
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_trace_json(cls, run_dir: str | Path, trace_json: str | None, *, agent: str,
                        remediate: str | None = None) -> LiveNode:  # fmt: skip
        from hyperacc.trace.options import TraceOptions

        opts = TraceOptions.from_json(trace_json) if trace_json else TraceOptions()
        return cls(run_dir, agent=agent, window=opts.window, grace_s=opts.grace_s, remediate=remediate)

    def _finish(self) -> None:
        """Every record is on disk and judged: write what is left."""
        if self._gatherer is not None:
            self._guard(self._gatherer.close)
        if self._events is not None:
            self._guard(self._events.close)

    def _guard(self, fn: Callable[[], Any]) -> None:
        if not self.on:
            return
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the job never sees the agent's errors
            self.on = False
            log.warning("hyperacc run: live window aggregation switched off (%s)", one_line(exc))

    # ------------------------------------------------------------------ one pass

    def pass_once(self, *, final: bool) -> None:
        self._guard(lambda: self._pass(final))

    def _pass(self, final: bool) -> None:
        from hyperacc.analysis.window_store import publish_rows

        rows = self._held + self._read_new(final)
        self._held = []
        mine = {r: m for r, m in self._metas.items() if m.agent == self.agent}
        if not mine:
            return
        ref = mine.get(0) or mine[min(mine)]  # every rank of a job names the same world and store
        # every rank of the job is here, or will be (a one-node job: a rank that has not written its
        # metadata yet, or never will, is missing in its windows): no store in between
        if len(mine) >= ref.world_size or ref.nodes == 1:
            gatherer = self._leader(ref)
            gatherer.offer(rows)
            gatherer.gather(None, final=final, final_grace_s=0.0)
            if self.live_episodes:
                self._judge_episodes(final)
            return
        if not ref.store or not (final or self._backoff.ready()):
            self._hold(rows)
            return
        try:
            store = self._agents_store(ref, leader=0 in mine, final=final)
            if store is None:  # the leader has not said where yet
                self._hold(rows)
                return
            windows = publish_rows(store, rows) if rows else []
            if 0 in mine:
                gatherer = self._leader(ref)
                for w in windows:
                    gatherer.note(w)
                gatherer.gather(store, final=False)
                if final:
                    self._final_gather(store, gatherer, ref)
                if self.live_episodes:
                    self._judge_episodes(final, store)
            else:
                if (
                    self.live_episodes
                    and self._episodes is not False
                    and (final or time.monotonic() >= self._blocks_due)
                ):
                    self._publish_blocks(store)
                    self._blocks_due = time.monotonic() + (ref.nodes or 1) / BLOCK_KEYS_PER_S
                if final:
                    store.add("final", 1)
            self._backoff.succeeded()
        except STORE_ERRORS as exc:  # rows kept for the next try (the newest OUTBOX_ROWS)
            self._store = self._job = None
            self._hold(rows)
            self._backoff.failed(exc)

    def _hold(self, rows: list[dict[str, Any]]) -> None:
        """Window rows and blocks kept for the next pass while the store cannot take them: the newest
        OUTBOX_ROWS rows, each rank's newest blocks (``live_episodes.KEEP_BLOCKS``)."""
        self._held = rows[-OUTBOX_ROWS:]
        if self._new_blocks:
            from hyperacc.analysis.live_episodes import merged_blocks

            self._new_blocks = merged_blocks(self._new_blocks)

    def _publish_blocks(self, store: Any) -> None:
        """A follower's new blocks of its ranks, for the live episodes that the leader judges
        (``live_episodes.send_blocks``)."""
        from hyperacc.analysis.live_episodes import merged_blocks, send_blocks

        try:
            send_blocks(store, merged_blocks(self._new_blocks))
        except STORE_ERRORS:
            raise  # the store's: the blocks are held for the next try (``_hold``)
        except Exception as exc:  # noqa: BLE001 - the job never sees the agent's errors
            self._episodes = False
            log.warning("hyperacc run: live episodes switched off (%s)", one_line(exc))
        self._new_blocks = []

    def _recovered(self, rank: int, since_step: int) -> bool:
        """The live episodes saw ``rank`` back from a slowdown that began with a straggler the windows
        confirm since ``since_step`` (the windows reach the leader later than the blocks: a Lightning
        job's 60-step fault was said a straggler 70 steps after its end was said)."""
        episodes = self._episodes
        try:
            return bool(episodes) and episodes.recovered(rank, since_step, self.window)
        except Exception:  # noqa: BLE001 - the windows' verdicts go on as they were
            return False

    def _beside(self) -> list[dict[str, Any]]:
        """The episodes the live episodes said ended (each rank's latest): a straggler is judged without
        their windows (``episodes.stragglers_beside_episodes``)."""
        episodes = self._episodes
        try:
            return episodes.ended() if episodes else []
        except Exception:  # noqa: BLE001 - the windows' verdicts go on as they were
            return []

    def _judge_episodes(self, final: bool, store: Any = None) -> None:
        """Live episodes (``analysis.live_episodes``) over the blocks read this pass, and those the other
        nodes' agents published to ``store`` (a multi-node job), as live findings. Judged at most once
        every ``EPISODE_DUTY`` times what the last judgement cost this thread, so that the agent's CPU stays
        bounded at thousands of ranks (docs/detection.md, "Episodes", Live). An error here switches the
        live episodes off, with one log line; the windows' verdicts go on."""
        blocks, self._new_blocks = self._new_blocks, []
        if self._episodes is False:
            return
        try:
            if self._episodes is None:
                from hyperacc.analysis.live_episodes import BlockInbox, LiveEpisodes
                from hyperacc.analysis.options import DetectionOptions

                self._inbox = BlockInbox(self.grace_s)  # the other nodes' blocks (a multi-node job)

                confirmed = lambda rank: rank in getattr(self._gatherer._detector, "confirmed", {})  # noqa: E731
                self._episodes = LiveEpisodes(DetectionOptions(window_steps=self.window), straggler=confirmed,
                                              silent_s=self.grace_s)  # fmt: skip
            if store is not None:
                blocks += self._inbox.take(store, final)
            self._episodes.add(blocks)
            if not final and time.monotonic() < self._judge_after:
                return
            began = time.thread_time()
            said = self._episodes.judge() + (self._episodes.close() if final else [])
            self._judge_after = time.monotonic() + EPISODE_DUTY * (time.thread_time() - began)
        except Exception as exc:  # noqa: BLE001 - the job never sees the agent's errors
            self._episodes = False
            log.warning("hyperacc run: live episodes switched off (%s)", one_line(exc))
            return
        for step, line in said:
            self._event("live_finding", step, None, line)

    def _final_gather(self, store: Any, gatherer: Any, ref: Any) -> None:
        """The leader after its own torchrun exited: the other nodes' agents send their last windows once
        their torchrun exits too; wait for them (at most ``min(grace_s, FINAL_WAIT_S)``), then judge
        what is left at once."""
        others = max((ref.nodes or 1) - 1, 0)
        deadline = time.monotonic() + min(self.grace_s, FINAL_WAIT_S)
        while int(store.add("final", 0)) < others and time.monotonic() < deadline:
            gatherer.gather(store, final=False)
            time.sleep(0.2)
        gatherer.gather(store, final=True, final_grace_s=0.0)

    def _agents_store(self, ref: Any, *, leader: bool, final: bool = False) -> Any:
        """Where the node agents of a multi-node job meet: a TCPStore that the leader (the agent that
        holds rank 0) serves, so that it outlives torchrun's own store and the last windows of every
        node still arrive after the job ends. The leader says where in ``RUN_DIR/live/agents`` (read
        first: a run directory the nodes share says it even after torchrun's store is gone) and in the
        job's store (``ref.store``, MASTER_ADDR:MASTER_PORT). The leader's store is made once and never
        depends on the job's: an advertisement that fails is tried again at the next pass (not at the
        last, when torchrun's store is gone). None until a follower knows where."""
        import datetime

        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=10)
        host, _, port = ref.store.rpartition(":")
        said = self.run_dir / "live" / "agents"
        key = f"hyperacc/agents/{ref.run_id}/address"
        if leader:
            if self._served is None:
                served = dist.TCPStore(host, 0, None, True, timeout=timeout, wait_for_workers=False)
                self._address = f"{_address_towards(host, int(port))}:{served.port}"
                said.parent.mkdir(parents=True, exist_ok=True)
                text = json.dumps({"run_id": ref.run_id, "address": self._address}) + "\n"
                records.write_atomically(said, lambda tmp: tmp.write_text(text))
                self._served = served
            if not self._advertised and not final:
                try:
                    self._job_store(ref).set(key, self._address)
                    self._advertised = True
                except STORE_ERRORS:
                    self._job = None  # the file says it meanwhile; the job's store is tried next pass
            return self._served
        if self._store is not None:
            return self._store
        address = None
        try:
            text = json.loads(said.read_text())
            address = text["address"] if text.get("run_id") == ref.run_id else None
        except (OSError, ValueError, KeyError):
            pass
        if address is None:
            job = self._job_store(ref)
            if not job.check([key]):
                return None
            address = job.get(key).decode()
        self._store = connect_store(address)
        return self._store

    def _job_store(self, ref: Any) -> Any:
        """A client of the job's own store (torchrun's, the one its rendezvous uses), made once."""
        if self._job is None:
            self._job = connect_store(ref.store)
        return self._job

    def _read_new(self, final: bool) -> list[dict[str, Any]]:
        """The window rows this agent's ranks completed since the last pass (all of them when ``final``)."""
        from hyperacc import store
        from hyperacc.analysis.options import DetectionOptions
        from hyperacc.analysis.windows import WindowStream, step_columns
        from hyperacc.schema import STEP_SCHEMA, steps_dir

        try:
            self._metas.update(self.metas())
        except Exception:  # noqa: BLE001 - metadata being written: read again next pass
            pass
        out: list[dict[str, Any]] = []
        for rank, meta in sorted(self._metas.items()):
            if meta.agent != self.agent:
                continue
            cursor = self._cursors.get(rank)
            if cursor is None:
                cursor = self._cursors[rank] = store.SegmentCursor(steps_dir(self.run_dir, rank))
            for table in cursor.read_new(None, STEP_SCHEMA):
                if not table.num_rows:
                    continue
                cols = step_columns(table, rank, meta.node)
                first = int(cols["step"][0])
                stream = self._streams.get(rank)
                if stream is None or first <= self._last_step.get(rank, -1):  # a restart counts steps again
                    opts = DetectionOptions(window_steps=self.window)
                    stream = self._streams[rank] = WindowStream(opts)
                    if self.live_episodes:
                        from hyperacc.analysis.live_episodes import BlockStream

                        self._blocks[rank] = BlockStream(rank, meta.node, opts)
                self._last_step[rank] = int(cols["step"][-1])
                self._sample(table)
                out += stream.add(cols)
                if self.live_episodes:  # when off, no blocks are made
                    self._new_blocks.append(self._blocks[rank].add(cols))
            if final and rank in self._streams:
                out += self._streams.pop(rank).close()
                if self.live_episodes:
                    self._new_blocks.append(self._blocks.pop(rank).close())
        return out

    def _sample(self, table: Any) -> None:
        """(wall-clock start, step) of the first and last step of newly read records: the ranks' pace."""
        starts = table.column("t_start_ns").to_pylist()
        steps = table.column("step").to_pylist()
        for i in (0, len(steps) - 1):
            if starts[i] is not None and (not self._steps_seen or steps[i] > self._steps_seen[-1][1]):
                self._steps_seen.append((starts[i] / 1e9, int(steps[i])))
                if self._remediation is not None:
                    self._remediation.observe(int(steps[i]), starts[i] / 1e9)

    def step_now(self) -> int:
        """The ranks' training step now, as far as their records tell: the newest step read, plus what
        the pace of the recorded steps (wall clock, ``t_start_ns``) adds since it started."""
        if not self._steps_seen:
            return 0
        (t0, s0), (t1, s1) = self._steps_seen[0], self._steps_seen[-1]
        rate = (s1 - s0) / (t1 - t0) if t1 > t0 else 0.0
        return s1 + math.ceil(rate * max(time.time() - t1, 0.0))

    def _leader(self, meta0: Any) -> Any:
        """The gatherer of the agent that holds rank 0, made on first use."""
        if self._gatherer is None:
            from hyperacc.analysis.live_aggregate import WindowGatherer

            self._gatherer = WindowGatherer(
                meta0.world_size, window=self.window, grace_s=self.grace_s,
                nodes=lambda: max(len({m.node for m in self._metas.values()}), 1),
                on_finding=lambda step, text: self._event("live_finding", step, None, text),
                on_window=self._window_event, run_dir=self.run_dir, compacts=False,
                recovered=self._recovered, beside=self._beside,
            )  # fmt: skip
            self._remediation = self._remediation_of(meta0)
            if self._remediation is not None:
                self._gatherer.on_judged = self._remediation.on_judged
        # after an elastic restart: the world as it is now, switches where the restarted ranks look
        self._gatherer.world_size = meta0.world_size
        if self._remediation is not None:
            self._remediation.retarget(_remediate_prefix(meta0), meta0.store)
        return self._gatherer

    def confirmed_stragglers(self) -> dict[int, str]:
        """The stragglers the live windows confirm now (rank -> kind); empty where this agent does not judge."""
        detector = getattr(self._gatherer, "_detector", None)
        return dict(getattr(detector, "confirmed", {}))

    def job_slowdown(self) -> tuple[float, str] | None:
        """The slowdown of the whole job said to be going on (its step time over its level, its kind;
        ``analysis.live_slowdowns``); None where none is, or where this agent does not judge."""
        rule = getattr(self._episodes, "slowdowns", None) if self._episodes else None
        going = rule.going if rule is not None else None
        return (going.slowdown, going.kind) if going is not None else None

    def _window_event(self, w: int, received: list[int], missing: list[int]) -> None:
        self._event("window_gathered", w * self.window, float(len(received)), window_gathered_detail(missing))

    def _event(self, kind: str, step: int, value: float | None, detail: str | None) -> None:
        """A row of ``RUN_DIR/live/events`` (EVENT_SCHEMA; rank 0, whose verdicts these are)."""
        if self._events is None:
            self._events = _EventLog(records.RecordWriter(live_events_dir(self.run_dir), "EVENT_SCHEMA"))
        self._events.add([0, step, time.time_ns(), kind, None, value, detail])

    def _remediation_of(self, meta0: Any) -> Any:
        """Live remediation's deciding half (``remediation.live``), when ``--remediate`` asks for it."""
        if not self.remediate or self.remediate == "off":
            return None
        from hyperacc.remediation.config import RemediationConfig
        from hyperacc.remediation.live import LiveRemediation

        config = RemediationConfig.parse(self.remediate)
        if config.mode == "off":
            return None
        if not config.run_dir:
            config = dataclasses.replace(config, run_dir=str(self.run_dir))
        live = LiveRemediation(config, rank=0, applies=False, store_address=meta0.store, current_step=self.step_now,
                               prefix=_remediate_prefix(meta0))  # fmt: skip
        live.connect()  # now, not at the first decision: importing torch there would make the switch late
        return live


def _address_towards(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (the job's store): what the other nodes reach it
    by, which ``host`` itself is not where the store runs elsewhere (a rendezvous endpoint on another
    machine). ``host`` where the route cannot be found."""
    import socket

    try:
        family, kind, proto, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(where)  # a datagram socket sends nothing on connect: it only picks the route
            return str(probe.getsockname()[0])
    except OSError:
        return host


def _remediate_prefix(meta: Any) -> str:
    """Where the ranks of this attempt of the job poll for live switches (``remediation.live``)."""
    return f"hyperacc/remediate/{meta.run_id}/{meta.restart_count}/"


class _EventLog:
    """Event rows written every few seconds as JSON-lines record segments (compacted by the agent)."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer
        self.rows: list[list[Any]] = []
        self.at = time.monotonic()

    def add(self, row: list[Any]) -> None:
        self.rows.append(row)
        if time.monotonic() - self.at >= 5.0:
            self.close()

    def close(self) -> None:
        if self.rows:
            rows, self.rows = self.rows, []
            self.writer.write_json(rows)
        self.at = time.monotonic()


class MetricsEndpoint(_Periodic):
    """``hyperacc run --metrics-port``: the Prometheus metrics of this agent's ranks, served by the agent
    (``present.metrics.RunDirEndpoint`` over the ranks whose metadata names it), so that no training rank
    serves them and every node is scraped for its own ranks, whether the run directory is a local disk or
    shared (docs/presentation.md, "Live metrics"). Where the agent holds every rank of the job (one node),
    its sink judges the stragglers itself, as ``analyze`` does; on several nodes the straggler gauge
    comes from ``stragglers`` (the live windows' verdicts of the agent that holds rank 0, over the whole
    job), and the other agents export none. The metadata is read through ``store.MetaCache``."""

    thread_name = "hyperacc-agent-metrics"

    def __init__(self, run_dir: str | Path, *, agent: str, address: str, poll_s: float = 1.0,
                 stragglers: Callable[[], dict[int, str]] | None = None,
                 job_slowdown: Callable[[], tuple[float, str] | None] | None = None) -> None:  # fmt: skip
        self.run_dir = Path(run_dir)
        self.agent, self.address, self.poll_s = agent, address, poll_s
        self.stragglers = stragglers
        self.job_slowdown = job_slowdown
        self.on = True
        self.endpoint: Any = None
        self._own: frozenset[int] = frozenset()  # the ranks whose metadata names this agent
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def pass_once(self, *, final: bool) -> None:
        if not self.on:
            return
        try:
            self._pass()
        except Exception as exc:  # noqa: BLE001 - the endpoint is a convenience; training goes on
            self.on = False
            log.warning("hyperacc run: metrics endpoint %s switched off (%s)", self.address, one_line(exc))

    def _pass(self) -> None:
        metas = self.metas()
        own = frozenset(rank for rank, m in metas.items() if m.agent == self.agent)
        if not own:
            return  # none of this agent's ranks has written its metadata yet
        self._own = own
        if self.endpoint is None:
            from hyperacc.present.metrics import RunDirEndpoint

            world = max(m.world_size for m in metas.values())
            alone = len(own) >= world or all(metas[r].nodes == 1 for r in own)
            self.endpoint = RunDirEndpoint(self.run_dir, self.address, world_size=world,
                                           ranks=lambda rank: rank in self._own, judges=alone)  # fmt: skip
        if not self.endpoint.sink.judges and 0 in own and self.stragglers is not None:
            self.endpoint.sink.set_stragglers(self.stragglers())
        if 0 in own and self.job_slowdown is not None:  # judged by the agent that holds rank 0 only
            self.endpoint.sink.set_job_slowdown(self.job_slowdown())

    def _finish(self) -> None:
        if self.endpoint is not None:
            endpoint, self.endpoint = self.endpoint, None
            endpoint.close()


class NodeAgent:
    """What ``hyperacc run`` does beside torchrun for its node's ranks: compaction and live aggregation."""

    def __init__(self, *parts: Any) -> None:
        self.parts = [p for p in parts if p is not None]
        from hyperacc import store

        shared: dict[Path, Any] = {}  # one metadata cache per run directory for all parts (one stat a pass)
        for part in self.parts:
            part.meta_cache = shared.setdefault(part.run_dir, part.meta_cache or store.MetaCache(part.run_dir))

    def start(self) -> None:
        for part in self.parts:
            part.start()

    def stop(self) -> None:
        """Live aggregation first (its last windows and events), then the final compaction of it all."""
        for part in sorted(self.parts, key=lambda p: isinstance(p, Compactor)):
            part.stop()

"""The node agent's work on the run directory: what ``hyperacc run`` does for the ranks of its node, so
that a training rank keeps to timing and writing its records.

Today that is compaction. Each rank writes one plain record segment per flush (``hyperacc.records``,
numpy and json: no pyarrow in the rank), and rank 0 its gathered window summaries (``live/windows``).
A thread of ``hyperacc run`` rolls the segments of the ranks on its own host into Parquet, one file per rank and period (``store.compact`` with the
tracer's ``compact_every``, ``compact_period_s`` and ``compact_min_rows``), every few seconds while the
job runs and once more, everything, when torchrun has exited. ``hyperacc run`` tells its ranks with
``HYPERACC_NODE_AGENT`` so that they do not compact themselves; a rank traced without ``hyperacc run``
compacts its own segments from its flusher thread, as before.

Which ranks: those whose metadata (``meta/rank-N.json``) names this agent (``HYPERACC_NODE_AGENT``,
"host:pid" of the ``hyperacc run`` process, which every rank records), so that the agents of a
multi-node job sharing one run directory never compact the same folder (``store.compact`` is run by
one process per folder), even where two nodes report the same host name. Nothing here can touch the job: it runs in the agent's process, and an error
switches compaction off with one log line; the ranks' segments stay readable as they are.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from hyperacc.schema import live_windows_dir, rank_name

log = logging.getLogger("hyperacc.agent")

KINDS = (("steps", "STEP_SCHEMA"), ("events", "EVENT_SCHEMA"), ("resources", "RESOURCE_SCHEMA"))


class Compactor:
    """Rolls the record segments of this host's ranks into Parquet (``run``: a background thread)."""

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

    def start(self) -> None:
        if self.on:
            self._thread = threading.Thread(target=self._loop, name="hyperacc-agent-compact", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """After the job: stop the thread, then roll every segment that is left (``final``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        self.pass_once(final=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.pass_once(final=False)

    def local_ranks(self) -> set[int]:
        """The ranks whose metadata names this agent (read again for ranks not yet seen: restarts)."""
        from hyperacc import store

        try:
            metas = store.read_meta(self.run_dir) if (self.run_dir / "meta").is_dir() else {}
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
        except Exception as exc:  # noqa: BLE001 - the ranks' segments stay readable as they are
            self.on = False
            log.warning("hyperacc run: compaction of %s switched off (%r); the records stay as written",
                        self.run_dir, exc)  # fmt: skip
        self.compacted += written
        return written

"""The live view of a job of many ranks, from the windows its leader gathered: what ``hyperacc watch``
shows by default on a job of more than ``commands.watch.RECORDS_MAX_RANKS`` ranks.

A view of every rank's records (``live_view.RunFollower``) reads every rank's new segments at every
refresh, so its cost grows with the job: 1.2 s of CPU a refresh at 256 ranks here, and many times a
core at thousands. The node agent that holds rank 0 (the leader) already gathers one summary row per
rank and window from every node (docs/tracing.md, "Live aggregation") and keeps them under
``RUN_DIR/live/windows``, with who reported each window under ``RUN_DIR/live/events``; ``WindowFollower``
reads those two folders, and one rank's step records for the pace (the lowest rank there, as the
records view takes it), so a refresh reads the new windows' rows (one row per rank a window) and one
rank's new steps whatever the size of the job. What it shows is the latest gathered window: each
rank's median self-time, wait and CPU time and its spikes, the median step across ranks, the waiting
share, the spread of the ranks' median waits and the rank that waited least (the one the others
waited for), the steps per second over the window, and the live findings. Figures that need every step of every rank
(the step's p99 and CV, the share of steps that spiked on any rank, the coordination view) are not
there: ``--source records`` shows them at any size. docs/presentation.md, "Watching a job".
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from hyperacc import store
from hyperacc.analysis.windows import RANK_CAUSES
from hyperacc.present.live_view import RankView, RunFollower, Snapshot
from hyperacc.schema import STEP_SCHEMA, live_windows_dir, steps_dir
from hyperacc.stats import nan_median

KEEP_WINDOWS = 4  # gathered windows kept (the latest one is shown)
PACE_STEPS = 1000  # the pace rank's newest (step, start time) kept: a window of steps, and more

_WANTED = (
    "rank", "node", "window", "first_step", "last_step", "step_ns_median", "self_ns_median",
    "comm_wait_ns_median", "dev_comm_wait_ns_median", "cpu_ns_median", "judged_steps",
    *(f"spikes_{c}" for c in RANK_CAUSES),
)  # fmt: skip


def gathered(run_dir: str | Path) -> bool:
    """Whether the run directory holds windows a leader gathered."""
    return bool(store.live_segments(live_windows_dir(run_dir)))


class WindowFollower(RunFollower):
    """Follows the gathered windows (``RUN_DIR/live/windows``) and the leader's live events of one or
    more run directories of one job; the same ``poll`` / ``snapshot`` as ``RunFollower``."""

    source = "windows"

    def __init__(self, run_dirs: Sequence[str | Path]) -> None:
        super().__init__(run_dirs, keep=0)
        self._windows: dict[int, dict[str, np.ndarray]] = {}  # window -> its rows' columns
        self._pace_dir: Path | None = None  # the step records of the rank whose pace is shown
        self._pace = (np.zeros(0), np.zeros(0))  # its newest (steps, start times in ns)

    def poll(self) -> bool:
        new = False
        for run_dir in self.run_dirs:
            self._read_meta(run_dir)
            new |= self._read_windows(run_dir)
            new |= self._read_leader_events(run_dir)
        self._read_pace()
        if new:
            self._last_new = time.monotonic()
        return new

    def _read_windows(self, run_dir: Path) -> bool:
        folder = live_windows_dir(run_dir)
        cursor = self._cursors.get(folder)
        if cursor is None:
            if not folder.is_dir():
                return False
            cursor = self._cursors[folder] = store.SegmentCursor(folder)
            cursor.start_at_tail(max(self.world_size, 1) * KEEP_WINDOWS)
        new = False
        for table in cursor.read_new(None, None):
            cols = {c: table.column(c).cast(pa.float64(), safe=False).to_numpy(zero_copy_only=False)
                    for c in _WANTED if c in table.column_names}  # fmt: skip
            if "window" not in cols or "rank" not in cols:
                continue
            for w in np.unique(cols["window"]).tolist():
                sel = cols["window"] == w
                part = {c: v[sel] for c, v in cols.items()}
                have = self._windows.get(int(w))
                self._windows[int(w)] = part if have is None else {
                    c: np.concatenate([have[c], part[c]]) for c in part if c in have}  # fmt: skip
            new = True
        for w in sorted(self._windows)[:-KEEP_WINDOWS]:
            del self._windows[w]
        return new

    def _read_leader_events(self, run_dir: Path) -> bool:
        """The leader's findings and who reported each window (``window_gathered``), and what
        ``--remediate`` did."""
        new = False
        for _rank, table in self._new_live_events(run_dir, ("kind", "detail", "value")):
            for row in table.to_pylist():
                new |= self._gathered(row) if row.get("kind") == "window_gathered" else self._finding(row)
        return self._read_remediation(run_dir) or new

    def _read_pace(self) -> None:
        """The new steps of the lowest rank that has step records (read from its newest records on)."""
        if self._pace_dir is None:
            found = (steps_dir(d, r) for r in sorted(self._node) for d in self.run_dirs)
            self._pace_dir = next((d for d in found if d.is_dir()), None)
            if self._pace_dir is None:
                return
            self._cursors[self._pace_dir] = store.SegmentCursor(self._pace_dir)
            self._cursors[self._pace_dir].start_at_tail(PACE_STEPS)
        for t in self._cursors[self._pace_dir].read_new(("step", "t_start_ns"), STEP_SCHEMA):
            steps, starts = (t.column(c).cast(pa.float64(), safe=False).to_numpy(zero_copy_only=False)
                             for c in ("step", "t_start_ns"))  # fmt: skip
            self._pace = (np.concatenate([self._pace[0], steps])[-PACE_STEPS:],
                          np.concatenate([self._pace[1], starts])[-PACE_STEPS:])  # fmt: skip

    def _gathered(self, row: dict) -> bool:
        try:  # the ranks that reported (the value), and the missing ones
            total = int(row.get("value") or 0) + len(json.loads(row.get("detail") or "{}").get("missing", []))
        except (ValueError, TypeError, AttributeError):
            return True
        self.world_size = max(self.world_size, total)
        return True

    def snapshot(self, window: int = 50) -> Snapshot | None:
        """The latest gathered window (``window`` is the leader's, not this argument); None before the
        first."""
        if not self._windows:
            return None
        cols = self._windows[max(self._windows)]
        n = cols["rank"].size
        nan = np.full(n, np.nan)
        step_ns, self_ns, cpu_ns = (cols.get(c, nan) for c in ("step_ns_median", "self_ns_median", "cpu_ns_median"))
        dev = cols.get("dev_comm_wait_ns_median", nan)
        wait = dev if not np.isnan(dev).all() else cols.get("comm_wait_ns_median", nan)
        spikes = np.nansum([cols.get(f"spikes_{c}", np.zeros(n)) for c in RANK_CAUSES], axis=0)
        judged = np.nansum(cols.get("judged_steps", nan))
        last = cols.get("last_step", nan)
        first = cols.get("first_step", nan)
        ok = ~np.isnan(wait)
        both = ok & ~np.isnan(step_ns)
        views = [
            RankView(rank=int(cols["rank"][i]), node=int(np.nan_to_num(cols.get("node", nan)[i])),
                     step=int(np.nan_to_num(last[i], nan=-1)), self_ms=float(self_ns[i]) / 1e6,
                     wait_ms=float(wait[i]) / 1e6, cpu_ms=float(cpu_ns[i]) / 1e6, rss_mb=None,
                     spikes=int(spikes[i]), culprit_share=math.nan)  # fmt: skip
            for i in np.argsort(cols["rank"], kind="stable")
        ]
        return Snapshot(
            run=", ".join(str(d) for d in self.run_dirs),
            ranks=n,
            world_size=max(self.world_size, n),
            step=int(np.nanmax(last)) if not np.isnan(last).all() else -1,
            window=int(np.nanmax(last) - np.nanmin(first) + 1) if not np.isnan(last).all() else 0,
            steps_per_s=self._steps_per_s(np.nanmin(first), np.nanmax(last)) if not np.isnan(last).all() else math.nan,
            p50_ms=float(nan_median(step_ns)) / 1e6,
            p99_ms=math.nan,
            cv=math.nan,
            spike_rate=math.nan,
            wait_share=float(wait[both].sum() / step_ns[both].sum()) if both.any() and step_ns[both].sum() > 0 else math.nan,
            spread_ms=float(wait[ok].max() - wait[ok].min()) / 1e6 if ok.any() else math.nan,
            culprit=int(cols["rank"][ok][np.argmin(wait[ok])]) if ok.any() else None,
            findings=list(self._findings.values())[-6:],
            per_rank=views,
            idle_s=time.monotonic() - self._last_new,
            source=self.source,
            rank_spike_rate=float(spikes.sum() / judged) if judged > 0 else math.nan,
        )

    def _steps_per_s(self, first: float, last: float) -> float:
        """Steps per second of the pace rank over the window's steps (its wall-clock step starts), as the
        records view measures it over its window."""
        steps, starts = self._pace
        ts = starts[(steps >= first) & (steps <= last) & ~np.isnan(starts)]
        return (ts.size - 1) / ((ts[-1] - ts[0]) / 1e9) if ts.size >= 2 and ts[-1] > ts[0] else math.nan


def follower(run_dirs: Sequence[str | Path], *, keep: int, source: str, records_max_ranks: int) -> RunFollower:
    """The follower ``hyperacc watch`` uses: every rank's records (``records``), the leader's gathered
    windows (``windows``), or (``auto``) the windows where the job has more than ``records_max_ranks``
    ranks and a leader gathers them (its ranks run under ``hyperacc run``, or windows are there)."""
    if source == "records":
        return RunFollower(run_dirs, keep=keep)
    if source == "windows":
        return WindowFollower(run_dirs)
    metas = {}
    for d in run_dirs:
        metas.update(store.MetaCache(d).read())
    world = max((m.world_size for m in metas.values()), default=0)
    led = any(gathered(d) for d in run_dirs) or any(m.agent for m in metas.values())
    return WindowFollower(run_dirs) if world > records_max_ranks and led else RunFollower(run_dirs, keep=keep)

"""The live view of a run: what `hyperacc run` shows while the job trains and `hyperacc watch` shows from
another terminal (or another node on a shared file system), read from what the run writes.

``RunFollower`` reads each rank's new step segments as they appear (never a segment twice) and keeps the
last ``keep`` steps of every rank, plus the live findings rank 0 logged and the latest resource sample;
``Snapshot`` is what one refresh shows, computed with the analysis' own rules over the last ``window``
steps every reporting rank has: step-time p50/p99 and CV of the cluster (the slowest rank's step, as
the cluster waits for it), steps/s, the share of steps that spiked on any rank (``judge_spikes``, the
rule of ``hyperacc analyze``), the share of time spent waiting at collectives and the arrival spread
(largest minus least wait), the culprit of the latest step (the rank that waited least) and how often
each rank was it, and every rank's self-time, wait, CPU time and memory. ``render`` draws it with rich;
``line`` is the one-line form for a log or a pipe. docs/presentation.md, "Live view".
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from hyperacc import store
from hyperacc.analysis.options import DetectionOptions
from hyperacc.schema import EVENT_SCHEMA, RESOURCE_SCHEMA, STEP_SCHEMA, live_events_dir
from hyperacc.stats import nan_median

RSS_KEPT = 3600  # resource samples kept per rank for memory creep (the newest)

_COLUMNS = (
    "step", "t_start_ns", "step_ns", "self_ns", "comm_wait_ns", "dev_comm_wait_ns", "cpu_ns", "data_ns",
    "h2d_ns", "forward_ns", "backward_ns", "optimizer_ns", "other_ns", "gc_ns", "major_faults",
    "invol_ctx_switches", "alloc_retries", "sync_all_streams", "launch_ns", "run_delay_ns",
)  # fmt: skip


@dataclasses.dataclass
class RankView:
    rank: int
    node: int
    step: int
    self_ms: float
    wait_ms: float
    cpu_ms: float
    rss_mb: float | None
    spikes: int
    culprit_share: float


@dataclasses.dataclass
class Snapshot:
    run: str
    ranks: int
    world_size: int
    step: int  # the latest step every reporting rank has
    window: int  # steps the figures cover
    steps_per_s: float
    p50_ms: float
    p99_ms: float
    cv: float
    spike_rate: float
    wait_share: float
    spread_ms: float
    culprit: int | None
    findings: list[str]
    per_rank: list[RankView]
    idle_s: float  # seconds since new records last arrived
    # the second document's view over the same window (``RunFollower._coordination``): p90, jitter, the
    # split of the wait, the spread trend, the failure modes, resource findings
    coordination: dict[str, Any] = dataclasses.field(default_factory=dict)
    # "records": every rank's step records; "windows": the leader's gathered windows (``job_view``), where
    # the figures that need every step (p99, CV, spike_rate, coordination) are NaN and the spikes are
    # counted per rank-step instead (``rank_spike_rate``)
    source: str = "records"
    rank_spike_rate: float = math.nan

    def to_dict(self) -> dict[str, Any]:
        def plain(v: Any) -> Any:
            return None if isinstance(v, float) and not math.isfinite(v) else v

        d = dataclasses.asdict(self)
        return {k: ([{kk: plain(vv) for kk, vv in r.items()} for r in v] if k == "per_rank" else
                    _plain(v) if k == "coordination" else plain(v)) for k, v in d.items()}  # fmt: skip


class RunFollower:
    """Follows one or more run directories of one job (several agents with local disks).

    ``agent``: follow only the ranks whose metadata names that node agent ("host:pid"), as ``hyperacc
    run``'s own view does, so that each node's view reads its own ranks' records whether the run
    directory is a local disk or shared by every node (where every agent following every rank would
    read nodes x ranks folders a refresh). The live findings are read either way."""

    def __init__(self, run_dirs: Sequence[str | Path], keep: int = 400, agent: str | None = None) -> None:
        self.run_dirs = [Path(d) for d in run_dirs]
        self.keep = keep
        self.agent = agent
        self._agents: dict[int, str] = {}  # rank -> the agent its metadata names
        self._meta_cache: dict[Path, store.MetaCache] = {}
        self._cursors: dict[Path, store.SegmentCursor] = {}  # per rank directory of steps, events, resources
        self._rows: dict[int, dict[str, np.ndarray]] = {}
        self._node: dict[int, int] = {}
        self._rss: dict[int, float] = {}
        self._findings: dict[str, str] = {}
        self._rss_hist: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # rank -> (t_ns, rss bytes), bounded
        self._last_new = time.monotonic()
        self.world_size = 0

    source = "records"

    def poll(self) -> bool:
        """Read what appeared since the last call; True when there was anything new."""
        new = False
        for run_dir in self.run_dirs:
            self._read_meta(run_dir)
            for rank, table in self._new_tables(run_dir, "steps", _COLUMNS, STEP_SCHEMA):
                self._add(rank, table)
                new = True
            new |= self._read_events(run_dir)
            self._read_resources(run_dir)
        if new:
            self._last_new = time.monotonic()
        return new

    def _read_meta(self, run_dir: Path) -> None:
        """The ranks' metadata (node, agent, world size), read again only when it changed
        (``store.MetaCache``): a refresh of a thousand ranks' view would otherwise read a thousand files."""
        cache = self._meta_cache.get(run_dir)
        if cache is None:
            cache = self._meta_cache[run_dir] = store.MetaCache(run_dir)
        for rank, m in cache.read().items():  # checked as analyze checks it
            self._node[rank] = m.node
            self._agents[rank] = m.agent
            self.world_size = max(self.world_size, m.world_size)

    def _mine(self, rank: int) -> bool:
        return self.agent is None or self._agents.get(rank) == self.agent

    def _new_tables(
        self, run_dir: Path, kind: str, columns: Sequence[str], schema: pa.Schema
    ) -> list[tuple[int, pa.Table]]:
        """The rows of every rank folder of ``kind`` not read yet, each once (across compactions), checked
        and conformed to ``schema`` as analyze reads them (a segment that does not fit: skipped)."""
        out = []
        for rank, rank_dir in store.rank_dirs(run_dir, kind, keep=self._mine):
            cursor = self._cursors.get(rank_dir)
            if cursor is None:
                cursor = self._cursors[rank_dir] = store.SegmentCursor(rank_dir)
                # only the rows kept are read at first, not a long job's whole history (events: all)
                tail = {"steps": self.keep, "resources": RSS_KEPT}.get(kind)
                if tail is not None:
                    cursor.start_at_tail(tail)
            out += [(rank, t) for t in cursor.read_new(columns, schema)]
        return out

    def _new_live_events(self, run_dir: Path, columns: Sequence[str] = ("kind", "detail", "rank")) -> list[tuple[int, pa.Table]]:
        """The node agent's live verdicts (``RUN_DIR/live/events``) not read yet."""
        folder = live_events_dir(run_dir)
        if not folder.is_dir():
            return []
        cursor = self._cursors.get(folder)
        if cursor is None:
            cursor = self._cursors[folder] = store.SegmentCursor(folder)
        return [(0, t) for t in cursor.read_new(columns, EVENT_SCHEMA)]

    def _add(self, rank: int, table: pa.Table) -> None:
        cols = {}
        for name in _COLUMNS:
            if name in table.column_names:
                cols[name] = table.column(name).cast(pa.float64(), safe=False).to_numpy(zero_copy_only=False)
            else:
                cols[name] = np.full(table.num_rows, np.nan)
        have = self._rows.get(rank)
        if have is not None:
            cols = {k: np.concatenate([have[k], v]) for k, v in cols.items()}
        order = np.argsort(cols["step"], kind="stable")[-self.keep :]
        self._rows[rank] = {k: v[order] for k, v in cols.items()}

    def _read_events(self, run_dir: Path) -> bool:
        new = False
        tables = self._new_tables(run_dir, "events", ("kind", "detail", "rank"), EVENT_SCHEMA)
        tables += self._new_live_events(run_dir)
        for _rank, table in tables:
            for row in table.to_pylist():
                new |= self._finding(row)
        new = self._read_remediation(run_dir) or new
        return new

    def _finding(self, row: dict[str, Any]) -> bool:
        """Keep an event row that is a live finding or a live switch a rank started; True if it was."""
        if row.get("kind") == "live_finding" and row.get("detail"):
            text = str(row["detail"])
            self._findings[_finding_key(text)] = text
            return True
        if row.get("kind") == "remediation" and row.get("detail"):  # a rank started a live switch
            self._findings[f"switch:{row['detail']}"] = f"remediation: {row['detail']}"
            return True
        return False

    def _read_remediation(self, run_dir: Path) -> bool:
        """What ``--remediate`` decided and did (docs/remediation.md), as findings of the live line."""
        from hyperacc.present.diagnosis import remediation_line
        from hyperacc.remediation.events import read_events

        new = False
        for event in read_events(run_dir)[-20:]:
            key = f"act:{event.get('kind')}:{event.get('rule', '')}:{event.get('target', '')}:{event.get('step')}:{event.get('at', '')}"
            if key not in self._findings:
                self._findings[key] = f"remediation: {remediation_line(event)}"
                new = True
        return new

    def _read_resources(self, run_dir: Path) -> None:
        for rank, table in self._new_tables(run_dir, "resources", ("rank", "rss_bytes", "t_ns"), RESOURCE_SCHEMA):
            if table.num_rows:
                rows = table.to_pylist()
                self._rss[rank] = (rows[-1]["rss_bytes"] or 0) / 2**20
                self._keep_rss(table)

    def snapshot(self, window: int = 50) -> Snapshot | None:
        """The figures over the last ``window`` steps that every reporting rank has (None: no records)."""
        from hyperacc.analysis.spikes import judge_spikes

        if not self._rows:
            return None
        last = min(int(r["step"][-1]) for r in self._rows.values())
        first = last - window + 1
        ranks = sorted(self._rows)
        opts = DetectionOptions(spike_window=max(3, min(101, self.keep // 2 * 2 - 1)))
        steps = np.arange(first, last + 1)
        step_max = np.full(steps.size, np.nan)
        wait_min = np.full(steps.size, np.inf)
        wait_max = np.full(steps.size, -np.inf)
        wait_rank = np.full(steps.size, -1)
        spiked = np.zeros(steps.size, bool)
        total = wait_total = 0.0
        views = []
        for rank in ranks:
            cols = self._rows[rank]
            pos = np.searchsorted(steps, cols["step"])
            inside = (cols["step"] >= first) & (cols["step"] <= last)
            p = pos[inside]
            st = cols["step_ns"][inside]
            step_max[p] = np.fmax(step_max[p], st)
            wait = cols["dev_comm_wait_ns"] if not np.isnan(cols["dev_comm_wait_ns"]).all() else cols["comm_wait_ns"]
            w = wait[inside]
            ok = ~np.isnan(w)
            better = ok & (w < wait_min[p])
            wait_min[p[better]] = w[better]
            wait_rank[p[better]] = rank
            wait_max[p[ok]] = np.fmax(wait_max[p[ok]], w[ok])
            total += float(np.nansum(st))
            wait_total += float(np.nansum(w))
            sp = judge_spikes({k: v for k, v in cols.items()}, opts).series.spike
            spiked[p] |= sp[inside]
            views.append(
                RankView(
                    rank=rank,
                    node=self._node.get(rank, 0),
                    step=int(cols["step"][-1]),
                    self_ms=float(nan_median(cols["self_ns"][inside])) / 1e6,
                    wait_ms=float(nan_median(w)) / 1e6,
                    cpu_ms=float(nan_median(cols["cpu_ns"][inside])) / 1e6,
                    rss_mb=self._rss.get(rank),
                    spikes=int(sp[inside].sum()),
                    culprit_share=0.0,
                )
            )
        measured = ~np.isnan(step_max)
        culprits = wait_rank[(wait_rank >= 0)]
        for v in views:
            v.culprit_share = float((culprits == v.rank).mean()) if culprits.size else 0.0
        x = step_max[measured]
        t = self._rows[ranks[0]]["t_start_ns"]
        ts = t[(self._rows[ranks[0]]["step"] >= first) & ~np.isnan(t)]
        rate = (ts.size - 1) / ((ts[-1] - ts[0]) / 1e9) if ts.size >= 2 and ts[-1] > ts[0] else math.nan
        spread = np.where(np.isfinite(wait_min) & np.isfinite(wait_max), wait_max - wait_min, np.nan)
        return Snapshot(
            run=", ".join(str(d) for d in self.run_dirs),
            ranks=len(ranks),
            world_size=max(self.world_size, len(ranks)),
            step=last,
            window=int(measured.sum()),
            steps_per_s=rate,
            p50_ms=float(np.percentile(x, 50)) / 1e6 if x.size else math.nan,
            p99_ms=float(np.percentile(x, 99)) / 1e6 if x.size else math.nan,
            cv=float(x.std() / x.mean()) if x.size > 1 and x.mean() > 0 else math.nan,
            spike_rate=float(spiked[measured].mean()) if measured.any() else math.nan,
            wait_share=wait_total / total if total > 0 else math.nan,
            spread_ms=float(nan_median(spread)) / 1e6,
            culprit=int(wait_rank[-1]) if wait_rank.size and wait_rank[-1] >= 0 else None,
            findings=list(self._findings.values())[-6:],
            per_rank=views,
            idle_s=time.monotonic() - self._last_new,
            coordination=self._coordination(first, last, x),
        )

    # ---- the second document's view (docs/presentation.md, "Live view"; rules in docs/detection.md)

    def _keep_rss(self, table: pa.Table, keep: int = RSS_KEPT) -> None:
        if "t_ns" not in table.column_names or "rss_bytes" not in table.column_names:
            return
        rank = table.column("rank").to_numpy(zero_copy_only=False)
        t = table.column("t_ns").cast(pa.float64(), safe=False).to_numpy(zero_copy_only=False)
        rss = table.column("rss_bytes").cast(pa.float64()).to_numpy(zero_copy_only=False)
        for r in np.unique(rank).tolist():
            sel = rank == r
            old_t, old_v = self._rss_hist.get(int(r), (np.zeros(0), np.zeros(0)))
            self._rss_hist[int(r)] = (np.concatenate([old_t, t[sel]])[-keep:], np.concatenate([old_v, rss[sel]])[-keep:])

    def _coordination(self, first: int, last: int, step_max: np.ndarray) -> dict[str, Any]:
        """p90 and jitter of the cluster's step, the wait split into the collective's own cost and waiting
        for late arrivals, the spread trend and the failure modes over the window (``analysis.coordination``),
        and memory creep over the samples seen (``analysis.resources``)."""
        from hyperacc.analysis.coordination import coordination, distribution, failure_modes
        from hyperacc.analysis.resources import ResourceOptions, memory_creep

        steps = np.arange(first, last + 1)
        step_sum, wait_sum = np.zeros(steps.size), np.zeros(steps.size)
        wait_min, wait_max = np.full(steps.size, np.inf), np.full(steps.size, -np.inf)
        n = np.zeros(steps.size)
        delay_sum, delay_n = np.zeros(steps.size), np.zeros(steps.size)
        for cols in self._rows.values():
            inside = (cols["step"] >= first) & (cols["step"] <= last)
            wait = cols["dev_comm_wait_ns"] if not np.isnan(cols["dev_comm_wait_ns"]).all() else cols["comm_wait_ns"]
            ok = inside & ~np.isnan(wait) & ~np.isnan(cols["step_ns"])
            p = np.searchsorted(steps, cols["step"][ok])
            np.add.at(step_sum, p, cols["step_ns"][ok])
            np.add.at(wait_sum, p, wait[ok])
            np.minimum.at(wait_min, p, wait[ok])
            np.maximum.at(wait_max, p, wait[ok])
            np.add.at(n, p, 1)
            delay = cols["run_delay_ns"][ok]
            measured = ~np.isnan(delay)
            np.add.at(delay_sum, p[measured], delay[measured])
            np.add.at(delay_n, p[measured], 1)
        seen = n >= 2
        delay = np.where(delay_n > 0, delay_sum / np.maximum(delay_n, 1), np.nan)
        coord = (coordination(step_sum[seen], wait_sum[seen], wait_min[seen], wait_max[seen], n[seen], delay[seen])
                 if seen.any() else None)  # fmt: skip
        dist = distribution(step_max)
        modes = [m for m in failure_modes(coord) if m.mode in ("sync_amplification", "fabric_contention")]
        creep = []
        for rank, (t, rss) in sorted(self._rss_hist.items()):
            c = memory_creep(t, rss, rank, "rss_bytes", ResourceOptions())
            if c is not None and c.creep:
                creep.append(f"memory creep on {c.text()}")
        return {
            "p90_ms": dist.p90_ns / 1e6 if dist else math.nan,
            "jitter": dist.jitter if dist else math.nan,
            "collective_share": coord.collective_share if coord else math.nan,
            "late_share": coord.late_share if coord else math.nan,
            "spread_trend": coord.spread_trend if coord else math.nan,
            "modes": {m.mode: m.verdict for m in modes},
            "resources": creep,
        }


def _plain(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _coordination_line(s: Snapshot) -> str:
    """The one-line form's part of the second document's view."""
    c = s.coordination
    if not c:
        return ""
    pct = lambda x: _fmt(x * 100 if math.isfinite(x) else None, ".0f", "%")  # noqa: E731
    likely = [k for k, v in c.get("modes", {}).items() if v == "likely"]
    return (f", p90 {_fmt(c['p90_ms'])} ms jitter {pct(c['jitter'])}, late {pct(c['late_share'])} "
            f"collective {pct(c['collective_share'])}, spread trend {_fmt(c['spread_trend'], '.2f')}x"
            + (f", likely: {' '.join(likely)}" if likely else "")
            + "".join(f"; {r}" for r in c.get("resources", [])[:2]))  # fmt: skip


def _coordination_rows(s: Snapshot) -> list[str]:
    """The rich panel's rows of the second document's view."""
    c = s.coordination
    if not c:
        return []
    pct = lambda x: _fmt(x * 100 if math.isfinite(x) else None, ".1f", " %")  # noqa: E731
    modes = ", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in c.get("modes", {}).items())
    rows = [f"p90 {_fmt(c['p90_ms'])} ms   jitter {pct(c['jitter'])}   waiting for late arrivals "
            f"{pct(c['late_share'])}   collective's own cost {pct(c['collective_share'])}   spread trend "
            f"{_fmt(c['spread_trend'], '.2f')}x", modes]  # fmt: skip
    rows += [f"[bold yellow]![/] {r}" for r in c.get("resources", [])[:4]]
    return rows


def _finding_key(text: str) -> str:
    words = text.split()
    return " ".join(words[:2]) if len(words) >= 2 else text


def _fmt(x: float | None, spec: str = ".3g", unit: str = "") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:{spec}}{unit}"


def _pct(x: float, spec: str) -> str:
    return _fmt(x * 100 if math.isfinite(x) else None, spec, "%")


def line(s: Snapshot) -> str:
    """One line per refresh, for a log or a pipe."""
    culprit = "-" if s.culprit is None else str(s.culprit)
    if s.source == "windows":
        return (
            f"hyperacc live (gathered windows): step {s.step}, {s.ranks}/{s.world_size} ranks, "
            f"{_fmt(s.steps_per_s)} steps/s, step median {_fmt(s.p50_ms)} ms over the last {s.window} steps, "
            f"rank-steps spiked {_pct(s.rank_spike_rate, '.2f')}, wait {_pct(s.wait_share, '.0f')}, "
            f"spread {_fmt(s.spread_ms)} ms, waited for most: rank {culprit}"
            + (f"; {s.findings[-1]}" if s.findings else "")
        )
    return (
        f"hyperacc live: step {s.step}, {s.ranks}/{s.world_size} ranks, {_fmt(s.steps_per_s)} steps/s, "
        f"step p50 {_fmt(s.p50_ms)} ms p99 {_fmt(s.p99_ms)} ms CV {_fmt(s.cv, '.2f')}, spikes "
        f"{_fmt(s.spike_rate * 100 if math.isfinite(s.spike_rate) else None, '.1f', '%')}, wait "
        f"{_fmt(s.wait_share * 100 if math.isfinite(s.wait_share) else None, '.0f', '%')}, spread "
        f"{_fmt(s.spread_ms)} ms, last in at step {s.step}: rank {culprit}"
        + _coordination_line(s)
        + (f"; {s.findings[-1]}" if s.findings else "")
    )


def render(s: Snapshot) -> Any:
    """A rich renderable of the snapshot."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table

    head = Table.grid(padding=(0, 3))
    for _ in range(4):
        head.add_column()
    pct = lambda x: _fmt(x * 100 if math.isfinite(x) else None, ".1f", " %")  # noqa: E731
    head.add_row(f"step [bold]{s.step}[/]", f"{_fmt(s.steps_per_s)} steps/s",
                 f"ranks {s.ranks}/{s.world_size}", f"last {s.window} steps")  # fmt: skip
    culprit = "-" if s.culprit is None else s.culprit
    if s.source == "windows":  # the leader's gathered windows: medians per rank, no per-step figures
        head.add_row(f"step median {_fmt(s.p50_ms)} ms", f"rank-steps spiked {pct(s.rank_spike_rate)}",
                     f"waiting {pct(s.wait_share)}", f"spread of waits {_fmt(s.spread_ms)} ms")  # fmt: skip
        head.add_row(f"waited for most: rank {culprit}", "", "",
                     "" if s.idle_s < 10 else f"[yellow]no new window for {s.idle_s:.0f} s[/]")  # fmt: skip
    else:
        head.add_row(f"step p50 {_fmt(s.p50_ms)} ms", f"p99 {_fmt(s.p99_ms)} ms", f"CV {_fmt(s.cv, '.2f')}",
                     f"spiked {pct(s.spike_rate)}")  # fmt: skip
        head.add_row(f"waiting {pct(s.wait_share)}", f"arrival spread {_fmt(s.spread_ms)} ms",
                     f"culprit now: rank {culprit}",
                     "" if s.idle_s < 10 else f"[yellow]no new records for {s.idle_s:.0f} s[/]")  # fmt: skip
    ranks = Table(box=None, pad_edge=False, header_style="bold")
    for name in ("rank", "node", "step", "self ms", "wait ms", "CPU ms", "RSS MB", "spikes", "culprit"):
        ranks.add_column(name, justify="right")
    top = sorted(s.per_rank, key=lambda v: -(v.self_ms if math.isfinite(v.self_ms) else -1))[:16]
    for v in sorted(top, key=lambda v: v.rank):
        ranks.add_row(str(v.rank), str(v.node), str(v.step), _fmt(v.self_ms), _fmt(v.wait_ms), _fmt(v.cpu_ms),
                      _fmt(v.rss_mb, ".0f"), str(v.spikes), _pct(v.culprit_share, ".0f"))  # fmt: skip
    parts: list[Any] = [head, *_coordination_rows(s), ranks]
    if s.findings:
        parts.append("\n".join(f"[bold red]![/] {f}" for f in s.findings))
    where = f"{s.run} (gathered windows)" if s.source == "windows" else s.run
    return Panel(Group(*parts), title=f"hyperacc live: {where}", expand=False)

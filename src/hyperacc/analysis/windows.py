"""Per-window, per-rank summaries (WINDOW_SCHEMA plus extra columns) from one rank's step columns.

This is the one summary every straggler verdict reads: ``hyperacc analyze`` summarises each rank with
``summarize_windows``, and the tracer's live aggregation summarises the rank's own steps with the same
function (through ``WindowStream``), so the live and the offline verdicts judge the same numbers
(docs/detection.md, "Windows").

A summary is made of a rank's *typical* steps: warm-up and spike steps are left out of the medians
(a spike is a transient, counted in the spike rates); the spikes of each window are counted by cause.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hyperacc.analysis.options import CAUSES, DetectionOptions
from hyperacc.analysis.robust import group_starts, run_slice
from hyperacc.analysis.spikes import RankSpikes, busy_ns, judge_spikes
from hyperacc.schema import ANALYSIS_COLUMNS, STEP_COLUMNS, fields
from hyperacc.stats import last_axis_nan_median

# Causes a rank's own spikes can have (``communication`` belongs to the cluster, not to a rank).
RANK_CAUSES: tuple[str, ...] = tuple(c for c in CAUSES if c != "communication")

# Medians this summary adds to WINDOW_SCHEMA: the phases, the typical step's GC time (a rare long
# pause is a spike, not a straggler), the rank's own time, CPU time (compute versus preemption),
# the device-clock columns, and the signals of the "host" kind.
_EXTRA_MEDIANS: dict[str, str] = {
    "forward_ns_median": "forward_ns",
    "backward_ns_median": "backward_ns",
    "gc_ns_median": "gc_ns",
    "invol_ctx_switches_median": "invol_ctx_switches",
    "vol_ctx_switches_median": "vol_ctx_switches",
    "major_faults_median": "major_faults",
    "minor_faults_median": "minor_faults",
    "busy_ns_median": "busy_ns",
    "cpu_ns_median": "cpu_ns",
    "dev_self_ns_median": "dev_self_ns",
    "dev_comm_wait_ns_median": "dev_comm_wait_ns",
    "dev_forward_ns_median": "dev_forward_ns",
    "dev_backward_ns_median": "dev_backward_ns",
    "dev_step_ns_median": "dev_step_ns",
    # the time outside every timed phase: a rank's own code between them (a trainer's callbacks)
    "other_ns_median": "other_ns",
    # the time the training thread waited for a CPU within its own time (``self_run_delay_ns``): a rank
    # said preempted must show it
    "self_run_delay_ns_median": "self_run_delay_ns",
}
# Counts this summary adds: the window's judged steps (spikes included), its spikes and the time they
# lost per cause. Offline only, the per-step culprit record (``culprit_steps``: steps in which the rank
# waited least in the collective; ``culprit_known``: steps of the window whose culprit is known).
_EXTRA_COUNTS: tuple[str, ...] = (
    "judged_steps",
    *(f"spikes_{c}" for c in RANK_CAUSES),
    *(f"lost_ns_{c}" for c in RANK_CAUSES),
)
# ``data_gap_share``: the share of the window's typical steps whose data wait is the input gap of a loop
# without a DataLoader (docs/detection.md, "The work between steps"); NaN where not recorded.
# ``sys_cpu_ns_mean``: the mean of the typical steps' CPU time in the kernel. A mean, not a median: the
# kernel splits a thread's CPU time into user and system time by clock-tick samples, so one step's system
# time is 0 or a whole tick's share, and only its mean over many steps is the time (docs/detection.md,
# "Kind").
EXTRA_WINDOW_COLUMNS: tuple[str, ...] = (
    *_EXTRA_MEDIANS, *_EXTRA_COUNTS, "culprit_steps", "culprit_known", "data_gap_share", "sys_cpu_ns_mean",
)  # fmt: skip

_MEDIANS: dict[str, str] = {
    "self_ns_median": "self_ns",
    "data_ns_median": "data_ns",
    "comm_wait_ns_median": "comm_wait_ns",
    "launch_ns_median": "launch_ns",
    "step_ns_median": "step_ns",
    **_EXTRA_MEDIANS,
}
SUMMARY_COLUMNS: tuple[str, ...] = (*(f[0] for f in fields("WINDOW_SCHEMA")), *EXTRA_WINDOW_COLUMNS)


_ROW_INDEX = {name: STEP_COLUMNS.index(name) for name in ANALYSIS_COLUMNS}


def within_budget(opts: DetectionOptions, ranks: int, steps: Sequence[np.ndarray]) -> DetectionOptions:
    """``opts`` with ``window_steps`` doubled, as many times as needed, until ``ranks`` x the windows
    that hold steps fit ``window_max_cells``: what the offline straggler rules hold grows with ranks x
    windows, and a run of a week has 10^5 windows a rank (docs/detection.md, "Windows"). ``steps``: the
    sorted steps of a few ranks (the most windows among them counts for every rank)."""

    def windows(width: int) -> int:
        return max((int(np.count_nonzero(np.diff(s // width))) + 1 for s in steps if s.size), default=0)

    width = opts.window_steps
    while ranks * (n := windows(width)) > opts.window_max_cells and n > 1:
        width *= 2
    return opts if width == opts.window_steps else dataclasses.replace(opts, window_steps=width)


def row_columns(rows: np.ndarray) -> dict[str, np.ndarray]:
    """Step records as the tracer writes them (int64 rows, -1: not measured) -> the columns
    ``WindowStream`` takes; numpy only, so a rank summarising its windows never loads pyarrow."""
    cols: dict[str, np.ndarray] = {}
    for name, j in _ROW_INDEX.items():
        col = rows[:, j]
        if name in ("rank", "node", "step"):
            cols[name] = col.astype(np.int64)
        elif name == "data_gap":
            cols[name] = np.where(col < 0, np.nan, (col > 0).astype(np.float64))
        else:
            cols[name] = np.where(col == -1, np.nan, col.astype(np.float64))
    return cols


def step_columns(table: Any, rank: int, node: int) -> dict[str, np.ndarray]:
    """New step records as the columns ``WindowStream`` takes (float64, NaN where not measured)."""
    n = table.num_rows
    names = set(table.column_names)
    cols: dict[str, np.ndarray] = {
        "rank": np.full(n, rank, dtype=np.int64),
        "node": np.full(n, node, dtype=np.int64),
        "step": table.column("step").to_numpy(zero_copy_only=False).astype(np.int64),
    }
    for name in ANALYSIS_COLUMNS:
        if name in cols:
            continue
        if name in names:
            import pyarrow as pa

            cols[name] = table.column(name).cast(pa.float64()).to_numpy(zero_copy_only=False)
        else:
            cols[name] = np.full(n, np.nan)
    return cols


def self_run_delay_ns(cols: Mapping[str, np.ndarray]) -> np.ndarray | None:
    """Per step: the run-queue delay of the training thread (ready to run, waiting for a CPU) less the
    part inside DDP's gradient wait where that was timed (``comm_run_delay_ns``); None where the run
    delay was not recorded. A script's own collectives' part is not timed apart, and stays in."""
    delay = cols.get("run_delay_ns")
    if delay is None:
        return None
    delay = np.asarray(delay, dtype=np.float64)
    inside = cols.get("comm_run_delay_ns")
    return delay if inside is None else delay - np.nan_to_num(np.asarray(inside, dtype=np.float64), nan=0.0)


def summarize_windows(
    cols: Mapping[str, np.ndarray],
    opts: DetectionOptions | None = None,
    *,
    first_step: int | None = None,
    windows: Sequence[int] | None = None,
    spikes: RankSpikes | None = None,
    window_steps: int | None = None,
    min_samples: int | None = None,
) -> dict[str, np.ndarray]:
    """One row per window the rank has judged steps in (SUMMARY_COLUMNS).

    ``cols``: one rank's step columns as numpy arrays sorted by step (``columns.read_rank``, or the
    tracer's own rows), NaN where not measured; ``rank`` and ``node`` may be scalars' arrays. Window
    ``w`` covers steps ``[w * window_steps, (w + 1) * window_steps)``, the same for every rank.

    With ``opts`` (how ``diagnose`` and the live aggregation call it): steps before ``first_step +
    opts.warmup_steps`` are left out (``first_step`` defaults to the first step given; a stream passes
    the rank's first step ever), spikes are judged on the rest (``judge_spikes``; pass ``spikes`` when
    already judged on the same columns), left out of the medians and counted by cause. ``windows``
    limits the output to those windows; the other steps given still serve as the spikes' baseline.
    A median of fewer than ``opts.min_window_samples`` measured steps is NaN (not judged); the launch
    probe needs one sample.

    Without ``opts`` the given rows are summarised as they are (the caller has already left out warm-up
    and spikes), with ``window_steps`` (default 50) and ``min_samples`` (default 1).
    """
    if opts is None:
        opts = DetectionOptions(window_steps=window_steps or 50, min_window_samples=min_samples or 1)
        judge = False
    else:
        judge = True
    width = opts.window_steps
    steps_all = np.asarray(cols["step"], dtype=np.int64)
    if judge and steps_all.size:
        start = int(steps_all[0]) if first_step is None else int(first_step)
        keep = steps_all >= start + opts.warmup_steps
        if not keep.all():
            cols = {k: _column(v, keep.size)[keep] for k, v in cols.items()}
            if spikes is not None:
                raise ValueError("pass spikes judged on the post-warm-up columns")
    steps = np.asarray(cols["step"], dtype=np.int64)
    if steps.size == 0:
        return _empty()
    n = steps.size
    rank = int(_column(cols["rank"], n)[0])
    node = int(_column(cols["node"], n)[0])
    spike_at = np.zeros(n, dtype=bool)
    cause_at = np.full(n, -1, dtype=np.int64)
    lost_at = np.zeros(n)
    judged_at = np.ones(n, dtype=bool)
    if judge:
        if spikes is None:
            spikes = judge_spikes(cols, opts)
        spike_at = spikes.series.spike
        judged_at = spikes.series.judged | np.isnan(spikes.values)  # a step without the metric still counts
        index = {c: i for i, c in enumerate(RANK_CAUSES)}
        cause_at[spikes.idx] = [index.get(str(c), index["unknown"]) for c in spikes.causes]
        lost_at[spikes.idx] = np.maximum(spikes.excess, 0.0)

    win = steps // width
    first_idx = group_starts(win)  # steps are sorted, so a window's steps are contiguous
    uniq = win[first_idx]
    counts = np.diff(first_idx, append=n)
    if windows is not None:
        wanted = np.isin(uniq, np.asarray(list(windows), dtype=np.int64))
    else:
        wanted = np.ones(uniq.size, dtype=bool)
    row = np.repeat(np.arange(uniq.size), counts)  # steps are sorted, so windows are contiguous
    # A step's cell in its window's row of the medians' grid: its offset in the window; where no window
    # is full (sparse steps, or windows wider than the run), its place among the window's steps, so the
    # grid is as wide as the fullest window, not as ``window_steps`` (a median does not care where).
    longest = int(counts.max()) if counts.size else 0
    if longest < width:
        cells_per_row, offset = longest, np.arange(n) - np.repeat(first_idx, counts)
    else:
        cells_per_row, offset = width, steps - win * width
    typical = ~spike_at
    out: dict[str, np.ndarray] = {
        "rank": np.full(uniq.size, rank, dtype=np.int32),
        "node": np.full(uniq.size, node, dtype=np.int32),
        "window": uniq.astype(np.int64),
        "first_step": steps[first_idx],
        "last_step": steps[first_idx + counts - 1],
        "steps": np.bincount(row[typical], minlength=uniq.size).astype(np.int64),
    }
    grid = np.full((uniq.size, cells_per_row), np.nan)
    cells = grid.reshape(-1)  # the same memory: a step's cell is row * cells_per_row + offset
    at = row * cells_per_row + offset
    at_typical = at[typical]
    # the usual rank, no step missing: its cells are one contiguous run, filled by a copy, not a scatter
    run = run_slice(at)
    derived = {"busy_ns": busy_ns(cols) if "step_ns" in cols else None,
               "self_run_delay_ns": self_run_delay_ns(cols)}  # fmt: skip
    for out_name, col in _MEDIANS.items():
        values = derived[col] if col in derived else cols.get(col)
        if values is None:
            out[out_name] = np.full(uniq.size, np.nan)
            continue
        grid.fill(np.nan)
        v = np.asarray(_column(values, n), dtype=np.float64)
        if np.isnan(v).all():
            out[out_name] = np.full(uniq.size, np.nan)
            continue
        # the launch probe is a measurement of its own: a spike in the step does not void it
        if col == "launch_ns":
            cells[at] = v
        elif run is not None:
            np.copyto(cells[run], v, where=typical)
        else:
            cells[at_typical] = v[typical]
        med, n_ok = last_axis_nan_median(grid)
        need = 1 if col == "launch_ns" else opts.min_window_samples
        out[out_name] = np.where(n_ok >= need, med, np.nan)
    gc_values = cols.get("gc_ns")
    if gc_values is None:
        out["gc_ns_sum"] = np.full(uniq.size, np.nan)
    else:
        g = np.asarray(_column(gc_values, n), dtype=np.float64)
        ok = ~np.isnan(g) & typical
        n_ok = np.bincount(row[ok], minlength=uniq.size)
        total = np.bincount(row[ok], weights=g[ok], minlength=uniq.size)
        out["gc_ns_sum"] = np.where(n_ok >= opts.min_window_samples, total, np.nan)
    out["data_gap_share"] = _window_mean(cols.get("data_gap"), n, row, typical, uniq.size, 1)
    out["sys_cpu_ns_mean"] = _window_mean(cols.get("sys_cpu_ns"), n, row, typical, uniq.size, opts.min_window_samples)
    if judge:
        out["judged_steps"] = np.bincount(row[judged_at], minlength=uniq.size).astype(np.float64)
        for i, cause in enumerate(RANK_CAUSES):
            sel = cause_at == i
            out[f"spikes_{cause}"] = np.bincount(row[sel], minlength=uniq.size).astype(np.float64)
            out[f"lost_ns_{cause}"] = np.bincount(row[sel], weights=lost_at[sel], minlength=uniq.size)
    else:
        for name in _EXTRA_COUNTS:
            out[name] = np.full(uniq.size, np.nan)
    out["culprit_steps"] = np.full(uniq.size, np.nan)
    out["culprit_known"] = np.full(uniq.size, np.nan)
    return {k: out[k][wanted] for k in SUMMARY_COLUMNS}


def _window_mean(values: Any, n: int, row: np.ndarray, typical: np.ndarray, windows: int, need: int) -> np.ndarray:
    """Mean of a column over each window's typical steps that measured it; NaN under ``need`` of them."""
    v = np.full(n, np.nan) if values is None else np.asarray(_column(values, n), dtype=np.float64)
    ok = ~np.isnan(v) & typical
    n_ok = np.bincount(row[ok], minlength=windows)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n_ok >= need, np.bincount(row[ok], weights=v[ok], minlength=windows) / n_ok, np.nan)


class WindowStream:
    """One rank's step records as they arrive -> its window summaries, exactly as offline.

    ``add(cols)`` takes the rank's newest step columns (numpy arrays, in step order) and returns the
    rows of the windows that are now final; ``close()`` returns the rest (a partial last window
    included). A window is final once ``spike_window - 1`` later steps have arrived: the spike
    baselines (a centred rolling median and MAD, each over ``spike_window`` steps) then see the same
    steps as the offline analysis, so every window row equals the one ``diagnose`` computes. Memory is
    bounded: one window plus twice the spike window of steps.
    """

    def __init__(self, opts: DetectionOptions | None = None) -> None:
        self.opts = opts or DetectionOptions()
        self._cols: dict[str, np.ndarray] = {}
        self._first_step: int | None = None
        self._next_window: int | None = None

    def add(self, cols: Mapping[str, np.ndarray]) -> list[dict[str, Any]]:
        n = np.asarray(cols["step"]).size
        if n == 0:
            return []
        new = {k: np.asarray(_column(v, n)) for k, v in cols.items()}
        if self._first_step is None:
            self._first_step = int(new["step"][0])
        if self._cols:
            names = [k for k in self._cols if k in new]
            self._cols = {k: np.concatenate([self._cols[k], new[k]]) for k in names}
        else:
            self._cols = new
        return self._emit(final=False)

    def close(self) -> list[dict[str, Any]]:
        return self._emit(final=True)

    def _emit(self, final: bool) -> list[dict[str, Any]]:
        if not self._cols or self._first_step is None:
            return []
        opts = self.opts
        steps = self._cols["step"].astype(np.int64)
        start = self._first_step + opts.warmup_steps
        post = steps[steps >= start]
        if post.size == 0:
            return []
        if self._next_window is None:
            self._next_window = int(post[0]) // opts.window_steps
        context = opts.spike_window - 1
        last = int(steps[-1])
        # window w is final when steps up to its end + context have arrived
        final_upto = (last - context + 1) // opts.window_steps - 1 if not final else last // opts.window_steps
        if final_upto < self._next_window:
            return []
        wanted = list(range(self._next_window, final_upto + 1))
        summary = summarize_windows(self._cols, opts, first_step=self._first_step, windows=wanted)
        self._next_window = final_upto + 1
        # keep the context the next window needs: its own steps and spike_window - 1 before them
        keep = steps >= max(self._next_window * opts.window_steps - context, start)
        if not keep.all():
            self._cols = {k: v[keep] for k, v in self._cols.items()}
        return window_rows(summary)


def window_rows(summary: Mapping[str, np.ndarray]) -> list[dict[str, Any]]:
    """Summary columns -> one JSON-ready dict per window (None where not measured)."""
    names = [n for n in SUMMARY_COLUMNS if n in summary]
    size = len(summary[names[0]]) if names else 0
    rows = []
    for i in range(size):
        item: dict[str, Any] = {}
        for name in names:
            v = summary[name][i]
            if _dtype(name) is np.float64:
                f = float(v)
                item[name] = f if math.isfinite(f) else None
            else:
                item[name] = int(v)
        rows.append(item)
    return rows


def rows_table(rows: Sequence[Mapping[str, Any]]) -> Any:
    """Window rows (``window_rows``, or the same dicts after a JSON round trip) of any ranks -> a table
    in WINDOW_SCHEMA with the extra columns the rows carry, as ``LiveDetector.update`` takes it."""
    present = {k for r in rows for k in r}
    import pyarrow as pa  # the gathering side only: a rank summarising its own windows never needs it

    from hyperacc.schema import WINDOW_SCHEMA

    schema = pa.schema(list(WINDOW_SCHEMA) + [pa.field(n, pa.float64()) for n in EXTRA_WINDOW_COLUMNS if n in present])
    ordered = sorted(rows, key=lambda r: (r["window"], r["rank"]))
    return pa.Table.from_pylist([{f.name: r.get(f.name) for f in schema} for r in ordered], schema=schema)


def rows_columns(rows: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """Window rows of any ranks -> numpy columns in (window, rank) order, as ``rows_table`` but without
    pyarrow (what rank 0's live aggregation hands the detector); None becomes NaN."""
    present = set().union(*(r.keys() for r in rows))
    return float_columns({name: np.array([r.get(name) for r in rows], dtype=np.float64) for name in present})


def float_columns(cols: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Window columns held as float64 (NaN: none; what the live aggregation's wire carries) -> the
    columns of ``rows_columns``: the SUMMARY_COLUMNS present, rows in (window, rank) order, the integer
    columns as int64 (-1: none)."""
    if not cols or "window" not in cols or "rank" not in cols:
        return {}
    order = np.lexsort((cols["rank"], cols["window"]))
    out: dict[str, np.ndarray] = {}
    for name in (n for n in SUMMARY_COLUMNS if n in cols):
        values = np.asarray(cols[name], dtype=np.float64)[order]
        if _dtype(name) is np.float64:
            out[name] = values
        else:
            out[name] = np.where(np.isnan(values), -1, values).astype(np.int64)
    return out


def concat_windows(parts: list[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The window summaries of several ranks as one set of columns (a column some part lacks is left out)."""
    if not parts:
        return _empty()
    return {n: np.concatenate([p[n] for p in parts]) for n in SUMMARY_COLUMNS if all(n in p for p in parts)}


def window_table(columns: Mapping[str, np.ndarray]) -> Any:
    """A WINDOW_SCHEMA table (extra columns kept after the schema's own) from summary columns."""
    import pyarrow as pa

    from hyperacc.schema import WINDOW_SCHEMA

    schema = pa.schema(list(WINDOW_SCHEMA) + [pa.field(n, pa.float64()) for n in EXTRA_WINDOW_COLUMNS if n in columns])
    return pa.table(
        {f.name: pa.array(columns[f.name], type=f.type, from_pandas=True) for f in schema}, schema=schema
    )


def _column(values: Any, n: int) -> np.ndarray:
    arr = np.asarray(values)
    return np.broadcast_to(arr, (n,)) if arr.ndim == 0 else arr


def _empty() -> dict[str, np.ndarray]:
    return {n: np.empty(0, dtype=_dtype(n)) for n in SUMMARY_COLUMNS}


def _dtype(name: str) -> type:
    if name in ("rank", "node"):
        return np.int32
    if name in ("window", "first_step", "last_step", "steps"):
        return np.int64
    return np.float64

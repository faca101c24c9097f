"""Per-window, per-rank summaries (WINDOW_SCHEMA) computed from one rank's step columns.

The offline analysis summarises every rank with ``summarize_windows`` and the straggler rules read the
result exactly as they read the summaries the tracer sends while training runs, so both paths are
judged by the same code (docs/detection.md, "Windows").
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pyarrow as pa

from hyperacc.analysis.robust import nan_median
from hyperacc.schema import WINDOW_SCHEMA

# Columns this summary adds to WINDOW_SCHEMA: forward and backward time, the typical step's GC time (a
# rare long pause is a spike, not a straggler) and the signals of the "host" straggler kind.
EXTRA_WINDOW_COLUMNS: tuple[str, ...] = (
    "forward_ns_median",
    "backward_ns_median",
    "gc_ns_median",
    "invol_ctx_switches_median",
    "major_faults_median",
)

_MEDIANS = {
    "self_ns_median": "self_ns",
    "data_ns_median": "data_ns",
    "comm_wait_ns_median": "comm_wait_ns",
    "launch_ns_median": "launch_ns",
    "step_ns_median": "step_ns",
    "gc_ns_median": "gc_ns",
    "forward_ns_median": "forward_ns",
    "backward_ns_median": "backward_ns",
    "invol_ctx_switches_median": "invol_ctx_switches",
    "major_faults_median": "major_faults",
}


def summarize_windows(
    cols: Mapping[str, np.ndarray], *, window_steps: int, min_samples: int = 1
) -> dict[str, np.ndarray]:
    """One row per window the rank has steps in: WINDOW_SCHEMA columns plus EXTRA_WINDOW_COLUMNS.

    ``cols`` holds one rank's columns sorted by step (``columns.read_rank``). Window ``w`` covers steps
    ``[w * window_steps, (w + 1) * window_steps)``, the same for every rank. A median of fewer than
    ``min_samples`` measured steps is NaN (not judged); the launch probe needs one sample.
    """
    steps = np.asarray(cols["step"], dtype=np.int64)
    names = list(WINDOW_SCHEMA.names) + list(EXTRA_WINDOW_COLUMNS)
    if steps.size == 0:
        return {n: np.empty(0, dtype=_dtype(n)) for n in names}
    win = steps // window_steps
    uniq, first_idx, counts = np.unique(win, return_index=True, return_counts=True)
    row = np.repeat(np.arange(uniq.size), counts)  # steps are sorted, so windows are contiguous
    offset = steps - win * window_steps
    out: dict[str, np.ndarray] = {
        "rank": np.full(uniq.size, int(cols["rank"][0]), dtype=np.int32),
        "node": np.full(uniq.size, int(cols["node"][0]), dtype=np.int32),
        "window": uniq.astype(np.int64),
        "first_step": steps[first_idx],
        "last_step": steps[first_idx + counts - 1],
        "steps": counts.astype(np.int64),
    }
    grid = np.full((uniq.size, window_steps), np.nan)
    for out_name, col in _MEDIANS.items():
        values = cols.get(col)
        if values is None:
            out[out_name] = np.full(uniq.size, np.nan)
            continue
        grid.fill(np.nan)
        grid[row, offset] = values
        n_ok = np.count_nonzero(~np.isnan(grid), axis=1)
        med = nan_median(grid, axis=1)
        need = 1 if col == "launch_ns" else min_samples
        out[out_name] = np.where(n_ok >= need, med, np.nan)
    gc_values = cols.get("gc_ns")
    if gc_values is None:
        out["gc_ns_sum"] = np.full(uniq.size, np.nan)
    else:
        grid.fill(np.nan)
        grid[row, offset] = gc_values
        n_ok = np.count_nonzero(~np.isnan(grid), axis=1)
        out["gc_ns_sum"] = np.where(n_ok >= min_samples, np.nansum(grid, axis=1), np.nan)
    return {n: out[n] for n in names}


def concat_windows(parts: list[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    names = list(WINDOW_SCHEMA.names) + list(EXTRA_WINDOW_COLUMNS)
    if not parts:
        return {n: np.empty(0, dtype=_dtype(n)) for n in names}
    return {n: np.concatenate([p[n] for p in parts]) for n in names}


def window_table(columns: Mapping[str, np.ndarray]) -> pa.Table:
    """A WINDOW_SCHEMA table (extra columns kept after the schema's own) from summary columns."""
    fields = list(WINDOW_SCHEMA) + [pa.field(n, pa.float64()) for n in EXTRA_WINDOW_COLUMNS if n in columns]
    schema = pa.schema(fields)
    return pa.table(
        {f.name: pa.array(columns[f.name], type=f.type, from_pandas=True) for f in schema}, schema=schema
    )


def _dtype(name: str) -> type:
    if name in ("rank", "node"):
        return np.int32
    if name in ("window", "first_step", "last_step", "steps"):
        return np.int64
    return np.float64

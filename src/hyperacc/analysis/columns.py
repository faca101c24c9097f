"""Reading a run directory one rank at a time, as numpy columns.

The analysis never holds the whole run: ``diagnose`` reads one rank's segments (pyarrow, only the
columns it needs), reduces them to window summaries and spike tallies, and drops them before the next
rank. Memory is bounded by the longest rank (about 8 bytes x steps x columns), not by ranks x steps.

A segment that cannot be read (truncated by a SIGKILL) is skipped with one warning naming the file,
as ``hyperacc.store`` does. Nulls become NaN: a value that was not measured is never read as zero.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from hyperacc import store
from hyperacc.schema import RankMeta

log = logging.getLogger(__name__)

_RANK_DIR = re.compile(r"^rank-(\d+)$")

# Columns the analysis reads (a subset of STEP_SCHEMA).
ANALYSIS_COLUMNS: tuple[str, ...] = (
    "rank", "node", "step", "step_ns", "self_ns",
    "data_ns", "h2d_ns", "forward_ns", "backward_ns", "comm_wait_ns", "optimizer_ns", "other_ns",
    "gc_ns", "major_faults", "invol_ctx_switches", "alloc_retries", "sync_all_streams", "launch_ns",
    "pace_delay_ns", "cpu_ns", "dev_step_ns", "dev_self_ns", "dev_comm_wait_ns", "dev_forward_ns",
    "dev_backward_ns",
)  # fmt: skip


@dataclasses.dataclass
class RankSource:
    """Where one rank's step records live."""

    rank: int
    node: int | None  # from the rank's metadata; None until read from its records
    segments: list[Path]


@dataclasses.dataclass
class RunLayout:
    run_dir: Path
    metas: dict[int, RankMeta]
    sources: dict[int, RankSource]  # ranks that have at least one segment
    world_size: int

    @property
    def missing_ranks(self) -> list[int]:
        """Ranks the metadata promises (0..world_size-1) that have no step records at all."""
        return [r for r in range(self.world_size) if r not in self.sources]


def discover(run_dir: str | os.PathLike) -> RunLayout:
    """The ranks of a run directory and their segments. Raises ``store.RunDirError`` for a bad path."""
    root = store.check_run_dir(run_dir)
    metas = store.read_meta(root)
    sources: dict[int, RankSource] = {}
    steps_root = root / "steps"
    if steps_root.is_dir():
        for sub in sorted(steps_root.iterdir()):
            m = _RANK_DIR.match(sub.name)
            if not m or not sub.is_dir():
                continue
            segments = sorted(sub.glob("seg-*.parquet"))
            if segments:
                rank = int(m.group(1))
                meta = metas.get(rank)
                sources[rank] = RankSource(rank, meta.node if meta else None, segments)
    world = max([m.world_size for m in metas.values()] + [r + 1 for r in sources] + [0])
    return RunLayout(root, metas, sources, world)


def _readable(paths: Iterable[Path]) -> Iterable[tuple[Path, pq.ParquetFile]]:
    for path in paths:
        try:
            yield path, pq.ParquetFile(path, pre_buffer=False)
        except (OSError, pa.ArrowException) as exc:
            log.warning("skipping unreadable segment %s (%s); the rest of the run is analysed", path, exc)


def step_bounds(paths: Sequence[Path]) -> tuple[int, int] | None:
    """(first, last) step over some segments, from Parquet statistics when present (no data read)."""
    lo: int | None = None
    hi: int | None = None
    for path, pf in _readable(paths):
        try:
            idx = pf.schema_arrow.get_field_index("step")
            if idx < 0:
                continue
            seg_lo = seg_hi = None
            md = pf.metadata
            stats = [md.row_group(i).column(idx).statistics for i in range(md.num_row_groups)]
            if stats and all(s is not None and s.has_min_max for s in stats):
                seg_lo, seg_hi = min(s.min for s in stats), max(s.max for s in stats)
            else:
                col = pf.read(columns=["step"]).column("step")
                if len(col):
                    mm = pc.min_max(col)
                    seg_lo, seg_hi = mm["min"].as_py(), mm["max"].as_py()
        except (OSError, pa.ArrowException) as exc:
            log.warning("skipping unreadable segment %s (%s); the rest of the run is analysed", path, exc)
            continue
        if seg_lo is None:
            continue
        lo = seg_lo if lo is None else min(lo, seg_lo)
        hi = seg_hi if hi is None else max(hi, seg_hi)
    return None if lo is None else (int(lo), int(hi))


def read_rank(paths: Sequence[Path], columns: Sequence[str] = ANALYSIS_COLUMNS) -> dict[str, np.ndarray]:
    """One rank's step records as numpy columns, sorted by step, one row per step (the last wins).

    ``step``, ``rank`` and ``node`` are int64; every other column is float64 with NaN where the value
    was not measured (null, or a column the segment does not have).
    """
    tables = []
    for path, pf in _readable(paths):
        names = set(pf.schema_arrow.names)
        have = [c for c in columns if c in names]
        try:
            # One rank's segments are small: threads cost more than they save (and ranks already stream).
            tables.append(pf.read(columns=have, use_threads=False))
        except (OSError, pa.ArrowException) as exc:
            log.warning("skipping unreadable segment %s (%s); the rest of the run is analysed", path, exc)
    tables = [t for t in tables if t.num_rows]
    if not tables:
        return {
            c: np.empty(0, dtype=np.int64 if c in ("rank", "node", "step") else np.float64) for c in columns
        }
    table = pa.concat_tables(tables, promote_options="permissive")
    steps = table.column("step").to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    order: np.ndarray | None = None
    if steps.size > 1 and not bool(np.all(steps[1:] > steps[:-1])):
        order = np.argsort(steps, kind="stable")
        ordered = steps[order]
        # A step written twice (a resumed writer) keeps its last record.
        keep = np.ones(ordered.size, dtype=bool)
        keep[:-1] = ordered[1:] != ordered[:-1]
        order = order[keep]
    n = steps.size if order is None else order.size
    out: dict[str, np.ndarray] = {}
    for name in columns:
        if name not in table.column_names:
            out[name] = np.full(n, np.nan)
            continue
        col = table.column(name)
        if name in ("rank", "node", "step"):
            arr = col.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        elif col.null_count == len(col):
            arr = np.full(len(col), np.nan)
        else:
            # safe=False: wall-clock ns exceed 2**53 and lose their last digits as float64, which is fine here
            arr = col.cast(pa.float64(), safe=False).to_numpy(zero_copy_only=False)
        out[name] = arr if order is None else arr[order]
    return out

"""Run directories on disk: Parquet segments per rank, written atomically, read tolerantly.

Writing: each call to ``SegmentWriter.write`` produces one new segment file, written to a temporary
name and renamed into place, so a reader never sees half a segment from a live writer and a crash
loses at most the segment being written.

Reading: ``read_steps``/``read_events`` concatenate every rank's segments with pyarrow (no Python
objects per row). A segment that cannot be read (truncated by a SIGKILL, corrupted on disk) is skipped
with one warning naming the file; it never stops the analysis.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from hyperacc.schema import (
    EVENT_SCHEMA,
    RESOURCE_SCHEMA,
    STEP_SCHEMA,
    RankMeta,
    events_dir,
    live_windows_dir,
    meta_path,
    resources_dir,
    steps_dir,
)

log = logging.getLogger(__name__)

_SEGMENT = re.compile(r"seg-(\d+)\.parquet$")


class RunDirError(ValueError):
    """A run directory that cannot be analysed; the message says what is wrong and what to do."""


class SegmentWriter:
    """Appends tables of one schema to ``directory`` as numbered Parquet segments."""

    def __init__(self, directory: str | os.PathLike, schema: pa.Schema | None) -> None:
        self.directory = Path(directory)
        self.schema = schema
        self.directory.mkdir(parents=True, exist_ok=True)
        existing = [int(m.group(1)) for p in self.directory.iterdir() if (m := _SEGMENT.search(p.name))]
        self._next = max(existing, default=0) + 1

    def write(self, table: pa.Table) -> Path | None:
        if table.num_rows == 0:
            return None
        if self.schema is not None and table.schema != self.schema:
            table = table.cast(self.schema)
        final = self.directory / f"seg-{self._next:06d}.parquet"
        tmp = final.with_suffix(".parquet.tmp")
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, final)
        self._next += 1
        return final


def write_meta(run_dir: str | os.PathLike, meta: RankMeta) -> None:
    path = meta_path(run_dir, meta.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(meta.to_json())
    os.replace(tmp, path)


def read_meta(run_dir: str | os.PathLike) -> dict[int, RankMeta]:
    out: dict[int, RankMeta] = {}
    for path in sorted((Path(run_dir) / "meta").glob("rank-*.json")):
        try:
            meta = RankMeta.from_json(path.read_text())
        except (ValueError, TypeError) as exc:
            log.warning("skipping unreadable rank metadata %s: %s", path, exc)
            continue
        out[meta.rank] = meta
    return out


def _segments(root: Path) -> Iterable[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("rank-*/seg-*.parquet"))


def _read_segments(paths: Iterable[Path], schema: pa.Schema, columns: list[str] | None) -> pa.Table:
    tables = []
    for path in paths:
        try:
            table = pq.read_table(path, columns=columns)
        except (OSError, pa.ArrowException) as exc:
            log.warning("skipping unreadable segment %s (%s); the rest of the run is analysed", path, exc)
            continue
        tables.append(table)
    if not tables:
        sel = schema if columns is None else pa.schema([schema.field(c) for c in columns])
        return sel.empty_table()
    return pa.concat_tables(tables, promote_options="permissive")


def check_run_dir(run_dir: str | os.PathLike) -> Path:
    root = Path(run_dir)
    if not root.is_dir():
        raise RunDirError(f"run directory {root} does not exist; pass the --run-dir of a traced job")
    if not (root / "steps").is_dir() and not (root / "meta").is_dir():
        raise RunDirError(
            f"{root} is not a hyperacc run directory (no steps/ or meta/ inside); "
            "pass the --run-dir given to `hyperacc run` or to the tracer"
        )
    return root


def read_steps(run_dir: str | os.PathLike, columns: list[str] | None = None) -> pa.Table:
    """Every rank's step records, sorted by (rank, step)."""
    root = check_run_dir(run_dir)
    table = _read_segments(_segments(root / "steps"), STEP_SCHEMA, columns)
    if table.num_rows and {"rank", "step"} <= set(table.column_names):
        table = table.sort_by([("rank", "ascending"), ("step", "ascending")])
    return table


def read_events(run_dir: str | os.PathLike) -> pa.Table:
    root = check_run_dir(run_dir)
    return _read_segments(_segments(root / "events"), EVENT_SCHEMA, None)


def read_resources(run_dir: str | os.PathLike) -> pa.Table:
    """Every rank's resource samples (RESOURCE_SCHEMA), sorted by (rank, time)."""
    root = check_run_dir(run_dir)
    table = _read_segments(_segments(root / "resources"), RESOURCE_SCHEMA, None)
    if table.num_rows:
        table = table.sort_by([("rank", "ascending"), ("t_ns", "ascending")])
    return table


def read_live_windows(run_dir: str | os.PathLike) -> pa.Table:
    """The window summaries rank 0 gathered while the job ran (empty when it wrote none)."""
    root = check_run_dir(run_dir) / "live" / "windows"
    paths = sorted(root.glob("seg-*.parquet")) if root.is_dir() else []
    tables = []
    for path in paths:
        try:
            tables.append(pq.read_table(path))
        except (OSError, pa.ArrowException) as exc:
            log.warning("skipping unreadable segment %s (%s); the rest of the run is analysed", path, exc)
    return pa.concat_tables(tables, promote_options="permissive") if tables else pa.table({})


def step_writer(run_dir: str | os.PathLike, rank: int) -> SegmentWriter:
    return SegmentWriter(steps_dir(run_dir, rank), STEP_SCHEMA)


def event_writer(run_dir: str | os.PathLike, rank: int) -> SegmentWriter:
    return SegmentWriter(events_dir(run_dir, rank), EVENT_SCHEMA)


def resource_writer(run_dir: str | os.PathLike, rank: int) -> SegmentWriter:
    return SegmentWriter(resources_dir(run_dir, rank), RESOURCE_SCHEMA)


def live_windows_writer(run_dir: str | os.PathLike) -> SegmentWriter:
    """Rank 0's gathered window summaries; the schema is the first table's (summary columns grow)."""
    return SegmentWriter(live_windows_dir(run_dir), None)

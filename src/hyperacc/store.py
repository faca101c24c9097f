"""Run directories on disk: Parquet segments per rank, written atomically, read tolerantly.

Writing: each call to ``SegmentWriter.write`` produces one new segment file, written to a temporary
name and renamed into place, so a reader never sees half a segment from a live writer and a crash
loses at most the segment being written. A write that fails (a full disk, a read-only file system)
removes its temporary file and raises; the tracer then switches writing off.

Reading (docs/reliability.md, "Run directories"): every segment is checked against its schema
(``STEP_SCHEMA`` or ``EVENT_SCHEMA``) before any of its data is used, by column name and type:

- a column the schema does not know, or one whose type does not fit (text in a number column, a
  fractional ``step``), makes the segment foreign: it is skipped with one warning that names the file
  and what did not fit;
- a column the segment lacks (written by an older schema) is read as null: not measured;
- a segment that cannot be read at all (truncated by a SIGKILL, corrupted on disk) is skipped the
  same way. None of these ever stops the analysis of the rest of the run.

``read_steps``/``read_events`` concatenate the segments that fit with pyarrow (no Python objects per
row); ``hyperacc.analysis.columns`` reads one rank at a time with the same checks.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
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

# Ranks are numbered below this (a million ranks); larger numbers in a folder name or in a rank's
# metadata are corrupt, and would make "which ranks are missing" unbounded.
MAX_RANKS = 1 << 20
# Step numbers are kept within float64's exact integers, so every reader may compute with them.
MAX_STEP = 1 << 53
# Columns that identify a row: integers only, never null in a segment that fits.
_IDENTITY = frozenset({"rank", "node", "step"})
# Columns a segment must have to be read at all.
REQUIRED: dict[str, tuple[str, ...]] = {"steps": ("step",), "events": ("kind",)}


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
        _write_atomically(final, lambda tmp: pq.write_table(table, tmp, compression="zstd"))
        self._next += 1
        return final


def write_meta(run_dir: str | os.PathLike, meta: RankMeta) -> None:
    path = meta_path(run_dir, meta.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(path, lambda tmp: tmp.write_text(meta.to_json()))


def _write_atomically(path: Path, write: Callable[[Path], Any]) -> None:
    """``write`` a file next to ``path`` and rename it into place: a reader never sees half of it, and a
    write that fails (a full disk, a read-only file system) leaves no half-written file behind."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise


_META_INTS = ("rank", "local_rank", "node", "world_size", "local_world_size", "pid")
_META_STRS = ("hostname", "backend", "device", "source")


def _meta_problem(meta: RankMeta) -> str | None:
    for name in _META_INTS:
        value = getattr(meta, name)
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{name} is {value!r}, not a whole number"
    for name in _META_STRS:
        if not isinstance(getattr(meta, name), str):
            return f"{name} is {getattr(meta, name)!r}, not text"
    if not 0 <= meta.rank < MAX_RANKS or not 1 <= meta.world_size <= MAX_RANKS or meta.rank >= meta.world_size:
        return f"rank {meta.rank} of world size {meta.world_size} is impossible"
    if meta.node < 0 or meta.local_rank < 0 or meta.local_world_size < 1:
        return "node, local_rank and local_world_size must be >= 0 (local_world_size >= 1)"
    return None


def read_meta(run_dir: str | os.PathLike) -> dict[int, RankMeta]:
    out: dict[int, RankMeta] = {}
    try:
        paths = sorted((Path(run_dir) / "meta").glob("rank-*.json"))
    except OSError as exc:
        log.warning("cannot list %s (%s); rank metadata is not used", Path(run_dir) / "meta", exc)
        return out
    for path in paths:
        try:
            meta = RankMeta.from_json(path.read_text())
            problem = _meta_problem(meta)
        except (OSError, ValueError, TypeError, AttributeError, RecursionError) as exc:
            problem = str(exc) or type(exc).__name__
        if problem is not None:
            warn_once(path, f"skipping unreadable rank metadata {path}: {problem}")
            continue
        out[meta.rank] = meta
    return out


# ------------------------------------------------------------------ segment checks


_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def warn_once(path: str | os.PathLike, message: str) -> None:
    """Log ``message`` about ``path`` once per process (readers may visit a segment several times)."""
    key = (str(path), message)
    with _warned_lock:
        if key in _warned:
            return
        if len(_warned) < 100_000:
            _warned.add(key)
    log.warning("%s", message)


def _type_fits(actual: pa.DataType, expected: pa.DataType, identity: bool) -> bool:
    if actual == expected or pa.types.is_null(actual):
        return True
    if pa.types.is_dictionary(actual):
        return _type_fits(actual.value_type, expected, identity)
    if pa.types.is_integer(expected):
        # measurements may arrive as floats (a NaN for "not measured"); step, rank and node may not
        return pa.types.is_integer(actual) or (not identity and pa.types.is_floating(actual))
    if pa.types.is_floating(expected):
        return pa.types.is_integer(actual) or pa.types.is_floating(actual)
    if pa.types.is_boolean(expected):
        return pa.types.is_boolean(actual)
    if pa.types.is_string(expected) or pa.types.is_large_string(expected):
        return pa.types.is_string(actual) or pa.types.is_large_string(actual)
    return False


def segment_problem(schema: pa.Schema, expected: pa.Schema, required: Sequence[str] = ()) -> str | None:
    """Why a segment with ``schema`` does not fit ``expected`` (None when it fits).

    Foreign columns and columns of the wrong type do not fit; columns the segment lacks do, except
    ``required`` ones.
    """
    names = schema.names
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        return f"column(s) {', '.join(map(repr, dup))} appear more than once"
    foreign = [n for n in names if expected.get_field_index(n) < 0]
    if foreign:
        shown = ", ".join(repr(n) for n in foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        return f"foreign column(s) {shown}"
    missing = [n for n in required if n not in names]
    if missing:
        return f"no {', '.join(missing)} column"
    for field in schema:
        want = expected.field(field.name).type
        if not _type_fits(field.type, want, field.name in _IDENTITY):
            return f"column {field.name!r} is {field.type}, not {want}"
    return None


def _kind(schema: pa.Schema) -> str:
    return "events" if schema.equals(EVENT_SCHEMA) else "steps"


def open_segment(path: str | os.PathLike, schema: pa.Schema) -> pq.ParquetFile | None:
    """The segment at ``path`` opened (no data read) when its columns fit ``schema``; else None,
    with one warning naming the file and why."""
    try:
        pf = pq.ParquetFile(path, pre_buffer=False)
        problem = segment_problem(pf.schema_arrow, schema, REQUIRED[_kind(schema)])
    except (OSError, pa.ArrowException, ValueError) as exc:
        warn_once(path, f"skipping unreadable segment {path} ({exc}); the rest of the run is analysed")
        return None
    if problem is not None:
        what = "step records" if _kind(schema) == "steps" else "events"
        warn_once(path, f"skipping segment {path}: {problem}, so it does not hold hyperacc {what}; "
                        "the rest of the run is analysed")  # fmt: skip
        return None
    return pf


def conform(table: pa.Table, schema: pa.Schema, path: str | os.PathLike = "") -> pa.Table:
    """A table that fits ``schema`` (``segment_problem`` is None) with exactly ``schema``'s columns,
    each cast to its type; a column the segment lacks is null, except ``rank``, taken from the
    segment's folder (``rank-00003``).

    A value an integer column cannot hold (NaN, an infinity, a number beyond its type) becomes null.
    Rows whose identity is null (``rank``, ``node``, ``step`` of a step record, ``kind`` of an event)
    or whose step lies beyond +-2**53 are dropped, with one warning.
    """
    n = table.num_rows
    arrays = []
    for field in schema:
        if field.name not in table.column_names:
            folder_rank = _folder_rank(path) if field.name == "rank" else None
            arrays.append(pa.nulls(n, field.type) if folder_rank is None else pa.array([folder_rank] * n, field.type))
            continue
        col = table.column(field.name)
        if pa.types.is_dictionary(col.type):
            col = col.cast(col.type.value_type)
        if col.type != field.type:
            if pa.types.is_integer(field.type):
                fits = _holds(col, field.type)
                if fits is not None:  # a value the column cannot hold is null, never wrapped around
                    col = pc.if_else(pc.fill_null(fits, False), col, pa.scalar(None, col.type))
            col = col.cast(field.type, safe=False)
        arrays.append(col)
    out = pa.Table.from_arrays(arrays, schema=schema)
    keep = []
    for name in ("rank", "node", "step", "kind"):
        if name in table.column_names and name in schema.names and not schema.field(name).nullable:
            keep.append(pc.is_valid(out.column(name)))
    if "step" in table.column_names and "step" in schema.names:
        step = out.column("step")
        inside = pc.and_(pc.greater_equal(step, -MAX_STEP), pc.less_equal(step, MAX_STEP))
        keep.append(pc.fill_null(inside, schema.field("step").nullable))
    if keep and n:
        mask = functools.reduce(pc.and_, keep)
        dropped = n - int(pc.sum(pc.cast(mask, pa.int64())).as_py() or 0)
        if dropped:
            warn_once(path, f"{path}: {dropped} row(s) without a step, rank, node or kind, or with a step "
                            "beyond +-2**53, were left out")  # fmt: skip
            out = out.filter(mask)
    return out


def _holds(col: pa.ChunkedArray, target: pa.DataType) -> pa.ChunkedArray | None:
    """Where the integer type ``target`` holds ``col``'s values (None: everywhere)."""
    dst = np.iinfo(target.to_pandas_dtype())
    if pa.types.is_floating(col.type):
        top = float(dst.max)
        below = pc.less(col, top) if top > dst.max else pc.less_equal(col, top)  # 2**63-1 rounds up
        return pc.and_(pc.and_(pc.is_finite(col), pc.greater_equal(col, float(dst.min))), below)
    if not pa.types.is_integer(col.type):
        return None
    src = np.iinfo(col.type.to_pandas_dtype())
    conds = []
    if src.min < dst.min:
        conds.append(pc.greater_equal(col, pa.scalar(dst.min, col.type)))
    if src.max > dst.max:
        conds.append(pc.less_equal(col, pa.scalar(dst.max, col.type)))
    return functools.reduce(pc.and_, conds) if conds else None


def _folder_rank(path: str | os.PathLike) -> int | None:
    m = re.match(r"^rank-(\d{1,7})$", Path(path).parent.name) if path else None
    return int(m.group(1)) if m else None


def read_segment(
    path: str | os.PathLike, schema: pa.Schema, columns: Sequence[str] | None = None
) -> pa.Table | None:
    """One segment, checked and conformed to ``schema`` (``columns`` of it when given), or None with
    one warning when it does not fit or cannot be read."""
    pf = open_segment(path, schema)
    if pf is None:
        return None
    try:
        table = pf.read(use_threads=False)
    except (OSError, pa.ArrowException, ValueError) as exc:
        warn_once(path, f"skipping unreadable segment {path} ({exc}); the rest of the run is analysed")
        return None
    table = conform(table, schema, path)
    return table if columns is None else table.select(list(columns))


def _segments(root: Path) -> Iterable[Path]:
    if not root.is_dir():
        return []
    try:
        return sorted(p for p in root.glob("rank-*/seg-*.parquet") if p.is_file())
    except OSError as exc:
        log.warning("cannot list %s (%s); its segments are not read", root, exc)
        return []


def _read_segments(paths: Iterable[Path], schema: pa.Schema, columns: list[str] | None) -> pa.Table:
    tables = [t for path in paths if (t := read_segment(path, schema, columns)) is not None and t.num_rows]
    if not tables:
        sel = schema if columns is None else pa.schema([schema.field(c) for c in columns])
        return sel.empty_table()
    return pa.concat_tables(tables)


def run_dir_list(run_dir: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """One run directory, or the run directories of one job (agents with local disks), as a list."""
    if isinstance(run_dir, (str, os.PathLike)):
        return [Path(run_dir)]
    return [Path(d) for d in run_dir]


def check_run_dir(run_dir: str | os.PathLike) -> Path:
    root = Path(run_dir)
    if not str(run_dir).strip():
        raise RunDirError("the run directory is empty; pass the --run-dir of a traced job")
    if not root.is_dir():
        raise RunDirError(f"run directory {root} does not exist; pass the --run-dir of a traced job")
    if not (root / "steps").is_dir() and not (root / "meta").is_dir():
        raise RunDirError(
            f"{root} is not a hyperacc run directory (no steps/ or meta/ inside); "
            "pass the --run-dir given to `hyperacc run` or to the tracer"
        )
    return root


def _segments_of(run_dir: str | os.PathLike | Sequence[str | os.PathLike], kind: str) -> list[Path]:
    """The ``kind`` segments of one run directory or of the run directories of one job."""
    return [p for d in run_dir_list(run_dir) for p in _segments(check_run_dir(d) / kind)]


def read_steps(
    run_dir: str | os.PathLike | Sequence[str | os.PathLike], columns: list[str] | None = None
) -> pa.Table:
    """Every rank's step records that fit ``STEP_SCHEMA``, sorted by (rank, step)."""
    unknown = [c for c in columns or () if STEP_SCHEMA.get_field_index(c) < 0]
    if unknown:
        raise ValueError(f"unknown step column(s) {unknown}; see hyperacc.schema.STEP_SCHEMA")
    table = _read_segments(_segments_of(run_dir, "steps"), STEP_SCHEMA, columns)
    if table.num_rows and {"rank", "step"} <= set(table.column_names):
        table = table.sort_by([("rank", "ascending"), ("step", "ascending")])
    return table


def read_events(run_dir: str | os.PathLike | Sequence[str | os.PathLike]) -> pa.Table:
    """Every rank's events that fit ``EVENT_SCHEMA`` (of one run directory, or of several of one job)."""
    return _read_segments(_segments_of(run_dir, "events"), EVENT_SCHEMA, None)


def read_resources(run_dir: str | os.PathLike | Sequence[str | os.PathLike]) -> pa.Table:
    """Every rank's resource samples (RESOURCE_SCHEMA), sorted by (rank, time)."""
    table = _read_segments(_segments_of(run_dir, "resources"), RESOURCE_SCHEMA, None)
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

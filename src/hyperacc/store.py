"""Run directories on disk: segments per rank, written atomically, read tolerantly.

Writing: each call to ``SegmentWriter.write`` (Parquet) or ``records.RecordWriter`` (a training rank's
plain records) produces one new segment file, written to a temporary name and renamed into place, so a
reader never sees half a segment from a live writer and a crash loses at most the segment being
written. A write that fails (a full disk, a read-only file system) removes its temporary file and
raises; the tracer then switches writing off. ``compact`` rolls both kinds into Parquet. Every reader
here reads both kinds alike (a plain record segment is opened as a table of its schema).

Reading (docs/reliability.md, "Run directories"): every segment is checked against its schema
(``STEP_SCHEMA`` or ``EVENT_SCHEMA``) before any of its data is used, by column name and type:

- a column the schema does not know, or one whose type does not fit (text in a number column, a
  fractional ``step``), makes the segment foreign: it is skipped with one warning that names the file
  and what did not fit; except that a segment with every column the schema cannot be without (a newer
  hyperacc's, with the columns it added) is read without the columns this one does not know;
- a column the segment lacks (written by an older schema) is read as null: not measured;
- a segment that cannot be read at all (truncated by a SIGKILL, corrupted on disk) is skipped the
  same way. None of these ever stops the analysis of the rest of the run.

``read_steps``/``read_events`` concatenate the segments that fit with pyarrow (no Python objects per
row); ``hyperacc.analysis.columns`` reads one rank at a time with the same checks.

Why this module is over 500 lines: it is the one place that knows the on-disk layout. Writing,
compaction (``compact``) and reading (``live_segments``, ``SegmentCursor``, ``read_steps``) share the
segment names and the rule of which segments a compacted file replaces; a reader and the compactor
that disagreed would lose or double rows, so they stay side by side.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from hyperacc import records
from hyperacc.records import segment_range, write_meta  # noqa: F401 - part of this module's interface
from hyperacc.records import write_atomically as _write_atomically
from hyperacc.schema import (
    EVENT_SCHEMA,
    RESOURCE_SCHEMA,
    STEP_SCHEMA,
    RankMeta,
    events_dir,
    live_events_dir,
    live_windows_dir,
    resources_dir,
    steps_dir,
)

log = logging.getLogger(__name__)

# A compacted segment names the range of segment numbers it replaces: seg-000001-000120.parquet
# (records.SEGMENT_NAME; a rank's plain records are seg-000121.rec).
# Key-value metadata of a compacted segment: when its period opened (wall ns), and for every segment it
# replaces "number:rows so far", so a follower that has read some of them reads only the rest.
_OPENED = b"hyperacc.opened_ns"
_PARTS = b"hyperacc.parts"

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
        existing = [r[1] for p in self.directory.iterdir() if (r := segment_range(p)) is not None]
        self._next = max(existing, default=0) + 1
        self.written = 0  # segments this writer wrote (a compactor counts them)

    def write(self, table: pa.Table) -> Path | None:
        if table.num_rows == 0:
            return None
        if self.schema is not None and table.schema != self.schema:
            table = table.cast(self.schema)
        final = self.directory / f"seg-{self._next:06d}.parquet"
        _write_atomically(final, lambda tmp: pq.write_table(table, tmp, **parquet_options(table.schema)))
        self._next += 1
        self.written += 1
        return final


# ------------------------------------------------------------------ compaction (bounded run directories)


class SegmentGone(Exception):
    """A listed segment was removed before it was read: a compaction replaced it. List again."""


def _is_compacted(path: Path) -> bool:
    return Path(path).name.count("-") == 2


def _listing(directory: Path) -> list[tuple[int, int, Path]]:
    # A rank may hold thousands of segments: the kind of each comes from the listing itself (no stat a
    # file), and the paths from ``iterdir``, which joins names without parsing them again as ``/`` does
    # (a 2,000-file folder in 4.4 ms, 7.0 ms before; docs/detection.md, "Many segments per rank").
    try:
        with os.scandir(directory) as entries:
            others = {e.name for e in entries if not e.is_file()}
        paths = list(directory.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        log.warning("cannot list %s (%s); its segments are not read", directory, exc)
        return []
    out = []
    for p in paths:
        name = p.name
        r = records.name_range(name)
        if r is not None and r[0] <= r[1] and name not in others:
            out.append((r[0], r[1], p))
    out.sort(key=lambda t: (t[0], -t[1]))
    return out


def _split_live(files: list[tuple[int, int, Path]]) -> tuple[list[tuple[int, int, Path]], list[Path]]:
    """(the files readers read, the files a compacted file already holds). Sorted by (lo, -hi), a file
    lies inside another exactly when its hi is at most the largest hi before it."""
    live: list[tuple[int, int, Path]] = []
    covered: list[Path] = []
    top = 0
    for lo, hi, p in files:
        if hi <= top:
            covered.append(p)
        else:
            live.append((lo, hi, p))
            top = hi
    return live, covered


def live_segments(directory: str | os.PathLike) -> list[Path]:
    """One rank's segment files that hold its records, each record once, in order.

    A compaction writes ``seg-lo-hi`` before it removes the segments ``lo``..``hi``, so for an instant
    both exist: a segment whose numbers lie inside a compacted file's range is left out here.
    """
    return [p for _, _, p in _split_live(_listing(Path(directory)))[0]]


def compact(
    directory: str | os.PathLike,
    schema: pa.Schema | None,
    *,
    every: int = 32,
    period_s: float = 3600.0,
    min_rows: int = 100_000,
    final: bool = False,
) -> Path | None:
    """Roll one rank directory's small segments into its compacted file of the current period.

    Runs once ``every`` small segments are waiting (any number when ``final``). The period's file
    ``seg-lo-hi`` is rewritten as ``seg-lo-hi2`` with the new segments appended, until it covers
    ``period_s`` of wall-clock time and ``min_rows`` rows (whichever is larger); then a new period
    opens. Atomic at every point: the new file is written to a temporary name and renamed into place,
    then the files it replaces are removed; readers skip files inside a compacted range
    (``live_segments``), and the next call removes what an interrupted one left behind. A segment that
    cannot be read is left where it is (readers skip it with a warning) and ends the period.

    ``schema`` None: the segments are taken as written and their columns unified (rank 0's gathered
    window summaries, whose columns grow with the detector's). Call it from one process per directory
    (the rank's flusher and rank 0's window aggregation today, a node agent later). Returns the
    compacted file written, or None.
    """
    directory = Path(directory)
    files = _listing(directory)
    live, covered = _split_live(files)
    for p in covered:  # left by an interrupted compaction: their rows are in a compacted file
        p.unlink(missing_ok=True)
    try:
        for p in directory.glob("seg-*-*.parquet.tmp"):  # only compactions write such names (seg-lo-hi)
            p.unlink(missing_ok=True)
    except OSError:
        pass
    rolled = [t for t in live if _is_compacted(t[2])]
    base = rolled[-1] if rolled else None  # the latest period's file, open unless full
    small = [t for t in live if not _is_compacted(t[2]) and (base is None or t[0] > base[1])]
    if not small or (len(small) < every and not final):
        return None
    now = time.time_ns()
    parts: list[tuple[int, int]] = []
    tables: list[pa.Table] = []
    opened = now
    if base is not None:
        try:
            md = pq.read_metadata(base[2])
            kv = md.metadata or {}
            opened = int(kv.get(_OPENED, b"0"))
            parts = _parse_parts(kv.get(_PARTS, b""))
            rows = md.num_rows
        except (OSError, pa.ArrowException, ValueError):
            base, rows = None, 0
        if base is not None and now - opened >= period_s * 1e9 and rows >= min_rows:
            base = None  # the period is full: a new one opens
        if base is not None:
            table = read_segment(base[2], schema)
            if table is None:
                base = None
            else:
                tables.append(table)
        if base is None:
            opened, parts, tables = now, [], []
    batch: list[Path] = []
    total = sum(t.num_rows for t in tables)
    for _lo, hi, p in small:
        table = read_segment(p, schema)
        if table is None:
            if batch:
                break  # an unreadable segment ends the batch; the next call starts after it
            base, opened, parts, tables, total = None, now, [], [], 0
            continue
        tables.append(table)
        batch.append(p)
        total += table.num_rows
        parts.append((hi, total))
    if not batch:
        return None
    first = base[0] if base is not None else segment_range(batch[0])[0]  # type: ignore[index]
    last = segment_range(batch[-1])[1]  # type: ignore[index]
    merged = pa.concat_tables(tables, promote_options="permissive")  # one schema, or columns that grew
    meta = {_OPENED: str(opened).encode(), _PARTS: ",".join(f"{n}:{r}" for n, r in parts).encode()}
    merged = merged.replace_schema_metadata({**(merged.schema.metadata or {}), **meta})
    final_path = directory / f"seg-{first:06d}-{last:06d}.parquet"
    _write_atomically(
        final_path, lambda tmp: pq.write_table(merged, tmp, row_group_size=1 << 20, **parquet_options(merged.schema))
    )
    for p in ([base[2]] if base is not None else []) + batch:
        p.unlink(missing_ok=True)
    return final_path


def parquet_options(schema: pa.Schema) -> dict[str, Any]:
    """How every segment is written (a compacted file also as one row group of its period): zstd; the
    integer columns (steps, clocks, nanoseconds, counts) as deltas, with no dictionary; dictionaries
    only for the rest (strings, flags). A step record's integers are mostly distinct values, for which
    a dictionary is built, outgrows its page and falls back to plain values: on 1e5-step ranks the deltas
    took 31 bytes a row against 59 and read in 10-13 ms against 28, and write 5x faster
    (docs/tracing.md, "On disk")."""
    ints = [f.name for f in schema if pa.types.is_integer(f.type)]
    return {
        "compression": "zstd",
        "use_dictionary": [f.name for f in schema if f.name not in ints],
        "column_encoding": dict.fromkeys(ints, "DELTA_BINARY_PACKED"),
    }


def _parse_parts(raw: bytes) -> list[tuple[int, int]]:
    out = []
    for item in raw.decode().split(","):
        if item:
            n, _, r = item.partition(":")
            out.append((int(n), int(r)))
    return out


class SegmentCursor:
    """Reads one rank directory's records as they appear, each row once, across compactions.

    ``done`` is the highest segment number read. A compacted file that holds some rows already read
    (the follower read segments 1-40 before they were rolled into ``seg-1-60``) is read from the row
    after them, found in the file's ``hyperacc.parts`` metadata.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.done = 0
        self._head: tuple[int, int] | None = None  # (segment number, rows to skip at its head): start_at_tail

    def start_at_tail(self, rows: int) -> None:
        """Before the first read: skip the segments older than the newest ones that hold at least
        ``rows`` rows, so that a follower that needs only the latest rows (``hyperacc watch`` of a job
        that has run for days) does not read the whole run first. The row counts come from the files'
        footers or headers, newest first; where fewer rows are found (or a file cannot be opened before
        enough are), everything is read as before."""
        need, start = rows, 0
        for path in reversed(live_segments(self.directory)):
            try:
                need -= int(_open_file(path).metadata.num_rows)
            except (OSError, pa.ArrowException, ValueError):
                break
            if need <= 0:
                start = segment_range(path)[0] - 1  # type: ignore[index]
                self._head = (start + 1, -need)  # that file's first rows are not needed either
                break
        self.done = start

    def read_new(self, columns: Sequence[str] | None = None, schema: pa.Schema | None = None) -> list[pa.Table]:
        """The new rows: ``columns`` that each file has, as written; or, given ``schema``, checked and
        conformed to it as every reader does (``open_segment``, ``conform``)."""
        out = []
        for path in live_segments(self.directory):
            lo, hi = segment_range(path)  # type: ignore[misc]
            if hi <= self.done:
                continue
            try:
                pf = open_segment(path, schema) if schema is not None else _open_file(path)  # opened once
                if pf is None:  # not a segment of this schema: skipped with its warning
                    self.done = hi
                    continue
                skip = 0
                if lo <= self.done:
                    parts = dict(_parse_parts((pf.schema_arrow.metadata or {}).get(_PARTS, b"")))
                    skip = parts.get(self.done, pf.metadata.num_rows)
                elif self._head is not None and self._head[0] == lo:
                    skip = self._head[1]
                names = pf.schema_arrow.names
                wanted = None if columns is None or schema is not None else [c for c in columns if c in names]
                # checked reads take every column: conform needs the identity
                table, skip = _read_from(pf, skip, wanted)
            except (FileNotFoundError, SegmentGone):
                break  # compacted while listed: the next call lists again
            except (OSError, pa.ArrowException, ValueError) as exc:
                warn_once(path, f"skipping unreadable segment {path} ({exc})")
                self.done = hi
                continue
            self.done, self._head = hi, None
            if skip:
                table = table.slice(skip)
            if schema is not None:
                table = conform(table, schema, path)
                if columns is not None:
                    table = table.select([c for c in columns if c in table.column_names])
            if table.num_rows:
                out.append(table)
        return out


def _read_from(pf: Any, skip: int, columns: list[str] | None) -> tuple[pa.Table, int]:
    """The rows of an opened segment from row ``skip`` on, reading only the Parquet row groups that hold
    them: (the table read, the rows still to skip at its head)."""
    groups = getattr(pf, "num_row_groups", 0)
    if skip <= 0 or groups <= 1:
        return pf.read(columns=columns), skip
    first, seen = 0, 0
    while first < groups - 1 and seen + pf.metadata.row_group(first).num_rows <= skip:
        seen += pf.metadata.row_group(first).num_rows
        first += 1
    return pf.read_row_groups(range(first, groups), columns=columns), skip - seen


_META_INTS = ("rank", "local_rank", "node", "world_size", "local_world_size", "pid")
_META_STRS = ("hostname", "backend", "device", "source", "agent")


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


_RANK_DIR = re.compile(r"^rank-(\d{1,7})$")


def rank_dirs(run_dir: str | os.PathLike, kind: str, keep: Callable[[int], bool] | None = None) -> list[tuple[int, Path]]:
    """Every rank folder ``rank-<number below MAX_RANKS>`` under ``run_dir/kind``, with its rank, as
    ``analysis.columns`` finds them: other folders are not a rank's. ``keep``: only the ranks it is true
    of (asked before any folder is looked at: a node agent's own ranks in a run directory every node
    shares). A folder that cannot be listed gives what was found so far (read again next time)."""
    out: list[tuple[int, Path]] = []
    try:
        for sub in sorted((Path(run_dir) / kind).glob("rank-*")):
            m = _RANK_DIR.match(sub.name)
            if not m or int(m.group(1)) >= MAX_RANKS or (keep is not None and not keep(int(m.group(1)))):
                continue
            if sub.is_dir():
                out.append((int(m.group(1)), sub))
    except OSError:
        pass
    return out


class MetaCache:
    """A run directory's rank metadata (``read_meta``) for a process that asks for it every second (the
    node agent): read again only when the ``meta`` folder changed (a rank writes its file under a
    temporary name and renames it into place, which changes the folder's modification time), while
    that change is under ``SETTLE_S`` old (a coarse clock, or a file system's cached attributes, can
    hide a second change within it), and at least every ``refresh_s``. At a thousand ranks that is one
    ``stat`` a pass instead of a thousand file reads."""

    SETTLE_S = 2.0

    def __init__(self, run_dir: str | os.PathLike, refresh_s: float = 60.0) -> None:
        self.folder = Path(run_dir) / "meta"
        self.refresh_s = refresh_s
        self._metas: dict[int, RankMeta] = {}
        self._mtime: int | None = None
        self._at = -math.inf

    def read(self) -> dict[int, RankMeta]:
        try:
            mtime = self.folder.stat().st_mtime_ns
        except OSError:
            return self._metas  # no metadata yet (or the folder cannot be read now): as last seen
        now = time.monotonic()
        settled = time.time_ns() - mtime > self.SETTLE_S * 1e9
        if mtime == self._mtime and settled and now - self._at < self.refresh_s:
            return self._metas
        self._metas, self._mtime, self._at = read_meta(self.folder.parent), mtime, now
        return self._metas


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
    ``required`` ones. Columns ``expected`` does not know in a segment that holds every column it cannot
    be without (its non-nullable ones: a newer hyperacc's segment, with the columns it added) are left
    out by ``conform``, not foreign.
    """
    names = schema.names
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        return f"column(s) {', '.join(map(repr, dup))} appear more than once"
    foreign = [n for n in names if expected.get_field_index(n) < 0]
    if foreign and not all(f.name in names for f in expected if not f.nullable):
        shown = ", ".join(repr(n) for n in foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        return f"foreign column(s) {shown}"
    missing = [n for n in required if n not in names]
    if missing:
        return f"no {', '.join(missing)} column"
    for field in schema:
        if field.name in foreign:
            continue
        want = expected.field(field.name).type
        if not _type_fits(field.type, want, field.name in _IDENTITY):
            return f"column {field.name!r} is {field.type}, not {want}"
    return None


def _kind(schema: pa.Schema) -> str:
    return "events" if schema.equals(EVENT_SCHEMA) else "steps"


class _RecordSegment:
    """A plain record segment (``hyperacc.records``) behind the part of ``pq.ParquetFile``'s interface
    the readers use: its whole table is read on opening (one flush of one rank: small)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.table: pa.Table = records.to_table(path)
        self.schema_arrow = self.table.schema
        self.metadata = _RecordMetadata(self.table.num_rows)

    def read(self, columns: Sequence[str] | None = None, use_threads: bool = True) -> pa.Table:
        return self.table if columns is None else self.table.select(list(columns))


class _RecordMetadata:
    num_row_groups = 0  # no Parquet statistics: readers that want the step range read the rows

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows


def is_record_segment(path: str | os.PathLike) -> bool:
    return str(path).endswith(records.SUFFIX)


def _open_file(path: str | os.PathLike, **parquet: Any) -> Any:
    """A segment opened for reading: ``pq.ParquetFile``, or a plain record segment's table."""
    return _RecordSegment(path) if is_record_segment(path) else pq.ParquetFile(path, **parquet)


def open_segment(path: str | os.PathLike, schema: pa.Schema) -> pq.ParquetFile | None:
    """The segment at ``path`` opened (no data read) when its columns fit ``schema``; else None,
    with one warning naming the file and why. Raises ``SegmentGone`` when the file is gone (a
    compaction replaced it since it was listed: list again)."""
    try:
        pf = _open_file(path, pre_buffer=False)
        problem = segment_problem(pf.schema_arrow, schema, REQUIRED[_kind(schema)])
    except FileNotFoundError as exc:
        raise SegmentGone(f"{path} was compacted while it was being read") from exc
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
    m = _RANK_DIR.match(Path(path).parent.name) if path else None
    return int(m.group(1)) if m else None


def read_segment(
    path: str | os.PathLike, schema: pa.Schema | None, columns: Sequence[str] | None = None
) -> pa.Table | None:
    """One segment, checked and conformed to ``schema`` (``columns`` of it when given), or None with
    one warning when it does not fit or cannot be read. ``schema`` None: the segment as written (rank
    0's gathered windows, whose columns grow)."""
    if schema is None:
        try:
            table = _open_file(path).read(columns=columns, use_threads=False)
        except (OSError, pa.ArrowException, ValueError) as exc:
            warn_once(path, f"skipping unreadable segment {path} ({exc}); the rest of the run is analysed")
            return None
        return table
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
        return [p for d in sorted(root.glob("rank-*")) for p in live_segments(d)]
    except OSError as exc:
        log.warning("cannot list %s (%s); its segments are not read", root, exc)
        return []


def _read_listed(
    list_paths: Callable[[], Iterable[Path]], read: Callable[[Path], pa.Table | None], tries: int = 20
) -> list[pa.Table]:
    """``read`` every listed segment; when one was compacted away meanwhile, list again and start over."""
    for _ in range(tries - 1):
        try:
            return [t for path in list_paths() if (t := read(path)) is not None and t.num_rows]
        except SegmentGone:
            continue
    return [t for path in list_paths() if (t := read(path)) is not None and t.num_rows]


def _read_segments(paths: Callable[[], Iterable[Path]], schema: pa.Schema, columns: list[str] | None) -> pa.Table:
    tables = _read_listed(paths, lambda path: read_segment(path, schema, columns))
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
    """Every rank's step records that fit ``STEP_SCHEMA``, sorted by (rank, step), one row per step: of a
    step recorded twice (a job resumed from a checkpoint ran the steps after it again) the later record,
    as ``analysis.columns.read_rank`` keeps it."""
    unknown = [c for c in columns or () if STEP_SCHEMA.get_field_index(c) < 0]
    if unknown:
        raise ValueError(f"unknown step column(s) {unknown}; see hyperacc.schema.STEP_SCHEMA")
    table = _read_segments(lambda: _segments_of(run_dir, "steps"), STEP_SCHEMA, columns)
    if table.num_rows and {"rank", "step"} <= set(table.column_names):
        table = table.sort_by([("rank", "ascending"), ("step", "ascending")])  # stable: written order kept
        rank = table.column("rank").to_numpy(zero_copy_only=False)
        step = table.column("step").to_numpy(zero_copy_only=False)
        again = (rank[1:] == rank[:-1]) & (step[1:] == step[:-1])  # row i is written again at row i + 1
        if again.any():
            table = table.filter(pa.array(np.concatenate([~again, [True]])))
    return table


def read_events(run_dir: str | os.PathLike | Sequence[str | os.PathLike]) -> pa.Table:
    """Every rank's events that fit ``EVENT_SCHEMA`` (of one run directory, or of several of one job)."""
    return _read_segments(lambda: _segments_of(run_dir, "events"), EVENT_SCHEMA, None)


def read_rank_events(run_dir: str | os.PathLike, rank: int) -> list[pa.Table]:
    """One rank's events that fit ``EVENT_SCHEMA`` (an export reads one rank at a time)."""
    return _read_listed(lambda: live_segments(events_dir(run_dir, rank)),
                        lambda path: read_segment(path, EVENT_SCHEMA, None))  # fmt: skip


def read_resources(run_dir: str | os.PathLike | Sequence[str | os.PathLike]) -> pa.Table:
    """Every rank's resource samples (RESOURCE_SCHEMA), sorted by (rank, time)."""
    table = _read_segments(lambda: _segments_of(run_dir, "resources"), RESOURCE_SCHEMA, None)
    if table.num_rows:
        table = table.sort_by([("rank", "ascending"), ("t_ns", "ascending")])
    return table


def read_live_windows(run_dir: str | os.PathLike) -> pa.Table:
    """The window summaries rank 0 gathered while the job ran, each once across compactions (empty when
    it wrote none)."""
    paths = live_segments(live_windows_dir(check_run_dir(run_dir)))
    tables = [t for t in (read_segment(p, None) for p in paths) if t is not None]
    return pa.concat_tables(tables, promote_options="permissive") if tables else pa.table({})


def read_live_events(run_dir: str | os.PathLike) -> pa.Table:
    """The node agent's live verdicts (``live_finding``, ``window_gathered``; EVENT_SCHEMA), each once."""
    return _read_segments(lambda: live_segments(live_events_dir(check_run_dir(run_dir))), EVENT_SCHEMA, None)


def step_writer(run_dir: str | os.PathLike, rank: int) -> SegmentWriter:
    return SegmentWriter(steps_dir(run_dir, rank), STEP_SCHEMA)


def event_writer(run_dir: str | os.PathLike, rank: int) -> SegmentWriter:
    return SegmentWriter(events_dir(run_dir, rank), EVENT_SCHEMA)


def resource_writer(run_dir: str | os.PathLike, rank: int) -> SegmentWriter:
    return SegmentWriter(resources_dir(run_dir, rank), RESOURCE_SCHEMA)


def live_windows_writer(run_dir: str | os.PathLike) -> SegmentWriter:
    """Gathered window summaries written as Parquet (benchmarks and tests; rank 0 itself writes plain
    record segments, ``analysis.live_aggregate``); the schema is the first table's (columns grow)."""
    return SegmentWriter(live_windows_dir(run_dir), None)

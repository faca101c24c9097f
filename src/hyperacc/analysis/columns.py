"""Reading a run directory one rank at a time, as numpy columns.

The analysis never holds the whole run: ``diagnose`` reads one rank's segments (pyarrow, only the
columns it needs), reduces them to window summaries and spike tallies, and drops them before the next
rank. Memory is bounded by the longest rank (about 8 bytes x steps x columns), not by ranks x steps.

Every segment is checked against ``STEP_SCHEMA`` first (``hyperacc.store``): one that cannot be read
(truncated by a SIGKILL) or whose columns do not fit (foreign columns, text in a number column) is
skipped with one warning naming the file. Nulls become NaN: a value that was not measured is never
read as zero. ``analyze``, ``report`` and ``export`` all read through here, so they skip the same.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from hyperacc import records, store
from hyperacc.schema import ANALYSIS_COLUMNS, STEP_SCHEMA, RankMeta

log = logging.getLogger(__name__)
T = TypeVar("T")

_RANK_DIR = re.compile(r"^rank-(\d{1,7})$")
_IDENTITY = ("rank", "node", "step")

@dataclasses.dataclass
class RankSource:
    """Where one rank's step records live."""

    rank: int
    node: int | None  # from the rank's metadata; None until read from its records
    segments: list[Path]


@dataclasses.dataclass
class RunLayout:
    run_dir: Path  # the first of ``run_dirs``
    metas: dict[int, RankMeta]
    sources: dict[int, RankSource]  # ranks that have at least one segment
    world_size: int
    run_dirs: list[Path] = dataclasses.field(default_factory=list)  # every run directory of the job

    @property
    def name(self) -> str:
        """The run directories as the user wrote them, joined by commas."""
        return ",".join(str(d) for d in self.run_dirs) if len(self.run_dirs) > 1 else str(self.run_dir)

    @property
    def missing_ranks(self) -> list[int]:
        """Ranks the metadata promises (0..world_size-1) that have no step records at all."""
        return [r for r in range(self.world_size) if r not in self.sources]


def discover(run_dir: str | os.PathLike | Sequence[str | os.PathLike]) -> RunLayout:
    """The ranks of a run directory and their segments. Raises ``store.RunDirError`` for a bad path.

    A folder whose name is not ``rank-<number below store.MAX_RANKS>`` is not a rank's; metadata
    that does not describe a rank is skipped with a warning (``store.read_meta``). Several run
    directories of one job (agents with local disks) are merged after ``merge_layouts`` checked that
    they belong together.
    """
    dirs = store.run_dir_list(run_dir)
    if len(dirs) != 1:
        if not dirs:
            raise store.RunDirError("no run directory given; pass the --run-dir of a traced job")
        return merge_layouts([_discover_one(d) for d in dirs])
    return _discover_one(dirs[0])


def _discover_one(run_dir: str | os.PathLike) -> RunLayout:
    root = store.check_run_dir(run_dir)
    metas = store.read_meta(root)
    sources: dict[int, RankSource] = {}
    steps_root = root / "steps"
    try:
        subs = sorted(steps_root.iterdir()) if steps_root.is_dir() else []
    except OSError as exc:
        raise store.RunDirError(f"cannot list {steps_root}: {exc.strerror or exc}") from None
    for sub in subs:
        m = _RANK_DIR.match(sub.name)
        if not m or int(m.group(1)) >= store.MAX_RANKS or not sub.is_dir():
            continue
        try:
            segments = store.live_segments(sub)  # a compacted file's segments once, never twice
        except OSError as exc:
            log.warning("cannot list %s (%s); rank %s is left out", sub, exc, m.group(1))
            continue
        if segments:
            rank = int(m.group(1))
            meta = metas.get(rank)
            sources[rank] = RankSource(rank, meta.node if meta else None, segments)
    world = max([m.world_size for m in metas.values()] + [r + 1 for r in sources] + [0])
    return RunLayout(root, metas, sources, world, [root])


def merge_layouts(layouts: Sequence[RunLayout]) -> RunLayout:
    """One job from the run directories its agents wrote (one per node with local disks).

    They belong together when their metadata agree on the world size, no rank has step records in two
    of them, and their steps overlap in wall-clock time; otherwise ``store.RunDirError`` names the two
    directories and what differs (docs/presentation.md, "Several run directories of one job").
    """
    roots = [lay.run_dir for lay in layouts]
    if len(set(roots)) != len(roots):
        raise store.RunDirError(f"the same run directory is given twice ({', '.join(map(str, roots))}); "
                                "give each agent's run directory once")  # fmt: skip
    sizes = {}
    for lay in layouts:
        for m in lay.metas.values():
            sizes.setdefault(m.world_size, lay.run_dir)
    if len(sizes) > 1:
        (wa, da), (wb, db) = list(sizes.items())[:2]
        raise store.RunDirError(
            f"{da} (world size {wa}) and {db} (world size {wb}) are not of one job: their metadata give "
            "different world sizes; compare different jobs with `hyperacc compare A B`"
        )
    owner: dict[int, Path] = {}
    for lay in layouts:
        for rank in lay.sources:
            if rank in owner:
                raise store.RunDirError(
                    f"rank {rank} has step records in both {owner[rank]} and {lay.run_dir}: these are not the "
                    "run directories of one job's agents (each rank writes to one); compare different runs "
                    "with `hyperacc compare A B`"
                )
            owner[rank] = lay.run_dir
    spans = [(s, lay.run_dir) for lay in layouts if (s := _wall_span(lay)) is not None]
    for i, ((lo_a, hi_a), da) in enumerate(spans):
        for (lo_b, hi_b), db in spans[i + 1 :]:
            if hi_a < lo_b or hi_b < lo_a:
                raise store.RunDirError(
                    f"{da} and {db} are not of one job: their steps do not overlap in time; compare "
                    "different runs with `hyperacc compare A B`"
                )
    metas: dict[int, RankMeta] = {}
    sources: dict[int, RankSource] = {}
    for lay in layouts:
        metas.update({r: m for r, m in lay.metas.items() if r in lay.sources or r not in metas})
        sources.update(lay.sources)
    world = max([lay.world_size for lay in layouts] + [0])
    return RunLayout(roots[0], metas, dict(sorted(sources.items())), world, roots)


def _wall_span(layout: RunLayout) -> tuple[float, float] | None:
    """(earliest, latest) wall-clock step start of a layout, from each rank's first and last segment."""
    lo, hi = math.inf, -math.inf
    for src in layout.sources.values():
        for path in {src.segments[0], src.segments[-1]}:
            cols = read_rank([path], ("t_start_ns",))
            t = cols["t_start_ns"][np.isfinite(cols["t_start_ns"])]
            if t.size:
                lo, hi = min(lo, float(t.min())), max(hi, float(t.max()))
    return (lo, hi) if lo <= hi else None


def _readable(paths: Iterable[Path]) -> Iterable[tuple[Path, pq.ParquetFile]]:
    """The segments whose columns fit ``STEP_SCHEMA``, opened (``store.open_segment``: the others are
    skipped with one warning naming the file and what did not fit)."""
    for path in paths:
        pf = store.open_segment(path, STEP_SCHEMA)
        if pf is not None:
            yield path, pf


def _read(path: Path, pf: pq.ParquetFile, columns: Iterable[str]) -> pa.Table | None:
    """The segment's ``columns`` (and its identity columns, which decide which rows are kept),
    conformed to ``STEP_SCHEMA``."""
    names = set(pf.schema_arrow.names)
    want = list(dict.fromkeys([*_IDENTITY, *columns]))
    try:
        # One rank's segments are small: threads cost more than they save (and ranks already stream).
        table = pf.read(columns=[c for c in want if c in names], use_threads=False)
    except (OSError, pa.ArrowException, ValueError) as exc:
        store.warn_once(path, f"skipping unreadable segment {path} ({exc}); the rest of the run is analysed")
        return None
    return store.conform(table, pa.schema([STEP_SCHEMA.field(c) for c in want]), path)


def _relisted(paths: Sequence[Path]) -> list[Path]:
    """The files that hold ``paths``' segments now (a compaction may have rolled them into one)."""
    out: list[Path] = []
    for parent in dict.fromkeys(p.parent for p in paths):
        ranges = [r for p in paths if p.parent == parent and (r := store.segment_range(p)) is not None]
        if not ranges:
            continue
        lo, hi = min(r[0] for r in ranges), max(r[1] for r in ranges)
        for p in store.live_segments(parent):
            r = store.segment_range(p)
            if r is not None and r[0] <= hi and r[1] >= lo:
                out.append(p)
    return out


def _retrying(paths: Sequence[Path], read: Callable[[Sequence[Path]], T]) -> T:
    """``read(paths)``, listed again when a compaction removed one of them while it was being read."""
    for _ in range(20):
        try:
            return read(paths)
        except store.SegmentGone:
            paths = _relisted(paths)
    return read(paths)


def step_bounds(paths: Sequence[Path]) -> tuple[int, int] | None:
    """(first, last) step over some segments, from Parquet statistics when present (no data read)."""
    return _retrying(paths, _step_bounds)


def _step_bounds(paths: Sequence[Path]) -> tuple[int, int] | None:
    lo: int | None = None
    hi: int | None = None
    for path, pf in _readable(paths):
        seg_lo = seg_hi = None
        try:
            idx = pf.schema_arrow.get_field_index("step")
            md = pf.metadata
            stats = [md.row_group(i).column(idx).statistics for i in range(md.num_row_groups)]
            if stats and all(s is not None and s.has_min_max and s.null_count == 0 for s in stats):
                seg_lo, seg_hi = min(s.min for s in stats), max(s.max for s in stats)
        except (OSError, pa.ArrowException, ValueError, TypeError):
            seg_lo = seg_hi = None
        if seg_lo is None or not (-store.MAX_STEP <= seg_lo and seg_hi <= store.MAX_STEP):
            # no statistics, or rows the readers leave out: the rows that are kept decide
            table = _read(path, pf, ("step",))
            if table is None or not table.num_rows:
                continue
            mm = pc.min_max(table.column("step"))
            seg_lo, seg_hi = mm["min"].as_py(), mm["max"].as_py()
        lo = seg_lo if lo is None else min(lo, seg_lo)
        hi = seg_hi if hi is None else max(hi, seg_hi)
    return None if lo is None else (int(lo), int(hi))


# Below this many segments the file-by-file path is as fast (docs/detection.md, "Analysis at scale").
FAST_MIN_SEGMENTS = 4
_FORMAT = ds.ParquetFileFormat()
_LOCAL = pafs.LocalFileSystem()


def _read_fast(paths: Sequence[Path], columns: Sequence[str]) -> list[pa.Table] | None:
    """Many segments of one rank as one pyarrow dataset: the footers are read in C++, the columns in
    parallel, and nothing runs per file in Python. Only when every segment is exactly what the tracer
    writes (its schema is ``STEP_SCHEMA``), its identity columns hold no null and its steps lie within
    +-2**53, and the steps come out in order; otherwise None, and ``read_rank`` reads file by file
    with the checks and warnings of ``store.open_segment``, giving the same rows."""
    if len(paths) < FAST_MIN_SEGMENTS or any(store.is_record_segment(p) for p in paths):
        return None  # plain record segments (not yet compacted) are read file by file
    want = list(dict.fromkeys([*_IDENTITY, *columns]))
    try:
        frags = [_FORMAT.make_fragment(str(p), _LOCAL) for p in paths]
        if not all(f.physical_schema.equals(STEP_SCHEMA) for f in frags):
            return None
        table = ds.FileSystemDataset(frags, STEP_SCHEMA, _FORMAT, _LOCAL).to_table(columns=want, use_threads=True)
    except FileNotFoundError:
        raise store.SegmentGone("a segment was compacted while it was being read") from None
    except (OSError, pa.ArrowException, ValueError):
        return None
    if not _kept_whole(table):
        return None
    step = table.column("step")
    if len(step) > 1:
        values = step.to_numpy()
        if not bool(np.all(values[1:] > values[:-1])):
            return None  # out of order or written twice: the file-by-file path keeps the last record
    return [table] if table.num_rows else None


def _kept_whole(table: pa.Table) -> bool:
    """Whether ``store.conform`` keeps every row of ``table`` (it drops, with a warning naming the file,
    rows whose identity is null or whose step lies beyond +-2**53)."""
    if any(c in table.column_names and table.column(c).null_count for c in _IDENTITY):
        return False
    mm = pc.min_max(table.column("step"))
    lo, hi = mm["min"].as_py(), mm["max"].as_py()
    return lo is None or (-store.MAX_STEP <= lo and hi <= store.MAX_STEP)


def _read_segments(paths: Sequence[Path], columns: Sequence[str]) -> list[pa.Table]:
    """One rank's segments as tables: its plain record segments (not yet compacted) at once where they
    allow it, its Parquet segments as one dataset where they allow it, else file by file."""
    recs = [p for p in paths if store.is_record_segment(p)]
    tables = _read_records(recs, columns)
    if tables is not None:
        paths = [p for p in paths if not store.is_record_segment(p)]
    else:
        tables = []
    return tables + (_read_fast(paths, columns) or [
        t for path, pf in _readable(paths) if (t := _read(path, pf, columns)) is not None and t.num_rows])  # fmt: skip


def _read_records(paths: Sequence[Path], columns: Sequence[str]) -> list[pa.Table] | None:
    """Many plain record segments of one rank as one table: each file's header and int64 rows read
    with numpy (a few tens of microseconds a file), the rows of all files joined and turned into Arrow
    once. Only when every file is an int64 step record with the same columns and the rows need nothing
    dropped or nulled by ``store.conform``; otherwise None, and the files are read one by one with its
    checks and warnings, giving the same rows (docs/detection.md, "Many segments per rank")."""
    if len(paths) < FAST_MIN_SEGMENTS:
        return None
    try:
        read = records.read_many(paths)
    except FileNotFoundError:
        raise store.SegmentGone("a segment was compacted while it was being read") from None
    except (OSError, records.RecordError):
        return None
    first = read[0][0]
    heads = {id(h): h for h, _ in read}.values()  # the distinct headers (``read_many`` shares them)
    if any(h["schema"] != "STEP_SCHEMA" or h["encoding"] != "int64" or h["columns"] != first["columns"] for h in heads):
        return None
    names = first["columns"]
    if store.segment_problem(records.rows_table("STEP_SCHEMA", names, read[0][1][:0]).schema, STEP_SCHEMA,
                             store.REQUIRED["steps"]) is not None:  # fmt: skip
        return None
    want = list(dict.fromkeys([*_IDENTITY, *columns]))
    table = records.rows_table("STEP_SCHEMA", names, np.concatenate([rows for _, rows in read]), keep=set(want))
    if not _kept_whole(table):
        return None
    table = table.select([c for c in want if c in table.column_names])
    return [store.conform(table, pa.schema([STEP_SCHEMA.field(c) for c in want]), paths[0])] if table.num_rows else []


def release_freed() -> None:
    """Give what reading freed back to the system. Arrow's memory pool keeps the buffers of every table
    read, and the C allocator the freed blocks of the reading threads' heaps, in case they are needed
    again; after all ranks were read they are not, and they were 40 % of ``diagnose``'s resident
    memory at 1,000 x 1e5 (docs/detection.md, "Scale"). Where the C library has no
    ``malloc_trim`` (it is glibc's), only Arrow's pool is released."""
    pa.default_memory_pool().release_unused()
    if _TRIM is not None:
        _TRIM(0)


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS), or no C library to load
        return None


_TRIM = _malloc_trim()


_RELEASE_ROWS = 1_000_000  # a rank read with this many rows gives Arrow's freed memory back


def read_rank(paths: Sequence[Path], columns: Sequence[str] = ANALYSIS_COLUMNS) -> dict[str, np.ndarray]:
    """One rank's step records as numpy columns, sorted by step, one row per step (the last wins).

    ``step``, ``rank`` and ``node`` are int64 (-1 where a segment did not record the node); every
    other column is float64 with NaN where the value was not measured (null, or a column the segment
    does not have). Segments that do not fit ``STEP_SCHEMA`` are skipped (``store.open_segment``),
    as are rows without a step or with a step beyond +-2**53 (``store.conform``).
    """
    _check_columns(columns)
    return _as_columns(_retrying(paths, lambda ps: _read_segments(ps, columns)), columns)


def _check_columns(columns: Sequence[str]) -> None:
    unknown = [c for c in columns if STEP_SCHEMA.get_field_index(c) < 0]
    if unknown:
        raise ValueError(f"unknown step column(s) {unknown}; see hyperacc.schema.STEP_SCHEMA")


def _as_columns(tables: list[pa.Table], columns: Sequence[str]) -> dict[str, np.ndarray]:
    """Tables of one rank's segments -> ``read_rank``'s columns (the tables are consumed)."""
    if not tables:
        return {c: np.empty(0, dtype=np.int64 if c in _IDENTITY else np.float64) for c in columns}
    table = pa.concat_tables(tables)
    tables.clear()  # each column's buffers go once it is converted (below): a rank of a week is 6e6 rows
    steps = table.column("step").to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    order: np.ndarray | None = None
    if steps.size > 1 and not bool(np.all(steps[1:] > steps[:-1])):
        order = np.argsort(steps, kind="stable")
        ordered = steps[order]
        # A step written twice (a resumed writer) keeps its last record.
        keep = np.ones(ordered.size, dtype=bool)
        keep[:-1] = ordered[1:] != ordered[:-1]
        order = order[keep]
    out: dict[str, np.ndarray] = {}
    for name in dict.fromkeys(columns):
        col = table.column(name)
        table = table.drop_columns([name])
        if name in _IDENTITY:
            arr = pc.fill_null(col, -1).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        elif col.null_count == len(col):
            # a column the rank never measured (device clocks on a CPU job, ...): one read-only NaN
            # shared by every row, not 8 bytes a row written (a dozen such columns per rank)
            arr = np.broadcast_to(np.float64(np.nan), (len(col),))
        else:
            # safe=False: wall-clock ns exceed 2**53 and lose their last digits as float64, which is fine here
            arr = col.cast(pa.float64(), safe=False).to_numpy(zero_copy_only=False)
        out[name] = arr if order is None else arr[order]
    if steps.size >= _RELEASE_ROWS:
        # Arrow's pool keeps what the Parquet decoding and the table freed (twice the columns of a rank
        # of 6e6 steps: 2 GB), and a thread reading the next rank adds to it
        pa.default_memory_pool().release_unused()
    return out


class NotInChunks(Exception):
    """A rank's segments cannot be read in chunks of steps (``read_rank_chunks``): two of them hold the
    same steps or are out of order (a resumed writer), or a compaction replaced one while it was read.
    Read the rank whole (``read_rank``)."""


_CHUNK_GROUP = 64  # the most segments ``read_rank_chunks`` reads at once


def read_rank_chunks(
    paths: Sequence[Path], chunk_rows: int, columns: Sequence[str] = ANALYSIS_COLUMNS
) -> Iterator[dict[str, np.ndarray]]:
    """One rank's columns as ``read_rank`` gives them, in consecutive chunks of about ``chunk_rows``
    rows or more (the last one shorter), so that a rank of a week is never held whole: memory follows
    ``chunk_rows`` and the largest segment. Segments are read in their order, which is the order of
    their steps for a tracer's segments, as many at once as the segments read last suggest make
    ``chunk_rows`` (at most ``_CHUNK_GROUP``). Raises ``NotInChunks`` (at the chunk that shows it) where
    a chunk's steps do not all come after the previous chunk's."""
    _check_columns(columns)
    last: int | None = None
    pending: list[pa.Table] = []
    rows = 0
    group = 1  # segments to read next: as many as make ``chunk_rows`` at the size of the last ones read
    i = 0
    while i < len(paths):
        try:
            tables = _read_segments(paths[i:i + group], columns)
        except store.SegmentGone:
            raise NotInChunks("a segment was compacted while the rank was read in chunks") from None
        i += group
        read = sum(t.num_rows for t in tables)
        per_segment = max(1, read // group)
        pending += tables
        rows += read
        if rows < chunk_rows and i < len(paths):
            group = min(_CHUNK_GROUP, max(1, (chunk_rows - rows) // per_segment))
            continue
        group = min(_CHUNK_GROUP, max(1, chunk_rows // per_segment))
        cols = _as_columns(pending, columns)
        rows = 0
        steps = cols["step"]
        if not steps.size:
            continue
        if last is not None and int(steps[0]) <= last:
            raise NotInChunks("two segments hold the same steps, or their steps are out of order")
        last = int(steps[-1])
        yield cols

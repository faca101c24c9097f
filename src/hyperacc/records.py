"""Plain record segments: what a training rank writes, with numpy and json only (no pyarrow in a rank).

A rank's flusher thread writes each flush as one file ``seg-NNNNNN.rec`` beside the Parquet segments
of the same folder (one numbering for both):

- line 1, a JSON header: ``{"format": "hyperacc-records", "version": 1, "schema": "STEP_SCHEMA",
  "encoding": "int64", "columns": [...], "rows": n}``;
- then the rows: ``int64`` little-endian, row after row, one value per column, -1 where not measured
  (``gc_max_gen``: -1 is "no collection"); or ``jsonl``, one JSON list per row in column order (events,
  whose kind and detail are text).

A file is written to a temporary name and renamed into place, so a reader sees all of it or nothing;
one whose length disagrees with its header (a truncated copy) is refused with a message naming it.
``store.compact`` (the node agent ``hyperacc run``, or the rank when no agent runs) rolls these files
into Parquet; ``to_table`` turns one into Arrow for every reader (``store.read_segment``). Measured:
pyarrow costs a rank 41 MiB on import and 11 MiB more once it writes Parquet (docs/tracing.md,
"What a rank carries").
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hyperacc.schema import NEG_ONE_IS_VALUE, RankMeta, fields, meta_path

SUFFIX = ".rec"
FORMAT = "hyperacc-records"
VERSION = 1
# A segment's name: seg-n (one flush) or seg-lo-hi (a compacted period, Parquet only).
SEGMENT_NAME = re.compile(r"^seg-(\d+)(?:-(\d+))?\.(?:parquet|rec)$")
_LE_INT64 = np.dtype("<i8")


class RecordError(ValueError):
    """A plain record file that cannot be read; the message names it and what is wrong."""


def write_atomically(path: Path, write: Callable[[Path], Any]) -> None:
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


def write_meta(run_dir: str | os.PathLike, meta: RankMeta) -> None:
    path = meta_path(run_dir, meta.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda tmp: tmp.write_text(meta.to_json()))


def segment_range(path: str | os.PathLike) -> tuple[int, int] | None:
    """The segment numbers a segment file holds: (n, n) for ``seg-n``, (lo, hi) for a compacted
    ``seg-lo-hi``; None for any other name."""
    return name_range(os.path.basename(path))  # not ``Path(path).name``: 9 us a file of thousands


def name_range(name: str) -> tuple[int, int] | None:
    """``segment_range`` of a file name."""
    m = SEGMENT_NAME.match(name)
    if m is None:
        return None
    lo = int(m.group(1))
    return lo, int(m.group(2)) if m.group(2) is not None else lo


class RecordWriter:
    """Appends rows of one schema to ``directory`` as numbered plain record segments (training ranks)."""

    def __init__(self, directory: str | os.PathLike, schema: str) -> None:
        self.directory = Path(directory)
        self.schema = schema
        self.columns = columns_of(schema)
        self.directory.mkdir(parents=True, exist_ok=True)
        existing = [r[1] for p in self.directory.iterdir() if (r := segment_range(p)) is not None]
        self._next = max(existing, default=0) + 1
        self.written = 0  # segments this writer wrote (a compactor counts them)

    def _header(self, rows: int, encoding: str, columns: Sequence[str]) -> bytes:
        head = {"format": FORMAT, "version": VERSION, "schema": self.schema, "encoding": encoding,
                "columns": list(columns), "rows": rows}  # fmt: skip
        return json.dumps(head, separators=(",", ":")).encode() + b"\n"

    def _write(self, payload: Callable[[Any], None], rows: int, encoding: str, columns: Sequence[str]) -> Path:
        final = self.directory / f"seg-{self._next:06d}{SUFFIX}"

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as f:
                f.write(self._header(rows, encoding, columns))
                payload(f)

        write_atomically(final, write)
        self._next += 1
        self.written += 1
        return final

    def write_int64(self, rows: np.ndarray) -> Path | None:
        """Rows of int64 values, one column per schema field in order (-1: not measured)."""
        if len(rows) == 0:
            return None
        if rows.ndim != 2 or rows.shape[1] != len(self.columns):
            raise ValueError(f"{self.schema} rows need {len(self.columns)} columns, got shape {rows.shape}")
        data = np.ascontiguousarray(rows, dtype=_LE_INT64)
        return self._write(lambda f: f.write(data.tobytes()), len(rows), "int64", self.columns)

    def write_json(self, rows: Sequence[Sequence[Any]], columns: Sequence[str] | None = None) -> Path | None:
        """Rows of JSON values (None: null), one per column: the schema's fields in order, or ``columns``
        (rank 0's gathered windows, whose columns grow with the detector's; columns the schema does not
        type are read with the types their values have)."""
        if not rows:
            return None
        text = "".join(json.dumps(list(r), separators=(",", ":")) + "\n" for r in rows).encode()
        return self._write(lambda f: f.write(text), len(rows), "jsonl", self.columns if columns is None else columns)


def read_header(path: str | os.PathLike) -> dict[str, Any]:
    """The header of a plain record file (its schema, columns and row count), without its rows."""
    with open(path, "rb") as f:
        return _parse_header(f.readline(), path)


def _parse_header(line: bytes, path: str | os.PathLike) -> dict[str, Any]:
    try:
        head = json.loads(line)
    except ValueError:
        head = None
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        raise RecordError(f"{path} is not a hyperacc record segment (no header line)")
    if head.get("version") != VERSION:
        raise RecordError(f"{path} is record format version {head.get('version')!r}; this hyperacc reads {VERSION}")
    columns, rows = head.get("columns"), head.get("rows")
    if not isinstance(columns, list) or not all(isinstance(c, str) for c in columns):
        raise RecordError(f"{path}: the header's columns are not a list of names")
    if not isinstance(rows, int) or rows < 0 or head.get("encoding") not in ("int64", "jsonl"):
        raise RecordError(f"{path}: the header's rows or encoding are not valid")
    return head


def read(path: str | os.PathLike) -> tuple[dict[str, Any], Any]:
    """(header, rows): an int64 matrix, or a list of JSON lists. Raises ``RecordError`` for a file that
    is not a record segment, is truncated or holds more than its header says."""
    return _decode(Path(path).read_bytes(), path, {})


def read_many(paths: Sequence[str | os.PathLike]) -> list[tuple[dict[str, Any], Any]]:
    """``read`` of many files (one rank's flushes since its last compaction: thousands after a long run
    without one), each distinct header line parsed once: a writer's files share theirs but for the row
    count of a shorter flush. The same checks and errors as ``read``."""
    seen: dict[bytes, dict[str, Any]] = {}
    out = []
    for path in paths:
        with open(path, "rb", buffering=0) as f:  # one read of the whole file, no buffer object
            out.append(_decode(f.readall(), path, seen))
    return out


def _decode(data: bytes, path: str | os.PathLike, seen: dict[bytes, dict[str, Any]]) -> tuple[dict[str, Any], Any]:
    end = data.find(b"\n")
    if end < 0:
        raise RecordError(f"{path} is not a hyperacc record segment (no header line)")
    line = data[:end]
    head = seen.get(line)
    if head is None:
        head = seen[line] = _parse_header(line, path)
    body = memoryview(data)[end + 1 :]
    n, width = head["rows"], len(head["columns"])
    if head["encoding"] == "int64":
        if len(body) != n * width * 8:
            raise RecordError(f"{path} holds {len(body)} bytes of rows where its header says {n} rows of {width} "
                              "columns: it is truncated or damaged; remove it to read the rest")  # fmt: skip
        return head, np.frombuffer(body, dtype=_LE_INT64).reshape(n, width)
    lines = bytes(body).decode().splitlines()
    if len(lines) != n:
        raise RecordError(f"{path} holds {len(lines)} lines where its header says {n}: it is truncated or damaged")
    try:
        rows = [json.loads(line) for line in lines]
    except ValueError as exc:
        raise RecordError(f"{path}: a row is not JSON ({exc})") from None
    if any(not isinstance(r, list) or len(r) != width for r in rows):
        raise RecordError(f"{path}: a row does not have {width} values")
    return head, rows


def columns_of(schema: str) -> list[str]:
    """The column names of one schema (``"STEP_SCHEMA"``, ...), in order."""
    return [name for name, _, _ in fields(schema)]


def to_table(path: str | os.PathLike) -> Any:
    """A plain record file as a ``pyarrow.Table`` (readers only: imports pyarrow)."""
    head, rows = read(path)
    return rows_table(head["schema"], head["columns"], rows)


def rows_table(schema: str, columns: Sequence[str], rows: Any, keep: Collection[str] | None = None) -> Any:
    """Rows (an int64 matrix, or JSON lists) of ``schema`` as a ``pyarrow.Table`` with its types.

    Columns the rows lack are left out (``store.conform`` fills them as not measured); -1 in int64 rows
    is null, except where -1 is a value (``gc_max_gen``); booleans are values above 0. ``keep``: only
    these columns (readers that need a few of them skip converting the rest).
    """
    import pyarrow as pa

    try:
        types = {name: (kind, nullable) for name, kind, nullable in fields(schema)}
    except KeyError:
        types = {}
    int64 = isinstance(rows, np.ndarray)
    arrays, schema = [], []
    for j, name in enumerate(columns):
        if keep is not None and name not in keep:
            continue
        kind, nullable = types.get(name, ("int64" if int64 else "", True))
        if not kind:  # a column no schema types: what its values are
            arrays.append(pa.array([r[j] for r in rows]))
            schema.append(pa.field(name, arrays[-1].type))
            continue
        target = getattr(pa, kind)()
        schema.append(pa.field(name, target, nullable=nullable))
        if int64:
            col = rows[:, j]
            mask = col == -1 if nullable and name not in NEG_ONE_IS_VALUE else None
            if mask is not None and not mask.any():
                mask = None
            values = col > 0 if kind == "bool_" else col.astype(target.to_pandas_dtype())
            arrays.append(pa.array(values, type=target, mask=mask))
        else:
            arrays.append(pa.array([r[j] for r in rows], type=target))
    return pa.Table.from_arrays(arrays, schema=pa.schema(schema))

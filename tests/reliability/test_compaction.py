"""Compaction of a rank's segments (docs/tracing.md, "Storage"): every reader sees every row exactly
once before, during and after a compaction, also when one is killed at any point, and a follower that
read some segments reads only the rest after they were rolled into one file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from reliability_runs import JOBS

from hyperacc import store
from hyperacc.analysis.columns import discover, read_rank
from hyperacc.schema import STEP_SCHEMA

ROWS = 10  # steps per small segment


def _segment(writer: store.SegmentWriter, first: int) -> None:
    steps = np.arange(first, first + ROWS)
    table = pa.table({"rank": pa.array([0] * ROWS, pa.int32()), "node": pa.array([0] * ROWS, pa.int32()),
                      "step": pa.array(steps, pa.int64()), "step_ns": pa.array(steps * 1000 + 7, pa.int64())})  # fmt: skip
    writer.write(store.conform(table, STEP_SCHEMA))


def _rank_dir(root: Path, segments: int, compacted_first: int = 0) -> tuple[Path, store.SegmentWriter]:
    """Rank 0 of a run with ``segments`` small segments; the first ``compacted_first`` of them already
    rolled into an open period's file."""
    writer = store.step_writer(root, 0)
    for i in range(compacted_first):
        _segment(writer, i * ROWS)
    if compacted_first:
        assert store.compact(writer.directory, STEP_SCHEMA, every=1) is not None
    for i in range(compacted_first, segments):
        _segment(writer, i * ROWS)
    return writer.directory, writer


def _exactly_once(root: Path, steps: int) -> None:
    every = np.arange(steps)
    table = store.read_steps(root, ["step"])
    assert table.column("step").to_numpy().tolist() == every.tolist()  # each once, none missing
    cols = read_rank(discover(root).sources[0].segments, ("step", "step_ns"))
    assert cols["step"].tolist() == every.tolist() and np.array_equal(cols["step_ns"], every * 1000 + 7.0)
    cursor_rows = [t.column("step") for t in store.SegmentCursor(store.steps_dir(root, 0)).read_new(["step"])]
    assert pa.chunked_array(cursor_rows).to_pylist() == every.tolist()


def test_compaction_rolls_segments_into_one_file_per_period(tmp_path: Path) -> None:
    rank_dir, writer = _rank_dir(tmp_path, 7)
    assert store.compact(rank_dir, STEP_SCHEMA, every=8) is None  # fewer than `every` waiting
    first = store.compact(rank_dir, STEP_SCHEMA, every=4)
    assert first is not None and first.name == "seg-000001-000007.parquet"
    for i in range(7, 12):
        _segment(writer, i * ROWS)
    second = store.compact(rank_dir, STEP_SCHEMA, every=4)  # the open period's file grows
    assert second is not None and second.name == "seg-000001-000012.parquet"
    assert sorted(p.name for p in rank_dir.iterdir()) == [second.name]
    _exactly_once(tmp_path, 12 * ROWS)
    # a full period (0 s, 0 rows) closes: the next segments open a new file
    _segment(writer, 12 * ROWS)
    third = store.compact(rank_dir, STEP_SCHEMA, every=1, period_s=0, min_rows=0)
    assert third is not None and third.name == "seg-000013-000013.parquet"
    assert len(list(rank_dir.iterdir())) == 2
    _exactly_once(tmp_path, 13 * ROWS)
    # a writer that starts again in the same directory numbers after the compacted ranges
    assert store.step_writer(tmp_path, 0).write(store.read_steps(tmp_path).slice(0, 1)).name == "seg-000014.parquet"


def test_an_unreadable_segment_is_left_and_ends_the_period(tmp_path: Path) -> None:
    rank_dir, writer = _rank_dir(tmp_path, 3)
    (rank_dir / "seg-000004.parquet").write_bytes(b"PAR1 truncated")
    writer._next = 5
    for i in range(3, 6):
        _segment(writer, i * ROWS)
    assert store.compact(rank_dir, STEP_SCHEMA, every=1).name == "seg-000001-000003.parquet"
    assert store.compact(rank_dir, STEP_SCHEMA, every=1).name == "seg-000005-000007.parquet"
    assert sorted(p.name for p in rank_dir.iterdir()) == [
        "seg-000001-000003.parquet", "seg-000004.parquet", "seg-000005-000007.parquet"]  # fmt: skip
    _exactly_once(tmp_path, 6 * ROWS)


def test_a_follower_reads_each_row_once_across_compactions(tmp_path: Path) -> None:
    rank_dir, writer = _rank_dir(tmp_path, 3)
    cursor = store.SegmentCursor(rank_dir)
    seen = [t.column("step") for t in cursor.read_new(["step"])]
    for i in range(3, 5):
        _segment(writer, i * ROWS)
    store.compact(rank_dir, STEP_SCHEMA, every=1)  # segments 1-3 read, 4-5 not yet: all in seg-1-5 now
    seen += [t.column("step") for t in cursor.read_new(["step"])]
    for i in range(5, 7):
        _segment(writer, i * ROWS)
    seen += [t.column("step") for t in cursor.read_new(["step"])]
    store.compact(rank_dir, STEP_SCHEMA, every=1)  # seg-1-7, every row already read
    seen += [t.column("step") for t in cursor.read_new(["step"], schema=STEP_SCHEMA)]
    assert pa.chunked_array(seen).to_pylist() == list(range(7 * ROWS))


def test_a_follower_that_starts_at_the_tail_reads_only_the_rows_it_keeps(tmp_path: Path) -> None:
    """``hyperacc watch`` of a long job reads the newest rows first, not the whole run: a cursor started
    at the tail reads exactly the last rows asked for (from a compacted file's row groups, then the small
    segments after it) and every new row after that; asked for more than there are, it reads them all."""
    import pyarrow.parquet as pq

    rank_dir, writer = _rank_dir(tmp_path, 9, compacted_first=6)
    compacted = next(p for p in rank_dir.iterdir() if p.stem.count("-") == 2)  # seg-lo-hi
    table = store.read_steps(tmp_path)
    pq.write_table(table.slice(0, 6 * ROWS), compacted, row_group_size=ROWS)  # row groups of 10 rows
    for tail in (25, 30, 45, 9 * ROWS, 10 * ROWS):
        cursor = store.SegmentCursor(rank_dir)
        cursor.start_at_tail(tail)
        seen = [t.column("step") for t in cursor.read_new(["step"], schema=STEP_SCHEMA)]
        assert pa.chunked_array(seen).to_pylist() == list(range(max(0, 9 * ROWS - tail), 9 * ROWS)), tail
    _segment(writer, 9 * ROWS)
    new = [t.column("step") for t in cursor.read_new(["step"])]
    assert pa.chunked_array(new).to_pylist() == list(range(9 * ROWS, 10 * ROWS))


@pytest.mark.parametrize("open_period", [False, True], ids=["first file", "growing the period's file"])
@pytest.mark.parametrize("where", ["write", "unlink-0", "unlink-1", "unlink-4"])
def test_a_compaction_killed_at_any_point_loses_and_duplicates_nothing(tmp_path: Path, where: str,
                                                                       open_period: bool) -> None:  # fmt: skip
    segments = 6
    rank_dir, _ = _rank_dir(tmp_path, segments, compacted_first=2 if open_period else 0)
    proc = subprocess.run([sys.executable, str(JOBS / "compact_killed.py"), str(rank_dir), where],
                          capture_output=True, text=True, timeout=120, env={**os.environ})  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    _exactly_once(tmp_path, segments * ROWS)  # readers, right after the kill
    again = store.compact(rank_dir, STEP_SCHEMA, every=1, final=True)  # cleans up, or does it all again
    assert (again is None) == (where != "write")
    assert sorted(p.name for p in rank_dir.iterdir()) == ["seg-000001-000006.parquet"]  # no .tmp left either
    _exactly_once(tmp_path, segments * ROWS)


def test_gathered_windows_whose_columns_grow_are_compacted_and_read_once(tmp_path: Path) -> None:
    """Rank 0's gathered window summaries (no fixed schema: the detector adds columns) roll into one file
    per period like a rank's segments; a file left behind by an interrupted compaction is not read twice."""
    (tmp_path / "meta").mkdir()  # a run directory: the tracer writes its metadata first
    writer = store.live_windows_writer(tmp_path)
    for w in range(1, 6):
        extra = {"z_self": pa.array([0.5 * w] * 2)} if w >= 3 else {}  # columns that appear later
        writer.write(pa.table({"window": pa.array([w, w]), "rank": pa.array([0, 1]), **extra}))
    assert store.compact(writer.directory, None, every=8) is None  # fewer than `every` waiting
    first = store.compact(writer.directory, None, every=4)
    assert first is not None and first.name == "seg-000001-000005.parquet"
    (writer.directory / "seg-000002.parquet").write_bytes(first.read_bytes())  # as if left by a kill
    live = store.read_live_windows(tmp_path)
    assert live.column("window").to_pylist() == [w for w in range(1, 6) for _ in (0, 1)]
    assert live.column("z_self").to_pylist() == [None] * 4 + [0.5 * w for w in range(3, 6) for _ in (0, 1)]
    writer.write(pa.table({"window": pa.array([6, 6]), "rank": pa.array([0, 1])}))
    second = store.compact(writer.directory, None, every=1)  # the period's file grows; the stray is removed
    assert second is not None and second.name == "seg-000001-000006.parquet"
    assert sorted(p.name for p in writer.directory.iterdir()) == [second.name]
    assert store.read_live_windows(tmp_path).column("window").to_pylist() == [w for w in range(1, 7) for _ in (0, 1)]

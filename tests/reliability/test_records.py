"""Plain record segments, what a training rank writes (``hyperacc.records``): every reader reads them as
it reads Parquet, each row once across the compaction that rolls them into Parquet, and a damaged one
is skipped with a warning naming it while the rest of the run is read."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from hyperacc import records, store
from hyperacc.analysis.columns import discover, read_rank
from hyperacc.schema import EVENT_SCHEMA, RESOURCE_SCHEMA, STEP_COLUMNS, STEP_SCHEMA, steps_dir

ROWS = 10


def _rows(first: int, rank: int = 0) -> np.ndarray:
    rows = np.full((ROWS, len(STEP_COLUMNS)), -1, dtype=np.int64)
    col = {name: i for i, name in enumerate(STEP_COLUMNS)}
    rows[:, col["rank"]] = rank
    rows[:, col["node"]] = 0
    rows[:, col["step"]] = np.arange(first, first + ROWS)
    rows[:, col["step_ns"]] = rows[:, col["step"]] * 1000 + 7
    rows[:, col["data_gap"]] = 1
    rows[:, col["gc_max_gen"]] = -1  # a value: no collection
    return rows


def _writer(root: Path, segments: int) -> records.RecordWriter:
    writer = records.RecordWriter(steps_dir(root, 0), "STEP_SCHEMA")
    for i in range(segments):
        writer.write_int64(_rows(i * ROWS))
    return writer


def _read_all(root: Path) -> list[int]:
    steps = store.read_steps(root, ["step"]).column("step").to_pylist()
    cols = read_rank(discover(root).sources[0].segments, ("step", "step_ns", "data_gap"))
    assert cols["step"].tolist() == steps
    assert np.array_equal(cols["step_ns"], cols["step"] * 1000 + 7.0) and np.all(cols["data_gap"] == 1.0)
    cursor = store.SegmentCursor(steps_dir(root, 0)).read_new(["step"], schema=STEP_SCHEMA)
    assert [s for t in cursor for s in t.column("step").to_pylist()] == steps
    return steps


def test_record_segments_read_as_step_records_with_the_schema_types(tmp_path: Path) -> None:
    _writer(tmp_path, 5)
    table = store.read_steps(tmp_path)
    assert table.schema == STEP_SCHEMA and table.num_rows == 5 * ROWS
    assert table.column("gc_max_gen").to_pylist()[:2] == [-1, -1]  # -1 is a value here
    assert table.column("forward_ns").null_count == table.num_rows  # -1 elsewhere: not measured
    assert table.column("data_gap").to_pylist()[0] is True
    assert _read_all(tmp_path) == list(range(5 * ROWS))


def test_compaction_rolls_record_segments_into_parquet_each_row_once(tmp_path: Path) -> None:
    writer = _writer(tmp_path, 6)
    out = store.compact(writer.directory, STEP_SCHEMA, every=4)
    assert out is not None and out.name == "seg-000001-000006.parquet"
    writer.write_int64(_rows(6 * ROWS))  # the rank goes on numbering after the compacted range
    assert sorted(p.name for p in writer.directory.iterdir()) == ["seg-000001-000006.parquet", "seg-000007.rec"]
    assert _read_all(tmp_path) == list(range(7 * ROWS))
    # a follower that read the records before a compaction reads only what came after it
    cursor = store.SegmentCursor(writer.directory)
    assert sum(t.num_rows for t in cursor.read_new(["step"])) == 7 * ROWS
    writer.write_int64(_rows(7 * ROWS))
    store.compact(writer.directory, STEP_SCHEMA, every=1)
    assert [s for t in cursor.read_new(["step"]) for s in t.column("step").to_pylist()] == list(range(70, 80))


def test_events_and_resources_round_trip(tmp_path: Path) -> None:
    events = records.RecordWriter(tmp_path / "events" / "rank-00002", "EVENT_SCHEMA")
    events.write_json([[2, 5, 123, "gc_collect", 10, 1.5, None], [2, None, 124, "note", None, None, "a\nb"]])
    resources = records.RecordWriter(tmp_path / "resources" / "rank-00002", "RESOURCE_SCHEMA")
    resources.write_int64(np.array([[2, 0, 99, 5, 1 << 30, 10**9, -1, -1, -1]], dtype=np.int64))
    (tmp_path / "steps").mkdir()
    got = store.read_events(tmp_path)
    assert got.schema == EVENT_SCHEMA
    assert got.to_pylist()[1] == {"rank": 2, "step": None, "t_ns": 124, "kind": "note", "duration_ns": None,
                                  "value": None, "detail": "a\nb"}  # fmt: skip
    res = store.read_resources(tmp_path)
    assert res.schema == RESOURCE_SCHEMA and res.column("rss_bytes").to_pylist() == [1 << 30]
    assert res.column("cuda_peak_bytes").to_pylist() == [None]


# 3 segments are read file by file; 8 at once (``columns._read_records``), which on a damaged one goes
# back to the file-by-file reading
@pytest.mark.parametrize("segments", [3, 8])
@pytest.mark.parametrize("damage", ["truncated", "no header", "extra bytes", "foreign format"])
def test_a_damaged_record_segment_is_skipped_with_a_warning_naming_it(
    tmp_path: Path, damage: str, segments: int, caplog: pytest.LogCaptureFixture
) -> None:
    writer = _writer(tmp_path, segments)
    bad = writer.directory / "seg-000002.rec"
    data = bad.read_bytes()
    bad.write_bytes({"truncated": data[: len(data) - 12], "no header": data[data.index(b"\n") + 1:],
                     "extra bytes": data + b"\0" * 8,
                     "foreign format": b'{"format": "other"}\n' + data[data.index(b"\n") + 1:]}[damage])  # fmt: skip
    with caplog.at_level(logging.WARNING):
        steps = _read_all(tmp_path)
    assert steps == list(range(ROWS)) + list(range(2 * ROWS, segments * ROWS))
    assert any("seg-000002.rec" in r.message for r in caplog.records)
    with pytest.raises(records.RecordError, match="seg-000002.rec"):
        records.read(bad)


def test_many_record_segments_read_at_once_give_the_rows_of_the_file_by_file_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank's plain record segments (what it wrote since its last compaction, thousands after a long
    run without one) are read at once; every column is what reading them one by one gives, beside a
    compacted Parquet file of the same rank, with values not measured (-1), booleans and ``gc_max_gen``."""
    from hyperacc.analysis import columns

    rng = np.random.default_rng(0)
    writer = records.RecordWriter(steps_dir(tmp_path, 0), "STEP_SCHEMA")
    for i in range(12):
        rows = _rows(i * ROWS)
        rows[:, 3:] = np.where(rng.random((ROWS, rows.shape[1] - 3)) < 0.2, -1, rng.integers(0, 2, (ROWS, rows.shape[1] - 3)) * rng.integers(1, 10**9, (ROWS, rows.shape[1] - 3)))
        writer.write_int64(rows)
        if i == 4:
            store.compact(writer.directory, STEP_SCHEMA, every=1)  # segments 1-5 as one Parquet file
    segments = discover(tmp_path).sources[0].segments
    assert sum(store.is_record_segment(p) for p in segments) == 7
    few = ("gc_max_gen", "step_ns", "data_gap")  # only the columns asked for are converted
    at_once = read_rank(segments, STEP_COLUMNS), read_rank(segments, few)
    monkeypatch.setattr(columns, "_read_records", lambda paths, cols: None)
    one_by_one = read_rank(segments, STEP_COLUMNS), read_rank(segments, few)
    assert at_once[0]["step"].tolist() == list(range(12 * ROWS))
    for a, b, names in zip(at_once, one_by_one, (STEP_COLUMNS, few), strict=True):
        assert list(a) == list(b) == list(names)
        for name in names:
            assert a[name].dtype == b[name].dtype, name
            assert np.array_equal(a[name], b[name], equal_nan=True), name


def test_rows_of_the_wrong_width_are_refused_before_writing(tmp_path: Path) -> None:
    writer = records.RecordWriter(tmp_path, "STEP_SCHEMA")
    with pytest.raises(ValueError, match="STEP_SCHEMA rows need"):
        writer.write_int64(np.zeros((2, 3), dtype=np.int64))
    assert list(tmp_path.iterdir()) == []


def test_a_training_rank_loads_neither_pyarrow_nor_the_analysis_stack() -> None:
    """What ``hyperacc run`` installs in a rank, rank 0's live detector included, imports no pyarrow, scipy,
    pandas or rich (docs/tracing.md, "What a rank carries")."""
    code = ("import sys, hyperacc.bootstrap, hyperacc.trace, hyperacc.analysis.live_aggregate, hyperacc.stabilize, "
            "hyperacc.remediation.live, hyperacc.chaos, hyperacc.pacing.runtime, hyperacc.records, "
            "hyperacc.analysis.live, hyperacc.trace.tracer\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'pyarrow', 'scipy', 'pandas', 'rich'}))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_a_table_sink_still_gets_arrow_tables(tmp_path: Path) -> None:
    from hyperacc.trace import Tracer

    got: list[pa.Table] = []
    tracer = Tracer(tmp_path / "run", flush_every_s=60, window=0, probe_every=0, resources_every_s=0)
    tracer.add_sink(got.append)
    for _ in range(3):
        with tracer.step():
            pass
    tracer.close()
    assert got and got[0].schema == STEP_SCHEMA and sum(t.num_rows for t in got) == 3


def test_the_node_agent_compacts_only_the_ranks_that_name_it(tmp_path: Path) -> None:
    """Two agents sharing one run directory (two nodes, one shared file system, even with one host
    name): each rolls only its own ranks' records, so no folder has two compactors."""
    from hyperacc.agent import Compactor
    from hyperacc.records import write_meta
    from hyperacc.schema import RankMeta

    for rank, agent in ((0, "host:1"), (1, "host:2")):
        write_meta(tmp_path, RankMeta(rank=rank, local_rank=0, node=rank, world_size=2, local_world_size=1,
                                      hostname="host", pid=10 + rank, agent=agent))  # fmt: skip
        writer = records.RecordWriter(steps_dir(tmp_path, rank), "STEP_SCHEMA")
        for i in range(3):
            writer.write_int64(_rows(i * ROWS, rank))
    first = Compactor(tmp_path, every=2, period_s=3600, min_rows=1, agent="host:1")
    assert first.pass_once(final=False) == 1
    assert [p.suffix for p in steps_dir(tmp_path, 0).iterdir()] == [".parquet"]
    assert sorted(p.suffix for p in steps_dir(tmp_path, 1).iterdir()) == [".rec"] * 3
    assert Compactor(tmp_path, every=2, period_s=3600, min_rows=1, agent="host:2").pass_once(final=True) == 1
    assert store.read_steps(tmp_path, ["rank"]).num_rows == 6 * ROWS

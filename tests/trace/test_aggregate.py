"""Live window aggregation through a real c10d TCPStore: delivery, missing ranks, a killed store."""

from __future__ import annotations

import datetime
import logging
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch.distributed as dist

from hyperacc import store
from hyperacc.analysis.live_aggregate import WindowAggregator, step_columns
from hyperacc.analysis.options import DetectionOptions
from hyperacc.analysis.windows import summarize_windows, window_rows, window_table
from hyperacc.schema import STEP_SCHEMA, WINDOW_SCHEMA


def steps_table(rank: int, steps: range, self_ms: float) -> pa.Table:
    rows = [
        {"rank": rank, "node": 0, "step": s, "step_ns": 20_000_000, "self_ns": int(self_ms * 1e6) + s,
         "data_ns": 1_000, "comm_wait_ns": 5_000_000, "gc_ns": 100, "launch_ns": 2_000 if s % 5 == 0 else None}
        for s in steps
    ]  # fmt: skip
    return pa.Table.from_pylist(rows, schema=STEP_SCHEMA)


def client(port: int, timeout_s: float = 5.0) -> Any:
    base = dist.TCPStore(
        "127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )
    return dist.PrefixStore("test/", base)


class Recorder:
    """Stands where hyperacc.analysis.live.LiveDetector plugs in; keeps what it was given."""

    def __init__(self) -> None:
        self.tables: list[pa.Table] = []

    def update(self, columns: dict[str, np.ndarray]) -> list[str]:  # numpy columns, as rank 0 hands them
        self.tables.append(window_table(columns))
        return [f"window {int(columns['window'][0])} seen"]


@pytest.fixture
def server() -> Any:
    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False
    )
    yield store


def test_every_ranks_windows_reach_rank_0(server: Any) -> None:
    detector = Recorder()
    findings: list[tuple[int, str]] = []
    windows: list[tuple[int, list[int], list[int]]] = []
    rank0 = WindowAggregator(
        0,
        0,
        2,
        window=10,
        grace_s=30,
        store=client(server.port),
        detector=detector,
        on_finding=lambda s, m: findings.append((s, m)),
        on_window=lambda w, got, missing: windows.append((w, got, missing)),
        poll_s=0.05,
    )
    rank1 = WindowAggregator(1, 1, 2, window=10, grace_s=30, store=client(server.port), poll_s=0.05)
    for agg, self_ms in ((rank0, 10.0), (rank1, 30.0)):
        agg.on_steps(steps_table(agg.rank, range(0, 7), self_ms))
        agg.on_steps(steps_table(agg.rank, range(7, 46), self_ms))
    rank1.close()
    rank0.close()
    # warm-up (10 steps) left out as offline; the last, partial window is sent at close
    assert [w for w, _, _ in windows] == [1, 2, 3, 4]
    assert all(got == [0, 1] and missing == [] for _, got, missing in windows)
    assert all(t.schema.names[: len(WINDOW_SCHEMA)] == WINDOW_SCHEMA.names for t in detector.tables)
    opts = DetectionOptions(window_steps=10)
    for rank, self_ms in ((0, 10.0), (1, 30.0)):
        offline = window_rows(summarize_windows(step_columns(steps_table(rank, range(46), self_ms), rank, rank), opts))
        live = [r for t in detector.tables for r in t.to_pylist() if r["rank"] == rank]
        assert len(live) == len(offline) == 4
        for a, b in zip(live, offline, strict=True):
            assert {k: a[k] for k in b} == pytest.approx(b, nan_ok=True)
    first = detector.tables[0].to_pylist()
    assert [r["rank"] for r in first] == [0, 1] and [r["node"] for r in first] == [0, 1]
    assert first[1]["self_ns_median"] == 30_000_014.5  # median of 30 ms + step, steps 10-19
    assert first[0]["steps"] == 10 and first[0]["first_step"] == 10 and first[0]["last_step"] == 19
    assert findings == [(10, "window 1 seen"), (20, "window 2 seen"), (30, "window 3 seen"), (40, "window 4 seen")]


def test_a_silent_rank_is_reported_missing_and_never_blocks(
    server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    detector = Recorder()
    windows: list[tuple[int, list[int], list[int]]] = []
    rank0 = WindowAggregator(
        0,
        0,
        3,
        window=5,
        grace_s=0.3,
        store=client(server.port),
        detector=detector,
        on_window=lambda w, got, missing: windows.append((w, got, missing)),
        poll_s=0.05,
    )
    rank1 = WindowAggregator(1, 0, 3, window=5, grace_s=0.3, store=client(server.port), poll_s=0.05)
    with caplog.at_level(logging.WARNING, logger="hyperacc.live"):
        for agg in (rank0, rank1):
            # windows 2 and 3 are final: the spike baseline (101 steps) has seen 100 steps after them
            agg.on_steps(steps_table(agg.rank, range(0, 121), 10.0))
        deadline = time.monotonic() + 20
        while len(windows) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        rank1.close()
        rank0.close()
    # windows 2 and 3 while running, the partial window 4 at close
    assert [(w, got, missing) for w, got, missing in windows] == [(w, [0, 1], [2]) for w in (2, 3, 4)]
    lines = [r.message for r in caplog.records if "no summary from rank(s) 2" in r.message]
    assert len(lines) == 1  # said once, not every window
    assert [t.num_rows for t in detector.tables] == [2, 2, 2]


def test_rank_0_keeps_the_gathered_windows_in_one_file_per_period(server: Any, tmp_path: Any) -> None:
    """Rank 0 writes what it gathered every few seconds; with the tracer's compaction settings those
    files are rolled into one per period, and a finished job leaves one, holding every window once."""
    run_dir = tmp_path / "run"
    (run_dir / "meta").mkdir(parents=True)  # what the tracer writes first
    rank0 = WindowAggregator(0, 0, 2, window=10, grace_s=30, store=client(server.port), detector=Recorder(),
                             poll_s=0.05, run_dir=run_dir, compaction=(2, 3600.0, 100_000))  # fmt: skip
    rank1 = WindowAggregator(1, 1, 2, window=10, grace_s=30, store=client(server.port), poll_s=0.05)
    for first in range(0, 180, 60):
        for agg in (rank0, rank1):
            agg.on_steps(steps_table(agg.rank, range(first, first + 60), 10.0))
        # window w (steps 10w..10w+9) is final once the spike baseline has seen 100 steps after it
        final = max(0, (first + 60 - 110) // 10)
        deadline = time.monotonic() + 20
        while rank0.windows_processed < final and time.monotonic() < deadline:
            time.sleep(0.05)
        rank0._write_gathered()  # what the aggregation thread does every 5 s
    rank1.close()
    rank0.close()
    assert rank0._writer.written >= 3  # two while running, one at close: rolled into one
    folder = run_dir / "live" / "windows"
    assert [p.name for p in folder.iterdir()] == [f"seg-000001-{rank0._writer.written:06d}.parquet"]
    live = store.read_live_windows(run_dir).to_pylist()
    pairs = [(r["window"], r["rank"]) for r in live]
    assert sorted(pairs) == [(w, r) for w in range(1, 18) for r in (0, 1)]  # each window of each rank once


def test_a_killed_store_switches_aggregation_off_once(caplog: pytest.LogCaptureFixture) -> None:
    code = (
        "import datetime, sys, time, torch.distributed as d\n"
        "s = d.TCPStore('127.0.0.1', 0, None, True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False)\n"
        "print(s.port, flush=True)\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        agg = WindowAggregator(1, 0, 2, window=5, grace_s=1, store=client(port, timeout_s=1.0), poll_s=0.05)
        agg.on_steps(steps_table(1, range(0, 121), 10.0))  # windows 2 and 3 final
        deadline = time.monotonic() + 10
        while agg._outbox and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not agg._outbox, "the first window was never published"
        proc.kill()
        proc.wait()
        with caplog.at_level(logging.WARNING, logger="hyperacc.trace"):
            for start in range(121, 181, 6):  # training goes on: the sink never raises
                agg.on_steps(steps_table(1, range(start, start + 6), 10.0))
                time.sleep(0.05)
            deadline = time.monotonic() + 15
            while agg._on and time.monotonic() < deadline:
                time.sleep(0.05)
            t0 = time.monotonic()
            agg.close()
            assert time.monotonic() - t0 < 10
        assert not agg._on
        lines = [r.message for r in caplog.records if "window aggregation" in r.message]
        assert len(lines) == 1 and "switched off" in lines[0]
    finally:
        proc.kill()
        proc.wait()

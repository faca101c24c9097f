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
from hyperacc.analysis.live_aggregate import WindowAggregator, WindowGatherer
from hyperacc.analysis.options import DetectionOptions
from hyperacc.analysis.windows import step_columns, summarize_windows, window_rows, window_table
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
    # windows 2 and 3 while running, the rest (4-24, steps up to 120) at close: once rank 2 was missing
    # from window 2, no later window waits for it, so all of them fit in rank 0's 2 s at close
    assert [(w, got, missing) for w, got, missing in windows] == [(w, [0, 1], [2]) for w in range(2, 25)]
    lines = [r.message for r in caplog.records if "no summary from rank(s) 2" in r.message]
    assert len(lines) == 1  # said once, not every window
    assert [t.num_rows for t in detector.tables] == [2] * 23


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
        rank0.gatherer.write_gathered()  # what the aggregation thread does every 5 s
    rank1.close()
    rank0.close()
    assert rank0.gatherer._writer.written >= 3  # two while running, one at close: rolled into one
    folder = run_dir / "live" / "windows"
    assert [p.name for p in folder.iterdir()] == [f"seg-000001-{rank0.gatherer._writer.written:06d}.parquet"]
    live = store.read_live_windows(run_dir).to_pylist()
    pairs = [(r["window"], r["rank"]) for r in live]
    assert sorted(pairs) == [(w, r) for w in range(1, 18) for r in (0, 1)]  # each window of each rank once


def _store_server(port: int = 0) -> tuple[subprocess.Popen, int]:
    code = (
        "import datetime, sys, time, torch.distributed as d\n"
        f"s = d.TCPStore('127.0.0.1', {port}, None, True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False)\n"
        "print(s.port, flush=True)\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


def _wait(condition: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return bool(condition())


def test_a_store_that_dies_is_retried_with_backoff_and_rejoined(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job's store goes away and comes back on its address: the rank says so once each way, its
    sink never raises, and its windows reach the store again."""
    proc, port = _store_server()
    procs = [proc]
    try:
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        agg = WindowAggregator(1, 0, 2, window=5, grace_s=1, poll_s=0.05, prefix="test/")
        agg.on_steps(steps_table(1, range(0, 121), 10.0))  # windows 2 and 3 final
        assert _wait(lambda: not agg._outbox, 10), "the first windows were never published"
        proc.kill()
        proc.wait()
        with caplog.at_level(logging.WARNING, logger="hyperacc.live"):
            for start in range(121, 181, 6):  # training goes on: the sink never raises
                agg.on_steps(steps_table(1, range(start, start + 6), 10.0))
                time.sleep(0.05)
            assert _wait(lambda: agg._backoff.failures >= 1, 30)
            assert agg._on and agg._outbox  # still on; the new windows wait
            procs.append(_store_server(port)[0])  # the store is back where it was
            assert _wait(lambda: not agg._outbox and not agg._backoff.down, 60), "never rejoined"
            t0 = time.monotonic()
            agg.close()
            assert time.monotonic() - t0 < 10
        check = client(port)
        assert check.check(["w8/n"])  # a window completed while the store was away reached the new one
        lines = [r.message for r in caplog.records if "c10d store" in r.message]
        assert len(lines) == 2 and "unreachable" in lines[0] and "answers again" in lines[1]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_store_that_is_gone_is_said_in_one_line_at_once(
    caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    """A job's store whose port is closed (the job ended) is refused at once, not after torch's client
    retried it for its whole timeout, and nothing but hyperacc's one line reaches stderr: torch's client
    prints a C++ backtrace for every failed try."""
    import socket

    from hyperacc.analysis.window_store import Backoff, connect_store
    from hyperacc.trace.failsafe import one_line

    with socket.socket() as s:  # a port that was just free and that nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(OSError) as caught:
        connect_store(f"127.0.0.1:{port}", timeout_s=30)
    assert time.monotonic() - t0 < 10  # torch's client alone took the whole 30 s
    with caplog.at_level(logging.WARNING, logger="hyperacc.live"):
        Backoff("the node agent's window summaries").failed(caught.value)
    assert "frame #" not in capfd.readouterr().err
    [line] = [r.getMessage() for r in caplog.records]
    assert "\n" not in line and "unreachable" in line, line
    # torch's C++ errors carry their backtrace in the message: a log line keeps the first line
    text = one_line(RuntimeError("connect failed\nException raised from x at y.cpp:1\nframe #0: c10::Error"))
    assert text == "RuntimeError: connect failed"
    assert len(one_line(ValueError("x" * 1000))) == 300


def _window_row(w: int, rank: int) -> dict[str, Any]:
    return {"window": w, "rank": rank, "node": rank // 2, "first_step": 10 * w, "last_step": 10 * w + 9, "steps": 10,
            "self_ns_median": 1e7}  # fmt: skip


def test_a_silent_rank_delays_one_window_once_and_counts_again_when_it_reports(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The gatherer of a node agent that holds every rank (rows offered directly): each window's grace
    runs from its own first row, a rank missing from a judged window is not waited for again, and it
    counts again as soon as it reports."""
    judged: list[tuple[int, list[int], list[int]]] = []

    class Counter:
        rows: list[int] = []

        def update(self, columns: dict[str, np.ndarray]) -> list[str]:
            self.rows.append(len(columns["rank"]))
            return []

    detector = Counter()
    gatherer = WindowGatherer(3, window=10, grace_s=0.5, detector=detector,
                              on_window=lambda w, got, missing: judged.append((w, got, missing)))  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="hyperacc.live"):
        gatherer.offer([_window_row(w, r) for w in range(1, 6) for r in (0, 1)])  # rank 2 is silent
        gatherer.gather()
        assert judged == []  # within the grace: rank 2 may be late
        assert _wait(lambda: (gatherer.gather(), len(judged) == 5)[1], 10)  # all five at once, not in turn
        gatherer.offer([_window_row(6, r) for r in (0, 1)])
        gatherer.gather()  # rank 2 is known missing: window 6 does not wait for it
        gatherer.offer([_window_row(7, r) for r in (0, 1, 2)])
        gatherer.gather()
        gatherer.offer([_window_row(4, 2)])  # a row of a window already judged is dropped
        gatherer.gather()
    assert judged == [(w, [0, 1], [2]) for w in range(1, 7)] + [(7, [0, 1, 2], [])]
    assert detector.rows == [2] * 6 + [3]
    lines = [r.message for r in caplog.records if "rank(s) 2" in r.message or "every rank" in r.message]
    assert len(lines) == 2 and "no summary" in lines[0] and "reports again" in lines[1]


def test_window_rows_travel_as_frames_and_read_back_as_the_same_columns() -> None:
    """Several senders' frames appended to one key read back as ``rows_columns`` makes of their rows:
    (window, rank) order, a column one sender lacks NaN (or -1) in its rows; a cut frame is an error
    that names the key."""
    from hyperacc.analysis.window_store import decode_frames, encode_rows
    from hyperacc.analysis.windows import rows_columns

    rng = np.random.default_rng(0)
    senders = []
    for node in range(4):
        rows = [_window_row(3, r) for r in range(4 * node, 4 * node + 4)]
        for row in rows:
            row["node"] = node
            row["cpu_ns_median"] = float(rng.uniform(1e6, 2e6))
            if node == 2:
                del row["cpu_ns_median"]  # this sender does not measure it
            if node == 1:
                row["launch_ns_median"] = None
        senders.append(rows)
    order = [2, 0, 3, 1]
    data = b"".join(encode_rows(senders[i]) for i in order)
    got = decode_frames(data, "w3")
    want = rows_columns([r for i in order for r in senders[i]])
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype
        np.testing.assert_array_equal(got[name], want[name])
    assert got["rank"].tolist() == list(range(16))
    assert np.isnan(got["cpu_ns_median"][8:12]).all() and not np.isnan(got["cpu_ns_median"][:8]).any()
    with pytest.raises(ValueError, match="w3: the frame at offset .* is truncated"):
        decode_frames(data[:-5], "w3")
    with pytest.raises(ValueError, match="w3: bytes at offset 0 are not a window-rows frame"):
        decode_frames(b'{"columns": []}\n' + data, "w3")

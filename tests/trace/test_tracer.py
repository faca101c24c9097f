"""The explicit tracer API in one process: what lands in the run directory, and failure safety."""

from __future__ import annotations

import gc
import logging
import shutil
import time
from pathlib import Path

import pyarrow as pa
import pytest

from hyperacc import store
from hyperacc.schema import STEP_SCHEMA
from hyperacc.trace import TraceConfigError, TraceOptions, Tracer, trace_from_env
from hyperacc.trace.probe import LaunchProbe


def make(tmp_path: Path, **options: object) -> Tracer:
    settings = {"handle_sigterm": False, "window": 0, "flush_every_s": 3600.0, **options}
    return Tracer(tmp_path / "run", rank=0, node=0, world_size=1, **settings)


def test_explicit_steps_phases_and_signals_reach_parquet(tmp_path: Path) -> None:
    tracer = make(tmp_path, probe_every=4)

    @tracer.phase("forward")
    def forward() -> None:
        time.sleep(0.002)

    wall0 = time.time_ns()
    for i in range(10):
        with tracer.step():
            with tracer.phase("data"):
                time.sleep(0.001)
            forward()
            forward()  # a repeated phase adds up
            if i == 3:
                gc.collect()
    tracer.close()

    table = store.read_steps(tmp_path / "run")
    assert table.schema == STEP_SCHEMA
    rows = table.to_pylist()
    assert [r["step"] for r in rows] == list(range(10))
    for r in rows:
        assert r["rank"] == 0 and r["node"] == 0
        assert r["data_ns"] >= 1_000_000
        assert r["forward_ns"] >= 4_000_000
        assert r["other_ns"] == r["step_ns"] - r["data_ns"] - r["forward_ns"]
        assert r["self_ns"] == r["step_ns"]  # no collective: the whole step is the rank's own work
        assert r["backward_ns"] is None and r["comm_wait_ns"] is None and r["h2d_ns"] is None
        assert (r["launch_ns"] is not None) == (r["step"] % 4 == 0)
        assert wall0 <= r["t_start_ns"] <= time.time_ns()
        assert r["major_faults"] >= 0 and r["invol_ctx_switches"] >= 0 and r["run_delay_ns"] >= 0
    assert [r["t_start_ns"] for r in rows] == sorted(r["t_start_ns"] for r in rows)
    collected = rows[3]
    assert collected["gc_count"] >= 1 and collected["gc_max_gen"] == 2 and collected["gc_ns"] > 0
    assert rows[4]["gc_max_gen"] in (-1, 0, 1, 2)  # -1 is a value here ("no collection"), never null
    meta = store.read_meta(tmp_path / "run")
    assert meta[0].node == 0 and meta[0].world_size == 1 and meta[0].source == "tracer"


def test_step_decorator_and_explicit_step_numbers(tmp_path: Path) -> None:
    tracer = make(tmp_path)

    @tracer.step()
    def train_step() -> None:
        with tracer.phase("optimizer"):
            pass

    train_step()
    train_step()
    with tracer.step(100):
        pass
    train_step()  # continues after the explicit number
    tracer.close()
    steps = store.read_steps(tmp_path / "run")["step"].to_pylist()
    assert steps == [0, 1, 100, 101]


def test_a_resumed_job_numbers_its_steps_as_the_run_it_continues(tmp_path: Path) -> None:
    # an attempt that ran 5 steps past its checkpoint at step 3, then the restarted attempt: its tracer is
    # told the checkpoint's step (``hyperacc.elastic`` does so) and records the steps it runs under the
    # run's own numbers; a step open before that (the checkpoint's load) is not recorded at all
    first = make(tmp_path)
    for _ in range(5):
        with first.step():
            pass
    first.close()
    second = make(tmp_path)
    second.begin_step()  # work before the resumed loop
    second.resume_at(3)
    for _ in range(4):
        with second.step():
            pass
    second.close()
    table = store.read_steps(tmp_path / "run")
    assert table["step"].to_pylist() == [0, 1, 2, 3, 4, 5, 6]  # steps 3 and 4 run twice: the later kept
    with pytest.raises(ValueError, match="resume_at"):
        second.resume_at(-1)


def test_unknown_phase_names_the_valid_ones(tmp_path: Path) -> None:
    tracer = make(tmp_path)
    with pytest.raises(ValueError, match="unknown phase 'fwd'.*forward"):
        tracer.phase("fwd")
    tracer.close()


def test_events_are_written(tmp_path: Path) -> None:
    tracer = make(tmp_path)
    with tracer.step():
        tracer.record_event("gc_collect", duration_ns=1234, value=2.0, detail="generation 2")
    tracer.close()
    events = store.read_events(tmp_path / "run").to_pylist()
    assert len(events) == 1
    assert events[0]["kind"] == "gc_collect" and events[0]["step"] == 0
    assert events[0]["duration_ns"] == 1234 and events[0]["detail"] == "generation 2"


def test_sinks_get_every_row_and_a_failing_sink_is_switched_off(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tracer = make(tmp_path)
    got: list[pa.Table] = []

    def broken_sink(table: pa.Table) -> None:
        raise RuntimeError("exporter down")

    tracer.add_sink(broken_sink)
    tracer.add_sink(got.append)
    with caplog.at_level(logging.WARNING, logger="hyperacc.trace"):
        for _ in range(2):
            for _ in range(5):
                with tracer.step():
                    pass
            tracer.flush()
        tracer.close()
    assert sum(t.num_rows for t in got) == 10
    lines = [r.message for r in caplog.records if "broken_sink" in r.message]
    assert len(lines) == 1 and "switched off" in lines[0]


def test_disk_failure_switches_writing_off_and_training_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, cpu_job: None
) -> None:
    tracer = make(tmp_path)
    got: list[pa.Table] = []
    tracer.add_sink(got.append)
    with tracer.step():
        pass
    tracer.flush()
    seg_dir = tmp_path / "run" / "steps" / "rank-00000"
    assert len(list(seg_dir.glob("seg-*.rec"))) == 1
    # the segment directory disappears and a file takes its place: every later write fails
    shutil.rmtree(seg_dir)
    seg_dir.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="hyperacc.trace"):
        for _ in range(3):
            for _ in range(4):
                with tracer.step():
                    pass
            tracer.flush()
        tracer.close()
    assert tracer.current_step == 13  # every step was recorded
    assert sum(t.num_rows for t in got) == 13  # sinks still get the rows
    failures = [r.message for r in caplog.records if "writing step records" in r.message]
    assert len(failures) == 1


def test_ring_overflow_drops_the_oldest_rows_and_counts_them(tmp_path: Path) -> None:
    tracer = make(tmp_path, capacity=16)
    for _ in range(40):
        with tracer.step():
            pass
    tracer.close()
    steps = store.read_steps(tmp_path / "run")["step"].to_pylist()
    assert steps == sorted(set(steps)) and steps[-1] == 39
    assert len(steps) + tracer.dropped_rows == 40
    assert len(steps) >= 16


def test_truncated_segment_is_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, cpu_job: None
) -> None:
    tracer = make(tmp_path, compact_every=0)  # two segments stay two files
    for _ in range(2):
        for _ in range(5):
            with tracer.step():
                pass
        tracer.flush()
    tracer.close()
    first, second = sorted((tmp_path / "run" / "steps" / "rank-00000").glob("seg-*.rec"))
    first.write_bytes(first.read_bytes()[: first.stat().st_size // 2])  # as a SIGKILL mid-write would
    with caplog.at_level(logging.WARNING):
        table = store.read_steps(tmp_path / "run")
    assert table["step"].to_pylist() == [5, 6, 7, 8, 9]
    assert any(first.name in r.message for r in caplog.records)


def test_launch_probe_times_op_dispatch() -> None:
    import torch

    probe = LaunchProbe(ops=8)
    assert probe.measure(torch.device("cpu")) > 0


def test_options_reject_bad_values_with_the_option_name() -> None:
    with pytest.raises(TraceConfigError, match="unknown trace option.*windw"):
        TraceOptions.from_json('{"windw": 10}')
    with pytest.raises(TraceConfigError, match="not valid JSON"):
        TraceOptions.from_json("{window: 10}")
    with pytest.raises(TraceConfigError, match="probe_every must be an integer"):
        TraceOptions.from_json('{"probe_every": "often"}')
    with pytest.raises(TraceConfigError, match="capacity=4 is invalid"):
        TraceOptions.from_mapping({"capacity": 4})
    assert TraceOptions.from_json('{"flush_every_s": 2, "inband": false}').flush_every_s == 2.0


def test_trace_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYPERACC_RUN_DIR", raising=False)
    assert trace_from_env() is None
    monkeypatch.setenv("HYPERACC_RUN_DIR", str(tmp_path / "env-run"))
    monkeypatch.setenv("HYPERACC_TRACE", '{"probe_every": 7, "window": 0}')
    tracer = trace_from_env(handle_sigterm=False)
    assert tracer is not None
    assert tracer.options.probe_every == 7
    with tracer.step():
        pass
    tracer.close()
    assert store.read_steps(tmp_path / "env-run").num_rows == 1


def test_a_step_that_never_ends_is_said_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # An update the tracer cannot see (written by hand, or a compiled optimizer step in automatic mode)
    # leaves one step open for ever: the flusher says so once, and training is not touched.
    from hyperacc.trace.tracer import UNENDED_MICRO_STEPS

    tracer = make(tmp_path, flush_every_s=0.05)
    with caplog.at_level(logging.WARNING, logger="hyperacc.trace"), tracer.step():
        for _ in range(2 * UNENDED_MICRO_STEPS):
            with tracer.phase("backward"):
                pass
        deadline = time.monotonic() + 30
        while "without a step boundary" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # several more flusher rounds: still one line
    tracer.close()
    said = [r for r in caplog.records if "without a step boundary" in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert "step 0 has run" in said[0].getMessage()
    assert [r["micro_steps"] for r in store.read_steps(tmp_path / "run").to_pylist()] == [2 * UNENDED_MICRO_STEPS]


@pytest.mark.slow  # an interpreter with torch
def test_a_script_that_leaves_through_os_exit_after_destroy_process_group_keeps_its_records(tmp_path: Path) -> None:
    import subprocess
    import sys

    job = Path(__file__).parent / "jobs" / "exit_fast_job.py"
    out = subprocess.run([sys.executable, str(job), str(tmp_path / "store"), str(tmp_path / "run"), "30"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert store.read_steps(tmp_path / "run")["step"].to_pylist() == list(range(30))


@pytest.mark.slow  # an interpreter with torch
def test_a_dataloader_made_again_each_epoch_is_input_from_the_iterators_start(tmp_path: Path) -> None:
    # persistent_workers=False: each epoch's ``iter(loader)`` starts the worker and draws the epoch's order
    # (0.3 s here) before the first batch; that is the input's time, not the rank's own between steps
    import json
    import subprocess
    import sys

    job = Path(__file__).parent / "jobs" / "epoch_loader_job.py"
    out = subprocess.run([sys.executable, str(job), str(tmp_path / "run"), "3", "0.3"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["error"] == "no order for epoch 4" and seen["tracing"]  # the sampler's error, passed on as it was
    rows = store.read_steps(tmp_path / "run").to_pylist()
    assert [r["step"] for r in rows] == list(range(12))  # 3 epochs of 3 batches, then 3 without workers
    # where the batch came from: the worker's (a producer the host could starve) or the thread's own fetch
    assert [r["data_own"] for r in rows] == [False] * 9 + [True] * 3
    for r in rows[:9:3]:  # each epoch's first step
        assert r["data_ns"] >= 0.3e9 and r["other_ns"] < r["data_ns"] / 2, r  # (before: other 308 ms, data 17)

"""A full disk and a file system remounted read-only while a traced job runs, and a metrics port that
is already taken: training goes on and ends as it would without hyperacc; one warning says what was
switched off (docs/reliability.md, "Disks and ports").

The file systems are 2 MiB tmpfs mounts; where this machine does not allow mounting, the tests are
skipped with the reason.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from reliability_runs import JOBS, check_cli_result, ddp_command, job_env

from hyperacc import harness, store
from hyperacc.analysis.columns import discover, read_rank
from hyperacc.cli import cli

pytestmark = pytest.mark.multirank


def _fill(directory: Path) -> None:
    """Write until the file system is full, to the last byte."""
    with (directory / "filler").open("wb", buffering=0) as f:
        for size in (65536, 4096, 256, 1):
            chunk = b"\0" * size
            try:
                while True:
                    f.write(chunk)
            except OSError:
                pass


def _steps(run_dir: Path) -> np.ndarray:
    src = discover(run_dir).sources[0]
    return read_rank(src.segments, ("step",))["step"]


def _traced_job_through(mnt: Path, tmp: Path, break_it) -> tuple[int, str, int, Path]:
    """A one-rank traced job writing into ``mnt``; ``break_it(mnt)`` once its first segment is there.
    Returns (exit status, launcher output, rows on disk when it broke, run directory).

    The job must still have rows to write after the break: 1,500 steps of 0.7-3 ms, the first 0.2 s flush
    out at 15-25 % of them. With 600 steps and the break after two flushes, a fast moment of this machine
    (0.7 ms a step: 0.42 s in all) had written its last rows before the break was made (a fresh-clone CI
    run, 2026-12-06): nothing failed to write, so nothing was switched off."""
    run_dir = mnt / "run"
    log_path = tmp / "job.log"
    cmd = ddp_command(run_dir, 1500, nproc=1, trace='{"flush_every_s": 0.2, "window": 0}')
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, env=job_env(HYPERACC_RESULT_DIR=str(tmp)), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not [p for p in run_dir.glob("steps/rank-*/seg-*") if store.segment_range(p)]:
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.1)
        before = _steps(run_dir).size
        break_it(mnt)
        assert proc.poll() is None, "the job ended before its run directory broke; give it more steps"
        code = proc.wait(timeout=240)
    finally:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        proc.wait()
    return code, log_path.read_text(errors="replace"), before, run_dir


@pytest.mark.parametrize("how", ["full", "read-only"])
def test_training_goes_on_when_the_run_directory_breaks(small_fs, tmp_path, how):
    def break_it(mnt: Path) -> None:
        if how == "full":
            _fill(mnt)
        else:
            subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)

    code, log, before, run_dir = _traced_job_through(small_fs, tmp_path, break_it)
    assert code == 0, log[-3000:]  # training finished, as it would have without hyperacc
    assert (tmp_path / "rank-0.json").is_file()  # the script's own result
    # one line from the rank; the node agent (hyperacc run), whose compaction cannot write there either,
    # switches its compaction off with one line of its own, if it tried before the job ended
    off = [ln for ln in log.splitlines() if "switched off" in ln and "hyperacc run: compaction" not in ln]
    assert len(off) == 1 and "writing" in off[0], (off, log[-3000:], sorted(p.name for p in run_dir.rglob("*")))
    assert sum("hyperacc run: compaction" in ln for ln in log.splitlines()) <= 1, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    steps = _steps(run_dir)
    assert steps.tolist() == list(range(steps.size)) and steps.size >= before
    assert not list(run_dir.rglob("*.tmp"))  # a failed write leaves no half segment
    # reading still works; writing the report there fails with one line and leaves nothing behind
    runner = CliRunner()
    check_cli_result(runner.invoke(cli, ["analyze", str(run_dir)]), (0,))
    res = runner.invoke(cli, ["report", str(run_dir)])
    check_cli_result(res, (1,))
    assert ("No space left" in res.output) if how == "full" else ("Read-only" in res.output), res.output
    assert not list(run_dir.glob("report.html*"))


def test_export_to_a_full_disk_is_one_line_and_leaves_nothing(small_fs, tmp_path):
    from reliability_runs import small_run

    run = small_run(tmp_path / "run")
    _fill(small_fs)
    res = CliRunner().invoke(cli, ["export", str(run), "--chrome", str(small_fs / "trace.json")])
    check_cli_result(res, (1, 2))
    assert "No space left" in res.output, res.output
    assert not list(small_fs.glob("trace.json*"))


def test_a_taken_metrics_port_is_one_warning_and_training_goes_on(tmp_path):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        job = harness.launch(JOBS / "metrics_port_taken.py", [str(tmp_path / "run"), str(port), "30"], nproc=2,
                             timeout=240, env=job_env())  # fmt: skip
    finally:
        holder.close()
    assert job.ok, job.explain()
    assert [r["served"] for r in job.results()] == [False, False]
    assert all(r["sink_on"] for r in job.results())  # the sink itself still works
    for rank in job.ranks.values():
        warnings = [ln for ln in rank.stderr.splitlines() if "cannot serve" in ln]
        assert len(warnings) == 1 and str(port) in warnings[0], rank.stderr[-2000:]
    kept = {r: read_rank(s.segments, ("step",))["step"].size for r, s in discover(tmp_path / "run").sources.items()}
    assert kept == {0: 30, 1: 30}

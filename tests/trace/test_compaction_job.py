"""A real traced job of 2 ranks (torchrun, gloo) with a segment every 50 ms: compaction keeps each rank
to one step file of the period, analyze counts every step once, and a rank killed with SIGKILL mid-run
loses at most its last flush (docs/tracing.md, "Storage")."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from hyperacc import records, store
from hyperacc.analysis.columns import discover, read_rank

pytestmark = pytest.mark.multirank  # real torchrun jobs

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(__file__).resolve().parent / "jobs" / "compact_job.py"
SECONDS = 6.0  # long enough for a hundred flushes and a dozen compactions per rank (3 x EVERY segments needed)
EVERY = 8


def _start(run_dir: Path, seconds: float) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "--max-restarts", "0", str(JOB), str(run_dir), str(seconds), str(EVERY)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip


def _files(run_dir: Path, kind: str, rank: int) -> list[Path]:
    d = run_dir / kind / f"rank-{rank:05d}"
    return sorted(p for p in d.iterdir()) if d.is_dir() else []


def _steps(run_dir: Path, rank: int) -> np.ndarray:
    layout = discover(run_dir)
    return read_rank(layout.sources[rank].segments, ("step",))["step"] if rank in layout.sources else np.empty(0)


def test_a_finished_job_leaves_one_step_file_per_rank_and_every_step_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _start(run_dir, SECONDS)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    # the two ranks share torchrun's stdout, so one rank's line can land in the middle of the other's
    done = {int(r): int(n) for r, n in re.findall(r"rank (\d+) steps (\d+)", out)}
    assert sorted(done) == [0, 1] and done[0] == done[1], out[-3000:]
    for rank in (0, 1):
        steps = _files(run_dir, "steps", rank)
        assert 1 <= len(steps) <= 2, steps
        # the file says how many segments it replaced: there were many small ones
        assert max(store.segment_range(p)[1] for p in steps) >= 3 * EVERY  # type: ignore[index]
        for kind in ("events", "resources"):
            assert len(_files(run_dir, kind, rank)) <= 2, _files(run_dir, kind, rank)
        got = _steps(run_dir, rank)
        assert got.tolist() == list(range(done[rank]))  # every step, once
    table = store.read_steps(run_dir, ["rank", "step"])
    assert table.num_rows == done[0] + done[1]
    result = subprocess.run([sys.executable, "-m", "hyperacc", "analyze", str(run_dir), "--json"],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT / "src")})  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    doc = json.loads(result.stdout)
    assert doc["steps"] == done[0] and doc["steps_per_rank"] == done[0], {k: doc[k] for k in ("steps", "steps_per_rank")}


def _largest_flush(run_dir: Path, rank: int) -> int:
    """The most rows one flush wrote, from the compacted files' record of the segments they replaced."""
    largest = 0
    for path in _files(run_dir, "steps", rank):
        if store.segment_range(path) is None:
            continue
        if store.is_record_segment(path):  # a flush not compacted yet
            largest = max(largest, records.read_header(path)["rows"])
            continue
        raw = (pq.read_schema(path).metadata or {}).get(b"hyperacc.parts", b"")
        ends = [int(item.split(b":")[1]) for item in raw.split(b",") if item]
        if ends:
            largest = max(largest, int(np.diff([0, *ends]).max()))
        else:
            largest = max(largest, pq.read_metadata(path).num_rows)
    return largest


def test_a_rank_killed_mid_run_loses_at_most_its_last_flush(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _start(run_dir, 120.0)
    try:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline:  # until rank 1 compacted a few times
            files = _files(run_dir, "steps", 1)
            if any(store.segment_range(p) and store.segment_range(p)[1] >= 3 * EVERY for p in files):  # type: ignore[index]
                break
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            time.sleep(0.2)
        else:
            pytest.fail("rank 1 never compacted")
        before = _steps(run_dir, 1).size
        pid = _rank_pid(proc.pid, 1)
        os.kill(pid, signal.SIGKILL)
        proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    killed, survivor = _steps(run_dir, 1), _steps(run_dir, 0)
    assert killed.tolist() == list(range(killed.size))  # a prefix, each step once, nothing duplicated
    assert killed.size >= before  # nothing already on disk was lost, whatever the kill interrupted
    # rank 0 stopped at the all-reduce rank 1 never joined: its last step is where rank 1 died
    lost = int(survivor.max()) - int(killed.max())
    assert lost <= 2 * _largest_flush(run_dir, 1) + 2, (lost, _largest_flush(run_dir, 1))


def _rank_pid(launcher: int, rank: int) -> int:
    import psutil

    for child in psutil.Process(launcher).children(recursive=True):
        try:
            if str(JOB) in " ".join(child.cmdline()) and child.environ().get("RANK") == str(rank):
                return child.pid
        except psutil.Error:
            continue
    raise AssertionError(f"no process of rank {rank}")


AGENT_JOB = Path(__file__).resolve().parent / "jobs" / "agent_loop.py"


def test_under_hyperacc_run_the_agent_compacts_and_the_ranks_never_load_pyarrow(tmp_path: Path) -> None:
    """``hyperacc run --quiet``: the ranks write plain records and leave compaction to the node agent
    (``hyperacc.agent``), which rolls everything into Parquet once the job has ended."""
    run_dir = tmp_path / "run"
    trace = json.dumps({"flush_every_s": 0.05, "compact_every": EVERY, "window": 50, "resources_every_s": 0.2})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run([sys.executable, "-m", "hyperacc", "run", "--quiet", "--nproc-per-node", "2",
                             "--run-dir", str(run_dir), "--trace", trace, "--", str(AGENT_JOB), "6"],
                            env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    ends = re.findall(r"rank (\d) steps (\d+) pyarrow (\w+) windows (\w+)", out)
    assert sorted(int(w[0]) for w in ends) == [0, 1], out[-3000:]
    assert all(w[2] == "False" for w in ends), ends  # no pyarrow in a training rank
    assert all(w[3] == "False" for w in ends), ends  # no rank summarises or gathers windows: the agent does
    steps = int(ends[0][1])
    for rank in (0, 1):
        files = _files(run_dir, "steps", rank)
        assert files and all(p.suffix == ".parquet" for p in files), files  # every record rolled into Parquet
        assert len(files) <= 2 and max(store.segment_range(p)[1] for p in files) >= 3 * EVERY, files  # type: ignore[index]
        for kind in ("events", "resources"):
            assert all(p.suffix == ".parquet" for p in _files(run_dir, kind, rank)), _files(run_dir, kind, rank)
        got = _steps(run_dir, rank)
        assert got.size >= steps - 1 and got.tolist() == list(range(int(got[0]), int(got[0]) + got.size))
    # the window summaries the agent gathered from the ranks' records, rolled into Parquet too
    windows = sorted((run_dir / "live" / "windows").iterdir())
    assert len(windows) == 1 and windows[0].suffix == ".parquet", windows
    gathered = store.read_live_windows(run_dir)
    assert set(gathered.column("rank").to_pylist()) == {0, 1} and gathered.num_rows >= 2 * (steps // 50 - 2)
    judged = [e for e in store.read_live_events(run_dir).to_pylist() if e["kind"] == "window_gathered"]
    assert len(judged) == gathered.num_rows // 2 and all(json.loads(e["detail"])["missing"] == [] for e in judged)
    assert not [e for e in store.read_events(run_dir).to_pylist() if e["kind"] == "window_gathered"]

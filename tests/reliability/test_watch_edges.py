"""``hyperacc watch`` on what a run directory may hold and on runs of any length, in a pipe (issue 23,
item 5; docs/reliability.md, "watch"): it reads what ``analyze`` reads, shows a run shorter than one
window and the last window of a run, and says what it waits for.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from reliability_runs import SMALL, job_env, small_run

from hyperacc.analysis.synthetic import SyntheticRun, write_run


def _watch(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """watch in a pipe (stdout is not a terminal)."""
    return subprocess.run([sys.executable, "-m", "hyperacc", "watch", *args], env=job_env(), capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def _no_traceback(res: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in res.stderr and "Error" not in res.stderr.replace("Error:", ""), res.stderr[-3000:]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    return small_run(tmp_path_factory.mktemp("watch") / "run")


def test_a_segment_of_a_foreign_type_is_skipped_as_analyze_skips_it(base_run: Path, tmp_path: Path) -> None:
    run = Path(shutil.copytree(base_run, tmp_path / "run"))
    bad = run / "steps" / "rank-00001" / "seg-000099.parquet"
    pq.write_table(pa.table({"rank": pa.array([1], pa.int32()), "node": pa.array([0], pa.int32()),
                             "step": pa.array([SMALL.steps], pa.int64()),
                             "t_start_ns": pa.array([0], pa.timestamp("ns"))}), bad)  # fmt: skip
    res = _watch(str(run), "--once", "--json")
    _no_traceback(res)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["ranks"] == SMALL.ranks
    assert str(bad) in res.stderr and "timestamp" in res.stderr


def test_folders_that_are_not_a_ranks_are_not_counted(base_run: Path, tmp_path: Path) -> None:
    run = Path(shutil.copytree(base_run, tmp_path / "run"))
    for name in ("rank-foo", "rank-99999999", "rank-1048576"):
        shutil.copytree(run / "steps" / "rank-00000", run / "steps" / name)
    res = _watch(str(run), "--once", "--json")
    _no_traceback(res)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["ranks"] == SMALL.ranks and doc["world_size"] == SMALL.ranks
    line = _watch(str(run), "--once")
    assert f"{SMALL.ranks}/{SMALL.ranks} ranks" in line.stdout, line.stdout


def test_a_run_shorter_than_one_window_is_shown_in_a_pipe(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", SyntheticRun(ranks=2, steps=20, ranks_per_node=2, seed=3, segment_steps=10))
    res = _watch(str(run), "--idle", "0.5", "--interval", "0.1", "--window", "50")
    _no_traceback(res)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1 and "step 19," in lines[0], res.stdout


def test_the_last_window_of_a_live_run_is_shown_in_a_pipe(tmp_path: Path) -> None:
    """The records arrive while watch runs: steps 0-99 first, then 100-129 (less than a window)."""
    full = write_run(tmp_path / "full", SyntheticRun(ranks=2, steps=130, ranks_per_node=2, seed=4, segment_steps=10))
    run = tmp_path / "run"
    shutil.copytree(full / "meta", run / "meta")
    segments = sorted(full.glob("steps/rank-*/seg-*.parquet"))
    late = [p for p in segments if int(p.stem.split("-")[1]) > 10]  # segments 11-13: steps 100-129

    def reveal(paths: list[Path]) -> None:
        for p in paths:
            dest = run / p.relative_to(full)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(p, dest.with_suffix(".tmp"))
            dest.with_suffix(".tmp").rename(dest)  # as the tracer writes: complete, then renamed

    reveal([p for p in segments if p not in late])
    proc = subprocess.Popen([sys.executable, "-m", "hyperacc", "watch", str(run), "--idle", "3", "--interval", "0.1",
                             "--window", "50"], env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert first.startswith("hyperacc live: step 99,"), first
    reveal(late)
    rest, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert rest.strip().splitlines()[-1].startswith("hyperacc live: step 129,"), first + rest


def test_an_empty_run_dir_says_what_watch_waits_for(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    once = _watch(str(empty), "--once")
    assert once.returncode == 1
    lines = [line for line in once.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and str(empty) in lines[0] and "no step records" in lines[0], once.stderr
    waiting = _watch(str(empty), "--idle", "0.3", "--interval", "0.1")
    assert waiting.returncode == 0 and "waiting for the first step records" in waiting.stderr, waiting.stderr

"""A second job into the run directory of a first one is refused with one line naming ``--overwrite``
and a new directory; ``--overwrite`` starts afresh; the nodes of one job (same ``--rdzv-id``) and
torchrun's own restarts are not a reuse (issue 23, item 4; docs/reliability.md, "Run directories").
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from reliability_runs import EXAMPLE, job_env

from hyperacc.analysis.columns import discover, read_rank
from hyperacc.harness import free_port

pytestmark = pytest.mark.multirank


def _run(run_dir: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hyperacc", "run", "--run-dir", str(run_dir), "--nproc-per-node", "1",
           "--max-restarts", "0", *extra, "--", str(EXAMPLE), "--steps", str(steps), "--features", "32",
           "--hidden", "32"]  # fmt: skip
    return subprocess.run(cmd, env=job_env(), capture_output=True, text=True, timeout=300)


def _steps(run_dir: Path) -> np.ndarray:
    (src,) = discover(run_dir).sources.values()
    return np.sort(read_rank(src.segments, ("step",))["step"])


def _analyze(run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hyperacc", "analyze", str(run_dir), "--json"], env=job_env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_a_second_job_into_a_used_run_dir_is_refused_and_overwrite_starts_afresh(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = _run(run_dir, 40)
    assert first.returncode == 0, first.stderr[-3000:]
    assert np.array_equal(_steps(run_dir), np.arange(40))
    (run_dir / "hosts.exclude").write_text("nodeX\n")  # a person's file: kept by --overwrite

    second = _run(run_dir, 20)
    assert second.returncode == 2, second.stderr[-3000:]
    lines = [line for line in second.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--overwrite" in lines[0] and "new directory" in lines[0], second.stderr
    assert np.array_equal(_steps(run_dir), np.arange(40))  # the first run is untouched

    third = _run(run_dir, 20, "--overwrite")
    assert third.returncode == 0, third.stderr[-3000:]
    assert np.array_equal(_steps(run_dir), np.arange(20))  # steps 0-19 once, nothing of the first run
    assert (run_dir / "hosts.exclude").read_text() == "nodeX\n"
    doc = json.loads(_analyze(run_dir).stdout)
    assert doc["steps"] == 20, doc["steps"]


def test_nodes_of_one_job_share_a_run_dir(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = _run(run_dir, 10, "--rdzv-id", "job-7", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                 f"127.0.0.1:{free_port()}")  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads((run_dir / "job.json").read_text())["rdzv_id"] == "job-7"
    node = ["--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29999",
            "--dry-run"]  # fmt: skip
    same = _run(run_dir, 10, "--rdzv-id", "job-7", *node)
    assert same.returncode == 0, same.stderr  # another node of the same job joins
    other = _run(run_dir, 10, "--rdzv-id", "job-8", *node)
    assert other.returncode == 2 and "--overwrite" in other.stderr, other.stderr

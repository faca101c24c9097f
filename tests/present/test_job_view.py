"""``hyperacc watch`` of a job of many ranks reads the windows its leader gathered (``present.job_view``),
not every rank's records (docs/presentation.md, "Watching a job"): the live windows and events are made
by the real node agent (``agent.LiveNode``) from a generated run of 300 ranks.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hyperacc import store
from hyperacc.analysis.options import DetectionOptions
from hyperacc.analysis.synthetic import SyntheticFault, SyntheticRun, write_run
from hyperacc.analysis.windows import summarize_windows

RANKS, SLOW = 300, 7


@pytest.fixture(scope="module")
def led_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """300 ranks x 160 steps, rank 7 1.5x slower in compute, gathered by one agent that holds them all."""
    from hyperacc.agent import LiveNode

    run = write_run(tmp_path_factory.mktemp("job") / "run", SyntheticRun(
        ranks=RANKS, steps=160, ranks_per_node=8, seed=5, segment_steps=160,
        faults=(SyntheticFault("slowdown", ranks=(SLOW,), factor=0.5),)))  # fmt: skip
    for meta in store.read_meta(run).values():
        store.write_meta(run, dataclasses.replace(meta, agent="host:1", source="tracer"))
    node = LiveNode(run, agent="host:1", window=50, grace_s=1.0)
    node.stop()  # one final pass over every rank's records, as after a job
    assert store.live_segments(run / "live" / "windows")
    return run


def _watch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hyperacc", "watch", *args], capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_watch_of_many_ranks_shows_the_gathered_windows_and_names_the_slow_rank(led_run: Path) -> None:
    res = _watch(str(led_run), "--once", "--json")
    assert res.returncode == 0, res.stderr
    assert "more than 256 ranks: showing the windows" in res.stderr
    snap = json.loads(res.stdout)
    assert snap["source"] == "windows" and snap["ranks"] == RANKS and snap["world_size"] == RANKS
    rows = {r["rank"]: r for r in snap["per_rank"]}
    assert sorted(rows) == list(range(RANKS))
    assert max(rows, key=lambda r: rows[r]["self_ms"]) == SLOW
    assert snap["culprit"] == SLOW  # the rank the others waited for
    # each rank's figures are the window summary analyze makes of the same steps
    last = max(r["step"] for r in rows.values())
    w = last // 50
    cols = {k: v for k, v in store.read_steps(led_run).to_pydict().items()}
    rank = np.asarray(cols["rank"])
    for r in (0, SLOW, RANKS - 1):
        mine = {k: np.asarray(v, dtype=np.float64)[rank == r] for k, v in cols.items()}
        summary = summarize_windows(mine, DetectionOptions(window_steps=50), windows=[w])
        assert rows[r]["self_ms"] == pytest.approx(summary["self_ns_median"][0] / 1e6)
    assert snap["p99_ms"] is None and snap["spike_rate"] is None  # per-step figures: not in the windows
    line = _watch(str(led_run), "--once")
    assert line.returncode == 0 and "(gathered windows)" in line.stdout and f"{RANKS}/{RANKS} ranks" in line.stdout


def test_records_are_still_read_when_asked_and_below_the_threshold(led_run: Path, tmp_path: Path) -> None:
    res = _watch(str(led_run), "--once", "--json", "--source", "records")
    assert res.returncode == 0, res.stderr
    snap = json.loads(res.stdout)
    assert snap["source"] == "records" and snap["ranks"] == RANKS and snap["p99_ms"] is not None
    # the pace of the same rank's records, over each view's own window of steps
    windows = json.loads(_watch(str(led_run), "--once", "--json").stdout)
    assert windows["steps_per_s"] == pytest.approx(snap["steps_per_s"], rel=0.2)
    small = write_run(tmp_path / "small", SyntheticRun(ranks=4, steps=120, ranks_per_node=4, seed=1))
    res = _watch(str(small), "--once", "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["source"] == "records", res.stderr
    res = _watch(str(small), "--once", "--source", "windows")  # no leader gathered windows there
    assert res.returncode == 1 and "no gathered windows" in res.stderr

"""A real 2-node job with per-node local disks: two ``hyperacc run`` agents on loopback, each writing its own
run directory. ``analyze``, ``report``, ``export``, ``compare`` and ``watch`` read them as one job; the live
view (``RunFollower``) and ``hyperacc watch --once`` / ``--json`` are tested on the same real records."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hyperacc import harness
from hyperacc.analysis import diagnose
from hyperacc.present.live_view import RunFollower, line, render

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_ddp.py"
STEPS = 120


def hyperacc(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hyperacc", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def two_agents(tmp_path_factory) -> tuple[Path, Path, str]:
    root = tmp_path_factory.mktemp("agents")
    port = harness.free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    dirs = [root / "node0-disk" / "run", root / "node1-disk" / "run"]
    procs, logs = [], []
    for node in range(2):
        log = root / f"node{node}.log"
        logs.append(log)
        cmd = [sys.executable, "-m", "hyperacc", "run", "--run-dir", str(dirs[node]), "--nproc-per-node", "2",
               "--nnodes", "2", "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
               "--max-restarts", "0", "--", str(EXAMPLE), "--steps", str(STEPS), "--features", "128",
               "--hidden", "128"]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                      start_new_session=True))  # fmt: skip
    deadline = time.monotonic() + 300
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    output = "\n".join(log.read_text(errors="replace")[-2000:] for log in logs)
    return dirs[0], dirs[1], output


@pytest.mark.multirank
def test_each_agent_alone_misses_the_other_node_and_merged_they_are_one_job(two_agents) -> None:
    a, b, output = two_agents
    assert (a / "steps").is_dir() and (b / "steps").is_dir(), output
    alone = diagnose(a, warmup_steps=5).to_dict()
    assert alone["missing_ranks"] == [2, 3] and alone["ranks_analyzed"] == 2, output
    merged = diagnose([a, b], warmup_steps=5).to_dict()
    assert merged["missing_ranks"] == [] and merged["ranks_analyzed"] == 4 and merged["nodes"] == 2
    assert merged["world_size"] == 4 and merged["steps"] >= STEPS - 5
    cost = merged["coordination"]["cost"]
    assert cost is not None and 0 < cost["wait_share"] < 1  # waits of all four ranks, across both agents
    assert merged["resources"]["ranks"] == 4  # both agents' resource samples

    # copied together into one directory, they are the same job
    import shutil

    copy = a.parent.parent / "copied"
    shutil.copytree(a, copy)
    shutil.copytree(b, copy, dirs_exist_ok=True)
    together = diagnose(copy, warmup_steps=5).to_dict()
    for key in ("ranks_analyzed", "missing_ranks", "stragglers", "spikes", "coordination", "resources"):
        assert together[key] == merged[key]

    r = hyperacc("analyze", f"{a},{b}", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ranks_analyzed"] == 4


@pytest.mark.multirank
def test_report_export_and_compare_take_the_merged_job(two_agents, tmp_path) -> None:
    a, b, _ = two_agents
    joined = f"{a},{b}"
    rep = hyperacc("report", joined, "-o", str(tmp_path / "r.html"), "--baseline", joined)
    assert rep.returncode == 0, rep.stderr
    assert "4 ranks" in rep.stdout and "<section id='comparison'>" in (tmp_path / "r.html").read_text()
    exp = hyperacc("export", joined, "--chrome", str(tmp_path / "t.json"), "--no-diagnosis")
    assert exp.returncode == 0, exp.stderr
    trace = json.loads((tmp_path / "t.json").read_text())
    pids = {e["pid"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert len(pids) == 4  # one process per rank, from both directories
    cmp = hyperacc("compare", joined, joined, "--fail-on", "p99=+1%,spike_rate=+1pp")
    assert cmp.returncode == 0, cmp.stdout + cmp.stderr
    # one agent's directory and the whole job are not one job
    bad = hyperacc("analyze", f"{a},{a.parent}")
    # records that do not belong together: the command cannot do its work (docs/reliability.md, "Exit status")
    assert bad.returncode == 1 and "Traceback" not in bad.stderr


@pytest.mark.multirank
def test_watch_shows_the_merged_job_once_and_as_json(two_agents) -> None:
    a, b, _ = two_agents
    follower = RunFollower([a, b], keep=200)
    assert follower.poll() and not follower.poll()  # every segment read once
    snap = follower.snapshot(window=50)
    assert snap is not None and snap.ranks == 4 and snap.world_size == 4
    assert snap.window >= 40 and snap.p50_ms > 0 and snap.p99_ms >= snap.p50_ms
    assert {v.node for v in snap.per_rank} == {0, 1}
    assert snap.coordination["modes"].keys() == {"sync_amplification", "fabric_contention"}
    text = line(snap)
    assert text.startswith(f"hyperacc live: step {snap.step}, 4/4 ranks") and "p90" in text
    from rich.console import Console

    console = Console(record=True, width=120)
    console.print(render(snap))
    screen = console.export_text()
    assert "waiting for late arrivals" in screen and "culprit now" in screen

    once = hyperacc("watch", str(a), str(b), "--once")
    assert once.returncode == 0 and once.stdout.startswith("hyperacc live: step"), once.stderr
    js = hyperacc("watch", f"{a},{b}", "--once", "--json")
    assert js.returncode == 0, js.stderr
    doc = json.loads(js.stdout)
    assert doc["ranks"] == 4 and len(doc["per_rank"]) == 4 and "coordination" in doc
    assert doc["coordination"]["p90_ms"] is not None
    idle = hyperacc("watch", str(a), "--idle", "0.5", "--interval", "0.2")
    assert idle.returncode == 0 and idle.stdout.count("hyperacc live") == 1  # a finished job: one line, then idle


def test_watch_of_a_directory_without_records_says_so(tmp_path) -> None:
    (tmp_path / "run").mkdir()
    r = hyperacc("watch", str(tmp_path / "run"), "--once")
    assert r.returncode == 1 and r.stdout == ""
    missing = hyperacc("watch", str(tmp_path / "nowhere"), "--once")
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_the_view_of_hyperacc_run_follows_its_own_ranks_in_a_shared_run_directory(tmp_path, monkeypatch) -> None:
    """Two nodes' agents sharing one run directory: each ``hyperacc run`` view (``RunFollower(agent=...)``)
    reads only the ranks whose metadata names it, as on local disks, not every node's; the metadata is
    read again only when it changed (``store.MetaCache``), not at every refresh."""
    import numpy as np

    from hyperacc import records
    from hyperacc.present import live_view
    from hyperacc.schema import RankMeta, steps_dir

    columns = records.columns_of("STEP_SCHEMA")
    for rank in range(4):
        records.write_meta(tmp_path, RankMeta(rank, rank % 2, rank // 2, 4, 2, "host", 10 + rank,
                                              agent=("a:1", "b:2")[rank // 2]))  # fmt: skip
        rows = np.full((80, len(columns)), -1, dtype=np.int64)
        for name, values in (("rank", rank), ("node", rank // 2), ("step", np.arange(80)), ("step_ns", 20_000_000),
                             ("self_ns", 15_000_000), ("comm_wait_ns", 5_000_000), ("t_start_ns", 10**18)):  # fmt: skip
            rows[:, columns.index(name)] = values
        records.RecordWriter(steps_dir(tmp_path, rank), "STEP_SCHEMA").write_int64(rows)
    past = os.stat(tmp_path / "meta").st_mtime - 10  # written a while ago: settled
    os.utime(tmp_path / "meta", (past, past))
    reads = []
    real = live_view.store.read_meta
    monkeypatch.setattr(live_view.store, "read_meta", lambda run_dir: reads.append(run_dir) or real(run_dir))
    mine = RunFollower([tmp_path], keep=200, agent="b:2")
    assert mine.poll()
    snap = mine.snapshot(window=50)
    assert snap is not None and {v.rank for v in snap.per_rank} == {2, 3} and snap.world_size == 4
    assert not mine.poll() and len(reads) == 1  # the second refresh read no metadata and no records
    records.write_meta(tmp_path, RankMeta(4, 0, 2, 5, 1, "host", 14, agent="b:2"))  # a rank joins
    mine.poll()
    assert len(reads) == 2 and mine.world_size == 5
    every = RunFollower([tmp_path], keep=200)
    every.poll()
    assert {v.rank for v in every.snapshot(window=50).per_rank} == {0, 1, 2, 3}

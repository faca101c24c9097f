"""Automatic tracing of scripts that know nothing of hyperacc: through ``hyperacc run`` on two
simulated nodes, and through ``python -m hyperacc.bootstrap`` in a single process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.compute as pc
import pytest

from hyperacc import harness, store

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_ddp.py"
PHASE_COLUMNS = ("data_ns", "h2d_ns", "forward_ns", "backward_ns", "comm_wait_ns", "optimizer_ns")
SINGLE_JOB = Path(__file__).parent / "jobs" / "single_job.py"
FAILING = Path(__file__).parent / "jobs" / "failing_script.py"


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra})
    return env


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    try:
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(deadline - time.monotonic(), 0.1)))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()
    return codes


@pytest.mark.multirank
def test_hyperacc_run_traces_an_unmodified_ddp_script_on_two_nodes(tmp_path: Path) -> None:
    run, results = tmp_path / "run", tmp_path / "results"
    results.mkdir()
    # 120 steps (12 windows): on a loaded host the second node's agent was seen to miss the job's store
    # for its first 10 s connect and rejoin after its backoff, when 40 steps had already ended
    steps = 120
    chaos = {"seed": 3, "faults": [{"kind": "slowdown", "ranks": [2], "factor": 2.0}]}
    port = harness.free_port()
    procs, logs = [], []
    for node in range(2):
        log = (tmp_path / f"node{node}.log").open("w")
        logs.append(tmp_path / f"node{node}.log")
        cmd = [
            sys.executable, "-m", "hyperacc", "run", "--run-dir", str(run), "--nproc-per-node", "2",
            "--nnodes", "2", "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
            "--max-restarts", "0", "--trace", json.dumps({"window": 10, "flush_every_s": 1.0, "probe_every": 10, "inband": True}),
            "--chaos", json.dumps(chaos),
            "--", str(EXAMPLE), "--steps", str(steps), "--features", "128", "--hidden", "128",
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(
                cmd,
                env=_env(HYPERACC_RESULT_DIR=str(results)),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    codes = _wait_all(procs, timeout=240)
    output = "\n".join(p.read_text(errors="replace")[-4000:] for p in logs)
    finished = sorted(p.name for p in results.glob("rank-*.json"))
    assert finished == [f"rank-{r}.json" for r in range(4)], f"codes={codes}\n{output}"

    meta = store.read_meta(run)
    assert {r: m.node for r, m in meta.items()} == {0: 0, 1: 0, 2: 1, 3: 1}  # GROUP_RANK
    assert {m.backend for m in meta.values()} == {"gloo"}
    table = store.read_steps(run)
    rows = {r: table.filter(pc.equal(table["rank"], r)).to_pylist() for r in range(4)}
    for r in range(4):
        assert [row["step"] for row in rows[r]] == list(range(steps)), output
        for row in rows[r][1:]:
            for col in ("data_ns", "forward_ns", "backward_ns", "comm_wait_ns", "optimizer_ns", "self_ns"):
                assert row[col] is not None and row[col] >= 0, (r, row["step"], col)
            assert (row["launch_ns"] is not None) == (row["step"] % 10 == 0)
    # every rank decoded the same in-band values, so every rank names the same culprit
    for step in range(2, steps):
        assert len({rows[r][step]["min_wait_rank"] for r in range(4)}) == 1
        assert rows[0][step]["min_wait_rank"] is not None

    def median(r: int, col: str) -> float:
        values = sorted(row[col] for row in rows[r][2:])
        return values[len(values) // 2]

    # chaos burns CPU after rank 2's forward (2 x forward x 3): its CPU time shows it, nobody else's
    # (CPU time, not self-time: on a loaded host the other ranks' self-times grow by preemption too)
    assert median(2, "cpu_ns") > 1.5 * max(median(r, "cpu_ns") for r in (0, 1, 3))
    # the node agent holding rank 0 judged the windows, the other node's agent sent its node's rows
    assert not [e for e in store.read_events(run).to_pylist() if e["kind"] == "window_gathered"]  # no rank did
    gathered = [e for e in store.read_live_events(run).to_pylist() if e["kind"] == "window_gathered"]
    assert gathered and all(e["rank"] == 0 for e in gathered), output
    assert any(e["value"] == 4 and json.loads(e["detail"])["missing"] == [] for e in gathered), (gathered, output)
    # rank 0 kept every rank's window summaries for the live view; every rank sampled its resources
    live = store.read_live_windows(run)
    assert set(live.column("rank").to_pylist()) == {0, 1, 2, 3}
    resources = store.read_resources(run).to_pylist()
    assert {r["rank"] for r in resources} == {0, 1, 2, 3}
    assert all(r["rss_bytes"] > 0 and r["cpu_ns"] >= 0 and r["cuda_allocated_bytes"] is None for r in resources)


@pytest.mark.slow  # a DDP job of one rank through the bootstrap, in its own interpreter
def test_bootstrap_times_explicit_collectives_and_wraps_the_users_comm_hook(tmp_path: Path) -> None:
    out, run = tmp_path / "out.json", tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "hyperacc.bootstrap", str(SINGLE_JOB), str(out), str(harness.free_port())],
        env=_env(HYPERACC_RUN_DIR=str(run), HYPERACC_TRACE='{"window": 0}'),
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["calls"] == 6  # the script's hook ran on every backward (one bucket each) ...
    assert result["halved"] == [True] * 6  # ... and its result is what DDP used
    rows = store.read_steps(run).to_pylist()
    steps = [r["step"] for r in rows]
    assert steps == list(range(len(steps))) and len(steps) >= 10
    for r in rows[1:6]:  # explicit all_reduce on every gradient, timed without DDP
        assert r["comm_wait_ns"] > 0 and r["self_ns"] is not None and r["backward_ns"] is not None
        assert r["data_ns"] is not None and r["forward_ns"] is not None
    for r in rows[7:]:  # the DDP model, its hook wrapped
        assert r["comm_wait_ns"] is not None and r["self_ns"] is not None


def _tracebacks(stderr: str) -> list[list[str]]:
    """Each traceback of a chain printed by Python, as its ``File ...`` lines and the exception's line."""
    out = []
    for block in stderr.split("Traceback (most recent call last):")[1:]:
        lines = [line.strip() for line in block.splitlines()]
        frames = [line for line in lines if line.startswith('File "')]
        error = next(line for line in lines if line.split(":")[0].endswith(("Error", "KeyError")))
        out.append([*frames, error])
    return out


@pytest.mark.slow  # two interpreters with torch per case
@pytest.mark.parametrize("mode", ["backward", "forward", "record"])
def test_a_failing_script_fails_through_the_bootstrap_as_it_does_alone(tmp_path: Path, mode: str) -> None:
    work = tmp_path / "work"
    work.mkdir()  # a working directory that is not the script's, as under a job scheduler
    script = os.path.relpath(FAILING, work)
    env = _env(HYPERACC_RUN_DIR=str(tmp_path / "run"), HYPERACC_TRACE='{"window": 0, "probe_every": 0}')
    errors = {arm: tmp_path / f"error-{arm}.json" for arm in ("alone", "traced")}
    alone = subprocess.run([sys.executable, script, mode], cwd=work, capture_output=True, text=True,
                           env={**env, "TORCHELASTIC_ERROR_FILE": str(errors["alone"])}, timeout=180)  # fmt: skip
    traced = subprocess.run([sys.executable, "-m", "hyperacc.bootstrap", script, mode], cwd=work,
                            env={**env, "TORCHELASTIC_ERROR_FILE": str(errors["traced"])},
                            capture_output=True, text=True, timeout=180)  # fmt: skip
    assert alone.returncode == traced.returncode == 1, traced.stderr[-3000:]
    # __file__ absolute, sys.path[0] the script's directory, argv as given but for argv[0], made absolute
    file, path0, argv = alone.stdout.split(" ", 2)
    assert traced.stdout == f"{file} {path0} {argv.replace(repr(script), file)}", (traced.stdout, alone.stdout)
    expected = _tracebacks(alone.stderr)
    assert len(expected) == 2 and "step failed" in expected[1][-1], alone.stderr[-3000:]
    assert _tracebacks(traced.stderr) == expected, traced.stderr[-3000:]
    assert "hyperacc" not in "".join(line for tb in _tracebacks(traced.stderr) for line in tb)
    assert store.read_steps(tmp_path / "run").num_rows >= 3  # it was traced
    if mode == "record":  # what torchrun's summary prints: the error file has the script's frames alone
        written = {arm: json.loads(path.read_text())["message"]["extraInfo"]["py_callstack"] for arm, path in errors.items()}
        assert _tracebacks(written["traced"]) == _tracebacks(written["alone"]), written["traced"]
        assert "boom in backward" in written["traced"]

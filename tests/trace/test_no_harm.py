"""hyperacc does no harm: the same script fails, trains and exits the same with tracing as without.

Every test starts real ranks (torchrun, gloo) and compares with the same script under plain torchrun.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hyperacc import harness, store

JOB = Path(__file__).parent / "jobs" / "faults_job.py"


def traced(run_dir: Path, **trace: object) -> dict[str, str]:
    return {"run-dir": str(run_dir), "trace": json.dumps({"window": 0, "probe_every": 0, **trace})}


# (gradient buckets, the traced variants run beside plain torchrun): one bucket, the default and with
# pacing; many buckets, with pacing (slots ride on the last bucket)
DEAD_PEER = {"one": ("default", "paced"), "many": ("paced",)}


@pytest.mark.multirank
def test_a_dead_peer_fails_the_survivor_as_under_plain_torchrun(tmp_path: Path) -> None:
    # torchrun stops the survivors once it sees the dead rank, at its first monitor check after the death
    # (every `--monitor-interval` seconds from the start of the workers). The survivors need that time to
    # meet the failure themselves, with and without hyperacc alike. At 10 s, a rank that died near the
    # 10 s check on a loaded host (slow start-up: three jobs beside another test's) left its survivor a
    # fraction of a second, and it was sometimes stopped first. The five jobs below start together and
    # spend most of their time waiting for that check, so they run side by side; at 45 s the death comes
    # well before the first check (the five survivors had failed 16-17 s after the start, a busy loop
    # beside them), and every job ends at that check.
    slow_monitor = ["--monitor-interval", "45"]

    def run(case: tuple[str, str]) -> harness.JobResult:
        buckets, name = case
        args = ["--buckets", buckets, "--die-rank", "1", "--die-step", "2"]
        if name == "plain":
            return harness.launch(JOB, args, nproc=2, timeout=180, torchrun_args=slow_monitor)
        opts = traced(tmp_path / f"{buckets}-{name}")
        if name == "paced":
            opts["pace"] = "1"  # pacing asks for the in-band exchange: slots ride on the last bucket
        return harness.launch(JOB, args, nproc=2, timeout=180, traced=opts, torchrun_args=slow_monitor)

    cases = [(b, name) for b, variants in DEAD_PEER.items() for name in ("plain", *variants)]
    with ThreadPoolExecutor(len(cases)) as pool:
        jobs = dict(zip(cases, pool.map(run, cases), strict=True))
    for (buckets, name), job in jobs.items():
        if name != "plain":
            _fails_as_plain(job, jobs[buckets, "plain"], f"{buckets} bucket(s), {name}")


def _fails_as_plain(job: harness.JobResult, plain: harness.JobResult, name: str) -> None:
    ref = plain.ranks[0].result
    assert ref is not None and ref["error"], plain.explain()
    assert ref["optimizer_steps"] == 2  # steps 0 and 1; step 2's backward raised
    mine = job.ranks[0].result
    assert mine is not None, job.explain()
    assert (mine["error"], mine["optimizer_steps"], mine["steps"]) == (
        ref["error"], ref["optimizer_steps"], ref["steps"]
    ), (name, mine, ref)
    assert bool(job.returncodes[0]) == bool(plain.returncodes[0]), (name, job.returncodes, plain.returncodes)
    # the survivor's traceback is the one plain torchrun's shows: no frame of hyperacc's bootstrap or
    # of its backward wrapper, the script's own path as Python gives it
    assert _frames(job.ranks[0].stderr) == _frames(plain.ranks[0].stderr), (name, job.ranks[0].stderr[-3000:])
    # torchrun's summary names the script that failed, as it does without hyperacc
    failed = f"{JOB} FAILED"
    assert failed in plain.launcher_output, plain.launcher_output[-3000:]
    assert failed in job.launcher_output and "bootstrap FAILED" not in job.launcher_output, job.launcher_output[-3000:]


def _frames(stderr: str) -> list[str]:
    """The ``File "...", line N, in f`` lines of the last traceback in a rank's output."""
    last = stderr.rsplit("Traceback (most recent call last):", 1)[-1]
    return [line.strip() for line in last.splitlines() if line.strip().startswith('File "')]


@pytest.mark.multirank
@pytest.mark.parametrize("inband", [True, False], ids=["in-band hook", "built-in all-reduce"])
def test_an_internal_error_on_one_rank_keeps_the_collective_shape(tmp_path: Path, inband: bool) -> None:
    run = tmp_path / "run"
    args = ["--buckets", "many", "--break-rank", "1", "--break-round", "3", "--twin", "--steps", "8"]
    job = harness.launch(JOB, args, nproc=2, timeout=180, traced=traced(run, inband=inband))
    assert job.ok, job.explain()
    for res in job.results():
        assert res["error"] is None and res["steps"] == 8
        assert all(res["exact"]), res["exact"]  # gradients as untouched DDP's, before and after the failure
    stderr = job.ranks[1].stderr
    assert stderr.count("gradient collective timing failed") == 1, stderr[-3000:]
    steps = store.read_steps(run).to_pylist()
    assert sorted({(r["rank"], r["step"]) for r in steps}) == [(r, s) for r in range(2) for s in range(8)]


@pytest.mark.multirank
def test_attaching_on_some_ranks_only_turns_the_exchange_off_for_all(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = ["--buckets", "many", "--attach-ranks", "0", "--twin", "--run-dir", str(run)]
    job = harness.launch(JOB, args, nproc=2, timeout=180)
    assert job.ok, job.explain()
    for res in job.results():
        assert res["error"] is None and all(res["exact"])
    assert "not every rank of the group agreed in time" in job.ranks[0].stderr


@pytest.mark.multirank
def test_tracing_leaves_gradients_bit_identical_at_four_ranks(tmp_path: Path) -> None:
    job = harness.launch(
        JOB, ["--buckets", "many", "--twin", "--steps", "5"], nproc=4, timeout=240, traced=traced(tmp_path / "run")
    )
    assert job.ok, job.explain()
    for res in job.results():
        assert all(res["exact"]), res["exact"]

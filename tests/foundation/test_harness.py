"""The harness really runs ranks through torchrun, survives gloo's exit crash and leaves nothing behind."""

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hyperacc import harness

SCRIPTS = Path(__file__).parent / "scripts"
pytestmark = pytest.mark.multirank


def test_two_agents_on_one_machine_are_two_nodes():
    job = harness.launch(SCRIPTS / "exit_crash.py", nproc=2, nnodes=2, timeout=120)
    assert job.ok, job.explain()
    assert [r["group_rank"] for r in job.results()] == [0, 0, 1, 1]
    assert job.ranks[3].node == 1


def _survive_aborts(runs: int) -> list[harness.JobResult]:
    # half the runs die with SIGABRT after writing their results, as gloo does at interpreter exit;
    # the deterministic half is what is tested, the concurrency only makes the runs overlap. The first
    # run has four ranks, the others two.
    def one(i: int) -> harness.JobResult:
        return harness.launch(SCRIPTS / "exit_crash.py", ["abort"] if i % 2 else [], nproc=2 if i else 4, timeout=180)

    with ThreadPoolExecutor(max_workers=4) as pool:
        jobs = list(pool.map(one, range(runs)))
    for job in jobs:
        assert job.ok, job.explain()
    for i, job in enumerate(jobs):
        if i % 2:
            assert any(code != 0 for code in job.returncodes), job.returncodes  # the abort really happened
    return jobs


def test_runs_survive_the_exit_time_abort_and_four_ranks_report_their_results():
    # an aborting run beside a clean one, at once (the soak: twenty, four at a time)
    clean = _survive_aborts(2)[0]
    assert [r["rank"] for r in clean.results()] == [0, 1, 2, 3]
    assert all(r["sum"] == 1 + 2 + 3 + 4 and r["world"] == 4 for r in clean.results())


@pytest.mark.soak
def test_many_overlapping_runs_survive_the_exit_time_abort():
    _survive_aborts(20)  # the same, five rounds of four at once


def test_timeout_kills_the_whole_process_group(tmp_path):
    job = harness.launch(SCRIPTS / "hang.py", nproc=2, timeout=10, workdir=tmp_path)
    assert job.timed_out and not job.ok
    pids = [int(p.read_text()) for p in (tmp_path / "results").glob("pid-*")]
    assert len(pids) == 2
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        # a zombie already reaped by init is gone; anything else alive is a leak
        state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
        assert state in ("Z", "X"), f"rank process {pid} left behind"


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="nproc"):
        harness.launch(SCRIPTS / "exit_crash.py", nproc=0)

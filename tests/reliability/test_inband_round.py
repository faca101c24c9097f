"""The in-band round shared by the hook thread, the completion callbacks and the training thread
(issue 23, item 8; ``GradientRounds`` in trace/inband.py names who owns which field): every step's round
closes and is measured, however its buckets complete, and a failed bucket does not stop the timing of
the rounds after it. Real gloo ranks (``jobs/inband_rounds.py``): one job runs the five configurations
in turn, each with its own model, tracer and run directory."""

from __future__ import annotations

from pathlib import Path

import pyarrow.compute as pc
import pytest

from hyperacc import harness, store

pytestmark = pytest.mark.multirank
JOB = Path(__file__).parent / "jobs" / "inband_rounds.py"
STEPS = 30
CONFIGS = [("default", -1), ("early", -1), ("threads", -1), ("threads", 10), ("early", 10)]


def _waits(run: Path) -> dict[int, list[tuple[int, int | None]]]:
    table = store.read_steps(run)
    out = {}
    for r in (0, 1):
        rows = table.filter(pc.equal(table["rank"], r)).sort_by("step").to_pylist()
        out[r] = [(row["step"], row["comm_wait_ns"]) for row in rows]
    return out


@pytest.fixture(scope="module")
def rounds(tmp_path_factory) -> tuple[Path, list[dict]]:
    """One 2-rank job runs the five configurations one after another, each with a model and a tracer of
    its own in its own run directory (one job, not five: starting the ranks was most of each job's cost)."""
    run = tmp_path_factory.mktemp("rounds")
    configs = ",".join(f"{hook}:{fail}" for hook, fail in CONFIGS)
    job = harness.launch(JOB, ["--run-dir", str(run), "--steps", str(STEPS), "--configs", configs], nproc=2,
                         timeout=300)  # fmt: skip
    assert job.ok, job.explain()
    return run, job.results()


@pytest.mark.parametrize("hook,fail_step", CONFIGS)
def test_every_round_closes_whoever_completes_its_buckets(rounds, hook: str, fail_step: int) -> None:
    run_root, results = rounds
    name = f"{hook}_{fail_step}"
    failed = [s for res in results for s in res["failed_at"][name]]
    assert failed == ([fail_step] * 2 if fail_step >= 0 else [])
    for rank, rows in _waits(run_root / name).items():
        measured = [step for step, wait in rows if wait is not None and wait >= 0]
        expected = [s for s in range(STEPS) if s != fail_step and s > 0]  # step 0: DDP builds its buckets
        missing = sorted(set(expected) - set(measured))
        assert not missing, f"rank {rank}: steps whose round never closed or was not measured: {missing}"

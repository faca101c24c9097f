"""The in-band round shared by the hook thread, the completion callbacks and the training thread
(issue 23, item 8; ``GradientRounds`` in trace/inband.py names who owns which field): every step's round
closes and is measured, however its buckets complete, and a failed bucket does not stop the timing of
the rounds after it. Real gloo ranks (``jobs/inband_rounds.py``)."""

from __future__ import annotations

from pathlib import Path

import pyarrow.compute as pc
import pytest

from hyperacc import harness, store

pytestmark = pytest.mark.multirank
JOB = Path(__file__).parent / "jobs" / "inband_rounds.py"
STEPS = 30


def _waits(run: Path) -> dict[int, list[tuple[int, int | None]]]:
    table = store.read_steps(run)
    out = {}
    for r in (0, 1):
        rows = table.filter(pc.equal(table["rank"], r)).sort_by("step").to_pylist()
        out[r] = [(row["step"], row["comm_wait_ns"]) for row in rows]
    return out


@pytest.mark.parametrize("hook,fail_step", [("default", -1), ("early", -1), ("threads", -1), ("threads", 10),
                                            ("early", 10)])  # fmt: skip
def test_every_round_closes_whoever_completes_its_buckets(tmp_path: Path, hook: str, fail_step: int) -> None:
    run = tmp_path / "run"
    job = harness.launch(JOB, ["--run-dir", str(run), "--steps", str(STEPS), "--hook", hook,
                               "--fail-step", str(fail_step)], nproc=2, timeout=240)  # fmt: skip
    assert job.ok, job.explain()
    failed = [s for res in job.results() for s in res["failed_at"]]
    assert failed == ([fail_step] * 2 if fail_step >= 0 else [])
    for rank, rows in _waits(run).items():
        measured = [step for step, wait in rows if wait is not None and wait >= 0]
        expected = [s for s in range(STEPS) if s != fail_step and s > 0]  # step 0: DDP builds its buckets
        missing = sorted(set(expected) - set(measured))
        assert not missing, f"rank {rank}: steps whose round never closed or was not measured: {missing}"

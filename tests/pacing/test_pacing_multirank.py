"""Pacing in a real 4-rank gloo DDP job: it delays the early ranks and never changes the gradients."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest

from hyperacc import harness
from hyperacc.store import read_steps

SCRIPT = Path(__file__).parent / "ranks" / "paced_ddp.py"
STEPS = 40


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    out = {}
    for mode in ("on", "off"):
        run_dir = tmp_path_factory.mktemp(f"paced-{mode}")
        job = harness.launch(SCRIPT, [mode, str(run_dir), str(STEPS)], nproc=4, timeout=180)
        assert job.ok, job.explain()
        out[mode] = (job.results(), run_dir)
    return out


@pytest.mark.multirank
def test_pacing_delays_the_ranks_ahead_of_the_straggler(jobs) -> None:
    results, run_dir = jobs["on"]
    assert all(r["exchanging"] for r in results), "the in-band exchange was not active"
    # pacing stayed enabled (no internal error) and delayed the ranks ahead; whether it is still on at
    # the very last step depends on how predictable the spread was under this host's noise
    assert all(r["hook_enabled"] for r in results)
    assert sum(r["hook_delays"] for r in results[1:]) > 0  # ranks 1-3 wait for rank 0
    assert all(r["explicit_enabled"] for r in results)
    assert sum(r["explicit_delays"] for r in results[1:]) > 0
    steps = read_steps(run_dir, columns=["rank", "step", "pace_delay_ns"])
    delayed = steps.filter(pc.greater(steps["pace_delay_ns"], 0))
    assert delayed.num_rows > 0, "the tracer recorded no pacing delay"
    by_rank = Counter(delayed["rank"].to_pylist())
    assert sum(by_rank[r] for r in (1, 2, 3)) > 3 * by_rank[0], by_rank  # the straggler is not held back


@pytest.mark.multirank
def test_identical_parameters_with_and_without_pacing(jobs) -> None:
    on, _ = jobs["on"]
    off, _ = jobs["off"]
    assert all(r["hook_delays"] == 0 and r["explicit_delays"] == 0 for r in off)
    assert [r["params"] for r in on] == [r["params"] for r in off]
    assert len({r["params"] for r in on}) == 1  # and every rank holds the same model
    assert [r["explicit"] for r in on] == [r["explicit"] for r in off]
    # the piggybacked all-reduce sums the user's values (to float32 summation order)
    assert max(r["explicit_vs_plain"] for r in on + off) < 1e-4
    assert np.isfinite([r["explicit_vs_plain"] for r in on]).all()

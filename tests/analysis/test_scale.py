"""A 200-rank x 3,000-step run: analysed rank by rank in bounded memory (no timing asserted)."""

import tracemalloc

import numpy as np
import pytest

from hyperacc.analysis import cluster, diagnose
from hyperacc.analysis.synthetic import SyntheticFault, SyntheticRun, write_run

RANKS, STEPS = 200, 3000


@pytest.mark.slow
def test_many_ranks_are_streamed_not_loaded(tmp_path, monkeypatch):
    spec = SyntheticRun(ranks=RANKS, steps=STEPS, ranks_per_node=8, segment_steps=1500, seed=4,
                        faults=(SyntheticFault("slowdown", (77,), factor=0.15),
                                SyntheticFault("data_stall", (150,), rate=0.02, ms=60)))  # fmt: skip
    run = write_run(tmp_path / "run", spec)

    in_flight = peak_in_flight = 0
    rows_per_read = []
    real_read, real_reduce = cluster.read_rank, cluster.reduce_rank

    def counting_read(segments, *args):
        nonlocal in_flight, peak_in_flight
        cols = real_read(segments, *args)
        in_flight += 1
        peak_in_flight = max(peak_in_flight, in_flight)
        rows_per_read.append(cols["step"].size)
        return cols

    def counting_reduce(*args, **kwargs):
        nonlocal in_flight
        try:
            return real_reduce(*args, **kwargs)
        finally:
            in_flight -= 1

    monkeypatch.setattr(cluster, "read_rank", counting_read)
    monkeypatch.setattr(cluster, "reduce_rank", counting_reduce)
    tracemalloc.start()
    try:
        d = diagnose(run, workers=2).to_dict()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert [(s["rank"], s["kind"]) for s in d["stragglers"]] == [(77, "compute")]
    per_rank = {r["rank"]: r for r in d["spikes"]["per_rank"]}
    assert len(per_rank) == RANKS and per_rank[150]["cause"] == "data"
    assert per_rank[150]["ci_low"] <= 0.02 <= per_rank[150]["ci_high"]
    # One read per rank, one rank's steps per read, at most two ranks reduced at once.
    assert len(rows_per_read) == RANKS and max(rows_per_read) == STEPS and peak_in_flight <= 2
    # The whole run as float64 columns would be 200 x 3000 x 18 x 8 B = 86 MB.
    assert peak < 40e6, f"peak traced memory {peak / 1e6:.0f} MB"
    assert np.isclose(d["spikes"]["cluster"]["rate"], d["projection"]["current"]["measured"])


def test_windows_widen_until_ranks_times_windows_fit_the_budget():
    from hyperacc.analysis.options import DetectionOptions
    from hyperacc.analysis.windows import within_budget

    opts = DetectionOptions()
    steps = [np.arange(100_000)]
    assert within_budget(opts, 1_000, steps) is opts  # 2e6 windows: within 4e6
    assert within_budget(opts, 10_000, steps).window_steps == 400  # 2.5e6 windows of 400 steps
    assert within_budget(opts, 1_024, [np.arange(6_048_000)]).window_steps == 1_600  # a week at 10 steps/s: 3.9e6
    assert within_budget(DetectionOptions(window_max_cells=1), 4, [np.arange(1_000)]).window_steps == 1_600  # one window
    # Windows that hold steps count, not the span: two steps 2**53 apart are two windows.
    assert within_budget(opts, 10_000, [np.array([0, 2**53])]) is opts
    assert within_budget(opts, 10_000, [np.arange(1_000), np.arange(100_000)]).window_steps == 400  # the most


def test_a_run_past_the_window_budget_is_judged_in_wider_windows_with_the_same_verdict(faulty_run, caplog):
    """8 ranks x 2,000 steps are 320 windows of 50 steps; with room for 100, windows of 200 steps (80)."""
    from analysis_runs import DATA_RANK, SLOW_RANK

    wide = diagnose(faulty_run, window_max_cells=100).to_dict()
    assert wide["options"]["window_steps"] == 200
    assert "judge windows of 200 steps" in caplog.text
    assert [(s["rank"], s["kind"]) for s in wide["stragglers"]] == [(SLOW_RANK, "compute")]
    assert {r["rank"]: r["cause"] for r in wide["spikes"]["per_rank"]}[DATA_RANK] == "data"

"""Spikes on a fixed period of steps (analysis.periods): found among noise, not made up from noise."""

from __future__ import annotations

import numpy as np
import pytest

from hyperacc.analysis import diagnose
from hyperacc.analysis.periods import spike_period
from hyperacc.analysis.synthetic import SyntheticFault, SyntheticRun, write_run
from hyperacc.present.report import _spike_tables

JUDGED = np.arange(10, 2000)


def _period(spikes, judged=JUDGED, excess=None):
    return spike_period(np.sort(np.asarray(spikes)), judged, 4, 0.75, 1e-3, excess)


def _noise(seed: int, rate: float, judged=JUDGED) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return judged[rng.random(judged.size) < rate]


def test_a_period_is_found_among_random_spikes_with_its_first_and_last_step():
    on = np.arange(26, 2000, 25)  # a checkpoint after every 25th step lands in the next step
    found = _period(np.union1d(on, _noise(1, 0.05)), excess=None)
    assert found is not None
    assert (found.every, found.first, found.last, found.repeats) == (25, 26, on[-1], on.size)
    assert found.expected == on.size


def test_the_time_lost_is_the_period_spikes_own():
    on = np.arange(60, 2000, 100)
    spikes = np.union1d(on, [15, 333, 1001])
    excess = np.where(np.isin(spikes, on), 50.0, 1.0)
    found = _period(spikes, excess=excess)
    assert found is not None and found.every == 100 and found.lost_ns == 50.0 * on.size


@pytest.mark.parametrize("rate", [0.01, 0.05, 0.15, 0.4])
def test_random_spikes_have_no_period(rate):
    found = [s for s in range(200) if _period(_noise(s, rate)) is not None]
    assert found == []


def test_a_transient_stretch_of_spikes_has_no_period():
    assert _period(np.arange(500, 560)) is None  # a 60-step fail-slow
    assert _period(np.arange(500, 620, 2)) is None  # every other step of it


def test_most_of_the_period_must_have_spiked():
    on = np.arange(40, 2000, 40)
    kept = on[np.arange(on.size) % 5 != 0]  # 80 % of the recurrences: still every 40, not every 80
    found = _period(np.union1d(kept, _noise(2, 0.03)))
    assert found is not None and found.every == 40 and found.repeats >= kept.size
    assert _period(on[: on.size // 5]) is None  # every 40 steps over the first fifth of the run only
    slots = np.arange(80, 2000, 80)
    assert _period(slots[np.random.default_rng(5).random(slots.size) < 0.5]) is None  # half of them, at random


def test_judged_steps_with_gaps_count_only_the_judged_recurrences():
    judged = np.concatenate([np.arange(10, 500), np.arange(900, 1500)])  # a gap in the records
    on = judged[judged % 30 == 0]
    found = _period(on, judged=judged)
    assert found is not None and found.every == 30 and found.expected == on.size


def test_too_few_recurrences_are_no_period():
    assert _period([100, 200, 300]) is None
    assert spike_period(np.array([100, 200, 300, 400]), JUDGED, 4, 0.75, 0.0) is None  # tests off


def test_one_ranks_periodic_data_stall_is_named_with_its_period(tmp_path):
    faults = (
        SyntheticFault("data_stall", ranks=(2,), ms=30, every=40, start_step=35),
        SyntheticFault("data_stall", ranks=(5,), rate=0.03, ms=30),  # the same stalls at random
    )
    run = write_run(tmp_path / "run", SyntheticRun(ranks=8, steps=1500, seed=3, faults=faults))
    d = diagnose(run)
    found = {e["rank"]: e for e in d.rank_causes if e["cause"] == "data"}
    assert set(found) == {2, 5}
    assert found[2]["period"]["every"] == 40 and found[2]["period"]["first"] == 35
    assert found[5]["period"] is None
    assert d.spikes["cluster"]["period"] is None  # one rank's work, not the job's
    assert "every 40 steps" in d.verdict
    assert any(line.startswith("rank 2, data spikes every 40 steps:") for line in d.next_step)
    html = _spike_tables(d.to_dict())  # the report's table of rank-specific causes has the period
    assert "<th>every</th>" in html and "<td>40 steps</td>" in html


def test_work_every_rank_does_on_a_period_is_the_jobs(tmp_path):
    faults = (SyntheticFault("compute_spike", ranks=tuple(range(8)), ms=25, every=50, start_step=49),)
    run = write_run(tmp_path / "run", SyntheticRun(ranks=8, steps=1000, seed=4, faults=faults))
    d = diagnose(run)
    period = d.spikes["cluster"]["period"]
    assert period is not None and (period["every"], period["first"]) == (50, 49)
    # what it cost the job: the cluster's step time over its rolling median at those steps, 25 ms each
    assert 0.8 * 25e6 * period["repeats"] < period["lost_ns"] < 1.2 * 25e6 * period["repeats"]
    assert not d.stragglers and not d.rank_causes
    assert period["causes"] == ["compute", "host", "unknown"] or period["causes"] == ["compute"], period
    assert "every 50 steps" in d.verdict and "work the job does on a fixed period" in d.verdict
    assert "a floor the ranks share" not in d.verdict  # not a random floor: the period says what it is
    assert "spiked at once every 50 steps, from step 49" in _spike_tables(d.to_dict())
    clean = diagnose(write_run(tmp_path / "clean", SyntheticRun(ranks=8, steps=1000, seed=4)))
    assert clean.spikes["cluster"]["period"] is None


def test_gc_pauses_on_a_cadence_keep_the_gc_advice(tmp_path):
    # a collector that runs every 30 steps (the loop allocates alike every step) is not work of the loop
    faults = (SyntheticFault("gc", ranks=(1,), ms=30, every=30, start_step=20),)
    d = diagnose(write_run(tmp_path / "run", SyntheticRun(ranks=8, steps=1200, seed=5, faults=faults)))
    (gc,) = [e for e in d.rank_causes if e["rank"] == 1]
    assert gc["cause"] == "gc" and gc["period"]["every"] == 30
    assert any("the collector's own cadence" in line for line in d.evidence)
    assert not any("every 30 steps: they recur" in line for line in d.next_step)
    assert any(line.startswith("rank 1, gc spikes: make garbage collection deterministic") for line in d.next_step)


def test_steps_numbered_far_apart_keep_their_period():
    # a job that numbers its steps sparsely: the period is found in the numbers as they are
    judged = np.arange(0, 2000) * 10**9
    found = _period(judged[::50], judged=judged)
    assert found is not None and found.every == 50 * 10**9 and found.repeats == 40


def test_every_ranks_collector_on_one_cadence_is_named_gc_with_gcs_advice(tmp_path):
    faults = (SyntheticFault("gc", ranks=tuple(range(8)), ms=25, every=40, start_step=30),)
    d = diagnose(write_run(tmp_path / "run", SyntheticRun(ranks=8, steps=1000, seed=6, faults=faults)))
    period = d.spikes["cluster"]["period"]
    assert period is not None and period["every"] == 40 and period["causes"] == ["gc"]
    assert "every rank's collector on one cadence" in d.verdict
    assert any(line.startswith("spikes every 40 steps on most ranks at once: make garbage collection deterministic")
               for line in d.next_step)  # fmt: skip


def test_every_ranks_input_on_one_period_is_named_input_with_the_epochs_advice(tmp_path):
    # every rank waits for its input at once every 30 steps: a DataLoader that starts its workers again
    # each epoch, not the loop's own periodic work (an evaluation, a checkpoint)
    faults = (SyntheticFault("data_stall", ranks=tuple(range(8)), ms=40, every=30, start_step=30),)
    d = diagnose(write_run(tmp_path / "run", SyntheticRun(ranks=8, steps=1000, seed=7, faults=faults)))
    period = d.spikes["cluster"]["period"]
    assert period is not None and period["every"] == 30 and period["causes"] == ["data"], period
    assert "every rank waited for its input at those steps" in d.verdict
    assert any(line.startswith("spikes every 30 steps on most ranks at once: every rank waits for its input")
               and "persistent_workers=True" in line for line in d.next_step)  # fmt: skip
    assert not any("an evaluation, a checkpoint" in line for line in d.next_step)

import numpy as np
import pytest

from hyperacc.analysis.options import DetectionOptions
from hyperacc.analysis.spikes import communication_spikes, detect_spikes, wilson_interval

MS = 1e6


def _series(n=2000, seed=0, base=30 * MS, sigma=0.02):
    rng = np.random.default_rng(seed)
    return base * rng.lognormal(0, sigma, n)


def test_injected_spikes_are_found_and_nothing_else():
    x = _series()
    at = np.arange(37, 2000, 97)
    x[at] += 20 * MS
    sp = detect_spikes(x, DetectionOptions())
    assert set(np.flatnonzero(sp.spike)) == set(at)
    assert sp.excess[at].min() > 15 * MS


def test_floors_keep_small_but_significant_wobbles_out():
    x = np.full(1000, 30 * MS)
    x[500] += 0.5 * MS  # infinitely many MADs away, but under the 1 ms floor
    x[600] += 5 * MS  # over 1 ms, under 25 % of 30 ms
    assert not detect_spikes(x, DetectionOptions()).spike.any()
    x[700] += 10 * MS
    assert np.flatnonzero(detect_spikes(x, DetectionOptions()).spike).tolist() == [700]


def test_a_persistent_slowdown_is_not_a_spike():
    x = _series()
    x[1000:] *= 1.3
    assert detect_spikes(x, DetectionOptions()).spike.sum() == 0


def test_missing_steps_are_not_judged():
    x = _series(200)
    x[50] = np.nan
    sp = detect_spikes(x, DetectionOptions())
    assert not sp.judged[50] and not sp.spike[50] and sp.judged.sum() == 199


def test_wilson_interval_known_values():
    lo, hi = wilson_interval(3, 100)
    assert float(lo) == pytest.approx(0.01025, abs=1e-4)
    assert float(hi) == pytest.approx(0.08452, abs=1e-4)
    lo, hi = wilson_interval(np.array([0, 10, 0]), np.array([100, 10, 0]))
    assert lo.tolist()[0] == 0.0 and hi[0] == pytest.approx(0.0370, abs=1e-3)
    assert hi[1] == 1.0 and lo[1] == pytest.approx(0.7225, abs=1e-3)
    assert (lo[2], hi[2]) == (0.0, 1.0)  # no trials: no knowledge


def test_communication_spike_only_when_no_rank_was_late():
    comm = _series(500, base=2 * MS, sigma=0.05)
    comm[[100, 200]] += 20 * MS
    self_spiked = np.zeros(500, dtype=bool)
    self_spiked[200] = True  # a rank was late: its lateness, not the network
    sp = communication_spikes(comm, self_spiked, DetectionOptions(spike_floor_rel=0.1))
    assert np.flatnonzero(sp.spike).tolist() == [100]


def test_a_stall_hidden_in_a_noisy_total_stands_out_in_its_phase():
    rng = np.random.default_rng(5)
    n = 1500
    data = 0.7 * MS * rng.lognormal(0, 0.05, n)
    compute = 80 * MS * rng.lognormal(0, 0.2, n)  # a contended host: +-20 % per step
    at = np.arange(20, n, 53)
    data[at] += 60 * MS
    total = data + compute
    opts = DetectionOptions()
    alone = detect_spikes(total, opts)
    with_parts = detect_spikes(total, opts, {"data_ns": data, "forward_ns": compute})
    assert set(at) - set(np.flatnonzero(alone.spike)), "the total alone misses some stalls"
    found = set(np.flatnonzero(with_parts.spike))
    assert len(set(at) & found) >= 0.9 * len(at)
    assert len(found - set(at)) <= 0.01 * n  # the compute noise is judged against its own spread


def test_relative_floor_is_of_the_whole_step():
    x = np.full(600, 3 * MS)  # 3 ms of own work in a 40 ms step (the rest is waiting)
    x[300] += 6 * MS  # twice the self-time, 15 % of the step: not a spike of the cluster
    x[400] += 12 * MS  # 30 % of the step
    sp = detect_spikes(x, DetectionOptions(), step_ns=np.full(600, 40 * MS))
    assert np.flatnonzero(sp.spike).tolist() == [400]
    assert np.flatnonzero(detect_spikes(x, DetectionOptions()).spike).tolist() == [300, 400]

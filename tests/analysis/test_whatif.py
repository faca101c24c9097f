"""What-if (docs/detection.md, "What-if"): the job time each culprit cost, replayed from the least waits."""

from __future__ import annotations

import numpy as np
import pytest

from hyperacc.analysis.run_reduce import WAIT_LOWEST, RankFindings, _Cluster
from hyperacc.analysis.whatif import Culprit, saved_ns, what_if

MS = 1_000_000


def _cluster(waits: np.ndarray, spikes: dict[int, tuple[list[int], list[str]]] | None = None) -> _Cluster:
    """A cluster of ``waits`` (ranks x steps, ns) added rank by rank as ``diagnose`` does."""
    c = _Cluster()
    steps = np.arange(waits.shape[1], dtype=np.int64)
    for r, w in enumerate(waits):
        sp, causes = (spikes or {}).get(r, ([], []))
        f = RankFindings(r, 0, steps, steps, np.array(sp, dtype=np.int64), steps, w.astype(float), {}, {}, {}, [],
                         spike_causes=np.array(causes, dtype=str))  # fmt: skip
        c.add(f)
    return c


def test_the_least_waits_are_kept_sorted_with_their_ranks():
    rng = np.random.default_rng(0)
    waits = rng.uniform(0, 10 * MS, size=(12, 50))
    c = _cluster(waits)
    order = np.argsort(waits, axis=0, kind="stable")[:WAIT_LOWEST].T
    assert np.array_equal(c.wait_rank, order)
    assert np.array_equal(c.wait_low, np.take_along_axis(waits.T, order, axis=1))
    assert np.array_equal(c.comm_rank, order[:, 0]) and np.array_equal(c.comm_min, waits.min(axis=0))


def test_a_late_rank_costs_the_gap_to_the_next_to_last_arrival():
    # 4 ranks: every rank waits 10 ms for the collective, except rank 2 at steps 20-39 that arrives 6 ms
    # late (it waits 4 ms, the others 10 ms): 20 steps x 6 ms saved without it
    waits = np.full((4, 60), 10.0 * MS)
    waits[2, 20:40] = 4 * MS
    waits[:, 20:40] += np.array([0.5, 0.0, 0.0, 0.3])[:, None] * MS  # the others' own spread stays
    c = _cluster(waits)
    step_ns = np.full(60, 30.0 * MS)
    out = what_if(c.steps, step_ns, c.wait_low, c.wait_rank, c.low_cause, [Culprit("episode", 2, 20, 39)])
    assert out["job_ns"] == pytest.approx(60 * 30 * MS)
    assert out["culprits"][0]["saved_ns"] == pytest.approx(20 * 6 * MS)
    assert out["all"]["job_ns_without"] == pytest.approx(60 * 30 * MS - 20 * 6 * MS)
    # outside its range, or another rank, saves nothing; a range that covers more saves no more
    assert saved_ns(c.steps, c.wait_low, c.wait_rank, c.low_cause, [Culprit("episode", 2, 40, 59)]).sum() == 0
    assert saved_ns(c.steps, c.wait_low, c.wait_rank, c.low_cause, [Culprit("episode", 1, 0, 59)]).sum() == 0
    whole = saved_ns(c.steps, c.wait_low, c.wait_rank, c.low_cause, [Culprit("straggler", 2, 0, 59)])
    assert whole.sum() == pytest.approx(20 * 6 * MS)


def test_two_culprits_in_one_step_save_together_more_than_each_alone():
    waits = np.full((5, 10), 10.0 * MS)
    waits[0] = 2 * MS  # rank 0 the latest (8 ms late), rank 1 next (5 ms late)
    waits[1] = 5 * MS
    c = _cluster(waits)
    a, b = Culprit("straggler", 0, 0, 9), Culprit("straggler", 1, 0, 9)
    s = lambda cs: saved_ns(c.steps, c.wait_low, c.wait_rank, c.low_cause, cs).sum()  # noqa: E731
    assert s([a]) == pytest.approx(10 * 3 * MS)  # down to rank 1's arrival
    assert s([b]) == 0  # rank 1 was never last
    assert s([a, b]) == pytest.approx(10 * 8 * MS)


def test_spike_causes_count_only_the_rank_s_spikes_of_that_cause():
    waits = np.full((4, 30), 10.0 * MS)
    for step in (3, 7, 11):
        waits[1, step] = 1 * MS  # rank 1 spiked 9 ms at three steps ...
    c = _cluster(waits, {1: ([3, 7, 11], ["gc", "data", "gc"])})  # ... twice GC, once input
    gc = Culprit("spikes", 1, 0, 29, causes=(c.causes.index("gc"),), label="gc")
    assert saved_ns(c.steps, c.wait_low, c.wait_rank, c.low_cause, [gc]).sum() == pytest.approx(2 * 9 * MS)


def test_no_wait_measured_is_no_what_if():
    c = _Cluster()
    steps = np.arange(5, dtype=np.int64)
    c.add(RankFindings(0, 0, steps, steps, steps[:0], steps[:0], np.zeros(0), {}, {}, {}, []))
    assert what_if(c.steps, np.full(5, 1.0), c.wait_low, c.wait_rank, c.low_cause, []) is None

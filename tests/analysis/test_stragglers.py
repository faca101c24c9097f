"""The straggler rules on small hand-made window tables (ranks x windows)."""

import numpy as np
import pyarrow as pa
from analysis_runs import MS, noisy, windows

from hyperacc.analysis.options import DetectionOptions
from hyperacc.analysis.stragglers import confirmation, detect_stragglers, outlier_flags
from hyperacc.analysis.windows import window_table


def test_slow_rank_is_the_culprit_and_its_victims_are_not_flagged():
    self_ms = noisy(8, 10)
    self_ms[3] *= 1.15
    # synchronous all-reduce: everyone finishes together, so the victims wait for rank 3
    comm = self_ms.max(axis=0) - self_ms + 2.0
    found = detect_stragglers(windows(self_ms, comm), DetectionOptions())
    assert [(s.rank, s.kind, s.metric) for s in found] == [(3, "compute", "self_ns")]
    s = found[0]
    assert s.since_step == 0 and s.confirmed_step == 149 and s.windows_flagged == 10
    assert 1.1 < s.slowdown < 1.2
    assert s.comm_wait_ns < s.cluster_comm_wait_ns


def test_a_fast_rank_is_never_a_straggler():
    self_ms = noisy(8, 10)
    self_ms[2] *= 0.7
    assert detect_stragglers(windows(self_ms), DetectionOptions()) == []


def test_missing_data_never_counts_as_fast_or_slow():
    self_ms = noisy(8, 10)
    self_ms[1, :] = np.nan  # rank 1 never reports
    self_ms[4, ::2] = np.nan  # rank 4 reports every other window
    self_ms[6] *= 1.2
    found = detect_stragglers(windows(self_ms), DetectionOptions())
    assert [s.rank for s in found] == [6]
    flags, judged, _ = outlier_flags(
        np.where(np.isnan(self_ms), np.nan, self_ms * MS), DetectionOptions(), 0.2 * MS
    )
    assert not judged[1].any() and judged[4].sum() == 5


def test_persistence_needs_k_of_the_last_n_and_most_of_the_recent_windows():
    self_ms = noisy(8, 16)
    self_ms[5, [1, 4]] *= 1.3  # 2 windows of 5: a blip, not a straggler
    assert detect_stragglers(windows(self_ms[:, :12]), DetectionOptions()) == []
    self_ms[5, 8:] *= 1.3  # slow from window 8 on
    (s,) = detect_stragglers(windows(self_ms), DetectionOptions())
    # 3 of 5 at window 10, but a host that starves a rank for a few windows does that too: confirmed
    # once it was slower in most of its last 10 windows (windows 3..12 hold 4, 8, 9, 10, 11, 12)
    assert s.rank == 5 and s.since_step == 8 * 50 and s.confirmed_step == 12 * 50 + 49
    assert s.windows_flagged == 10 and s.windows_seen == 16 and s.active


def test_confirmation_reports_when_it_stops():
    flags = np.array([0, 1, 1, 1, 0, 0, 0, 0, 0, 0], dtype=bool)
    judged = np.ones(10, dtype=bool)
    assert confirmation(flags, judged, 3, 5) == (3, 1, False)
    assert confirmation(flags, judged, 4, 5) is None


def test_too_few_ranks_abstain():
    self_ms = noisy(3, 10)
    self_ms[0] *= 1.5
    assert detect_stragglers(windows(self_ms), DetectionOptions()) == []


def test_victim_guard_refuses_a_slow_rank_that_waits_more_than_the_median():
    self_ms = noisy(8, 10)
    self_ms[2] *= 1.2
    comm = np.full((8, 10), 3.0)
    comm[2] = 40.0  # 20 ms slow but waits 37 ms longer: it cannot have been the one everybody waited for
    assert detect_stragglers(windows(self_ms, comm), DetectionOptions()) == []
    comm[2] = 9.0  # waits 6 ms longer while 20 ms slow: within the noise of a contended collective
    assert [s.rank for s in detect_stragglers(windows(self_ms, comm), DetectionOptions())] == [2]


def test_without_a_culprit_record_a_rank_hidden_behind_a_slower_one_is_not_a_straggler():
    """Live has no per-step culprit record: a rank slower than the median whose slowness the job never
    waited for (it still waited, for a far slower rank, longer than it was slow) is left out beside that
    rank, as the record leaves it out offline. Two ranks slow alike take turns to be last: both are named."""
    self_ms = noisy(8, 10)
    self_ms[3] *= 1.6  # the job waits for rank 3 ...
    self_ms[5] *= 1.15  # ... and rank 5's 15 ms more are hidden in its wait for rank 3
    comm = self_ms.max(axis=0) - self_ms + 2.0
    found = detect_stragglers(windows(self_ms, comm), DetectionOptions())
    assert [s.rank for s in found] == [3], [(s.rank, s.kind, s.metric) for s in found]
    self_ms[5] = self_ms[3] * (1 + 0.01 * np.random.default_rng(2).standard_normal(10))  # as slow as rank 3
    comm = self_ms.max(axis=0) - self_ms + 2.0
    assert [s.rank for s in detect_stragglers(windows(self_ms, comm), DetectionOptions())] == [3, 5]


def test_and_rule_is_stricter_than_or():
    self_ms = np.array([[100.0] * 6, [101.0] * 6, [115.0] * 6])  # 3 ranks: MAD says slow, IQR does not
    opts_and = DetectionOptions(min_ranks=3)
    opts_or = DetectionOptions(min_ranks=3, outlier_rule="or")
    assert detect_stragglers(windows(self_ms), opts_and) == []
    assert [s.rank for s in detect_stragglers(windows(self_ms), opts_or)] == [2]


def test_most_ranks_of_a_node_slow_is_a_node_problem():
    self_ms = noisy(24, 8)
    nodes = np.repeat(np.arange(6), 4)
    self_ms[8:12] *= 1.2  # all of node 2
    self_ms[13] *= 1.2  # one rank of node 3
    comm = self_ms.max(axis=0) - self_ms + 2.0
    found = {s.rank: s for s in detect_stragglers(windows(self_ms, comm, nodes=nodes), DetectionOptions())}
    assert sorted(found) == [8, 9, 10, 11, 13]
    assert {found[r].kind for r in (8, 9, 10, 11)} == {"node"}
    assert found[13].kind == "compute" and found[8].rank_kind == "compute"


def test_more_than_a_quarter_slow_needs_the_or_rule():
    # Tukey's Q3 breaks down past 25 % slow ranks; the MAD holds to 50 %.
    self_ms = noisy(16, 8)
    self_ms[[1, 5, 9, 12, 14]] *= 1.2
    assert detect_stragglers(windows(self_ms), DetectionOptions()) == []
    found = detect_stragglers(windows(self_ms), DetectionOptions(outlier_rule="or"))
    assert [s.rank for s in found] == [1, 5, 9, 12, 14]


def test_data_wait_names_the_kind_when_it_explains_the_slowness():
    self_ms = noisy(8, 10)
    data = np.ones((8, 10)) + 0.05 * np.random.default_rng(1).standard_normal((8, 10))
    data[4] += 20.0
    self_ms[4] += 20.0
    (s,) = detect_stragglers(windows(self_ms, data_ms=data), DetectionOptions())
    assert (s.rank, s.kind, s.metric) == (4, "data", "data_ns")
    assert s.metrics == ["self_ns", "data_ns"]


def test_a_self_time_straggler_whose_input_wait_holds_its_excess_is_a_data_straggler():
    """Off its CPU (CPU time flat) and in its input wait: named as the data rule names it, though the
    data wait is not confirmed on its own yet (the other ranks' waits are noisy). Live, a rank whose
    DataLoader workers slowed was told "host straggler" first and "data straggler (was: host)" a window
    later. Where the input wait holds less than half of the excess, it stays a host straggler."""

    def found(data_excess: float) -> list:
        rng = np.random.default_rng(4)
        data = np.clip(5.0 + 3.0 * rng.standard_normal((8, 10)), 0.5, None)
        self_ms = 15.0 + data + 0.2 * rng.standard_normal((8, 10))
        data[4] = np.median(data, axis=0) + data_excess
        self_ms[4] = np.median(self_ms, axis=0) + 20.0
        cols = windows(self_ms, self_ms.max(axis=0) - self_ms + 2.0, data_ms=data)
        cpu = 15.0 + 0.1 * rng.standard_normal((8, 10))
        cols["cpu_ns_median"] = cpu[cols["rank"], cols["window"]] * MS
        return [(s.rank, s.kind, s.metric, s.kind_basis, s.metrics) for s in detect_stragglers(cols, DetectionOptions())]

    assert found(12.0) == [(4, "data", "self_ns", "input_fetch", ["self_ns"])]
    assert [f[:3] for f in found(4.0)] == [(4, "host", "self_ns")]


def test_a_rank_that_loads_its_input_on_the_training_thread_is_a_data_straggler_not_compute():
    """CPU time 2.2x the others' and its self-time's excess in its input fetch (a DataLoader with
    num_workers=0 on one rank: it decodes what the others' workers decode): a data straggler, its CPU
    time said. The same CPU time spent in its forward (a larger batch) stays a compute straggler."""

    def found(in_fetch: bool) -> list:
        rng = np.random.default_rng(6)
        data = np.clip(2.6 + 0.5 * rng.standard_normal((4, 10)), 0.5, None)  # waits for its workers
        fwd = 1.0 + 0.05 * rng.standard_normal((4, 10))
        cpu = 2.2 + 0.1 * rng.standard_normal((4, 10))
        cpu[3] += 2.8
        if in_fetch:
            data[3] = np.median(data, axis=0) + 1.2  # it decodes in its fetch, on its CPU
        else:
            fwd[3] += 2.8  # it computes more in its forward
        self_ms = data + fwd + 1.2 + 0.1 * rng.standard_normal((4, 10))
        cols = windows(self_ms, self_ms.max(axis=0) - self_ms + 10.0, data_ms=data)
        cols["cpu_ns_median"] = cpu[cols["rank"], cols["window"]] * MS
        cols["forward_ns_median"] = fwd[cols["rank"], cols["window"]] * MS
        return [(s.rank, s.kind, s.kind_basis, s.cpu_share is not None) for s in detect_stragglers(cols, DetectionOptions())]

    assert found(True) == [(3, "data", "input_fetch", True)]
    assert [f[:3] for f in found(False)] == [(3, "compute", "cpu_time")]


def test_gc_time_per_step_and_a_zero_median():
    self_ms = noisy(8, 10)
    gc = np.zeros((8, 10))
    gc[7] = 8.0  # 8 ms of GC in every step of ~100 ms, the others none
    self_ms[7] += 8.0  # the rank's own time shows it
    (s,) = detect_stragglers(windows(self_ms, gc_ms=gc), DetectionOptions())
    assert (s.rank, s.kind) == (7, "gc") and s.slowdown is None and s.excess_ns == 8 * MS
    gc[7] = 2.0  # 2 % of the step: real, but not material
    self_ms[7] -= 6.0
    assert detect_stragglers(windows(self_ms, gc_ms=gc), DetectionOptions()) == []


def test_a_part_that_grows_while_the_own_time_stays_normal_is_no_straggler():
    # the DDP backward measured to the last bucket launch picks up contention in the collective: 2-3x
    # on one rank while its self-time is the cluster's (seen on clean jobs of a loaded 2-core host)
    self_ms = noisy(4, 8, base=30.0, sd=0.3)
    cols = windows(self_ms)
    bwd = 1.0 + 0.05 * np.random.default_rng(5).standard_normal((4, 8))
    bwd[1] *= 3.0
    cols["backward_ns_median"] = bwd[cols["rank"], cols["window"]] * MS
    assert detect_stragglers(cols, DetectionOptions()) == []
    gc = np.zeros((4, 8))
    gc[2] = 5.0  # GC time per step that does not lengthen the rank's own time
    assert detect_stragglers(windows(self_ms, gc_ms=gc), DetectionOptions()) == []


def test_accepts_a_window_schema_table():
    self_ms = noisy(8, 10)
    self_ms[0] *= 1.2
    cols = windows(self_ms)
    table = window_table({**cols, "invol_ctx_switches_median": np.zeros(len(cols["rank"]))})
    assert isinstance(table, pa.Table)
    assert [s.rank for s in detect_stragglers(table, DetectionOptions())] == [0]


def test_windows_with_too_few_steps_are_not_judged():
    self_ms = noisy(8, 10)
    self_ms[0] *= 1.2
    assert detect_stragglers(windows(self_ms, steps=5), DetectionOptions()) == []


def test_rare_long_gc_pauses_are_spikes_not_a_gc_straggler():
    self_ms = noisy(8, 10)
    gc = np.zeros((8, 10))
    gc[7] = 8.0  # one 400 ms pause per 50-step window: 8 ms per step on average
    busy = self_ms.copy()
    busy[7] += 8.0  # WINDOW_SCHEMA alone: the mean, and the step less the wait grew by as much
    cols = windows(busy, gc_ms=gc)
    assert [s.rank for s in detect_stragglers(cols, DetectionOptions())] == [7]
    cols["gc_ns_median"] = np.zeros(len(cols["rank"]))  # the typical step collects nothing
    typical = self_ms[cols["rank"], cols["window"]] * MS  # and its typical step is normal
    cols["busy_ns_median"] = cols["self_ns_median"] = typical
    assert detect_stragglers(cols, DetectionOptions()) == []


def test_a_slow_forward_is_a_compute_straggler_when_the_own_time_shows_it():
    rng = np.random.default_rng(3)
    self_ms = 100 + 2 * rng.standard_normal((4, 10))
    fwd = 30 + 1.0 * rng.standard_normal((4, 10))
    fwd[1] += 12  # rank 1's forward is 40 % slower, 12 % of the step
    self_ms[1] += 12
    cols = windows(self_ms)
    cols["forward_ns_median"] = fwd[cols["rank"], cols["window"]] * MS
    (s,) = detect_stragglers(cols, DetectionOptions())
    assert (s.rank, s.kind) == (1, "compute") and "forward_ns" in s.metrics
    fwd[1] -= 9  # +3 ms: 10 % of the forward but 3 % of the step, not material
    self_ms[1] -= 9
    cols = windows(self_ms)
    cols["forward_ns_median"] = fwd[cols["rank"], cols["window"]] * MS
    assert detect_stragglers(cols, DetectionOptions()) == []


def test_four_noisy_ranks_the_persistently_slowest_is_found_by_rank_order():
    # contended 2-core host: 4 ranks whose window medians wander by +-15 %, so the MAD of four values
    # is too unsteady for z > 3.5, but one rank is the slowest in every window
    rng = np.random.default_rng(3)
    self_ms = 12.0 * (1 + 0.15 * rng.standard_normal((4, 8)))
    self_ms[2] = self_ms.max(axis=0) * 1.08
    comm = self_ms.max(axis=0) - self_ms + 20.0
    opts = DetectionOptions()
    assert detect_stragglers(windows(self_ms, comm), DetectionOptions(top_alpha=0)) == []
    found = detect_stragglers(windows(self_ms, comm), opts)
    assert [(s.rank, s.kind) for s in found] == [(2, "compute")]
    assert found[0].confirmed_step == 6 * 50 - 1  # 6 of 6 windows: p = 0.25**6 < 1e-3 / 4 ranks


def test_rank_order_of_exchangeable_ranks_flags_nobody():
    rng = np.random.default_rng(11)
    false = 0
    for _ in range(50):
        self_ms = 12.0 * (1 + 0.15 * rng.standard_normal((4, 8)))
        comm = self_ms.max(axis=0) - self_ms + 20.0
        false += len(detect_stragglers(windows(self_ms, comm), DetectionOptions()))
    assert false <= 1


def _cpu_windows(cpu_ms: np.ndarray, sys_ms: np.ndarray, faults: np.ndarray) -> dict[str, np.ndarray]:
    """Windows of ranks whose own time is their CPU time plus a little waiting, with the CPU time's
    part in the kernel and the minor page faults per step."""
    cols = windows(cpu_ms * 1.05)
    at = cols["rank"], cols["window"]
    cols["cpu_ns_median"] = cpu_ms[at] * MS
    cols["sys_cpu_ns_mean"] = sys_ms[at] * MS
    cols["minor_faults_median"] = faults[at].astype(float)
    return cols


def test_extra_cpu_time_paid_in_the_kernel_for_fresh_pages_is_page_faults_not_compute():
    # rank 2 does the same work as the others, but its allocator maps and returns its blocks at every
    # step: 1,000 page faults a step and 2.2 of its 2.4 extra ms in the kernel (measured so, docs/detection.md)
    rng = np.random.default_rng(7)
    cpu = 12 + 0.2 * rng.standard_normal((4, 8))
    sys_ms = 0.7 + 0.1 * rng.standard_normal((4, 8))
    faults = np.full((4, 8), 11.0) + rng.integers(0, 3, (4, 8))
    cpu[2] += 2.4
    sys_ms[2] += 2.2
    faults[2] += 990
    (s,) = detect_stragglers(_cpu_windows(cpu, sys_ms, faults), DetectionOptions())
    assert (s.rank, s.kind, s.kind_basis) == (2, "page_faults", "sys_cpu_time")
    assert s.minor_faults > 900 and s.cluster_minor_faults < 20 and s.sys_cpu_ns > s.cluster_sys_cpu_ns + 1.5 * MS
    # the kernel's part sampled by its tick (a fresh-clone CI run, 2026-12-08): a few ticks a window, so the
    # same 2.2 ms show as 0.5 ms in most windows and 5-6 ms in some; the median of those lies under half
    # the CPU time's excess, their mean does not (it was compute)
    ticks = sys_ms.copy()
    ticks[2] = 0.7 + np.array([0.5, 0.5, 5.4, 0.5, 6.3, 0.5, 0.5, 3.4])
    (s,) = detect_stragglers(_cpu_windows(cpu, ticks, faults), DetectionOptions())
    assert (s.rank, s.kind) == (2, "page_faults"), s
    # more work in user space (a busy loop, a bigger batch): compute, whatever its page faults
    (s,) = detect_stragglers(_cpu_windows(cpu, sys_ms - np.where(np.arange(4)[:, None] == 2, 2.2, 0), faults),
                             DetectionOptions())  # fmt: skip
    assert s.kind == "compute"
    # its kernel time grew, but its page faults are no more than another rank's: not paging (a syscall,
    # a lock), so the kind stays compute
    faults[0] += 995
    (s,) = detect_stragglers(_cpu_windows(cpu, sys_ms, faults), DetectionOptions())
    assert (s.rank, s.kind) == (2, "compute")
    # two ranks paging so: each one's faults are above every rank that is not (before 2026-12-05 each hid
    # the other's, and both were named compute)
    faults[0] -= 995
    cpu6 = np.vstack([cpu, cpu[:2]])
    sys6, faults6 = np.vstack([sys_ms, sys_ms[:2]]), np.vstack([faults, faults[:2]])
    cpu6[4] += 2.4
    sys6[4] += 2.2
    faults6[4] += 990
    found = detect_stragglers(_cpu_windows(cpu6, sys6, faults6), DetectionOptions())
    assert [(s.rank, s.kind) for s in found] == [(2, "page_faults"), (4, "page_faults")], found
    # recorded before these columns existed: compute, as before
    cols = _cpu_windows(cpu, sys_ms, faults)
    del cols["sys_cpu_ns_mean"], cols["minor_faults_median"]
    (s,) = detect_stragglers(cols, DetectionOptions())
    assert s.kind == "compute" and s.minor_faults is None


def test_cpu_work_outside_the_timed_phases_is_a_host_work_straggler_not_compute():
    # a loop with a DataLoader whose rank 1 does 2.4 ms more CPU work a step in a trainer's step callback
    # (outside its forward, backward and optimizer step: other_ns), as an episode of Matrix H did for 60
    # steps; judged compute before 2026-12-05, with the advice to look for uneven work in the model
    rng = np.random.default_rng(3)
    cpu = 12 + 0.2 * rng.standard_normal((4, 8))
    cpu[1] += 2.4
    cols = _cpu_windows(cpu, np.full((4, 8), 0.7), np.full((4, 8), 11.0))
    other = 0.5 + 0.05 * rng.standard_normal((4, 8))
    cols["other_ns_median"] = (other + np.where(np.arange(4)[:, None] == 1, 2.4, 0.0))[cols["rank"], cols["window"]] * MS
    (s,) = detect_stragglers(cols, DetectionOptions())
    assert (s.rank, s.kind, s.kind_basis, s.between_steps) == (1, "host_work", "outside_phases", True), s
    assert 0.8 < s.cpu_share < 1.3, s
    # the same work in its forward: compute, as before
    cols["other_ns_median"] = other[cols["rank"], cols["window"]] * MS
    (s,) = detect_stragglers(cols, DetectionOptions())
    assert (s.rank, s.kind, s.between_steps) == (1, "compute", False), s


def test_a_rank_slow_off_its_cpu_time_that_neither_waited_for_a_cpu_nor_blocked_is_compute_not_host():
    """A pipeline's last stage (an outside job, 2026-12-07: 4 stages over send/recv, the last with the
    head and the loss): its self-time 1.22x, its CPU time level with the middle stages', which spend CPU
    inside twice as many sends and receives. It was said "host: preempted or blocked"; its run-queue delay
    was below the others' and it blocked no more. Compute, basis ``not_preempted``. The same windows with
    its run-queue delay risen by its excess stay host; so do they without any delay recorded, and so does
    an excess outside the timed phases (a sleep there blocks once a step, which a DataLoader's queue waits
    hide from the switch counts)."""

    def found(delay_rise_ms: float | None, outside: bool = False, blocks: float = 7.0) -> list:
        rng = np.random.default_rng(3)
        self_ms = 3.0 + 0.05 * rng.standard_normal((4, 10))
        self_ms[3] += 0.7
        cpu = 3.6 + 0.05 * rng.standard_normal((4, 10))
        cpu[0] -= 0.6  # the first stage sends and receives as little as the last
        cpu[3] = cpu[0] + 0.65
        cols = windows(self_ms, self_ms.max(axis=0) - self_ms + 9.0)
        cols["cpu_ns_median"] = cpu[cols["rank"], cols["window"]] * MS
        cols["vol_ctx_switches_median"] = np.where(cols["rank"] == 0, 7.0, np.where(cols["rank"] == 3, blocks, 11.0))
        cols["other_ns_median"] = np.where((cols["rank"] == 3) & outside, 0.8, 0.1) * MS
        if delay_rise_ms is not None:
            delay = 2.0 + 0.05 * rng.standard_normal((4, 10))
            delay[[0, 3]] -= 0.8  # fewer wake-ups at the ends of the pipeline
            delay[3] += delay_rise_ms
            cols["self_run_delay_ns_median"] = delay[cols["rank"], cols["window"]] * MS
        return [(s.rank, s.kind, s.kind_basis) for s in detect_stragglers(cols, DetectionOptions())]

    assert found(0.0) == [(3, "compute", "not_preempted")]
    assert found(1.5) == [(3, "host", "cpu_time")]  # it waited for a CPU: preempted
    assert found(None) == [(3, "host", "cpu_time")]  # nothing to tell it by: as before
    assert found(0.0, outside=True) == [(3, "host", "cpu_time")]
    # it blocked a little more than the median rank (11.5 switches a step against 11): a wait of its own in
    # part of its windows (an outside HF job, 2026-12-08: a collator that slept 30 ms a step on the
    # training thread for 60 steps, one switch a step more there) is no proof that it did not block
    assert found(0.0, blocks=11.5) == [(3, "host", "cpu_time")]
    assert found(0.0, blocks=11.0) == [(3, "compute", "not_preempted")]

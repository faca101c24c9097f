"""Verdicts users can trust: the false-straggler shapes seen on real jobs, on small hand-made tables."""

import numpy as np
import pytest
from analysis_runs import MS, host_noise_windows, noisy, windows

from hyperacc.analysis import diagnose
from hyperacc.analysis.excess import excess_from_windows, pooled_dispersion, rank_excess, window_dispersion
from hyperacc.analysis.options import DetectionOptions
from hyperacc.analysis.stragglers import detect_stragglers
from hyperacc.analysis.synthetic import SyntheticFault, SyntheticRun, write_run
from hyperacc.analysis.windows import RANK_CAUSES


def _with(cols, name, matrix):
    cols[name] = np.asarray(matrix, dtype=float)[cols["rank"], cols["window"]] * MS
    return cols


def test_a_busy_looping_rank_with_many_context_switches_is_compute():
    # it spins on a contended host, so the scheduler preempts it often; but its CPU time grew with its
    # wall time: it computes more
    self_ms = noisy(4, 8, base=10.0, sd=0.2)
    self_ms[1] += 6.0
    cpu = self_ms * 0.9
    switches = np.full((4, 8), 3.0)
    switches[1] = 40.0
    cols = _with(_with(windows(self_ms), "cpu_ns_median", cpu), "invol_ctx_switches_median", switches / MS)
    (s,) = detect_stragglers(cols, DetectionOptions())
    assert (s.rank, s.kind, s.kind_basis) == (1, "compute", "cpu_time") and s.cpu_share > 0.8


def test_a_preempted_rank_is_host():
    # another process takes its core: wall time grew by 6 ms, CPU time did not
    self_ms = noisy(4, 8, base=10.0, sd=0.2)
    cpu = self_ms * 0.9
    self_ms[2] += 6.0
    cols = _with(windows(self_ms), "cpu_ns_median", cpu)
    (s,) = detect_stragglers(cols, DetectionOptions())
    assert (s.rank, s.kind, s.kind_basis) == (2, "host", "cpu_time") and s.cpu_share < 0.2


def test_a_host_straggler_that_blocked_off_its_cpu_waited_one_that_did_not_was_preempted():
    # wall time grew by 6 ms, CPU time did not; where its voluntary context switches per step rose (a
    # blocking read, a lock, a sleep) it waited, and the advice says so; without the rise it was preempted
    from hyperacc.analysis.diagnosis import basis_phrase

    self_ms = noisy(4, 8, base=10.0, sd=0.2)
    cpu = self_ms * 0.9
    self_ms[2] += 6.0
    for rise, blocked in ((1.0, 1.0), (0.0, None)):
        switches = np.full((4, 8), 1.0)
        switches[2] += rise
        cols = _with(_with(windows(self_ms), "cpu_ns_median", cpu), "vol_ctx_switches_median", switches / MS)
        (s,) = detect_stragglers(cols, DetectionOptions())
        assert (s.rank, s.kind, s.blocked_per_step) == (2, "host", blocked)
        text = basis_phrase(s.to_dict())
        assert ("it waited" in text) == (blocked is not None) and ("preempted or blocked" in text) == (blocked is None)


def test_a_rank_that_computes_more_is_found_by_its_cpu_time_when_host_noise_hides_it_in_wall_time():
    # a loaded host: every rank's wall self-time wanders 5-30 ms window to window, while the CPU time
    # of the training thread is steady; rank 2 spends 1.3 ms more CPU per step (a 30 % heavier step)
    rng = np.random.default_rng(2)
    cpu = 4.7 * (1 + 0.02 * rng.standard_normal((4, 10)))
    cpu[2] += 1.3
    wall = cpu * rng.uniform(1.0, 5.0, (4, 10))
    cols = _with(windows(wall, wall.max(axis=0) - wall + 20.0), "cpu_ns_median", cpu)
    (s,) = detect_stragglers(cols, DetectionOptions())
    assert (s.rank, s.kind, s.metric, s.kind_basis) == (2, "compute", "cpu_ns", "cpu_time")


def test_without_cpu_time_the_kind_says_it_was_judged_on_wall_time_only(tmp_path):
    self_ms = noisy(4, 8, base=10.0, sd=0.2)
    self_ms[2] += 6.0
    switches = np.full((4, 8), 3.0)
    switches[2] = 40.0  # context switches no longer make a rank "host"
    cols = _with(windows(self_ms), "invol_ctx_switches_median", switches / MS)
    (s,) = detect_stragglers(cols, DetectionOptions())
    assert (s.kind, s.kind_basis) == ("compute", "wall_time_only")


def test_self_time_and_wait_use_the_device_clock_when_every_rank_has_it():
    host_ms = noisy(4, 8, base=10.0, sd=0.1)
    host_ms[3] += 5.0  # on the host clock rank 3 looks slow (a late host thread) ...
    dev_ms = noisy(4, 8, seed=2, base=10.0, sd=0.1)
    dev_ms[1] += 5.0  # ... the devices say rank 1 computes longer
    cols = _with(windows(host_ms), "dev_self_ns_median", dev_ms)
    cols["dev_comm_wait_ns_median"] = cols["comm_wait_ns_median"]
    (s,) = detect_stragglers(cols, DetectionOptions())
    assert (s.rank, s.clock, s.kind_basis) == (1, "device", "device_clock")
    # one rank without device times: the whole comparison falls back to the host clock
    cols["dev_self_ns_median"] = np.where(cols["rank"] == 0, np.nan, cols["dev_self_ns_median"])
    (s,) = detect_stragglers(cols, DetectionOptions())
    assert (s.rank, s.clock) == (3, "host")


@pytest.mark.parametrize("nodes", [2, 3])
def test_a_whole_slow_node_is_found_from_two_nodes(nodes):
    # 2 ranks per node, the last node's ranks at 1.5x: half (or a third) of the ranks are slow, so the
    # median, the MAD and Tukey's fences of the ranks cannot see them; the node rule can
    rng = np.random.default_rng(nodes)
    ranks = 2 * nodes
    self_ms = 10.0 * (1 + 0.08 * rng.standard_normal((ranks, 8)))
    self_ms[-2:] *= 1.5
    comm = self_ms.max(axis=0) - self_ms + 5.0
    found = detect_stragglers(windows(self_ms, comm, nodes=np.arange(ranks) // 2), DetectionOptions())
    assert [(s.rank, s.kind) for s in found] == [(ranks - 2, "node"), (ranks - 1, "node")]
    assert all(s.rule == "node" or s.rank_kind in ("compute", "host") for s in found)


def test_thirty_percent_of_the_ranks_slow_are_all_found():
    rng = np.random.default_rng(4)
    self_ms = 10.0 * (1 + 0.05 * rng.standard_normal((10, 8)))
    slow = [1, 4, 7]
    self_ms[slow] *= 1.5
    comm = self_ms.max(axis=0) - self_ms + 5.0
    found = detect_stragglers(windows(self_ms, comm), DetectionOptions())
    assert [s.rank for s in found] == slow and {s.kind for s in found} == {"compute"}


def test_a_rank_starved_for_a_few_windows_is_an_episode_not_a_straggler():
    self_ms = noisy(4, 10, base=10.0, sd=0.2)
    self_ms[0, 2:5] *= 3.0  # lost its cores for three windows, then fine
    cpu = noisy(4, 10, seed=3, base=9.0, sd=0.2)
    cols = _with(windows(self_ms), "cpu_ns_median", cpu)
    assert [s for s in detect_stragglers(cols, DetectionOptions()) if s.active] == []
    self_ms[0, 5:] *= 3.0  # ... and then for good: slow in most of its recent windows
    (s,) = detect_stragglers(_with(windows(self_ms), "cpu_ns_median", cpu), DetectionOptions())
    assert (s.rank, s.active, s.kind) == (0, True, "host")


def test_a_rank_that_is_late_in_most_steps_of_a_short_run_is_confirmed_by_the_culprit_record():
    # 4 windows: too few for 3-of-5 with a noisy MAD, but the per-step record says who arrived last
    rng = np.random.default_rng(7)
    self_ms = 12.0 * (1 + 0.15 * rng.standard_normal((4, 4)))
    self_ms[2] = self_ms.max(axis=0) * 1.08
    cols = windows(self_ms)
    cols["culprit_steps"] = np.where(cols["rank"] == 2, 27.0, 8.0)
    cols["culprit_known"] = np.full(cols["rank"].size, 50.0)
    assert detect_stragglers({**cols, "culprit_steps": np.full(cols["rank"].size, 12.5)}, DetectionOptions()) == []
    (s,) = detect_stragglers(cols, DetectionOptions())
    assert (s.rank, s.rule, s.culprit_steps, s.culprit_known) == (2, "culprit", 108, 200)


@pytest.mark.parametrize("layout", [(4, 1), (2, 2), (3, 2), (8, 1), (12, 1), (4, 4)])
def test_exchangeable_ranks_flag_nobody(layout):
    # 100 runs per layout, 10 windows each: window medians with 10 % noise, and 3 % of windows in which
    # a rank lost its cores (1.5-4x): the host-wide floor, not stragglers
    per_node, n_nodes = layout
    ranks = per_node * n_nodes
    rng = np.random.default_rng(ranks * 100 + n_nodes)
    flagged = []
    for _ in range(100):
        cols, _, _ = host_noise_windows(ranks, 10, rng, nodes=np.arange(ranks) // per_node)
        flagged += [(s.rank, s.kind) for s in detect_stragglers(cols, DetectionOptions()) if s.active]
    assert flagged == []


def test_on_an_overloaded_host_a_flagged_rank_was_slow_in_most_of_its_windows():
    # 12 % of windows starved, in episodes: now and then a rank is starved for most of a run. That rank
    # is that run's (host) straggler; a rank starved now and then is not flagged.
    rng = np.random.default_rng(1)
    for _ in range(100):
        cols, self_ms, _ = host_noise_windows(8, 10, rng, starve=0.12, episodes=True)
        for s in detect_stragglers(cols, DetectionOptions()):
            if not s.active:
                continue
            slower = self_ms[s.rank] >= 1.05 * np.median(self_ms, axis=0)
            assert slower.sum() > 5, (s.rank, np.round(self_ms[s.rank], 1))
            assert s.kind == "host"  # its CPU time did not grow


def test_intermittent_data_stalls_on_one_rank_stand_out_from_host_noise(tmp_path):
    # every rank loses its core on 15 % of steps (host-wide noise); rank 1 also stalls 40 ms in data
    # loading on 2 % of its steps
    spec = SyntheticRun(ranks=4, steps=1500, ranks_per_node=4, seed=6, faults=(
        SyntheticFault("host", (0, 1, 2, 3), rate=0.15, ms=12),
        SyntheticFault("data_stall", (1,), rate=0.02, ms=40),
    ))  # fmt: skip
    d = diagnose(write_run(tmp_path / "run", spec)).to_dict()
    assert d["stragglers"] == []
    (e,) = d["rank_causes"]
    assert (e["rank"], e["cause"]) == (1, "data") and 0.01 < e["rate"] < 0.035
    assert e["mean_excess_ns"] == pytest.approx(40e6, rel=0.15)
    assert "Rank 1 (node 0) stalls in data loading on" in d["verdict"]
    assert "ms each" in d["verdict"] and "lost" in d["verdict"]


def test_the_rank_specific_test_needs_a_rate_above_the_typical_rank():
    opts = DetectionOptions()
    steps = [1000, 1000, 1000, 1000]
    # host-wide: every rank ~15 % host spikes, one a little more by chance
    quiet = rank_excess([0, 1, 2, 3], [0] * 4, steps, {"host": [150, 160, 140, 175]}, {"host": [1e9] * 4}, opts)
    assert quiet == []
    # two ranks with the same cause do not hide each other (the floor is the median rank)
    two = rank_excess([0, 1, 2, 3], [0] * 4, steps, {"data": [0, 25, 0, 22]}, {"data": [0, 1e9, 0, 9e8]}, opts)
    assert sorted(e.rank for e in two) == [1, 3]
    # exchangeable counts over many seeds: nobody
    rng = np.random.default_rng(0)
    for _ in range(200):
        p = rng.uniform(0.0, 0.2)
        counts = rng.binomial(500, p, size=8)
        assert rank_excess(list(range(8)), [0] * 8, [500] * 8, {"compute": counts}, {"compute": counts * 1e7},
                           opts) == []  # fmt: skip


def _data_windows(per_window: list[list[int]]) -> dict[str, np.ndarray]:
    """Window summaries of 50 judged steps each: ``per_window[rank]`` the data spikes per window."""
    k = np.asarray(per_window, dtype=np.float64)
    ranks, wins = k.shape
    out = {"rank": np.repeat(np.arange(ranks), wins), "node": np.zeros(ranks * wins, dtype=np.int64),
           "window": np.tile(np.arange(wins), ranks), "judged_steps": np.full(ranks * wins, 50.0),
           "cpu_ns_median": np.full(ranks * wins, 1e7)}  # fmt: skip
    for cause in RANK_CAUSES:
        out[f"spikes_{cause}"] = k.ravel() if cause == "data" else np.zeros(ranks * wins)
        out[f"lost_ns_{cause}"] = out[f"spikes_{cause}"] * 3e7
    return out


def test_data_spikes_in_bursts_on_every_rank_are_the_hosts_not_one_ranks():
    # A loaded host starves one rank's loader workers for a stretch, then another's (an outside CNN job
    # beside a busy loop here: 27 data spikes on rank 0 in 290 steps, 11 on the typical rank, in bursts
    # of up to 17 in 25 steps). Counted as independent draws, rank 0 stood out (p 3e-5); its spikes are
    # a few bursts, not 27 independent stalls.
    bursty = [[0, 0, 12, 0, 0, 0, 9, 0, 6, 0], [0, 8, 0, 0, 3, 0, 0, 0, 0, 0],
              [0, 0, 0, 0, 0, 10, 0, 0, 1, 0], [5, 0, 0, 0, 0, 0, 0, 6, 0, 0]]  # fmt: skip
    opts = DetectionOptions()
    assert excess_from_windows(_data_windows(bursty), RANK_CAUSES, opts) == []
    # the same totals, each rank's spread over its windows as independent stalls are: rank 0 stands out
    spread = [[3, 3, 3, 2, 3, 3, 2, 3, 3, 2], [1, 1, 1, 1, 1, 1, 2, 1, 1, 1],
              [1, 1, 2, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 2, 1, 1, 1, 1, 1]]  # fmt: skip
    (e,) = excess_from_windows(_data_windows(spread), RANK_CAUSES, opts)
    assert (e.rank, e.cause, e.spikes, e.dispersion) == (0, "data", 27, 1.0)
    # the dispersion of binomial counts is about 1, of bursts far above it
    rng = np.random.default_rng(3)
    phis = [pooled_dispersion(window_dispersion(rng.binomial(50, 0.04, 10), np.full(10, 50)) for _ in range(4))
            for _ in range(200)]  # fmt: skip
    assert 0.9 < float(np.mean(phis)) < 1.3
    assert pooled_dispersion(window_dispersion(np.asarray(r), np.full(10, 50)) for r in bursty) > 4
    # a culprit's own fault is bursty by nature (GC pauses over 60 steps only): the dispersion is the
    # other ranks', so it does not hide itself
    stretch = [[0, 0, 9, 9, 0, 0, 0, 0, 0, 0], [0] * 10, [0, 0, 0, 0, 1, 0, 0, 0, 0, 0], [0] * 10]
    (e,) = excess_from_windows(_data_windows(stretch), RANK_CAUSES, opts)
    assert (e.rank, e.spikes) == (0, 18) and e.dispersion < 1.1


def test_spikes_all_in_one_window_are_one_burst():
    # the live detector's first window after a start-up: 6 spikes in 40 steps on one rank, none on the
    # others (two outside runs here, clean, said "loses its CPU on 15 % of its steps" at step 10)
    opts = DetectionOptions()
    first = [[6], [0], [0], [0]]
    assert excess_from_windows(_data_windows(first), RANK_CAUSES, opts) == []
    assert excess_from_windows(_data_windows([[6, 0], [0, 0], [0, 0], [0, 0]]), RANK_CAUSES, opts) == []
    # spread over windows, as an intermittent culprit's are, they are found
    (e,) = excess_from_windows(_data_windows([[3, 3], [0, 0], [0, 0], [0, 0]]), RANK_CAUSES, opts)
    assert (e.rank, e.spikes) == (0, 6)


def test_data_spikes_of_a_rank_that_did_not_wait_longer_in_all_are_no_cause_of_its_own():
    # An outside run beside a busy loop: rank 3 had 31 data spikes (others about 7), 1.05 s lost in
    # them, while its whole input wait was 3.19 s against the others' 3.0-3.8 s: its usual wait was
    # shorter, so more of the same waiting counted as spikes. Spread evenly (no bursts to discount).
    spikes = [[1] * 10, [1] * 10, [1] * 10, [3] * 10]
    w = _data_windows(spikes)
    typical_ms = np.repeat([5.4, 5.4, 5.4, 3.6], 10)  # per window, over its 50 judged steps
    w["data_ns_median"] = typical_ms * 1e6
    w["lost_ns_data"] = w["spikes_data"] * 34e6
    opts = DetectionOptions()
    assert excess_from_windows(w, RANK_CAUSES, opts) == []
    # the same spikes on a rank whose usual wait is the others': 1.0 s of input wait of its own
    w["data_ns_median"] = np.full(40, 5.4e6)
    (e,) = excess_from_windows(w, RANK_CAUSES, opts)
    assert (e.rank, e.cause, e.spikes) == (3, "data", 30)


def test_a_slow_rank_the_job_did_not_wait_for_is_no_straggler():
    """Slowest in every window by 30 % (the window rules confirm it), but with a culprit record it arrived
    last in about a chance share of its steps (31 % where 25 % is chance): its excess was not on the
    job's path. Last in most of its steps, it is one."""
    rng = np.random.default_rng(11)
    self_ms = 10.0 * (1 + 0.02 * rng.standard_normal((4, 6)))
    self_ms[0] *= 1.3
    cols = _with(windows(self_ms), "cpu_ns_median", 9.0 * (1 + 0.02 * rng.standard_normal((4, 6))))
    (s,) = detect_stragglers(cols, DetectionOptions())  # no culprit record: judged on the windows
    assert s.rank == 0 and s.active
    cols["culprit_known"] = np.full(cols["rank"].size, 48.0)
    cols["culprit_steps"] = np.where(cols["rank"] == 0, 15.0, 11.0)  # 90 of 288: 31 %
    assert detect_stragglers(cols, DetectionOptions()) == []
    cols["culprit_steps"] = np.where(cols["rank"] == 0, 35.0, 4.0)  # 73 %
    (s,) = detect_stragglers(cols, DetectionOptions())
    assert s.rank == 0 and s.active


def test_live_says_a_rank_cause_once_and_that_it_is_over_once_it_stays_gone():
    from hyperacc.analysis import LiveDetector

    # rank 0 stalls in data loading in windows 0-5, then not; one window (8) it stalls again alone
    spikes = [[3, 3, 3, 3, 3, 3, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], [0] * 23, [0] * 23, [0] * 23]
    cols = _data_windows(spikes)
    cols["first_step"] = cols["window"] * 50
    cols["last_step"] = cols["first_step"] + 49
    cols["steps"] = cols["judged_steps"]
    live = LiveDetector(world_size=4, nodes=1)
    said = []
    for w in range(23):
        at = cols["window"] == w
        said += [(w, line) for line in live.update({k: v[at] for k, v in cols.items()})]
    stalls = [(w, line) for w, line in said if "rank 0 (node 0) stalls in data loading" in line]
    over = [(w, line) for w, line in said if "no longer" in line]
    assert len(stalls) == 1, said  # not said again when it drops out of the history and comes back
    assert len(over) == 1 and over[0][1] == (
        "rank 0 (node 0) no longer has more data-loading stalls than the other ranks over the recent windows"), said
    # said over only after persist_n (5) updates in a row without it, after its last spikes left the history
    assert over[0][0] > 8 + DetectionOptions().persist_n, said

"""The simulator against theory, against itself, and against what a pure max model allows."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pyarrow as pa
import pytest

from hyperacc.pacing import PacingConfig
from hyperacc.schema import STEP_SCHEMA, RankMeta
from hyperacc.sim import (
    ComputeModel,
    EarlyArrivalCost,
    FabricModel,
    MeasuredRun,
    SimConfig,
    SimConfigError,
    simulate,
)
from hyperacc.sim.model import (
    allreduce_ns,
    bernoulli_positions,
    draw_compute,
    finish_no_delay_max,
    finish_times,
    locality_offsets,
)
from hyperacc.store import read_meta, read_steps, step_writer, write_meta
from hyperacc.theory import cluster_spike_probability


@pytest.mark.parametrize(
    ("p_rank", "nodes", "gpus", "p_node"),
    [(0.01, 4, 8, 0.0), (0.0005, 64, 8, 0.0), (0.002, 16, 1, 0.0), (0.001, 4, 8, 0.01)],
)
def test_spike_fraction_matches_closed_form_within_monte_carlo_error(p_rank, nodes, gpus, p_node) -> None:
    cfg = SimConfig(
        nodes=nodes, gpus_per_node=gpus, steps=20_000, seed=7, pacing=None,
        compute=ComputeModel(spike_rate=p_rank, node_spike_rate=p_node, spike_dist="fixed", spike_ms=50),
    )  # fmt: skip
    r = simulate(cfg)
    theory = cluster_spike_probability(p_rank, ranks_per_node=gpus, nodes=nodes, p_node=p_node)
    assert r.theory_spike_probability == pytest.approx(theory)
    se = math.sqrt(theory * (1 - theory) / cfg.steps)
    assert abs(r.spike_fraction - theory) < 4 * se, (r.spike_fraction, theory, se)
    # a 50 ms spike on 100 ms steps is a slow step: the step-level view agrees with the ground truth
    assert abs(r.baseline.slow_fraction - r.spike_fraction) < 4 * se + 0.002


def test_bernoulli_positions_have_the_right_rate_and_are_distinct() -> None:
    rng = np.random.default_rng(0)
    pos = bernoulli_positions(rng, 2_000_000, 0.003)
    assert np.all(np.diff(pos) > 0) and pos.max() < 2_000_000
    assert pos.size == pytest.approx(6000, abs=4 * math.sqrt(6000))
    assert bernoulli_positions(rng, 10, 0.0).size == 0
    assert bernoulli_positions(rng, 10, 1.0).tolist() == list(range(10))


def test_in_a_pure_max_model_pacing_never_shortens_a_step() -> None:
    cfg = SimConfig(
        nodes=4, gpus_per_node=8, steps=3000, seed=3,
        compute=ComputeModel(locality_gpu=0.1, locality_node=0.05, spike_rate=0.001),
        pacing=PacingConfig(gain=1.0, margin=0.0),
    )  # fmt: skip
    r = simulate(cfg, keep_steps=True)
    assert r.paced is not None and r.paced.pace_on_fraction > 0.9 and r.paced.mean_delay_ms > 0
    assert np.all(r.paced_ns >= r.baseline_ns - 1e-3)


def test_with_a_spin_cost_and_persistent_leads_pacing_shortens_steps() -> None:
    cfg = SimConfig(
        nodes=4, gpus_per_node=8, steps=3000, seed=3,
        compute=ComputeModel(noise_cv=0.01, locality_gpu=0.2),
        cost=EarlyArrivalCost(spin_cost=1.0),
    )  # fmt: skip
    r = simulate(cfg)
    assert r.paced is not None
    assert r.paced.mean_ms < r.baseline.mean_ms
    assert r.paced.throughput > r.baseline.throughput


def test_a_burst_cost_makes_pacing_pay_for_synchronised_starts() -> None:
    base = SimConfig(
        nodes=2, gpus_per_node=8, steps=2000, seed=5,
        compute=ComputeModel(noise_cv=0.005, locality_gpu=0.2),
        fabric=FabricModel(exposed_mb=400),
        pacing=PacingConfig(gain=1.0, margin=0.0, max_delay_frac=0.3),
    )  # fmt: skip
    calm = simulate(base)
    burst = simulate(dataclasses.replace(base, cost=EarlyArrivalCost(burst_cost=2.0, burst_window_us=3000)))
    gain_calm = calm.paced.mean_ms - calm.baseline.mean_ms
    gain_burst = burst.paced.mean_ms - burst.baseline.mean_ms
    assert gain_burst > gain_calm  # pacing bunches arrivals, and bunching now costs


def test_vectorised_and_per_step_finish_agree() -> None:
    cfg = SimConfig(
        nodes=3, gpus_per_node=4, steps=50, compute=ComputeModel(locality_gpu=0.1, spike_rate=0.05)
    )
    chunk, _ = draw_compute(np.random.default_rng(1), cfg, 0, 50, locality_offsets(cfg))
    cost = EarlyArrivalCost(spin_cost=0.7)
    fast = finish_no_delay_max(chunk, cost)
    slow = np.array([finish_times(chunk[i], np.zeros((4, 3)), cost).max() for i in range(50)])
    np.testing.assert_allclose(fast, slow, rtol=1e-6)


def test_spinning_peers_slow_the_last_rank_and_sleeping_ones_do_not() -> None:
    c = np.array([[80.0], [90.0], [100.0]])  # three ranks of one node, ms
    cost = EarlyArrivalCost(spin_cost=0.5)
    f = finish_times(c, np.zeros((3, 1)), cost)
    assert f[2, 0] == pytest.approx(100 + 0.5 / 2 * (20 + 10))
    paced = finish_times(c, np.array([[20.0], [10.0], [0.0]]), cost)
    assert paced[2, 0] == pytest.approx(100.0)
    half = finish_times(c, np.array([[20.0], [10.0], [0.0]]), dataclasses.replace(cost, sleep_cost=0.5))
    assert half[2, 0] == pytest.approx(100 + 0.5 / 2 * 0.5 * (20 + 10))


def test_allreduce_model_grows_with_nodes_oversubscription_and_load() -> None:
    f = FabricModel(exposed_mb=100, nodes_per_leaf=4, oversubscription=3.0)
    times = [allreduce_ns(f, n, 8) for n in (1, 2, 4, 8, 16)]
    assert all(b > a for a, b in zip(times, times[1:], strict=False))
    assert allreduce_ns(f, 8, 8) > 2 * allreduce_ns(dataclasses.replace(f, oversubscription=1.0), 8, 8) * 0.9
    assert float(allreduce_ns(f, 8, 8, 0.5)) > float(allreduce_ns(f, 8, 8, 0.0))
    assert allreduce_ns(f, 4, 8, 0.9) == allreduce_ns(f, 4, 8, 0.9)  # one leaf: no uplink in the path


def test_throughput_falls_from_linear_and_cv_rises_with_nodes() -> None:
    from hyperacc.sim import sweep

    cfg = SimConfig(
        gpus_per_node=8, steps=2000, seed=1, pacing=None,
        compute=ComputeModel(spike_rate=0.0005, spike_ms=50),
        fabric=FabricModel(nodes_per_leaf=4, oversubscription=2.0, background_load=0.3),
    )  # fmt: skip
    res = sweep(cfg, [1, 4, 16, 64])
    eff = [r.baseline.efficiency for r in res]
    cv = [r.baseline.cv for r in res]
    assert eff[0] == pytest.approx(1.0)
    assert all(b < a for a, b in zip(eff, eff[1:], strict=False)), eff
    assert cv[-1] > cv[0], cv


def test_same_seed_same_result_and_locality_is_stable_as_the_cluster_grows() -> None:
    cfg = SimConfig(
        nodes=4, steps=500, compute=ComputeModel(locality_gpu=0.1, locality_node=0.1, spike_rate=0.01)
    )
    a, b = simulate(cfg), simulate(cfg)
    assert a.baseline == b.baseline and a.paced == b.paced
    small = locality_offsets(cfg)
    big = locality_offsets(dataclasses.replace(cfg, nodes=16))
    np.testing.assert_array_equal(big[:, :4], small)


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: ComputeModel(spike_rate=1.5), "spike_rate"),
        (lambda: ComputeModel(spike_dist="pareto"), "spike_dist"),
        (lambda: FabricModel(oversubscription=0.5), "oversubscription"),
        (lambda: EarlyArrivalCost(sleep_cost=2.0), "sleep_cost"),
        (lambda: SimConfig(nodes=0), "nodes"),
        (lambda: SimConfig(nodes=8192, gpus_per_node=16), "ranks"),
    ],
)
def test_impossible_settings_are_refused_with_the_name(make, name) -> None:
    with pytest.raises(SimConfigError, match=name):
        make()


def _write_measured_run(run_dir, ranks: int, steps: int, seed: int = 0) -> np.ndarray:
    """A run directory in the shared schema: rank r computes 10 ms x (1 + 0.05 r) plus rare spikes."""
    rng = np.random.default_rng(seed)
    compute = np.empty((ranks, steps))
    for r in range(ranks):
        c = 10e6 * (1 + 0.05 * r) * (1 + 0.02 * rng.standard_normal(steps))
        c[rng.random(steps) < 0.02] += 30e6
        compute[r] = c
    comm = 1e6
    step_ns = compute.max(axis=0) + comm
    for r in range(ranks):
        write_meta(run_dir, RankMeta(r, r, 0, ranks, ranks, "host", 1))
        cols = {
            "rank": np.full(steps, r, np.int32), "node": np.zeros(steps, np.int32),
            "step": np.arange(steps), "step_ns": step_ns.astype(np.int64),
            "self_ns": compute[r].astype(np.int64), "comm_wait_ns": (step_ns - compute[r]).astype(np.int64),
        }  # fmt: skip
        arrays = [
            pa.array(cols[n], type=f.type) if n in cols else pa.nulls(steps, f.type)
            for n, f in zip(STEP_SCHEMA.names, STEP_SCHEMA, strict=True)
        ]
        step_writer(run_dir, r).write(pa.Table.from_arrays(arrays, schema=STEP_SCHEMA))
    return step_ns


def test_trace_driven_run_reproduces_the_measured_job_at_its_own_size(tmp_path) -> None:
    measured_steps = _write_measured_run(tmp_path, ranks=4, steps=3000)
    run = MeasuredRun.from_run_dir(tmp_path)
    assert run.ranks == 4 and run.nodes == 1
    assert np.median(run.comm_ns) == pytest.approx(1e6, rel=0.01)
    cfg = SimConfig(nodes=1, gpus_per_node=4, steps=3000, seed=2, pacing=None)
    r = simulate(cfg, measured=run)
    assert r.baseline.p50_ms == pytest.approx(np.median(measured_steps[5:]) / 1e6, rel=0.03)
    assert r.baseline.mean_ms == pytest.approx(measured_steps[5:].mean() / 1e6, rel=0.05)
    assert abs(r.spike_fraction - r.theory_spike_probability) < 4 * r.spike_fraction_se + 0.01


def test_simulated_run_directory_is_read_by_the_shared_store(tmp_path) -> None:
    cfg = SimConfig(nodes=2, gpus_per_node=2, steps=40, compute=ComputeModel(locality_gpu=0.2))
    r = simulate(cfg, write_run=tmp_path, keep_steps=True)
    table = read_steps(tmp_path)
    assert table.num_rows == 4 * 40
    meta = read_meta(tmp_path)
    assert sorted(meta) == [0, 1, 2, 3] and all(m.source == "simulator" for m in meta.values())
    rank0 = table.filter(pa.compute.equal(table["rank"], 0))
    np.testing.assert_allclose(rank0["step_ns"].to_numpy(), r.paced_ns.astype(np.int64), atol=1)
    # the simulated job reads back as a measured one
    assert MeasuredRun.from_run_dir(tmp_path).ranks == 4


def test_too_large_a_run_directory_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="too large"):
        simulate(SimConfig(nodes=512, gpus_per_node=8, steps=10_000), write_run=tmp_path)


def _write_correlated_run(run_dir, ranks: int, steps: int, seed: int = 0) -> np.ndarray:
    """What real DDP ranks record: in every step one rank is the late one (the others wait for it), and
    the machine goes through slow phases that last tens of steps and hit every rank at once."""
    rng = np.random.default_rng(seed)
    phase = np.repeat(np.where(rng.random(steps // 40 + 1) < 0.2, 1.6, 1.0), 40)[:steps]  # shared slow phases
    late = rng.integers(0, ranks, steps)
    compute = 10e6 * phase * (1 + 0.05 * rng.standard_normal((ranks, steps)))
    compute[late, np.arange(steps)] *= 1.5  # the one late rank of each step
    comm = 1e6 * (1 + 0.1 * rng.random(steps))
    step_ns = compute.max(axis=0) + comm
    for r in range(ranks):
        write_meta(run_dir, RankMeta(r, r, 0, ranks, ranks, "host", 1))
        cols = {
            "rank": np.full(steps, r, np.int32), "node": np.zeros(steps, np.int32),
            "step": np.arange(steps), "step_ns": step_ns.astype(np.int64),
            "self_ns": compute[r].astype(np.int64), "comm_wait_ns": (step_ns - compute[r]).astype(np.int64),
        }  # fmt: skip
        arrays = [
            pa.array(cols[n], type=f.type) if n in cols else pa.nulls(steps, f.type)
            for n, f in zip(STEP_SCHEMA.names, STEP_SCHEMA, strict=True)
        ]
        step_writer(run_dir, r).write(pa.Table.from_arrays(arrays, schema=STEP_SCHEMA))
    return step_ns


@pytest.mark.parametrize("ranks", [2, 4])
def test_replay_at_the_measured_size_keeps_p50_and_p99_within_ten_percent(tmp_path, ranks) -> None:
    """Cross-rank correlation (one late rank per step) and over-time correlation (slow phases) are
    replayed, so the measured job's own step distribution and its time structure come back."""
    measured_steps = _write_correlated_run(tmp_path, ranks=ranks, steps=2000)[5:] / 1e6
    run = MeasuredRun.from_run_dir(tmp_path)
    assert run.compute.shape == (ranks, 1995)
    r = simulate(SimConfig(nodes=1, gpus_per_node=ranks, steps=20_000, seed=1, pacing=None), measured=run,
                 keep_steps=True)  # fmt: skip
    p50, p99 = np.percentile(measured_steps, [50, 99])
    assert r.baseline.p50_ms == pytest.approx(p50, rel=0.10)
    assert r.baseline.p99_ms == pytest.approx(p99, rel=0.10)
    # the slow phases stay together: neighbouring simulated steps are correlated as measured ones are
    sim = r.baseline_ns
    measured_lag1 = np.corrcoef(measured_steps[:-1], measured_steps[1:])[0, 1]
    assert np.corrcoef(sim[:-1], sim[1:])[0, 1] == pytest.approx(measured_lag1, abs=0.1)
    assert measured_lag1 > 0.3  # (an independent resample of each step would have none)


def test_copies_of_the_measured_job_replay_independent_runs(tmp_path) -> None:
    from hyperacc.sim.model import block_steps, draw_measured_compute, replica_map

    _write_correlated_run(tmp_path, ranks=2, steps=400)
    run = MeasuredRun.from_run_dir(tmp_path)
    cfg = SimConfig(nodes=2, gpus_per_node=4, steps=100, pacing=None, replay_block=10)
    assert replica_map(cfg, 2).tolist() == [[0, 2], [0, 2], [1, 3], [1, 3]]  # slot-major: ranks 0-3, 4-7
    C, _, comm = draw_measured_compute(np.random.default_rng(0), cfg, run, 0, 100, 0.5)
    compute, _ = run.replayable()
    flat = C.transpose(0, 2, 1).reshape(100, 8)  # [step, rank]
    # each copy replays whole measured steps: its two ranks come from the same measured step
    for k in range(4):
        pair = flat[:, 2 * k : 2 * k + 2].astype(np.float64)
        dist = np.abs(compute[0][None, :] - pair[:, :1]) + np.abs(compute[1][None, :] - pair[:, 1:])
        steps = dist.argmin(axis=1)
        assert (dist.min(axis=1) < 8).all()  # both ranks' values are one measured step's (float32 rounding)
        assert (np.diff(steps)[np.arange(99) % 10 != 9] == 1).all()  # runs of 10 consecutive steps
    assert not np.array_equal(flat[:, 0], flat[:, 2])  # copies are independent
    idx = block_steps(np.random.default_rng(1), 50, 10, 25, 15)
    assert idx.shape == (25,) and (np.diff(idx)[[0, 1, 2, 3, 5, 6]] == 1).all()

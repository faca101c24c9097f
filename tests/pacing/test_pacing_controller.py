"""The pacing rules of docs/pacing.md, each on small hand-made observations."""

from __future__ import annotations

import numpy as np
import pytest

from hyperacc.pacing import PacingConfig, PacingConfigError, PacingController

MS = 1_000_000


def feed(ctl: PacingController, natural: np.ndarray, step: int, comm_ns: float = 5 * MS) -> np.ndarray:
    """One bulk-synchronous step: each rank arrives at natural + its planned delay; all exit together."""
    d = ctl.plan(step)
    arrivals = natural + d
    end = arrivals.max() + comm_ns
    ctl.observe(step, arrivals, end - arrivals)
    return d


def run(ctl: PacingController, naturals: list[np.ndarray], first: int = 0) -> list[np.ndarray]:
    return [feed(ctl, a, first + i) for i, a in enumerate(naturals)]


def test_equal_arrivals_never_switch_on() -> None:
    rng = np.random.default_rng(1)
    ctl = PacingController(ranks=16)
    plans = run(ctl, [100 * MS + rng.normal(0, 0.1 * MS, 16) for _ in range(300)])
    assert not ctl.on
    assert ctl.state.switches == 0
    assert all(not p.any() for p in plans)


def test_switches_on_after_k_steps_above_both_thresholds() -> None:
    cfg = PacingConfig(warmup_steps=2, on_steps=4)
    ctl = PacingController(cfg, ranks=4)
    natural = np.array([90, 95, 100, 110], float) * MS  # spread 20 ms, step 115 ms: both thresholds passed
    for step in range(2 + cfg.on_steps - 1):
        feed(ctl, natural, step)
        assert not ctl.on, f"on too early, after {step + 1} observations"
    feed(ctl, natural, 2 + cfg.on_steps - 1)
    assert ctl.on


def test_relative_threshold_keeps_it_off_on_long_steps() -> None:
    # 3 ms spread passes the 1 ms absolute threshold but is 0.3 % of a 1 s step (< 5 %)
    ctl = PacingController(ranks=4)
    run(ctl, [np.array([1000, 1001, 1002, 1003], float) * MS] * 100)
    assert ctl.state.spread_ns > PacingConfig().on_spread_ns
    assert not ctl.on


def test_absolute_threshold_keeps_it_off_on_short_steps() -> None:
    # 0.5 ms spread is 25 % of a 2 ms step but below the 1 ms absolute threshold
    ctl = PacingController(ranks=4)
    run(ctl, [np.array([1.0, 1.2, 1.3, 1.5]) * MS] * 100, first=0)
    assert not ctl.on


def test_hysteresis_holds_between_thresholds_and_switches_off_after_m_steps() -> None:
    # alpha=1 and no clipping: the estimates are the last sample, so the counters are seen exactly
    cfg = PacingConfig(alpha=1.0, clip=1e9, warmup_steps=0, on_steps=3, off_steps=5)
    ctl = PacingController(cfg, ranks=2)
    wide = np.array([100, 120], float) * MS  # 20 ms spread: above on (max(1 ms, 5 % of ~125 ms))
    middle = np.array([100, 104], float) * MS  # 4 ms: between off (~2.7 ms) and on (~5.5 ms)
    narrow = np.array([100, 100.5]) * MS  # 0.5 ms: below off
    step = 0
    for _ in range(3):
        feed(ctl, wide, step)
        step += 1
    assert ctl.on
    for _ in range(50):  # in the band: stays on
        feed(ctl, middle, step)
        step += 1
    assert ctl.on
    for i in range(cfg.off_steps):
        assert ctl.on, f"switched off after {i} narrow steps, needs {cfg.off_steps}"
        feed(ctl, narrow, step)
        step += 1
    assert not ctl.on
    assert not ctl.delays_ns.any()
    assert ctl.state.switches == 2
    for _ in range(50):  # in the band again: stays off
        feed(ctl, middle, step)
        step += 1
    assert not ctl.on


def test_delay_is_capped_absolutely_and_relative_to_the_step() -> None:
    rng = np.random.default_rng(2)
    for cap_ms, frac in [(2.0, 0.5), (50.0, 0.05), (50.0, 0.0)]:
        cfg = PacingConfig(max_delay_ns=int(cap_ms * MS), max_delay_frac=frac, gain=1.0, margin=0.0)
        ctl = PacingController(cfg, ranks=8)
        offsets = np.linspace(0, 60, 8) * MS  # leads up to 60 ms on ~100 ms steps
        for step in range(200):
            d = feed(ctl, 50 * MS + offsets + rng.normal(0, 0.2 * MS, 8), step)
            bound = min(cap_ms * MS, frac * ctl.state.step_ns) if step else 0
            assert d.max() <= max(bound, cap_ms * MS), "plan above the cap"
            assert (ctl.delays_ns <= min(cap_ms * MS, frac * ctl.state.step_ns) + 1).all()
        assert ctl.on
        if frac > 0:
            assert ctl.delays_ns.max() > 0


def test_latest_rank_is_never_delayed_and_earlier_ranks_wait_longer() -> None:
    rng = np.random.default_rng(3)
    ctl = PacingController(ranks=6)
    offsets = np.array([0, 2, 4, 6, 8, 10], float) * MS  # rank 5 always last
    for step in range(300):
        feed(ctl, 100 * MS + offsets + rng.normal(0, 0.1 * MS, 6), step)
    d = ctl.delays_ns
    assert ctl.on
    assert d[5] == 0
    assert (np.diff(d) <= 0).all(), d
    assert d[0] > 0


def test_applied_delays_are_taken_out_so_pacing_does_not_switch_itself_off() -> None:
    # Once early ranks are held back the measured spread shrinks; the natural spread does not.
    cfg = PacingConfig(gain=1.0, margin=0.0, max_delay_frac=0.5, max_delay_ns=100 * MS)
    ctl = PacingController(cfg, ranks=4)
    natural = np.array([80, 90, 100, 110], float) * MS
    for step in range(400):
        feed(ctl, natural, step)
    assert ctl.on
    assert ctl.state.switches == 1
    assert ctl.state.spread_ns == pytest.approx(30 * MS, rel=0.01)
    np.testing.assert_allclose(ctl.delays_ns, [30 * MS, 20 * MS, 10 * MS, 0], atol=0.05 * MS)


def test_without_subtraction_the_controller_chases_its_own_delays() -> None:
    # Reading delayed arrivals as natural ones, it settles where delay = lead - delay: half the lead.
    cfg = PacingConfig(
        gain=1.0, margin=0.0, max_delay_frac=0.5, max_delay_ns=100 * MS, arrivals_include_delay=False
    )
    ctl = PacingController(cfg, ranks=4)
    natural = np.array([80, 90, 100, 110], float) * MS
    for step in range(400):
        feed(ctl, natural, step)
    np.testing.assert_allclose(ctl.delays_ns, [15 * MS, 10 * MS, 5 * MS, 0], atol=0.1 * MS)


def test_missing_values_never_count_as_early_or_late() -> None:
    ctl = PacingController(ranks=4)
    natural = np.array([90, 100, 110, 100], float) * MS
    for step in range(200):
        d = ctl.plan(step)
        a = natural + d
        a[3] = -1 if step % 2 else np.nan  # rank 3 never measured
        ctl.observe(step, a, np.full(4, 5 * MS))
    assert ctl.on
    assert ctl.delay_ns(3) == 0
    assert ctl.delay_ns(0) > ctl.delay_ns(1) > 0
    assert ctl.delay_ns(2) == 0


def test_wait_signal_gives_the_same_decisions_as_arrivals() -> None:
    rng = np.random.default_rng(4)
    naturals = [
        100 * MS + np.array([0, 3, 6, 9], float) * MS + rng.normal(0, 0.2 * MS, 4) for _ in range(200)
    ]
    by_arrival = PacingController(PacingConfig(signal="arrival"), ranks=4)
    by_wait = PacingController(PacingConfig(signal="wait"), ranks=4)
    for step, nat in enumerate(naturals):
        feed(by_arrival, nat, step)
        feed(by_wait, nat, step)
    assert by_arrival.on and by_wait.on
    # a wait also carries the last rank's noise (0.2 ms here), so the two agree to about that noise
    np.testing.assert_allclose(by_arrival.delays_ns, by_wait.delays_ns, atol=0.25 * MS)


def test_one_spike_does_not_switch_pacing_on() -> None:
    rng = np.random.default_rng(5)
    ctl = PacingController(ranks=8)
    for step in range(300):
        a = 100 * MS + rng.normal(0, 0.1 * MS, 8)
        if step == 150:
            a[2] += 300 * MS
        feed(ctl, a, step)
        assert not ctl.on, f"switched on at step {step}"


def test_state_reports_what_it_does() -> None:
    ctl = PacingController(ranks=3)
    run(ctl, [np.array([90, 100, 110], float) * MS] * 50)
    st = ctl.state
    assert st.on and st.switches == 1
    assert st.max_delay_ns == ctl.delays_ns.max() > 0
    assert st.spread_ns == pytest.approx(20 * MS, rel=0.02)
    assert st.off_threshold_ns < st.on_threshold_ns < st.spread_ns


@pytest.mark.parametrize(
    "kwargs",
    [
        {"alpha": 0.0},
        {"gain": 1.5},
        {"max_delay_frac": 1.0},
        {"off_spread_ns": 2_000_000},
        {"on_steps": 0},
        {"signal": "clock"},
    ],
)
def test_impossible_settings_are_refused_with_the_name(kwargs: dict) -> None:
    name = next(iter(kwargs))
    with pytest.raises(PacingConfigError, match=name):
        PacingConfig(**kwargs)


def test_observations_of_the_wrong_shape_are_refused() -> None:
    ctl = PacingController(ranks=4)
    with pytest.raises(ValueError, match="4"):
        ctl.observe(0, np.zeros(5), np.zeros(5))
    with pytest.raises(ValueError, match="rank"):
        ctl.delay_ns(7)


def test_noise_alone_at_thousands_of_ranks_never_switches_on() -> None:
    """4,096 ranks of pure 2 ms noise: the raw spread is ~15 ms (the expected range of 4,096 normals is
    7.3 sigma), far above the 1 ms threshold, but none of it is predictable."""
    rng = np.random.default_rng(2)
    ctl = PacingController(ranks=4096)
    plans = run(ctl, [100 * MS + rng.normal(0, 2 * MS, 4096) for _ in range(200)])
    st = ctl.state
    assert st.spread_ns > 10 * MS  # the raw spread the old rule switched on
    assert not ctl.on and st.switches == 0
    assert all(not p.any() for p in plans)
    # the noise-alone range of the estimates: 2 E[max of 4096] x sigma x sqrt(alpha / (2 - alpha))
    expected = 2 * 3.626 * 2 * MS * np.sqrt(0.1 / 1.9)
    assert st.noise_ns == pytest.approx(expected, rel=0.15)
    assert st.predictable_ns < PacingConfig().on_spread_ns


def test_one_predictably_late_rank_among_thousands_switches_on() -> None:
    rng = np.random.default_rng(3)
    ctl = PacingController(ranks=4096)
    late = np.zeros(4096)
    late[17] = 8 * MS  # rank 17 is always 8 ms late, on top of the same 2 ms noise as everyone
    plans = run(ctl, [100 * MS + late + rng.normal(0, 2 * MS, 4096) for _ in range(200)])
    assert ctl.on
    assert ctl.state.predictable_ns > PacingConfig().on_spread_ns
    assert plans[-1][17] == 0 and np.median(plans[-1]) > 2 * MS  # the late rank is not held back

"""PacingHook in one process: the listener/pacer contract, thread hand-off, failure safety, delays."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from hyperacc.pacing import PacingConfig
from hyperacc.pacing.runtime import PacingHook

MS = 1_000_000
FAST = PacingConfig(warmup_steps=0, on_steps=2)


class Exchange:
    """The in-band exchange's contract (hyperacc.trace.inband.InBand): listeners and one pacer."""

    def __init__(self) -> None:
        self.listeners = []
        self.pacer = None

    def add_listener(self, fn) -> None:
        self.listeners.append(fn)

    def set_pacer(self, pacer) -> None:
        self.pacer = pacer

    def round(self, step: int, natural: np.ndarray, comm_ns: float = 2 * MS) -> None:
        """What every rank would learn in-band for ``step``: arrivals with delays, waits to a common exit."""
        arrivals = natural.copy()
        arrivals[self.pacer.rank] += self.pacer.last_delay_ns
        end = arrivals.max() + comm_ns
        for fn in self.listeners:
            fn(step, arrivals, end - arrivals)


def test_attach_registers_listener_and_pacer_and_delays_the_early_rank() -> None:
    ex = Exchange()
    hook = PacingHook(FAST, rank=0, world_size=3).attach(ex)
    assert ex.pacer is hook and ex.listeners == [hook.observe]
    natural = np.array([80, 90, 100], float) * MS
    delays = []
    for step in range(40):
        delays.append(ex.pacer.delay_before(step))
        ex.round(step, natural)
    assert delays[0] == 0 and delays[-1] > 0
    assert delays[-1] <= FAST.max_delay_frac * hook.controller.state.step_ns
    st = hook.state
    assert st["pace_on"] is True and st["pace_delay_ns"] == delays[-1] and st["spread_ns"] > 15 * MS
    assert hook.delays_applied > 0


def test_the_late_rank_is_not_delayed() -> None:
    ex = Exchange()
    hook = PacingHook(FAST, rank=2, world_size=3).attach(ex)
    natural = np.array([80, 90, 100], float) * MS
    for step in range(40):
        assert hook.delay_before(step) == 0
        ex.round(step, natural)
    assert hook.controller.on


def test_observations_from_another_thread_reach_the_controller() -> None:
    hook = PacingHook(FAST, rank=0, world_size=4)
    natural = np.array([70, 80, 90, 100], float) * MS
    stop = threading.Event()
    fed = []

    def comm_thread() -> None:
        step = 0
        while not stop.is_set() and step < 200:
            hook.observe(step, natural + 0.0, np.full(4, 2 * MS) + (natural.max() - natural))
            fed.append(step)
            step += 1
            time.sleep(0.0005)

    t = threading.Thread(target=comm_thread)
    t.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not hook.controller.on:
        hook.delay_before(len(fed))
        time.sleep(0.001)
    stop.set()
    t.join()
    assert hook.controller.on
    assert hook.controller.state.steps_observed > 0
    assert hook.enabled


def test_a_broken_observation_switches_pacing_off_with_one_line(caplog) -> None:
    hook = PacingHook(FAST, rank=0, world_size=4)
    with caplog.at_level(logging.WARNING, logger="hyperacc.pacing"):
        hook.observe(0, np.zeros(5), np.zeros(5))  # five ranks' values for a world of four
        hook.observe(1, np.zeros(5), np.zeros(5))
        assert hook.delay_before(2) == 0
    assert not hook.enabled
    lines = [r for r in caplog.records if r.name == "hyperacc.pacing"]
    assert len(lines) == 1 and "pacing is off" in lines[0].getMessage()


def test_no_delay_before_anything_was_learned() -> None:
    hook = PacingHook(rank=1)
    assert hook.delay_before(0) == 0
    assert hook.state["pace_on"] is False


def test_host_delay_sleeps_at_least_the_delay() -> None:
    hook = PacingHook(rank=0)
    t0 = time.perf_counter_ns()
    with hook.delayed(3 * MS, "cpu"):
        t1 = time.perf_counter_ns()
    assert t1 - t0 >= 3 * MS
    t0 = time.perf_counter_ns()
    with hook.delayed(0, "cpu"):
        pass
    assert hook.enabled


def test_a_device_delay_that_fails_at_entry_switches_pacing_off_and_the_collective_still_runs(caplog) -> None:
    """The device-side delay's side stream and clock calibration are made when its block is entered; on a
    torch without CUDA they fail there, which must switch pacing off, not reach the collective's caller."""
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("the device-side delay works here (make gpu-check tests it)")
    hook = PacingHook(rank=0)
    ran = []
    with caplog.at_level(logging.WARNING, logger="hyperacc.pacing"):
        with hook.delayed(3 * MS, "cuda:0"):
            ran.append("collective")
        with hook.delayed(3 * MS, "cuda:0"):  # off now: no second attempt, no second line
            ran.append("collective")
    assert ran == ["collective", "collective"] and not hook.enabled
    lines = [r for r in caplog.records if r.name == "hyperacc.pacing"]
    assert len(lines) == 1 and "pacing is off" in lines[0].getMessage()

"""The step model on hand-made timelines: phases nest, closures, deferred boundaries, the input gap,
waits collected from the gradient collectives, and signals clipped to their step."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from hyperacc import store
from hyperacc.trace import Tracer
from hyperacc.trace.columns import (
    BACKWARD_NS,
    COLLECTIVES,
    COMM_WAIT_NS,
    DATA_GAP,
    DATA_NS,
    FORWARD_NS,
    MICRO_STEPS,
    NCOLS,
    OPTIMIZER_NS,
    PACE_DELAY_NS,
    SELF_NS,
    STEP_NS,
)
from hyperacc.trace.step_clock import BACKWARD, COMM, DATA, EVAL, FORWARD, OPTIMIZER, StepClock

MS = 1_000_000


def finish(clock: StepClock, t_end: int, t_start: int = 0) -> list[int]:
    row = [-1] * NCOLS
    row[STEP_NS] = t_end - t_start
    clock.fill(row, t_end)
    return row


def test_closure_phases_are_charged_to_forward_backward_and_the_update_only() -> None:
    c = StepClock()
    c.begin(0)
    c.enter(DATA, 0)
    c.exit(DATA, 2 * MS)
    c.enter(OPTIMIZER, 3 * MS)  # Lightning: optimizer.step(closure)
    c.enter(FORWARD, 4 * MS)
    c.exit(FORWARD, 14 * MS)
    c.enter(BACKWARD, 15 * MS)
    c.exit(BACKWARD, 35 * MS)
    c.exit(OPTIMIZER, 37 * MS)  # the update itself: 2 ms after the closure returned
    row = finish(c, 40 * MS)
    assert (row[DATA_NS], row[FORWARD_NS], row[BACKWARD_NS], row[OPTIMIZER_NS]) == (2 * MS, 10 * MS, 20 * MS, 2 * MS)
    assert row[MICRO_STEPS] == 1 and row[SELF_NS] == 40 * MS and row[COMM_WAIT_NS] == -1


def test_nested_same_phase_and_a_blocked_collective_inside_backward() -> None:
    c = StepClock()
    c.begin(0)
    c.enter(BACKWARD, 0)
    c.enter(BACKWARD, 1 * MS)  # re-entrant backward (checkpointing) is not a second micro-step
    c.exit(BACKWARD, 5 * MS)
    c.enter(COMM, 6 * MS)
    c.exit(COMM, 9 * MS)
    c.exit(BACKWARD, 10 * MS)
    row = finish(c, 10 * MS)
    assert row[BACKWARD_NS] == 7 * MS and row[COMM_WAIT_NS] == 3 * MS
    assert row[MICRO_STEPS] == 1 and row[COLLECTIVES] == 1 and row[SELF_NS] == 7 * MS


def test_gradient_rounds_collected_at_backward_exit_overlap_not_add() -> None:
    c = StepClock()
    # two DDP models in one backward: their rounds overlap in time
    c.wait_sources.append(lambda: (8 * MS, 11 * MS, -1, 1))
    c.wait_sources.append(lambda: (9 * MS, 12 * MS, 1 * MS, 1))
    c.begin(0)
    c.enter(BACKWARD, 0)
    c.exit(BACKWARD, 12 * MS)
    c.wait_sources.clear()
    row = finish(c, 12 * MS)
    assert row[COMM_WAIT_NS] == 3 * MS  # latest completion 12 less latest launch 9, not 3 + 3
    assert row[PACE_DELAY_NS] == 1 * MS and row[BACKWARD_NS] == 8 * MS
    assert row[SELF_NS] == 8 * MS and row[COLLECTIVES] == 2


def test_input_gap_is_the_uncovered_time_before_the_last_backward() -> None:
    c = StepClock()
    c.input_gap = True
    c.begin(0)
    c.enter(FORWARD, 1 * MS)  # 1 ms read before the first forward
    c.exit(FORWARD, 5 * MS)
    c.enter(BACKWARD, 8 * MS)  # 3 ms read between forward and backward (nanoGPT)
    c.exit(BACKWARD, 12 * MS)
    c.enter(EVAL, 13 * MS)  # an evaluation forward is never input
    c.exit(EVAL, 20 * MS)
    c.enter(OPTIMIZER, 21 * MS)
    c.exit(OPTIMIZER, 22 * MS)
    row = finish(c, 22 * MS)
    assert row[DATA_NS] == 4 * MS and row[DATA_GAP] == 1
    c.begin(0)
    c.enter(DATA, 0)  # a DataLoader fetch: no gap rule
    c.exit(DATA, 1 * MS)
    row = finish(c, 5 * MS)
    assert row[DATA_NS] == 1 * MS and row[DATA_GAP] == 0


def test_a_boundary_inside_an_open_phase_waits_for_it() -> None:
    c = StepClock()
    ended: list[int] = []
    c.on_end = ended.append
    c.begin(0)
    c.enter(OPTIMIZER, 1 * MS)  # GradScaler.step
    c.enter(OPTIMIZER, 2 * MS)  # optimizer.step inside it
    c.exit(OPTIMIZER, 3 * MS)
    c.request_end(3 * MS)
    assert ended == []
    c.exit(OPTIMIZER, 4 * MS)
    assert ended == [4 * MS]


def test_an_exit_skipped_by_an_exception_does_not_corrupt_the_stack() -> None:
    c = StepClock()
    c.begin(0)
    c.enter(BACKWARD, 0)
    c.enter(FORWARD, 1 * MS)  # never exited: an exception unwound past its hook
    c.exit(BACKWARD, 5 * MS)
    assert c.depth == 0
    row = finish(c, 5 * MS)
    assert row[FORWARD_NS] == 4 * MS and row[BACKWARD_NS] == 1 * MS


def test_signals_before_the_first_step_are_not_charged_to_it(tmp_path: Path) -> None:
    tracer = Tracer(tmp_path, rank=0, world_size=1, window=0, probe_every=0)
    junk = [[i] for i in range(200_000)]
    gc.collect()  # a start-up collection, before the first step
    del junk
    with tracer.step():
        pass
    tracer.close()
    (row,) = store.read_steps(tmp_path).to_pylist()
    assert row["gc_count"] == 0 and row["gc_ns"] == 0
    assert row["cpu_ns"] >= 0


def test_a_step_with_more_phase_changes_than_the_stamp_list_holds_is_accounted_whole() -> None:
    """The clock accounts its stamps at the step's end, or earlier when the list fills (a long
    accumulation): 700 micro-steps are 2,800 stamps, more than the list holds, and every one counts."""
    clock = StepClock()
    clock.input_gap = True
    clock.begin(0)
    t = 0
    for _ in range(700):
        clock.enter(FORWARD, t)
        t += 1 * MS
        clock.exit(FORWARD, t)
        clock.enter(BACKWARD, t)
        t += 2 * MS
        clock.exit(BACKWARD, t)
    # what another thread reads while the step is open (the flusher's "never ends" check) lags at most
    # one list's worth of stamps
    assert 700 - clock.micro <= len(clock.stamps) // 4
    row = finish(clock, t + MS)
    assert row[FORWARD_NS] == 700 * MS and row[BACKWARD_NS] == 1400 * MS and row[MICRO_STEPS] == 700
    assert row[DATA_NS] == 0 and row[DATA_GAP] == 1  # no time was left uncovered before the last backward



def test_run_queue_delay_is_what_a_competitor_on_the_same_cpu_took_from_the_step() -> None:
    """Pinned to one CPU beside a busy process, a spinning step waits for that CPU about half its wall
    time, the part of it inside a collective wait counted apart; a sleeping step waits for none of it
    (blocked, not ready to run), and with no wait timed its wait part is not measured."""
    import os
    import subprocess
    import sys
    import time

    from hyperacc.trace.columns import COL
    from hyperacc.trace.signals import RunDelay, StepSignals

    if not hasattr(os, "sched_setaffinity") or not RunDelay().open:
        pytest.skip("the kernel keeps no run-queue delay here (/proc/self/task/TID/schedstat)")
    cpu = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    busy = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    try:
        os.sched_setaffinity(0, {cpu})
        time.sleep(0.2)  # the busy process is running
        signals = StepSignals()
        rows = []
        for work in ("spin", "sleep"):
            row = [-1] * NCOLS
            signals.begin(contiguous=False)
            t0 = time.perf_counter_ns()
            while time.perf_counter_ns() - t0 < 200 * MS:
                if work == "sleep":
                    time.sleep(0.2)
            if work == "spin":  # a second half inside a (spinning) collective wait
                signals.wait_begins()
                while time.perf_counter_ns() - t0 < 400 * MS:
                    pass
                signals.wait_ends()
            signals.end(row)
            rows.append((row[COL["run_delay_ns"]], row[COL["comm_run_delay_ns"]], time.perf_counter_ns() - t0))
        signals.close()
    finally:
        os.sched_setaffinity(0, before)
        busy.kill()
        busy.wait()
    (spin_delay, in_wait, spin_wall), (sleep_delay, no_wait, sleep_wall) = rows
    assert 0.2 * spin_wall < spin_delay < spin_wall, rows
    assert 0.1 * spin_delay < in_wait < 0.9 * spin_delay, rows  # about half of it in the wait's half
    assert 0 <= sleep_delay < 0.1 * sleep_wall and no_wait == -1, rows

"""The step model: where one rank's training thread spent each step, phase by phase.

``StepClock`` keeps a stack of open phases on the training thread. Phases nest, and each one is
charged its *exclusive* time (its duration less the phases inside it), so the phases of a step never
add up to more than the step, whatever the loop looks like:

- Lightning runs forward, backward and the all-reduce inside ``optimizer.step(closure)``: the closure's
  forward and backward are charged to forward and backward; of the optimizer call only the time after
  the closure returned (the parameter update) is charged to the optimizer, the closure's own code
  around them to the rest of the step;
- gradient accumulation: every micro-step's forward and backward is counted (``micro_steps`` counts
  the outermost backward calls);
- a collective the thread is blocked in (a synchronous call, ``Work.wait``, DDP's gradient all-reduce
  at the end of backward) is the exposed *wait* (``comm_wait_ns``), taken out of the phase it
  happened in; the rank's *self-time* is the step less that wait and less any pacing delay.

Time on the thread outside every phase is the rest of the step (``other_ns`` = step less the phases).
In automatic mode, a step in which no DataLoader fetch was seen charges the uncovered time before its
last backward began to ``data_ns`` (the *input gap*: a hand-written loader such as nanoGPT's
``get_batch`` reads there) and sets ``data_gap``.

A step boundary requested while phases are open (an optimizer step inside ``GradScaler.step``) takes
effect when the outermost phase closes. Only the training thread calls ``enter``/``exit``: nothing is
locked, nothing is allocated per step. docs/tracing.md, "The step model".

Deferred accounting. A phase change on the training thread keeps only what must be known at once (the
stack of open kinds, for a boundary requested inside a phase and an exit that skips inner ones) and
writes a *stamp* (time, code) into one preallocated list; the exclusive times are computed from the
stamps once per step, at its end (``fill``), or when the list fills. The arithmetic is the same, but it
runs in one tight loop instead of spread over a dozen hooks that each run cold between torch's work: a
hook then touches a few memory lines instead of a dozen objects (docs/tracing.md, "Per-iteration CPU").
With device timing (CUDA events recorded at phase changes) every change is accounted at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hyperacc.trace.columns import (
    BACKWARD_NS,
    COLLECTIVES,
    COMM_WAIT_NS,
    DATA_GAP,
    DATA_NS,
    DATA_OWN,
    FORWARD_NS,
    H2D_NS,
    MICRO_STEPS,
    OPTIMIZER_NS,
    PACE_DELAY_NS,
    SELF_NS,
    STEP_NS,
)

# Phase kinds. EVAL (a forward without gradients) has no column: it is part of the rest of the step,
# but it is never an input gap.
DATA, H2D, FORWARD, BACKWARD, COMM, OPTIMIZER, EVAL = range(7)
NKINDS = 7
KIND_COLUMN: tuple[int, ...] = (DATA_NS, H2D_NS, FORWARD_NS, BACKWARD_NS, COMM_WAIT_NS, OPTIMIZER_NS, -1)
KIND_BY_NAME: dict[str, int] = {
    "data": DATA, "h2d": H2D, "forward": FORWARD, "backward": BACKWARD, "comm_wait": COMM,
    "optimizer": OPTIMIZER, "eval": EVAL,
}  # fmt: skip
_MAX_DEPTH = 32

# ``collect()`` of a wait source, over its rounds finished since the last call: (latest launch of a last
# bucket, latest completion, pacing delay or -1, rounds); perf_counter_ns times.
WaitSource = Callable[[], tuple[int, int, int, int]]


# Stamp codes: an enter of kind k is k; an exit is _EXIT + k; a backward's exit that collected the gradient
# collectives' wait carries three more slots (wait, pacing delay, rounds).
_EXIT = 8
_EXIT_COLLECTED = 16
_STAMPS = 1024  # slots; replayed when fewer than one record's worth are left


class StepClock:
    """Exclusive phase times of the current step (one instance per traced process)."""

    def __init__(self) -> None:
        # Real time: the open phases as the hooks see them.
        self.depth = 0
        self.kinds = [0] * _MAX_DEPTH
        self.comm_open = 0  # COMM phases open now (a collective inside one is not counted again)
        self.end_pending = False
        self.stamps = [0] * _STAMPS
        self.n = 0  # slots of ``stamps`` in use
        # Accounted from the stamps (``_replay``): per open phase, its start, the time of the phases
        # nested inside it, when the last of those closed, and its device event (-1: none).
        self._depth = 0
        self.t0 = [0] * _MAX_DEPTH
        self.child = [0] * _MAX_DEPTH
        self.child_end = [0] * _MAX_DEPTH
        self.events = [-1] * _MAX_DEPTH
        self.open_by_kind = [0] * NKINDS
        self.acc = [0] * NKINDS
        self.seen = [False] * NKINDS
        self.input_gap = False  # automatic mode: charge the input gap to data when no fetch was seen
        self.step_open = False
        self.step_t0 = 0
        self.idle_since = 0  # when the stack last became empty
        self.gap = 0  # uncovered time of this step so far
        self.gap_at_backward = -1  # uncovered time before the latest outermost backward began
        self.fetches = 0  # DataLoader fetches seen on this thread in the step
        self.own_fetches = 0  # of them, fetches of a DataLoader without workers (automatic mode)
        self.micro = 0
        self.collectives = 0
        self.pace_delay = -1
        self.on_end: Callable[[int], None] | None = None  # called with the boundary time
        self.wait_sources: list[WaitSource] = []
        self.device: Any = None  # hyperacc.trace.device.DeviceTimer on CUDA: timed kinds accounted at once
        self.device_kinds = 0  # bit per phase kind timed on the device too

    # ------------------------------------------------------------------ step boundaries

    def begin(self, t: int) -> None:
        if self.n:
            self._replay()
        self.step_open = True
        self.step_t0 = self.idle_since = t
        acc, seen = self.acc, self.seen
        for k in range(NKINDS):
            acc[k] = 0
            seen[k] = False
        self.gap = 0
        self.gap_at_backward = -1
        self.fetches = self.micro = self.collectives = self.own_fetches = 0
        self.pace_delay = -1
        self.end_pending = False

    def request_end(self, t: int) -> None:
        """A step boundary: now if no phase is open, else when the outermost phase closes."""
        if self.depth == 0:
            self._end(t)
        else:
            self.end_pending = True

    def _end(self, t: int) -> None:
        self.end_pending = False
        if self.on_end is not None:
            self.on_end(t)

    def fill(self, row: list[int], t1: int) -> None:
        """Write the step's phases, wait, self-time and counts into ``row`` (step_ns already set)."""
        if self.n:
            self._replay()
        if self.depth == 0:
            self.gap += t1 - self.idle_since
        wait, delay, count = self._collect() if self.wait_sources else (0, -1, 0)
        acc, seen = self.acc, self.seen
        if count:
            acc[COMM] += wait
            seen[COMM] = True
            self.collectives += count
        if delay >= 0:
            self.pace_delay = delay if self.pace_delay < 0 else self.pace_delay + delay
        for k in range(NKINDS - 1):
            if seen[k]:
                row[KIND_COLUMN[k]] = acc[k]
        if self.input_gap and self.fetches == 0 and not seen[DATA]:
            gap = self.gap_at_backward if self.gap_at_backward >= 0 else self.gap
            row[DATA_NS] = gap
            row[DATA_GAP] = 1
        elif self.input_gap:
            row[DATA_GAP] = 0
            row[DATA_OWN] = 1 if self.own_fetches else 0
        step_ns = row[STEP_NS]
        own = step_ns - (acc[COMM] if seen[COMM] else 0) - max(self.pace_delay, 0)
        row[SELF_NS] = own if own > 0 else 0
        if self.pace_delay >= 0:
            row[PACE_DELAY_NS] = self.pace_delay
        row[MICRO_STEPS] = self.micro
        row[COLLECTIVES] = self.collectives
        self.step_open = False

    # ------------------------------------------------------------------ phases (training thread)

    def enter(self, kind: int, t: int) -> None:
        d = self.depth
        self.depth = d + 1
        if d >= _MAX_DEPTH:
            return  # too deep to account: counted, never charged
        self.kinds[d] = kind
        if kind == COMM:
            self.comm_open += 1
        if self.device is not None and (self.device_kinds >> kind) & 1:
            self._replay()  # a phase timed on the device too: its event is recorded now
            self._enter(kind, t)
            return
        i = self.n
        if i > _STAMPS - 5:
            self._replay()
            i = 0
        s = self.stamps
        s[i] = t
        s[i + 1] = kind
        self.n = i + 2

    def exit(self, kind: int, t: int) -> None:
        d = self.depth - 1
        if d < 0:
            return
        if d >= _MAX_DEPTH:
            self.depth = d
            return
        kinds = self.kinds
        if kinds[d] != kind:
            # A phase left without its exit (an exception skipped a hook): close the inner ones first.
            j = d
            while j >= 0 and kinds[j] != kind:
                j -= 1
            if j < 0:
                return
            while self.depth - 1 > j:
                self.exit(kinds[self.depth - 1], t)
            d = j
        self.depth = d
        if kind == COMM:
            self.comm_open -= 1
        collect = kind == BACKWARD and self.wait_sources
        if self.device is not None and (self.device_kinds >> kind) & 1:
            self._replay()
            self._exit(kind, t, *(self._collect() if collect else (0, -1, 0)))
        else:
            i = self.n
            if i > _STAMPS - 5:
                self._replay()
                i = 0
            s = self.stamps
            s[i] = t
            if collect:
                s[i + 1] = _EXIT_COLLECTED
                s[i + 2], s[i + 3], s[i + 4] = self._collect()
                self.n = i + 5
            else:
                s[i + 1] = _EXIT + kind
                self.n = i + 2
        if d == 0 and self.end_pending:
            self._end(t)

    def add(self, kind: int, duration_ns: int) -> None:
        """Charge time measured elsewhere (``Tracer.add_phase``) to a phase of the current step."""
        if self.n:
            self._replay()
        if duration_ns > 0:
            self.acc[kind] += duration_ns
        self.seen[kind] = True
        if kind == DATA:
            self.fetches += 1

    # ------------------------------------------------------------------ accounting

    def _replay(self) -> None:
        """Account the stamps written since the last replay, in order, and empty the list."""
        s, n = self.stamps, self.n
        self.n = 0
        i = 0
        while i < n:
            t, code = s[i], s[i + 1]
            if code < _EXIT:
                self._enter(code, t)
                i += 2
            elif code < _EXIT_COLLECTED:
                self._exit(code - _EXIT, t, 0, -1, 0)
                i += 2
            else:
                self._exit(BACKWARD, t, s[i + 2], s[i + 3], s[i + 4])
                i += 5

    def _enter(self, kind: int, t: int) -> None:
        d = self._depth
        if d == 0:
            if self.step_open:
                self.gap += t - self.idle_since
            if kind == BACKWARD:
                self.gap_at_backward = self.gap
        if kind == BACKWARD and self.open_by_kind[BACKWARD] == 0:
            self.micro += 1
        elif kind == DATA:
            self.fetches += 1
        self.t0[d] = t
        self.child[d] = 0
        self.child_end[d] = 0
        dev = self.device
        timed = dev is not None and (self.device_kinds >> kind) & 1 and self.open_by_kind[kind] == 0
        self.events[d] = dev.mark() if timed else -1
        self.open_by_kind[kind] += 1
        self._depth = d + 1

    def _exit(self, kind: int, t: int, wait: int, delay: int, count: int) -> None:
        """Close the innermost open phase (of ``kind``); ``count`` > 0: gradient rounds collected at its
        end, their exposed ``wait`` and pacing ``delay`` (-1: none) taken out of it."""
        d = self._depth - 1
        self._depth = d
        self.open_by_kind[kind] -= 1
        t0 = self.t0[d]
        if t0 < self.step_t0 and self.step_open:
            t0 = self.step_t0  # opened before this step began: charge this step's part only
        duration = t - t0
        inner = self.child[d]
        if count:
            self.acc[COMM] += wait
            self.seen[COMM] = True
            self.collectives += count
            inner += wait
        if delay >= 0:
            self.pace_delay = delay if self.pace_delay < 0 else self.pace_delay + delay
            inner += delay
        if kind == COMM:
            self.collectives += 1
        own = duration - inner
        if kind == OPTIMIZER and self.child[d] and self.child_end[d]:
            own = t - self.child_end[d]  # a closure ran inside: only the update after it is the optimizer's
        if own > 0:
            self.acc[kind] += own
        self.seen[kind] = True
        dev = self.device
        if dev is not None and self.events[d] >= 0:
            dev.pair(kind, self.events[d], dev.mark())
        if d > 0:
            self.child[d - 1] += duration
            self.child_end[d - 1] = t
        else:
            self.idle_since = t

    def _collect(self) -> tuple[int, int, int]:
        """(exposed wait, pacing delay, rounds) of the gradient collectives finished since the last call.

        The rounds collected together belong to one backward (or one step): the thread computed until
        the last bucket of any model was launched and was blocked until the last one completed, so the
        wait is the latest completion less the latest launch, not a sum over models whose collectives
        overlapped.
        """
        launch = done = count = 0
        delay = -1
        for source in self.wait_sources:
            last_launch, last_done, p, n = source()
            if n:
                count += n
                if last_launch > launch:
                    launch = last_launch
                if last_done > done:
                    done = last_done
            if p >= 0:
                delay = p if delay < 0 else delay + p
        wait = done - launch if count and done > launch else 0
        return wait, delay, count

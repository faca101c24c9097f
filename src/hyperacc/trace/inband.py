"""DDP's gradient collectives: timed by a communication hook, optionally exchanged in-band.

Every DDP model built while tracing gets a communication hook (``GradientRounds``) that does exactly
what DDP's default does (divide by the world size, all-reduce, return the result) or calls the user's
own hook, and times each *round* (one backward's buckets): its first and last bucket launch and the
completion of all of them. The rank's exposed **wait** is completion minus last launch: the time it had
nothing left to compute and waited for the others. ``collect()`` hands the step clock that wait (and any
pacing delay) when the backward returns. Errors of the collective reach DDP unchanged: every completion
callback takes the future's value first.

**In-band exchange** (``inband`` option; off by default, because it changes the all-reduce's length and,
with more than two ranks, the summation order of some gradient elements in their last bit): on the
first model, the last bucket of every round carries ``2 x world`` extra values in the bucket's dtype,
slot ``rank`` this rank's arrival and slot ``world + rank`` its wait of round ``r - lag``, in
milliseconds, every other slot 0; after the SUM every rank knows every rank's values (NaN: not
measured), with no extra collective. Whether the slots ride along is agreed once for all ranks of the
group when the model is attached (through the job's store, the first proposal wins), never decided by
one rank alone: after an internal error a rank keeps sending slots of the same length, filled with NaN.
The culprit of a round is the rank that waited least (``min_wait_rank``); a pacer's delay is applied
before the first bucket of each round. docs/tracing.md, "Gradient collectives" and "In-band exchange".
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from hyperacc.trace.columns import MIN_WAIT_RANK, PACE_ON, SPREAD_NS
from hyperacc.trace.ddp_wait import DDP_COMM, DDPWait
from hyperacc.trace.failsafe import switch_off
from hyperacc.trace.inband_slots import InBand, Listener, agree

_SLOT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

_original_register: Any = None
_original_builtin: Any = None


def _patch_ddp_registration() -> None:
    """Route ``DDP.register_comm_hook`` of a traced model into its wrapper (process-wide, idempotent)."""
    global _original_register, _original_builtin
    from torch.nn.parallel import DistributedDataParallel as DDP

    if _original_register is not None:
        return
    _original_register = DDP.register_comm_hook
    _original_builtin = DDP._register_builtin_comm_hook

    def register_comm_hook(self: Any, state: object, hook: Callable) -> None:
        rounds = getattr(self, "_hyperacc_rounds", None)
        if not isinstance(rounds, GradientRounds):
            return _original_register(self, state, hook)
        rounds.set_user_hook(state, hook)

    def _register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> None:
        rounds = getattr(self, "_hyperacc_rounds", None)
        if not isinstance(rounds, GradientRounds):
            return _original_builtin(self, comm_hook_type)
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        builtin = {
            dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
            dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook,
        }
        hook = builtin.get(comm_hook_type)
        if hook is None:
            raise ValueError(f"unknown builtin communication hook {comm_hook_type!r}")
        rounds.set_user_hook(self.process_group, hook)

    register_comm_hook.__doc__ = _original_register.__doc__
    DDP.register_comm_hook = register_comm_hook
    DDP._register_builtin_comm_hook = _register_builtin_comm_hook


def _dispatch(state, bucket):  # type: ignore[no-untyped-def]
    # No annotations: DDP checks them against the real types, and string annotations fail that check.
    return state.run(bucket)


def _first_value(fut: torch.futures.Future) -> torch.Tensor:
    return fut.value()[0]


class GradientRounds:
    """The communication hook of one DDP model: times its rounds, runs DDP's default or the user's hook,
    and (first model, when agreed) carries the in-band slots on the last bucket.

    Three threads touch a round, each owning its fields:

    * the hook thread (autograd's; the training thread on CPU) opens the round and asks the pacer
      (``round``, ``_launches``, ``_first_launch``, ``_last_launch``, ``_delay``, ``_ev_launch``,
      ``pace_on``);
    * completion callbacks (a collective's worker threads, several at once, or the hook thread itself
      when a future completes before the hook returns) count completions (``_done``, ``_done_at``,
      ``_ev_done``, ``_failed``);
    * the training thread collects and closes the round (``_launch_acc`` ... ``_rounds_acc``,
      ``_prev_done``).

    ``_open`` and the completion fields are read and written under ``_lock``, held only for a few
    assignments (never while waiting, never around a collective or a device call), so the training thread
    waits at most for another thread's few assignments. A completion whose collective failed still
    counts (the round closes, with no wait measured), so one failed bucket does not stop the timing of
    every later round.
    """

    def __init__(self, model: Any, *, device: Any = None) -> None:
        self.model = model
        self.group = model.process_group
        self.world = self.group.size()
        self.user_hook: Callable | None = None
        self.user_state: object = None
        self.inband: InBand | None = None  # set when the slots were agreed for this model
        self.pacer: Any = None
        self.device = device  # DeviceTimer (CUDA) or None
        self.next_row: Callable[[], int] = lambda: -1  # ring index the current step's row will take
        self.on = True  # timing; off after an internal error (the collectives run on untouched)
        self.round = -1
        self._open = False
        self._launches = 0
        self._done = 0
        self._first_launch = -1
        self._last_launch = -1
        self._done_at = -1
        self._prev_done = -1
        self._delay = -1
        self._ev_launch = -1
        self._ev_done = -1
        self._failed = False
        self._lock = threading.Lock()
        self.pace_on = -1
        # collected by the step clock
        self._launch_acc = 0
        self._done_acc = 0
        self._delay_acc = -1
        self._rounds_acc = 0

    # ------------------------------------------------------------------ registration

    def set_user_hook(self, state: object, hook: Callable) -> None:
        if self.user_hook is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        self.model._check_comm_hook(hook)
        logger = getattr(self.model, "logger", None)
        if logger is not None:
            logger._set_comm_hook_name(getattr(hook, "__qualname__", str(hook)))
        self.model._comm_hooks.append((hook, state))
        self.user_state, self.user_hook = state, hook

    # ------------------------------------------------------------------ the hook (autograd thread)

    def run(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        slots = self.inband is not None and self.user_hook is None and bucket.is_last()
        slots = slots and bucket.buffer().dtype in _SLOT_DTYPES
        if not self.on:
            return self._plain(bucket, slots)
        launched = [False]
        try:
            if not self._open:
                self._open_round()
                if self._delay > 0:
                    # A pacer that delays on the device (CUDA) gets the launch inside its context;
                    # otherwise the host sleeps: sleeping, not spinning (docs/pacing.md).
                    delayed = getattr(self.pacer, "delayed", None)
                    if delayed is not None:
                        with delayed(self._delay, bucket.buffer().device):
                            return self._launch(bucket, slots, launched)
                    time.sleep(self._delay / 1e9)
            return self._launch(bucket, slots, launched)
        except Exception as exc:
            if launched[0]:
                raise  # the collective itself failed: DDP gets its error unchanged
            self.on = False
            switch_off("gradient collective timing", exc)
            return self._plain(bucket, slots)

    def _launch(
        self, bucket: dist.GradBucket, slots: bool, launched: list[bool]
    ) -> torch.futures.Future[torch.Tensor]:
        now = perf_counter_ns()
        if self._launches == 0:
            self._first_launch = now
        self._last_launch = now
        self._launches += 1
        last = bucket.is_last()
        if last and self.device is not None:
            self._ev_launch = self.device.mark()
        if self.user_hook is not None:
            launched[0] = True
            fut = self.user_hook(self.user_state, bucket)
            return fut.then(self._completed_last_raw if last else self._completed_raw)
        buf = bucket.buffer()
        if slots:
            inband = self.inband
            assert inband is not None
            ext, head, tail = inband.extended(buf)
            torch.div(buf, self.world, out=head)  # into our copy: buf stays intact if anything fails
            inband.fill(self.round, tail)
            launched[0] = True
            return c10d.all_reduce(ext, group=self.group, async_op=True).get_future().then(self._completed_slots)
        buf.div_(self.world)
        launched[0] = True
        fut = c10d.all_reduce(buf, group=self.group, async_op=True).get_future()
        return fut.then(self._completed_last if last else self._completed)

    def _plain(self, bucket: dist.GradBucket, slots: bool) -> torch.futures.Future[torch.Tensor]:
        """What DDP would do without timing, keeping the agreed length (NaN slots) when agreed."""
        if self.user_hook is not None:
            return self.user_hook(self.user_state, bucket)
        buf = bucket.buffer()
        if slots:
            nan = torch.full((2 * self.world,), math.nan, dtype=buf.dtype, device=buf.device)
            ext = torch.cat([buf.div_(self.world), nan])
            n = buf.numel()
            fut = c10d.all_reduce(ext, group=self.group, async_op=True).get_future()
            return fut.then(lambda f: f.value()[0][:n])
        buf.div_(self.world)
        return c10d.all_reduce(buf, group=self.group, async_op=True).get_future().then(_first_value)

    def _open_round(self) -> None:
        with self._lock:
            self._open = True
            self._done, self._done_at, self._ev_done, self._failed = 0, -1, -1, False
        self.round += 1
        self._launches = 0
        self._ev_launch = -1
        self._delay = -1
        if self.inband is not None:
            self.inband.poll()
        pacer = self.pacer
        if pacer is not None:
            try:
                delay = max(int(pacer.delay_before(self.round)), 0)
                state = getattr(pacer, "state", None)
                on = state.get("pace_on") if isinstance(state, dict) else None
                self.pace_on = int(bool(delay > 0 if on is None else on))
                self._delay = delay
            except Exception as exc:  # noqa: BLE001
                self.pacer = None
                self.pace_on = -1
                switch_off("pacing delay", exc)

    # ------------------------------------------------------------------ completion callbacks

    def _mark_done(self, last: bool, ok: bool = True) -> None:
        t = perf_counter_ns()
        ev = self.device.mark() if ok and last and self.device is not None else -1  # on the callback's stream
        with self._lock:
            self._done += 1
            if t > self._done_at:
                self._done_at = t
            if ev != -1:
                self._ev_done = ev
            if not ok:
                self._failed = True

    def _value(self, fut: torch.futures.Future, last: bool) -> Any:
        try:
            value = fut.value()  # first: an error of the collective reaches DDP unchanged
        except BaseException:
            self._mark_done(last, ok=False)
            raise
        self._mark_done(last)
        return value

    def _completed(self, fut: torch.futures.Future) -> torch.Tensor:
        return self._value(fut, False)[0]

    def _completed_last(self, fut: torch.futures.Future) -> torch.Tensor:
        return self._value(fut, True)[0]

    def _completed_raw(self, fut: torch.futures.Future) -> Any:
        return self._value(fut, False)

    def _completed_last_raw(self, fut: torch.futures.Future) -> Any:
        return self._value(fut, True)

    def _completed_slots(self, fut: torch.futures.Future) -> torch.Tensor:
        self._value(fut, True)
        inband = self.inband
        assert inband is not None
        try:
            inband.receive(self.round, inband.slots)
        except Exception as exc:  # noqa: BLE001 - the gradients below are still returned
            inband.decoding = False
            switch_off("in-band decoding", exc)
        return inband.gradients

    # ------------------------------------------------------------------ the step clock's side

    def collect(self) -> tuple[int, int, int, int]:
        """(latest last-bucket launch, latest completion, pacing delay, rounds) of the rounds finished
        since the last call (``step_clock.WaitSource``).

        Called on the training thread when a backward returns (DDP has waited for every bucket by then)
        and at the step's end.
        """
        with self._lock:  # a few reads and one assignment: the callbacks hold it no longer
            closing = self._open and self._launches > 0 and self._done >= self._launches
            if closing:
                self._open = False
                done, ev_done, failed = self._done_at, self._ev_done, self._failed
        if closing:
            self._close_round(-1 if failed else done, ev_done)
        out = (self._launch_acc, self._done_acc, self._delay_acc, self._rounds_acc)
        self._launch_acc, self._done_acc, self._delay_acc, self._rounds_acc = 0, 0, -1, 0
        return out

    def _close_round(self, done: int, ev_done: int) -> None:
        """The training thread's side of a round the callbacks completed (``done`` -1: one failed)."""
        wait = done - self._last_launch if done > 0 else -1
        arrival = self._first_launch - self._prev_done if self._prev_done > 0 else -1
        self._prev_done = done
        if self.inband is not None:
            self.inband.remember(self.round, arrival, wait, self.next_row())
        if wait >= 0:
            self._launch_acc = max(self._launch_acc, self._last_launch)
            self._done_acc = max(self._done_acc, done)
        self._rounds_acc += 1
        if self._delay >= 0:
            self._delay_acc = self._delay if self._delay_acc < 0 else self._delay_acc + self._delay
        if self.device is not None:
            self.device.pair(DDP_COMM, self._ev_launch, ev_done)

    def fill(self, row: list[int]) -> None:
        """The exchange's columns of the step just ended."""
        inband = self.inband
        if inband is not None:
            row[MIN_WAIT_RANK] = inband.min_wait_rank
            row[SPREAD_NS] = inband.spread
        if self.pacer is not None or self.pace_on >= 0:
            row[PACE_ON] = self.pace_on


class Exchange:
    """The gradient collectives of this process: a ``GradientRounds`` hook on every DDP model, and the
    in-band exchange (listeners, pacer) on the first one when it was asked for and agreed."""

    def __init__(self, *, want: bool, agree_timeout_s: float) -> None:
        self.want = want
        self.agree_timeout_s = agree_timeout_s
        self.models: list[GradientRounds | DDPWait] = []
        self.listeners: list[Listener] = []
        self.pacer: Any = None
        self.device: Any = None
        self.waits: Any = None  # StepSignals (the run-queue delay inside the waits), or None
        self.device_values: Callable[[int], tuple[int, int]] | None = None
        self.next_row: Callable[[], int] = lambda: -1
        self._warned = False

    @property
    def primary(self) -> GradientRounds | DDPWait | None:
        return self.models[0] if self.models else None

    @property
    def exchanging(self) -> bool:
        """True while values ride along (agreed, default all-reduce path, more than one rank)."""
        p = self.primary
        return bool(isinstance(p, GradientRounds) and p.inband is not None and p.user_hook is None and p.on)

    def attach(self, model: Any) -> GradientRounds | DDPWait:
        """Time this DDP model's gradient collectives: through a communication hook (``GradientRounds``)
        on the first model when values ride along in-band (agreed by every rank) or a pacer is set,
        otherwise from autograd's callbacks (``DDPWait``), leaving DDP its built-in C++ all-reduce."""
        existing = getattr(model, "_hyperacc_rounds", None)
        if existing is not None:
            return existing
        primary = not self.models
        world = model.process_group.size()
        inband: InBand | None = None
        hooked = primary and world > 1 and (self.want or self.pacer is not None)
        if hooked and getattr(model, "_comm_hooks", None):
            raise ValueError(
                "this DDP model already has a communication hook; attach the tracer before calling "
                "register_comm_hook (the tracer then wraps the user's hook)"
            )
        if hooked and self.want:
            try:
                agreed = agree(model.process_group, True, self.agree_timeout_s)
            except Exception as exc:  # noqa: BLE001 - a store problem: everyone falls back the same way
                agreed = False
                switch_off("in-band agreement", exc)
            if agreed:
                device = next((p.device for p in model.parameters()), torch.device("cpu"))
                inband = InBand(world, model.process_group.rank(), lag=2 if device.type == "cuda" else 1)
                inband.listeners = self.listeners
                inband.device_values = self.device_values if device.type == "cuda" else None
            else:
                switch_off("in-band exchange", RuntimeError("not every rank of the group agreed in time"))
        timer: GradientRounds | DDPWait
        if inband is None and not (hooked and self.pacer is not None):
            timer = DDPWait(model, device=self.device, waits=self.waits)
        else:
            _patch_ddp_registration()
            timer = GradientRounds(model, device=self.device)
            timer.inband = inband
            timer.pacer = self.pacer
            timer.next_row = self.next_row
            _original_register(model, timer, _dispatch)
        model._hyperacc_rounds = timer
        self.models.append(timer)
        return timer

    def add_listener(self, fn: Listener) -> None:
        """``fn(step, arrivals_ns, waits_ns)`` with every rank's values of an earlier round."""
        self.listeners.append(fn)
        for m in self.models:
            if m.inband is not None:
                m.inband.listeners = self.listeners

    def set_pacer(self, pacer: Any) -> None:
        """``pacer.delay_before(step) -> ns`` before the first gradient collective of each step.

        Pacing needs the in-band exchange: set before a DDP model is attached, it asks for it."""
        self.pacer = pacer
        if not self.models:
            self.want = True
        elif not self.exchanging and not self._warned:
            self._warned = True
            switch_off(
                "pacing",
                RuntimeError(
                    "the in-band exchange is off for this model; start the tracer with inband=True "
                    "(or set the pacer) before the DDP model is built"
                ),
            )
        p = self.primary
        if isinstance(p, GradientRounds):
            p.pacer = pacer

    def set_device(self, device: Any) -> None:
        self.device = device
        for m in self.models:
            m.device = device

    def fill(self, row: list[int]) -> None:
        """The exchange's columns of the step just ended (the tracer calls this only when
        ``fills_rows``: a ``DDPWait`` has none)."""
        p = self.primary
        if p is not None:
            p.fill(row)

    @property
    def fills_rows(self) -> bool:
        return isinstance(self.primary, GradientRounds)

    def close(self) -> None:
        for m in self.models:
            m.on = False

"""Arrival and wait at the DDP gradient all-reduce, exchanged in-band between all ranks.

A DDP communication hook times this rank's gradient collectives: its *arrival* (time from the
previous round's exit to launching the first bucket) and its *wait* (from launching the last bucket
to the completion of all of them). On the default all-reduce path it also appends a float32 vector of
``2 x world`` slots to the last bucket (``bucket.is_last()``): slot ``rank`` holds this rank's arrival of
an earlier round, slot ``world + rank`` its wait, both in milliseconds (small offsets, never clock
readings, so float32 keeps them to ~10 ns and no clock synchronisation is needed); every other slot is
zero. After the SUM every rank holds every rank's values, with no extra collective. The slots are
stripped off before DDP sees the gradients.

The exchanged values belong to round ``r - lag`` (lag 1 on CPU, 2 on CUDA where device times are read
a step or more later); a rank without a value for that round sends NaN ("not measured").
Listeners receive ``(step, arrivals_ns, waits_ns)`` with -1 for unmeasured ranks; the arrays are
reused, so copy them to keep them. A pacer's ``delay_before(step)`` (ns) is applied before the first
bucket of each round is launched. The culprit of a round is the rank that waited least
(``min_wait_rank``). docs/tracing.md, "In-band exchange".

With a user's own communication hook the user's hook runs unchanged (it is wrapped, never replaced)
and only local timing is kept; the exchange runs on the default path only, because a compression hook
(fp16/bf16) would destroy the small values.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from hyperacc.trace.columns import (
    COMM_WAIT_NS,
    MIN_WAIT_RANK,
    PACE_DELAY_NS,
    PACE_ON,
    SELF_NS,
    SPREAD_NS,
)
from hyperacc.trace.failsafe import switch_off

if TYPE_CHECKING:
    from hyperacc.trace.tracer import Tracer

Listener = Callable[[int, np.ndarray, np.ndarray], None]

_HISTORY = 16
_SMALL_WORLD = 64
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
        wrapper = getattr(self, "_hyperacc_hook", None)
        if wrapper is None:
            return _original_register(self, state, hook)
        wrapper.set_user_hook(state, hook)

    def _register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> None:
        wrapper = getattr(self, "_hyperacc_hook", None)
        if wrapper is None:
            return _original_builtin(self, comm_hook_type)
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        builtin = {
            dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
            dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook,
        }
        hook = builtin.get(comm_hook_type)
        if hook is None:
            raise ValueError(f"unknown builtin communication hook {comm_hook_type!r}")
        wrapper.set_user_hook(self.process_group, hook)

    register_comm_hook.__doc__ = _original_register.__doc__
    DDP.register_comm_hook = register_comm_hook
    DDP._register_builtin_comm_hook = _register_builtin_comm_hook


def _dispatch(state, bucket):  # type: ignore[no-untyped-def]
    # No annotations: DDP checks them against the real types, and string annotations fail that check.
    return state.run(bucket)


class _Done:
    """Completion callback of the k-th launch of a round (preallocated, one per launch position)."""

    __slots__ = ("inband", "k", "unwrap")

    def __init__(self, inband: InBand, k: int, unwrap: bool) -> None:
        self.inband, self.k, self.unwrap = inband, k, unwrap

    def __call__(self, fut: torch.futures.Future) -> Any:
        inband = self.inband
        inband._done_at[self.k] = perf_counter_ns()
        dev = inband.tracer._dev
        if dev is not None:
            inband._done_mark = dev.mark()  # on the callback's stream: after the collective on the device
        value = fut.value()
        return value[0] if self.unwrap else value


class _ModelHook:
    """The hook registered on one DDP model: times it, exchanges in-band, runs the user's hook."""

    def __init__(self, inband: InBand, model: Any, primary: bool) -> None:
        self.inband = inband
        self.model = model
        self.primary = primary
        self.group = model.process_group
        self.world = self.group.size()
        self.user_hook: Callable | None = None
        self.user_state: object = None

    def set_user_hook(self, state: object, hook: Callable) -> None:
        if self.user_hook is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        self.model._check_comm_hook(hook)
        logger = getattr(self.model, "logger", None)
        if logger is not None:
            logger._set_comm_hook_name(getattr(hook, "__qualname__", str(hook)))
        self.model._comm_hooks.append((hook, state))
        self.user_state, self.user_hook = state, hook

    def plain(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """What DDP would do without us: the user's hook, or the default averaging all-reduce."""
        if self.user_hook is not None:
            return self.user_hook(self.user_state, bucket)
        buf = bucket.buffer()
        buf.div_(self.world)
        fut = dist.all_reduce(buf, group=self.group, async_op=True).get_future()
        return fut.then(_first_value)

    def run(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        inband = self.inband
        if self.primary and inband._on:
            try:
                return inband._run(self, bucket)
            except Exception as exc:  # noqa: BLE001 - fall back to the plain path, never break backward
                inband._on = False
                switch_off("gradient collective timing", exc)
        return self.plain(bucket)


def _first_value(fut: torch.futures.Future) -> torch.Tensor:
    return fut.value()[0]


class InBand:
    """Times the gradient collectives of the traced DDP model and exchanges the values in-band."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self.piggyback = tracer.options.inband
        self.world = 0
        self.rank = -1
        self.lag = 1
        self.round = -1  # index of the current (or last) round
        self.timing_ddp = False  # a DDP model is attached: explicit collective wrappers step aside
        self._on = True
        self._listeners: list[Listener] = []
        self._pacer: Any = None
        self._models: list[_ModelHook] = []
        self._open = False
        self._n = 0  # launches in the current round
        self._done_at: list[int] = [-1] * 64
        self._done_cbs: list[_Done] = []
        self._done_cbs_raw: list[_Done] = []
        self._first_entry = -1  # before the pacing delay
        self._first_launch = -1  # after it
        self._last_launch = -1
        self._prev_done = -1
        self._delay = 0
        self._pace_on = -1
        self._wait = -1  # of the round just closed
        self._min_wait_rank = -1
        self._spread = -1
        self._hist_round = [-1] * _HISTORY
        self._hist_arrival = [-1] * _HISTORY
        self._hist_wait = [-1] * _HISTORY
        self._hist_row = [-1] * _HISTORY
        self._ext: torch.Tensor | None = None
        self._ext_n = -1
        self._ext_head: torch.Tensor | None = None
        self._ext_tail: torch.Tensor | None = None
        self._send: list[torch.Tensor] = []
        self._send_np: list[np.ndarray] = []
        self._recv: torch.Tensor | None = None
        self._recv_np: np.ndarray | None = None
        self._recv_event: Any = None
        self._recv_round = -1
        self._recv_pending = False
        self.arrivals_ns = np.zeros(0, np.int64)
        self.waits_ns = np.zeros(0, np.int64)
        self._tmp = self._scratch = np.zeros(0, np.float64)
        self._valid = self._invalid = np.zeros(0, bool)
        self._last_k = 0
        self._last_mark = -1
        self._done_mark = -1

    # ------------------------------------------------------------------ public contract

    def add_listener(self, fn: Listener) -> None:
        """``fn(step, arrivals_ns, waits_ns)`` with every rank's values of an earlier round."""
        self._listeners.append(fn)

    def set_pacer(self, pacer: Any) -> None:
        """``pacer.delay_before(step) -> ns`` is applied before the first gradient collective of a step."""
        self._pacer = pacer

    @property
    def exchanging(self) -> bool:
        """True while values are piggybacked (DDP, default all-reduce path, float gradients)."""
        hooks = self._models
        return bool(self._on and self.piggyback and hooks and hooks[0].user_hook is None and self.world > 1)

    # ------------------------------------------------------------------ attaching

    def attach(self, model: Any) -> None:
        if getattr(model, "_hyperacc_hook", None) is not None:
            return
        if getattr(model, "_comm_hooks", None):
            raise ValueError(
                "this DDP model already has a communication hook; attach the tracer before calling "
                "register_comm_hook (the tracer then wraps the user's hook)"
            )
        _patch_ddp_registration()
        hook = _ModelHook(self, model, primary=not self._models)
        _original_register(model, hook, _dispatch)
        model._hyperacc_hook = hook
        self._models.append(hook)
        if hook.primary:
            self.world = hook.world
            self.rank = hook.group.rank()
            self._allocate(self.world)
            self.timing_ddp = True

    def _allocate(self, world: int) -> None:
        self.arrivals_ns = np.full(world, -1, np.int64)
        self.waits_ns = np.full(world, -1, np.int64)
        self._tmp = np.zeros(world, np.float64)
        self._scratch = np.zeros(world, np.float64)
        self._valid = np.zeros(world, bool)
        self._invalid = np.zeros(world, bool)

    # ------------------------------------------------------------------ the hook (autograd thread)

    def _run(self, hook: _ModelHook, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        t = perf_counter_ns()
        delay = 0 if self._open else self._start_round(t)
        k = self._n
        if k >= len(self._done_at):
            self._done_at.extend([-1] * len(self._done_at))
        while len(self._done_cbs) <= k:
            i = len(self._done_cbs)
            self._done_cbs.append(_Done(self, i, unwrap=True))
            self._done_cbs_raw.append(_Done(self, i, unwrap=False))
        self._done_at[k] = -1
        self._n = k + 1
        if delay:
            # A pacer that knows how to delay a launch (on CUDA: on the device) gets the launch inside
            # its context; otherwise the host sleeps (sleeping, not spinning: docs/pacing.md).
            delayed = getattr(self._pacer, "delayed", None)
            if delayed is not None:
                with delayed(delay, bucket.buffer().device):
                    return self._launch(hook, bucket, k)
            time.sleep(delay / 1e9)
        return self._launch(hook, bucket, k)

    def _launch(
        self, hook: _ModelHook, bucket: dist.GradBucket, k: int
    ) -> torch.futures.Future[torch.Tensor]:
        now = perf_counter_ns()
        if k == 0:
            self._first_launch = now
        self._last_launch = now
        dev = self.tracer._dev
        if dev is not None:
            self._last_mark = dev.mark()
        if hook.user_hook is not None:
            return hook.user_hook(hook.user_state, bucket).then(self._done_cbs_raw[k])
        buf = bucket.buffer()
        if (
            self.piggyback
            and hook.world > 1
            and bucket.is_last()
            and buf.dtype in (torch.float32, torch.float64)
        ):
            ext = self._extended(buf)
            # divide into our copy: buf stays intact should anything below fail (the plain path reruns)
            torch.div(buf, hook.world, out=self._ext_head)
            self._fill_slots(self._ext_tail)
            self._last_k = k
            fut = dist.all_reduce(ext, group=hook.group, async_op=True).get_future()
            return fut.then(self._done_last)
        buf.div_(hook.world)
        fut = dist.all_reduce(buf, group=hook.group, async_op=True).get_future()
        return fut.then(self._done_cbs[k])

    def _start_round(self, t: int) -> int:
        """Open a round; returns the pacing delay (ns) to apply before its first launch."""
        if self._n:
            self._close_round()
        self._open = True
        self.round += 1
        self._first_entry = t
        if self._recv_pending:
            self._poll_recv()
        dev = self.tracer._dev
        if dev is not None:
            dev.pair(SELF_NS, 0, dev.mark())
        delay = 0
        pacer = self._pacer
        if pacer is not None:
            try:
                delay = max(int(pacer.delay_before(self.round)), 0)
                state = getattr(pacer, "state", None)
                on = state.get("pace_on") if isinstance(state, dict) else None
                self._pace_on = int(bool(delay > 0 if on is None else on))
            except Exception as exc:  # noqa: BLE001
                self._pacer = None
                self._pace_on = -1
                delay = 0
                switch_off("pacing delay", exc)
        self._delay = delay
        return delay

    def _done_last(self, fut: torch.futures.Future) -> torch.Tensor:
        fut.value()  # a failed all-reduce (a peer died) raises here, as it would without us
        self._done_at[self._last_k] = perf_counter_ns()
        dev = self.tracer._dev
        if dev is not None:
            self._done_mark = dev.mark()
        try:
            self._receive(self._ext_tail)
        except Exception as exc:  # noqa: BLE001 - the gradients below are still returned
            self.piggyback = False
            switch_off("in-band exchange", exc)
        return self._ext_head

    def _extended(self, buf: torch.Tensor) -> torch.Tensor:
        n = buf.numel()
        ext = self._ext
        if ext is None or self._ext_n != n or ext.dtype != buf.dtype or ext.device != buf.device:
            ext = torch.empty(n + 2 * self.world, dtype=buf.dtype, device=buf.device)
            self._ext, self._ext_n = ext, n
            self._ext_head, self._ext_tail = ext[:n], ext[n:]  # views made once: slicing costs µs
            pinned = buf.device.type == "cuda"
            self._send = [torch.zeros(2 * self.world, dtype=buf.dtype, pin_memory=pinned) for _ in range(2)]
            self._send_np = [s.numpy() for s in self._send]
            self._recv = torch.zeros(2 * self.world, dtype=buf.dtype, pin_memory=pinned)
            self._recv_np = self._recv.numpy()
            self.lag = 2 if pinned else 1
            if pinned:
                self._recv_event = torch.cuda.Event()
        return ext

    def _fill_slots(self, slots: torch.Tensor) -> None:
        send = self._send[self.round & 1]
        values = self._send_np[self.round & 1]
        values.fill(0.0)
        w, r = self.world, self.rank
        arrival, wait = self._history(self.round - self.lag)
        values[r] = arrival / 1e6 if arrival >= 0 else math.nan
        values[w + r] = wait / 1e6 if wait >= 0 else math.nan
        slots.copy_(send, non_blocking=slots.is_cuda)

    def _history(self, rnd: int) -> tuple[int, int]:
        h = rnd % _HISTORY
        if rnd < 0 or self._hist_round[h] != rnd:
            return -1, -1
        if self.tracer._dev is None:
            return self._hist_arrival[h], self._hist_wait[h]
        # CUDA: device times of that round's step, once its row is resolved
        ring = self.tracer._ring
        row = self._hist_row[h]
        if row < 0 or row >= ring.ready:
            return -1, -1
        values = ring.buf[row % ring.capacity]
        self_ns, wait = int(values[SELF_NS]), int(values[COMM_WAIT_NS])
        delay = max(int(values[PACE_DELAY_NS]), 0)
        return (self_ns + delay if self_ns >= 0 else -1), wait

    def _receive(self, slots: torch.Tensor) -> None:
        recv = self._recv
        if slots.is_cuda:
            recv.copy_(slots, non_blocking=True)
            self._recv_event.record()
            self._recv_round = self.round - self.lag
            self._recv_pending = True
            return
        recv.copy_(slots)
        self._decode(self.round - self.lag)

    def _poll_recv(self) -> None:
        if self._recv_event is not None and self._recv_event.query():
            self._recv_pending = False
            self._decode(self._recv_round)

    def _decode(self, step: int) -> None:
        """Slots after the SUM -> culprit, spread and (for listeners) ns arrays; allocates no arrays."""
        w = self.world
        vals = self._recv_np
        if w <= _SMALL_WORLD:
            # a few dozen Python floats are cheaper than a dozen numpy calls
            lo, hi, culprit = math.inf, -math.inf, -1
            for r, v in enumerate(vals[w:].tolist()):
                if v >= 0.0:  # NaN compares False
                    if v < lo:
                        lo, culprit = v, r
                    if v > hi:
                        hi = v
            self._min_wait_rank = culprit
            self._spread = int(round((hi - lo) * 1e6)) if culprit >= 0 else -1
        else:
            scratch, invalid = self._scratch, self._invalid
            np.copyto(scratch, vals[w:])
            np.greater_equal(scratch, 0.0, out=self._valid)
            np.logical_not(self._valid, out=invalid)
            if self._valid.any():
                np.copyto(scratch, np.inf, where=invalid)
                self._min_wait_rank = int(scratch.argmin())
                lo = float(scratch[self._min_wait_rank])
                np.copyto(scratch, -np.inf, where=invalid)
                self._spread = int(round((float(scratch.max()) - lo) * 1e6))
            else:
                self._min_wait_rank = self._spread = -1
        if step < 0 or not self._listeners:
            return
        self._to_ns(vals[w:], self.waits_ns)
        self._to_ns(vals[:w], self.arrivals_ns)
        for fn in self._listeners:
            try:
                fn(step, self.arrivals_ns, self.waits_ns)
            except Exception as exc:  # noqa: BLE001
                self._listeners = [f for f in self._listeners if f is not fn]
                switch_off(f"in-band listener {getattr(fn, '__qualname__', fn)!s}", exc)

    def _to_ns(self, ms: np.ndarray, out: np.ndarray) -> None:
        tmp = self._tmp
        np.multiply(ms, 1e6, out=tmp)
        np.greater_equal(tmp, 0.0, out=self._valid)
        np.logical_not(self._valid, out=self._invalid)
        np.copyto(tmp, -1.0, where=self._invalid)
        np.rint(tmp, out=tmp)
        np.copyto(out, tmp, casting="unsafe")

    # ------------------------------------------------------------------ end of round / step

    def _close_round(self) -> None:
        """Final values of the round (all its futures have completed: DDP waited for them)."""
        if not self._open:
            return
        self._open = False
        n = self._n
        done = max(self._done_at[:n]) if n else -1
        self._n = 0
        wait = done - self._last_launch if done > 0 else -1
        arrival = self._first_launch - self._prev_done if self._prev_done > 0 else -1
        self._prev_done = done
        self._wait = wait
        h = self.round % _HISTORY
        self._hist_round[h] = self.round
        self._hist_arrival[h] = arrival
        self._hist_wait[h] = wait
        self._hist_row[h] = self.tracer._ring.head
        dev = self.tracer._dev
        if dev is not None:
            dev.pair(COMM_WAIT_NS, self._last_mark, self._done_mark)

    def take_step(self, row: list[int], t0: int) -> None:
        """Called by the tracer at the end of a step (training thread): fill the collective columns."""
        if not self._open or not self._n:
            return
        first = self._first_entry
        self._close_round()
        if first >= t0:
            row[SELF_NS] = first - t0
        row[COMM_WAIT_NS] = self._wait
        if self._pacer is not None:
            row[PACE_DELAY_NS] = self._delay
            row[PACE_ON] = self._pace_on
        row[MIN_WAIT_RANK] = self._min_wait_rank
        row[SPREAD_NS] = self._spread

    @property
    def last_launch_ns(self) -> int:
        """perf_counter_ns of the current round's latest bucket launch (-1 outside a round)."""
        return self._last_launch if self._open else -1

    def close(self) -> None:
        self._on = False

"""Pacing inside a training job: the controller fed by the in-band exchange, and the delay itself.

Two ways in (docs/pacing.md, "Runtime"):

- ``PacingHook`` plugs into the in-band exchange of the tracer (``hyperacc.trace.inband``): the exchange
  calls ``hook.observe(step, arrivals_ns, waits_ns)`` with every rank's values, learned in-band, and
  asks ``hook.delay_before(step)`` how long to hold this rank before launching the step's first gradient
  collective; the launch itself goes inside ``hook.delayed(delay_ns, device)``.
- ``paced(dist.all_reduce)`` wraps an explicit collective: it measures arrival and wait around the call
  and, when the tensor is a float32 SUM all-reduce, piggybacks every rank's values on the user's own
  tensor (no extra collective); otherwise it measures locally only.

How the delay is applied:

- CPU (gloo): the host sleeps (``time.sleep``). Sleeping, not spinning: on shared cores a spinning
  rank steals CPU from the slow ranks it is waiting for, which is the cost pacing exists to avoid.
- CUDA (NCCL): a host sleep would not delay the device, which runs behind the host. ``delayed`` makes a
  side stream wait for the current stream (so the gradients are ready), enqueues
  ``torch.cuda._sleep(cycles)`` on it, and makes the side stream current while the collective is
  launched. ProcessGroupNCCL makes its communication stream wait for the *current* stream, so the
  collective starts on the device ``delay`` after the gradients are ready, while the compute stream
  runs on (the rest of backward is not held back). ``_sleep`` spins one thread block; cycles per
  nanosecond are measured once per device with CUDA events on a stream of their own, read back
  without waiting (``_DeviceSleeper``).

Failure safety: any internal error logs one line and switches pacing off, on every rank alike
(``trace.failsafe.OffOnEveryRank``: the failing rank sets a key in the job's c10d store, every other rank
looks once a second and stops pacing at its next step); training continues with undelayed collectives.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from hyperacc.options import load, parse_json
from hyperacc.pacing.controller import PacingConfig, PacingController
from hyperacc.process import place
from hyperacc.trace.failsafe import OffOnEveryRank, one_line

log = logging.getLogger("hyperacc.pacing")

_SLOTS = 8  # observations buffered between the exchange's thread and the training thread
_FLOAT32_EXACT = float(1 << 24)  # integers below this survive a float32 sum exactly


class PacingHook:
    """Pacer and listener of the in-band exchange around one ``PacingController`` (per rank).

    The exchange may call ``observe`` from a communication thread while the training thread calls
    ``delay_before``: observations go through a small ring of preallocated slots guarded by sequence
    numbers (no lock the training thread could wait on), and the controller is only ever touched by
    the training thread, inside ``delay_before``.
    """

    def __init__(
        self,
        config: PacingConfig | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        self.config = config or PacingConfig()
        self.rank = place().rank if rank is None else rank
        self.world_size = world_size
        self.controller = PacingController(self.config, ranks=world_size)
        self.enabled = True
        self.last_delay_ns = 0
        self.last_step = -1
        self.delays_applied = 0
        self._seq = [0] * _SLOTS  # even: stable, odd: being written
        self._step = [0] * _SLOTS
        self._a: list[np.ndarray] | None = None
        self._w: list[np.ndarray] | None = None
        self._written = 0  # observations written so far
        self._consumed = 0
        self._sleeper: _DeviceSleeper | None = None
        PacingHook._instances += 1  # the same number on every rank: hooks are made in the same order
        self._everywhere = OffOnEveryRank(f"hyperacc/pacing/{PacingHook._instances}/off/", self.rank)
        if (world_size or place().world_size or 1) > 1:
            self._everywhere.watch(("pacing",))

    _instances = 0

    # ------------------------------------------------------------------ exchange side

    def attach(self, exchange: Any) -> PacingHook:
        """Register with an in-band exchange (``add_listener`` and ``set_pacer``)."""
        exchange.add_listener(self.observe)
        exchange.set_pacer(self)
        return self

    def observe(self, step: int, arrivals_ns: np.ndarray, waits_ns: np.ndarray | None) -> None:
        """Listener: every rank's arrival and wait of ``step``; queued for the training thread."""
        if not self.enabled:
            return
        try:
            a = np.asarray(arrivals_ns)
            if self._a is None:
                n = a.shape[0]
                if self.world_size is not None and n != self.world_size:
                    raise ValueError(f"{n} arrivals for a world of {self.world_size} ranks")
                self.world_size = n
                self._a = [np.zeros(n) for _ in range(_SLOTS)]
                self._w = [np.full(n, -1.0) for _ in range(_SLOTS)]
                self._scratch_a, self._scratch_w = np.zeros(n), np.zeros(n)
            i = self._written % _SLOTS
            self._seq[i] += 1  # odd: the reader skips this slot until it is even again
            self._a[i][:] = a
            if waits_ns is None:
                self._w[i].fill(-1.0)
            else:
                self._w[i][:] = waits_ns
            self._step[i] = int(step)
            self._seq[i] += 1
            self._written += 1
        except Exception as exc:  # noqa: BLE001 - never let pacing stop training
            self._switch_off(exc)

    def _drain(self) -> None:
        if self._a is None or self._w is None:
            return
        written = self._written
        start = max(self._consumed, written - _SLOTS)
        for k in range(start, written):
            i = k % _SLOTS
            seq = self._seq[i]
            if seq % 2:
                break  # still being written: take it next time
            step = self._step[i]
            a, w = self._scratch_a, self._scratch_w
            a[:] = self._a[i]
            w[:] = self._w[i]
            if self._seq[i] != seq:
                break  # overwritten while copied
            self.controller.observe(step, a, w)
            self._consumed = k + 1

    # ------------------------------------------------------------------ training-thread side

    def delay_before(self, step: int) -> int:
        """Nanoseconds to hold this rank before its first gradient collective of ``step``."""
        if not self.enabled:
            return 0
        if self._everywhere.elsewhere:
            for _, text in self._everywhere.take():
                self.enabled = False
                log.warning("hyperacc pacing is off: it failed on %s; training continues", text)
                return 0
        try:
            self._drain()
            if self.controller.ranks == 0:
                return 0
            delay = int(self.controller.plan(step)[self.rank])
        except Exception as exc:  # noqa: BLE001
            self._switch_off(exc)
            return 0
        self.last_delay_ns, self.last_step = delay, step
        if delay:
            self.delays_applied += 1
        return delay

    @contextlib.contextmanager
    def delayed(self, delay_ns: int, device: Any = None) -> Iterator[None]:
        """Launch a collective inside this block to start it ``delay_ns`` later (see module doc)."""
        if delay_ns <= 0 or not self.enabled:
            yield
            return
        if device is not None and getattr(device, "type", str(device).split(":")[0]) == "cuda":
            stack = contextlib.ExitStack()
            try:
                if self._sleeper is None:
                    self._sleeper = _DeviceSleeper()
                # entered here, inside the guard: the side stream, the calibration and the sleep run at
                # entry, and a failure there switches pacing off instead of reaching the collective's caller
                stack.enter_context(self._sleeper.delayed(delay_ns, device))
            except Exception as exc:  # noqa: BLE001
                self._switch_off(exc)
            with stack:
                yield
            return
        time.sleep(delay_ns / 1e9)
        yield

    def pace(self, step: int) -> None:
        """Host-side delay of ``step`` in one call (CPU jobs): ``delay_before`` then sleep."""
        delay = self.delay_before(step)
        if delay > 0:
            time.sleep(delay / 1e9)

    # ------------------------------------------------------------------ reporting

    @property
    def state(self) -> dict[str, Any]:
        """This rank's pacing columns for the tracer: pace_on, pace_delay_ns, spread_ns."""
        st = self.controller.state
        return {
            "pace_on": st.on and self.enabled,
            "pace_delay_ns": self.last_delay_ns,
            "spread_ns": int(st.spread_ns),
        }

    def _switch_off(self, exc: BaseException) -> None:
        if self.enabled:
            self.enabled = False
            log.warning("hyperacc pacing failed (%s); pacing is off, training continues", one_line(exc))
            self._everywhere.publish("pacing", exc)


class _DeviceSleeper:
    """Device-side delay of a collective launch with ``torch.cuda._sleep`` on a side stream.

    ``_sleep`` counts SM clock cycles, so a delay in nanoseconds needs the cycles per nanosecond. They are
    measured once per device, at first use, by a timed ``_sleep`` on a stream of its own and read back
    with ``query()`` at a later call: the host never waits for the device. Until then ``GUESS`` is used
    (1.5 cycles/ns, a 1.5 GHz SM clock; an H200 boosts to 1.98 GHz, so a delay is at most a third off
    for the first few calls).
    """

    CALIBRATION_CYCLES = 2_000_000  # about 1 ms at a boosted clock
    GUESS = 1.5

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.streams: dict[int, Any] = {}
        self.cycles_per_ns: dict[int, float] = {}
        self._calibrating: dict[int, tuple[Any, Any, Any]] = {}

    def _start_calibration(self, index: int) -> None:
        torch = self.torch
        stream = torch.cuda.Stream(device=index)  # its own stream: it waits for no queued training work
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(index), torch.cuda.stream(stream):
            torch.cuda._sleep(1000)  # the kernel loaded before the timed one
            start.record(stream)
            torch.cuda._sleep(self.CALIBRATION_CYCLES)
            end.record(stream)
        self._calibrating[index] = (start, end, stream)  # the stream is kept alive until read

    def rate(self, index: int) -> float:
        """Cycles per nanosecond of device ``index``: measured once its calibration finished, else GUESS."""
        pending = self._calibrating.get(index)
        if pending is not None and pending[1].query():
            ms = pending[0].elapsed_time(pending[1])
            if ms > 0:
                self.cycles_per_ns[index] = self.CALIBRATION_CYCLES / (ms * 1e6)
            del self._calibrating[index]
        return self.cycles_per_ns.get(index, self.GUESS)

    @contextlib.contextmanager
    def delayed(self, delay_ns: int, device: Any) -> Iterator[None]:
        torch = self.torch
        index = torch.device(device).index
        index = torch.cuda.current_device() if index is None else index
        if index not in self.streams:
            self._start_calibration(index)
            self.streams[index] = torch.cuda.Stream(device=index)
        side = self.streams[index]
        current = torch.cuda.current_stream(index)
        side.wait_stream(current)  # the gradients must be ready before the delay starts
        with torch.cuda.stream(side):
            torch.cuda._sleep(int(delay_ns * self.rate(index)))
            yield  # ProcessGroupNCCL's stream waits for `side`, the current stream here
        # the caller waits on the collective's future/work as usual; compute stayed on `current`


# ---------------------------------------------------------------------- explicitly wrapped collectives


class PacedCollective:
    """``paced(dist.all_reduce)``: arrival/wait measured, the delay applied, values shared in-band.

    Call it exactly as the wrapped function: ``(tensor, op=ReduceOp.SUM, group=None, async_op=False)``.
    Arrival = time since this wrapper's previous call returned (the previous collective's exit), with
    the delay; wait = time inside the call. For a synchronous float32 SUM on CPU, three values per
    rank (step, arrival, wait of the previous call, in microseconds) ride in a buffer holding the
    user's tensor followed by ``3 x world`` slots, so every rank learns every rank's values and the
    controller paces the next calls. Any other call (other dtype or op, async, CUDA) is paced from
    what was learned before and measured locally only (``local_arrival_ns``, ``local_wait_ns``).

    The buffer is allocated once per tensor size. The reduced values are the user's, but the longer
    buffer can change how the backend splits the reduction (gloo's ring with more than two ranks), so
    the sum may differ from an unwrapped call in the last bits; it is the same with pacing on or off.
    """

    def __init__(self, fn: Callable[..., Any], hook: PacingHook | None = None, group: Any = None) -> None:
        self.fn = fn
        self.hook = hook or PacingHook()
        self.group = group
        self.calls = 0
        self.local_arrival_ns = -1
        self.local_wait_ns = -1
        self._prev_exit = -1
        self._buffers: dict[tuple[int, Any], Any] = {}
        self._world = -1
        self._rank = 0
        self._pending_arrivals: np.ndarray | None = None
        self._waits: np.ndarray | None = None
        self._pending_step = -1

    def _world_rank(self, group: Any) -> tuple[int, int]:
        import torch.distributed as dist

        return dist.get_world_size(group), dist.get_rank(group)

    def __call__(self, tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
        import torch
        import torch.distributed as dist

        op = dist.ReduceOp.SUM if op is None else op
        group = self.group if group is None else group
        step = self.calls
        self.calls += 1
        hook = self.hook
        t_ready = time.perf_counter_ns()
        delay = hook.delay_before(step)
        piggyback = (
            hook.enabled
            and not async_op
            and tensor.dtype == torch.float32
            and tensor.device.type == "cpu"
            and tensor.is_contiguous()
            and op == dist.ReduceOp.SUM
        )
        with hook.delayed(delay, tensor.device):
            t_launch = time.perf_counter_ns() if delay else t_ready
            arrival = t_launch - self._prev_exit if self._prev_exit >= 0 else -1
            if not piggyback:
                out = self.fn(tensor, op=op, group=group, async_op=async_op)
            else:
                out = self._piggyback(tensor, op, group, step, arrival)
        t_exit = time.perf_counter_ns()
        self.local_arrival_ns = arrival
        self.local_wait_ns = t_exit - t_launch if not async_op else -1
        self._prev_exit = t_exit
        return out

    def _piggyback(self, tensor: Any, op: Any, group: Any, step: int, arrival: int) -> Any:
        import torch

        if self._world < 0:
            self._world, self._rank = self._world_rank(group)
        world, rank = self._world, self._rank
        n = tensor.numel()
        key = (n, tensor.device)
        buf = self._buffers.get(key)
        if buf is None:
            buf = torch.empty(n + 3 * world, dtype=torch.float32, device=tensor.device)
            self._buffers[key] = buf
        buf[:n].copy_(tensor.view(-1))
        extra = buf[n:]
        extra.zero_()
        # this call's arrival, the previous call's wait (its exit was only known after it returned)
        base = 3 * rank
        extra[base] = float(step % (1 << 24))
        extra[base + 1] = _to_us(arrival)
        extra[base + 2] = _to_us(self.local_wait_ns if step > 0 else -1)
        out = self.fn(buf, op=op, group=group, async_op=False)
        tensor.view(-1).copy_(buf[:n])
        values = extra.numpy().reshape(world, 3)
        self._learn(step, values)
        return out

    def _learn(self, step: int, values: np.ndarray) -> None:
        """Call k brings arrivals of k and waits of k-1: observe step k-1 once both are known."""
        if self._pending_arrivals is None:
            world = values.shape[0]
            self._pending_arrivals, self._waits = np.full(world, -1.0), np.full(world, -1.0)
        # microseconds to ns; a missing value (-1 us) stays negative, which the controller skips
        np.multiply(values[:, 2], 1e3, out=self._waits)
        if self._pending_step == step - 1:
            self.hook.observe(step - 1, self._pending_arrivals, self._waits)
        np.multiply(values[:, 1], 1e3, out=self._pending_arrivals)
        self._pending_step = step


def paced(fn: Callable[..., Any], hook: PacingHook | None = None, group: Any = None) -> PacedCollective:
    """Wrap a collective (``dist.all_reduce``) with pacing: ``paced(dist.all_reduce)(tensor)``."""
    return PacedCollective(fn, hook, group)


def _to_us(ns: int | float) -> float:
    if ns < 0:
        return -1.0
    return float(min(ns / 1e3, _FLOAT32_EXACT - 1))


ENV = "HYPERACC_PACE"


def config_from_json(text: str) -> PacingConfig:
    """``HYPERACC_PACE``: ``1`` for the defaults, or a JSON object of ``PacingConfig`` fields."""
    text = text.strip()
    if text in ("1", "true", "on", ""):
        return PacingConfig()
    return load(PacingConfig, parse_json(text, ENV, '{"gain": 0.5}, or 1 for the defaults'), "pacing")

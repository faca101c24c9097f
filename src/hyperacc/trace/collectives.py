"""Time the training thread spends blocked in the script's own collectives (FSDP, HF's gathers, barriers).

In automatic mode the public ``torch.distributed`` collectives are wrapped at the module edge (the
``torch.distributed`` attributes; torch's own internal calls are left alone), and so is
``Work.wait``. What counts as *wait* is the time the training thread could not go on:

- a synchronous call (``async_op`` false, given by keyword or position): its whole duration;
- an asynchronous one: nothing at launch; the time spent in ``Work.wait()`` when the script (or FSDP)
  waits for it;
- calls on other threads (a prefetch thread, a checkpoint writer) are not the step's wait and are left
  alone; so are calls nested inside a timed one (``all_gather_object`` calling ``all_gather``).

DDP's gradient all-reduce is timed apart (``hyperacc.trace.ddp_wait``, or the communication hook of
``hyperacc.trace.inband``, which calls torch's unwrapped function), so nothing is counted twice. Nothing is added to the communication.
docs/tracing.md, "Collectives".
"""

from __future__ import annotations

import functools
import inspect
import threading
from time import perf_counter_ns
from typing import Any

from hyperacc.trace.failsafe import switch_off
from hyperacc.trace.step_clock import COMM, StepClock

# Blocking calls without an ``async_op`` parameter.
_BLOCKING = ("monitored_barrier", "all_gather_object", "broadcast_object_list", "gather_object",
             "scatter_object_list", "send", "recv")  # fmt: skip


def _collectives() -> dict[str, int]:
    """Public ``torch.distributed`` collectives -> position of their ``async_op`` argument (-1: none)."""
    import torch.distributed as dist

    out: dict[str, int] = {}
    for name in dir(dist):
        if name.startswith("_"):
            continue
        fn = getattr(dist, name, None)
        if not callable(fn) or isinstance(fn, type):
            continue
        try:
            params = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            continue
        if "async_op" in params:
            out[name] = params.index("async_op")
        elif name in _BLOCKING:
            out[name] = -1
    return out


class CollectiveClock:
    """Wraps the collectives and ``Work.wait`` to charge blocked time to the step clock."""

    def __init__(self, clock: StepClock, thread_id: int) -> None:
        self.clock = clock
        self.thread_id = thread_id
        self.on = True
        self._originals: dict[str, Any] = {}
        self._wait: Any = None
        self._compiling: Any = lambda: False

    def install(self) -> None:
        import torch.distributed as dist
        from torch.compiler import is_compiling

        self._compiling = is_compiling  # a collective traced by torch.compile is left to it

        for name, pos in _collectives().items():
            if name in self._originals:
                continue
            orig = getattr(dist, name)
            self._originals[name] = orig
            setattr(dist, name, self._wrap(orig, pos))
        work = getattr(dist, "Work", None)
        if work is not None and self._wait is None:
            self._wait = work.wait
            clock = self

            def wait(w: Any, *args: Any, **kwargs: Any) -> Any:
                return clock._timed(clock._wait, (w, *args), kwargs)

            wait.__doc__ = getattr(self._wait, "__doc__", None)
            try:
                work.wait = wait
            except (TypeError, AttributeError) as exc:
                self._wait = None
                switch_off("timing of Work.wait", exc)

    def close(self) -> None:
        import torch.distributed as dist

        for name, orig in self._originals.items():
            setattr(dist, name, orig)
        self._originals.clear()
        if self._wait is not None:
            try:
                dist.Work.wait = self._wait
            except (TypeError, AttributeError):
                pass
            self._wait = None

    def _wrap(self, orig: Any, pos: int) -> Any:
        clock = self

        @functools.wraps(orig)
        def collective(*args: Any, **kwargs: Any) -> Any:
            if "async_op" in kwargs:
                if kwargs["async_op"]:
                    return orig(*args, **kwargs)
            elif 0 <= pos < len(args) and args[pos]:
                return orig(*args, **kwargs)
            return clock._timed(orig, args, kwargs)

        return collective

    def _timed(self, fn: Any, args: Any, kwargs: Any) -> Any:
        clock = self.clock
        if self._compiling() or not self.on or threading.get_ident() != self.thread_id or clock.comm_open:
            return fn(*args, **kwargs)
        try:
            clock.enter(COMM, perf_counter_ns())
        except Exception as exc:  # noqa: BLE001 - timing never stands between the script and its collective
            self.on = False
            switch_off("timing of collectives", exc)
            return fn(*args, **kwargs)
        try:
            return fn(*args, **kwargs)
        finally:
            clock.exit(COMM, perf_counter_ns())

"""Timing of a script's own collectives when DDP is not used (FSDP, hand-written all-reduce).

In automatic mode the public ``torch.distributed`` collectives are wrapped at the module edge: a
wrapped call records its entry (the step's arrival is the first entry) and the time until it returns
(synchronous) or until its work completes (``async_op=True``, through the work's future). Nothing is
added to the communication: no extra collective, no synchronisation. When a DDP model's gradient
collectives are timed through its communication hook, these wrappers step aside.
docs/tracing.md, "Collectives without DDP".
"""

from __future__ import annotations

import functools
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

from hyperacc.trace.columns import COMM_WAIT_NS, SELF_NS
from hyperacc.trace.failsafe import switch_off

if TYPE_CHECKING:
    from hyperacc.trace.tracer import Tracer

WRAPPED = (
    "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather", "reduce_scatter",
    "broadcast", "reduce", "all_to_all_single", "all_to_all",
)  # fmt: skip


class ExplicitCollectives:
    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self.first_entry = -1
        self.inside_ns = 0
        self.count = 0
        self._originals: dict[str, Any] = {}
        self._on = True

    def install(self) -> None:
        import torch.distributed as dist

        for name in WRAPPED:
            orig = getattr(dist, name, None)
            if orig is None or name in self._originals:
                continue
            self._originals[name] = orig
            setattr(dist, name, self._wrap(orig))

    def close(self) -> None:
        if not self._originals:
            return
        import torch.distributed as dist

        for name, orig in self._originals.items():
            setattr(dist, name, orig)
        self._originals.clear()

    def _wrap(self, orig: Any) -> Any:
        clock = self

        @functools.wraps(orig)
        def collective(*args: Any, **kwargs: Any) -> Any:
            tracer = clock.tracer
            if not clock._on or not tracer._open or tracer.inband.timing_ddp:
                return orig(*args, **kwargs)
            t0 = perf_counter_ns()
            if clock.first_entry < 0:
                clock.first_entry = t0
            work = orig(*args, **kwargs)
            try:
                if work is None or not kwargs.get("async_op", False):
                    clock.inside_ns += perf_counter_ns() - t0
                    clock.count += 1
                else:
                    work.get_future().then(functools.partial(clock._async_done, t0))
            except Exception as exc:  # noqa: BLE001 - e.g. a backend without futures for this op
                clock._on = False
                switch_off("timing of explicit collectives", exc)
            return work

        return collective

    def _async_done(self, t0: int, fut: Any) -> None:
        self.inside_ns += perf_counter_ns() - t0
        self.count += 1

    def take_step(self, row: list[int], t0: int) -> None:
        """Write the step's arrival (self-time) and time inside collectives; reset for the next step."""
        if self.count and row[SELF_NS] < 0:
            row[SELF_NS] = max(self.first_entry - t0, 0)
            row[COMM_WAIT_NS] = self.inside_ns
        self.first_entry = -1
        self.inside_ns = 0
        self.count = 0

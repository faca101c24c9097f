"""DDP's gradient all-reduce timed without a communication hook: DDP keeps its built-in C++ all-reduce.

When nothing rides along in-band (no exchange, no pacer: ``inband.Exchange`` decides), the tracer needs
only the rank's exposed wait at the gradient collectives, and that is visible from autograd alone:

1. at each forward with grad enabled, ``arm`` notes whether it prepares a synchronised backward
   (``require_backward_grad_sync``: what DDP itself checks; ``no_sync()`` and the accumulation flag of
   nanoGPT-style loops turn it off). A forward pre-hook on the DDP module calls it until automatic
   tracing wraps the module's ``forward`` and calls it from there, removing the hook (``pre_hook``);
2. during that backward, a post-accumulate-grad hook on one of two parameters (the first and the last that
   require grad) queues an autograd *final callback*. A parameter's post-accumulate-grad hook runs
   before the node's post hooks, where DDP's reducer marks the parameter ready, so this callback is
   queued before the one in which DDP waits for its buckets (``finalize_backward``);
3. final callbacks run in order once the graph is done: ours stamps ``graph_done`` (every gradient
   computed, every bucket launched) and queues a second one, which runs after DDP's and stamps
   ``reduced`` (every bucket reduced and its values in ``.grad``).

wait = reduced - graph_done: the interval DDP's own runtime statistics call backward communication. On
CPU (gloo) it includes DDP's copy of the reduced buckets into ``.grad`` (unless
``gradient_as_bucket_view``): about 5 ms for 21 MB on this machine, the same on every rank. On CUDA the
host returns from the wait at once; the device events recorded in the two callbacks (``device.mark``, on
the current stream) give the wait on the device.

Per synchronised backward: one ``arm``, at most two parameter hooks and two callbacks, no
allocation and no lock. Every hook and callback catches its own errors: a failure switches the timing off
with one log line and never reaches the backward. docs/tracing.md, "Gradient collectives".
"""

from __future__ import annotations

from time import perf_counter_ns
from typing import Any

import torch
from torch.autograd import Variable
from torch.compiler import is_compiling

from hyperacc.trace.failsafe import switch_off

# hyperacc.trace.device.DDP_COMM (not imported: device.py imports torch.cuda lazily); inband.py uses it too
DDP_COMM = 7


class DDPWait:
    """The exposed wait of one DDP model's gradient all-reduce, per synchronised backward (a *round*).

    Every field is written on the thread that runs the backward's final callbacks (the training thread on
    CPU) or on the training thread between backwards; the training thread reads them in ``collect`` after
    the backward returned, so no lock is needed.
    """

    inband = None  # never exchanges (``Exchange.exchanging``)

    def __init__(self, model: Any, *, device: Any = None, waits: Any = None) -> None:
        self.model = model
        self.device = device  # DeviceTimer (CUDA) or None
        # StepSignals: told where each wait begins and ends (its run-queue delay), or None
        self.waits = waits
        self.on = True
        self.armed = False  # the last forward with grad prepared a synchronised backward
        self.queued = False
        self._graph_done = -1
        self._ev_graph = -1
        self._launch_acc = 0
        self._done_acc = 0
        self._rounds_acc = 0
        # Bound once: the hooks run every backward and must not allocate.
        self._after_graph_cb = self._after_graph
        self._after_reduce_cb = self._after_reduce
        # Removed by automatic tracing once it wraps this module's forward (``arm`` from there): any
        # module hook sends every call of the module down torch's slower hooked path.
        self.pre_hook: Any = model.register_forward_pre_hook(self._forward_pre)
        params = [p for p in model.module.parameters() if p.requires_grad]
        for p in {id(p): p for p in (params[:1] + params[-1:])}.values():
            p.register_post_accumulate_grad_hook(self._grad_ready)

    # ------------------------------------------------------------------ hooks and callbacks

    def _forward_pre(self, module: Any, args: Any) -> None:
        if is_compiling():  # traced by torch.compile: nothing of this belongs in the user's graph
            return
        if torch.is_grad_enabled():
            self.arm()

    def arm(self) -> None:
        """A training forward of the model (grad enabled) begins: note whether it prepares a synchronised
        backward. Called by the forward pre-hook, or by automatic tracing's forward wrapper."""
        try:
            if self.on:
                self.armed = bool(self.model.require_backward_grad_sync)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def _grad_ready(self, param: Any) -> None:
        if is_compiling() or not (self.armed and self.on) or self.queued:
            return
        try:
            self.queued = True
            Variable._execution_engine.queue_callback(self._after_graph_cb)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def _after_graph(self) -> None:
        try:
            self.queued = False
            self.armed = False
            if not self.on:
                return
            self._graph_done = perf_counter_ns()
            self._ev_graph = self.device.mark() if self.device is not None else -1
            if self.waits is not None:
                self.waits.wait_begins()
            Variable._execution_engine.queue_callback(self._after_reduce_cb)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def _after_reduce(self) -> None:
        try:
            t = perf_counter_ns()
            start, self._graph_done = self._graph_done, -1
            if not self.on or start < 0:
                return
            if self.waits is not None:
                self.waits.wait_ends()
            if start > self._launch_acc:
                self._launch_acc = start
            if t > self._done_acc:
                self._done_acc = t
            self._rounds_acc += 1
            if self.device is not None and self._ev_graph >= 0:
                self.device.pair(DDP_COMM, self._ev_graph, self.device.mark())
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        self.on = False
        switch_off("gradient collective timing", exc)

    # ------------------------------------------------------------------ the step clock's side

    def collect(self) -> tuple[int, int, int, int]:
        """(latest graph-done, latest reduced, pacing delay -1, rounds) of the rounds finished since the
        last call (``step_clock.WaitSource``)."""
        out = (self._launch_acc, self._done_acc, -1, self._rounds_acc)
        self._launch_acc = self._done_acc = self._rounds_acc = 0
        return out

    def fill(self, row: list[int]) -> None:
        """Nothing is exchanged: the exchange's columns stay unmeasured."""

    def close(self) -> None:
        """Stop timing. The hooks stay (each returns at its first test): ``close`` may run in a signal
        handler on the training thread, in the middle of a backward that is iterating over them."""
        self.on = False

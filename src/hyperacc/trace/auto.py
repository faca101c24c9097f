"""Zero-code tracing of a script that was not written for hyperacc (docs/tracing.md, "Automatic mode").

Where each measurement comes from:

- step boundaries: the global optimizer step hooks; the boundary is the end of ``step()`` of the first
  optimizer that steps (other optimizers of the job are timed into the same step);
- data wait: ``DataLoader`` iterators, by wrapping ``_BaseDataLoaderIter.__next__`` at the edge;
- forward: the outermost modules only. Global module hooks find the modules called at depth 0 with
  gradients enabled during the first step (the model, a loss module); they are then replaced by
  hooks on those modules alone, so a deep model costs two hook calls per forward, not two per module;
- backward: from the end of the last forward to the launch of the last gradient bucket (DDP), to the
  first explicit collective, or to the optimizer;
- gradient collectives: a DDP communication hook attached right after each DDP model is built
  (``hyperacc.trace.inband``), composing with any hook the script registers later; without DDP, the
  script's own ``torch.distributed`` collectives are timed (``hyperacc.trace.collectives``).

Every hook body is guarded: an exception switches automatic tracing off with one log line and the
script runs on untouched.
"""

from __future__ import annotations

import functools
from time import perf_counter_ns
from typing import Any

import torch

from hyperacc.trace.columns import BACKWARD_NS, DATA_NS, FORWARD_NS, OPTIMIZER_NS, STEP
from hyperacc.trace.failsafe import switch_off
from hyperacc.trace.tracer import Tracer

_MAX_OUTERMOST = 8
_MAX_REDETECTIONS = 3


class AutoTrace:
    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self._handles: list[Any] = []
        self._module_handles: list[Any] = []
        self._outermost: list[torch.nn.Module] = []
        self._detecting = True
        self._depth = 0
        self._fwd_t0 = 0
        self._fwd_end = 0
        self._opt_t0 = 0
        self._optimizer: int | None = None
        self._other: int | None = None
        self._others = 0
        self._hooked = 0
        self._redetections = 0
        self._opt_depth = 0
        self._orig_next: Any = None
        self._orig_ddp_init: Any = None
        self._installed = False
        self._step_callbacks: list[Any] = []

    def add_step_callback(self, fn: Any) -> None:
        """``fn(step)`` on the training thread right after each step boundary (e.g. stabilizers)."""
        self._step_callbacks.append(fn)

    # ------------------------------------------------------------------ install / uninstall

    def install(self) -> AutoTrace:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        from torch.utils.data import dataloader

        if self._installed:
            return self
        self._installed = True
        self._handles = [
            register_optimizer_step_pre_hook(self._opt_pre),
            register_optimizer_step_post_hook(self._opt_post),
        ]
        self._depth = 0
        if self._detecting:
            self._handles += [
                register_module_forward_pre_hook(self._global_pre),
                register_module_forward_hook(self._global_post, always_call=True),
            ]
        else:  # installed again after an uninstall: the outermost modules are known
            self._hook_outermost()
        orig_next = dataloader._BaseDataLoaderIter.__next__
        self._orig_next = orig_next
        auto = self

        def __next__(it: Any) -> Any:
            t0 = perf_counter_ns()
            try:
                return orig_next(it)
            finally:
                auto._on_data(t0)

        dataloader._BaseDataLoaderIter.__next__ = __next__

        orig_init = DDP.__init__
        self._orig_ddp_init = orig_init

        def __init__(ddp: Any, *args: Any, **kwargs: Any) -> None:
            orig_init(ddp, *args, **kwargs)
            auto._attach(ddp)

        __init__.__wrapped__ = orig_init  # type: ignore[attr-defined]
        DDP.__init__ = __init__
        self.tracer.explicit.install()
        return self

    def uninstall(self) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torch.utils.data import dataloader

        if not self._installed:
            return
        self._installed = False
        for h in self._handles + self._module_handles:
            h.remove()
        self._handles, self._module_handles = [], []
        self._hooked = 0
        if self._orig_next is not None:
            dataloader._BaseDataLoaderIter.__next__ = self._orig_next
        if self._orig_ddp_init is not None:
            DDP.__init__ = self._orig_ddp_init
        self.tracer.explicit.close()

    def close(self) -> None:
        """Remove the hooks and flush the tracer."""
        self.uninstall()
        self.tracer.close()

    def _fail(self, exc: BaseException) -> None:
        try:
            self.uninstall()
        finally:
            switch_off("automatic tracing hooks", exc)

    # ------------------------------------------------------------------ hooks

    def _attach(self, ddp: Any) -> None:
        try:
            self.tracer.attach_ddp(ddp)
        except Exception as exc:  # noqa: BLE001
            switch_off("gradient collective timing", exc)

    def _ensure_step(self) -> None:
        if not self.tracer._open:
            self.tracer.begin_step()

    def _on_data(self, t0: int) -> None:
        try:
            t1 = perf_counter_ns()
            tr = self.tracer
            if not tr._open:
                tr.begin_step()
                return  # the step starts after this fetch's first part; the rest is not attributable
            row = tr._row
            v = row[DATA_NS]
            row[DATA_NS] = t1 - t0 if v < 0 else v + t1 - t0
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def _global_pre(self, module: torch.nn.Module, args: Any) -> None:
        if self._depth == 0 and self._detecting and torch.is_grad_enabled():
            outer = self._outermost
            if len(outer) < _MAX_OUTERMOST and not any(m is module for m in outer):
                outer.append(module)
        self._pre(module, args)

    def _global_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._post(module, args, output)

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        if self._depth == 0:
            if not self.tracer._open:
                self.tracer.begin_step()
            self._fwd_t0 = perf_counter_ns()
        self._depth += 1

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            t1 = perf_counter_ns()
            if not torch.is_grad_enabled():
                return  # evaluation forwards are part of the step but not its training forward
            tr = self.tracer
            if tr._open:
                row = tr._row
                v = row[FORWARD_NS]
                d = t1 - self._fwd_t0
                row[FORWARD_NS] = d if v < 0 else v + d
                self._fwd_end = t1
        elif self._depth < 0:
            self._depth = 0

    def _opt_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        try:
            if self._optimizer is None:
                self._optimizer = id(optimizer)
            t = perf_counter_ns()
            self._ensure_step()
            tr = self.tracer
            if self._opt_depth == 0:
                self._opt_t0 = t
                fe = self._fwd_end
                if fe > 0:
                    end = t
                    launch = tr.inband.last_launch_ns
                    if launch > fe:
                        end = launch
                    elif tr.explicit.first_entry > fe:
                        end = tr.explicit.first_entry
                    row = tr._row
                    v = row[BACKWARD_NS]
                    row[BACKWARD_NS] = end - fe if v < 0 else v + end - fe
                    self._fwd_end = 0
            self._opt_depth += 1
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def _opt_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        try:
            t = perf_counter_ns()
            self._opt_depth = max(self._opt_depth - 1, 0)
            tr = self.tracer
            if self._opt_depth == 0 and tr._open:
                row = tr._row
                v = row[OPTIMIZER_NS]
                d = t - self._opt_t0
                row[OPTIMIZER_NS] = d if v < 0 else v + d
            if id(optimizer) != self._optimizer:
                # A second optimizer stepping twice with no step of the first one in between: the first
                # was replaced (a new training stage), so this one marks the steps from now on.
                self._others = self._others + 1 if self._other == id(optimizer) else 1
                self._other = id(optimizer)
                if self._others < 2:
                    return
                self._optimizer = id(optimizer)
            self._other, self._others = None, 0
            row = tr._row
            finished = row[STEP]
            no_forward = tr._open and row[FORWARD_NS] < 0
            tr.end_step()
            if self._detecting:
                self._finish_detection()
            elif no_forward and self._redetections < _MAX_REDETECTIONS:
                self._restart_detection()  # a model built later (a new stage) has not been seen yet
            for fn in self._step_callbacks:
                try:
                    fn(finished)
                except Exception as exc:  # noqa: BLE001
                    self._step_callbacks = [f for f in self._step_callbacks if f is not fn]
                    switch_off(f"step callback {getattr(fn, '__qualname__', fn)!s}", exc)
            tr.begin_step()
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def _restart_detection(self) -> None:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self._redetections += 1
        self._detecting = True
        self._depth = 0
        self._handles += [
            register_module_forward_pre_hook(self._global_pre),
            register_module_forward_hook(self._global_post, always_call=True),
        ]

    def _finish_detection(self) -> None:
        """After the first step: hook only the outermost modules, drop the global module hooks."""
        self._detecting = False
        for h in self._handles[2:]:
            h.remove()
        del self._handles[2:]
        self._hook_outermost()
        self._depth = 0

    def _hook_outermost(self) -> None:
        for module in self._outermost[self._hooked :]:
            if "forward" in vars(module) or type(module).__name__ == "OptimizedModule":
                # forward already replaced on the instance, or a compiled module: leave it, use hooks
                self._module_handles.append(module.register_forward_pre_hook(self._pre))
                self._module_handles.append(module.register_forward_hook(self._post, always_call=True))
            else:
                # Any module hook sends every call of the module down torch's slow path (~5 us here);
                # wrapping the instance's forward keeps the fast path and costs one Python frame.
                self._module_handles.append(_ForwardWrapper(self, module))
        self._hooked = len(self._outermost)


class _ForwardWrapper:
    """Times ``module.forward`` through an instance attribute; ``remove()`` restores the class method."""

    def __init__(self, auto: AutoTrace, module: torch.nn.Module) -> None:
        self.module = module
        original = module.forward
        pre, post = auto._pre, auto._post

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            pre(module, args)
            try:
                return original(*args, **kwargs)
            finally:
                post(module, args, None)

        self.forward = forward
        module.forward = forward

    def remove(self) -> None:
        if vars(self.module).get("forward") is self.forward:
            del self.module.forward


_installed: AutoTrace | None = None


def install(tracer: Tracer) -> AutoTrace:
    """Install automatic tracing once per process (a second call returns the first one)."""
    global _installed
    if _installed is None or not _installed._installed:
        _installed = AutoTrace(tracer).install()
    return _installed


def installed() -> AutoTrace | None:
    return _installed if _installed is not None and _installed._installed else None

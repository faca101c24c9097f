"""Zero-code tracing of a script that was not written for hyperacc (docs/tracing.md, "Automatic mode").

Where each measurement comes from (every one on the training thread only, the thread that started
tracing; calls on other threads are left alone):

- step boundaries: the end of ``step()`` of the first optimizer that steps (global optimizer hooks),
  or the end of ``GradScaler.step`` when it skipped the optimizer (inf/NaN gradients), so a skipped
  update never merges two iterations; a boundary inside an open phase takes effect when it closes;
  an update those hooks cannot see (compiled, or written by hand) ends the step at the next training
  forward, when a watched parameter changed with no optimizer step seen (``_unseen_update``);
- data: ``DataLoader`` iterators' ``__next__`` and ``DataLoader.__iter__`` (where an iterator made
  again each epoch starts its workers), wrapped at the class edge; without any fetch in a step, the
  input gap (see ``step_clock``);
- forward: the outermost modules only. Global module hooks find the modules called at depth 0 during
  the first step (the model, a loss module); they are then replaced by a wrapper on those modules'
  ``forward`` alone, so a deep model costs one wrapper call per forward, not two hooks per module.
  A forward without gradients is evaluation: part of the rest of the step, never input. Under
  ``torch.compile`` the global hooks leave before the first compiled code runs (a compiled module
  under an outermost one, or the start of any compilation): TorchDynamo guards on their number, so
  removing them later would recompile every compiled frame once, and ``OptimizedModule`` warns about
  them (that one warning is filtered while they exist);
- backward: the time inside ``torch.autograd.backward`` (``loss.backward()``, accelerate's and
  Lightning's backward go through it), each micro-step's, less the collective wait inside it;
- optimizer: ``step()`` of the optimizers (pre/post hooks) and ``GradScaler.step``;
- gradient collectives: each DDP model is attached right after it is built (``hyperacc.trace.inband``):
  timed from autograd's final callbacks with DDP's built-in all-reduce left in place
  (``hyperacc.trace.ddp_wait``), or through a communication hook when the in-band exchange or pacing
  needs one, composing with any hook the script registers later; the script's own
  ``torch.distributed`` collectives and ``Work.wait`` (``hyperacc.trace.collectives``).

Every hook body is guarded: an exception switches automatic tracing off with one log line and the
script runs on untouched.

Why this module is over 500 lines: every hook of automatic tracing is here, because they share one
state (the module depth, the open forward, the outermost modules, the watched parameter, whether
detection still runs) that no other module reads; the detection that must end before compiled code
runs (``_end_detection_now``) changes that same state inside a forward.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings
from collections.abc import Iterator
from threading import get_ident
from time import perf_counter_ns
from typing import Any

import torch
from torch.compiler import is_compiling

from hyperacc.trace.ddp_wait import DDPWait
from hyperacc.trace.failsafe import switch_off
from hyperacc.trace.step_clock import BACKWARD, COMM, DATA, EVAL, FORWARD, OPTIMIZER
from hyperacc.trace.tracer import Tracer

_MAX_OUTERMOST = 8
_MAX_REDETECTIONS = 3
# OptimizedModule.__call__ warns whenever any global module hook exists; ours are there for one step.
_COMPILE_HOOK_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks on modules"


class AutoTrace:
    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self.clock = tracer.clock
        self.thread_id = tracer.thread_id
        self._handles: list[Any] = []
        self._module_handles: list[Any] = []
        self._outermost: list[torch.nn.Module] = []
        self._detecting = True
        self._depth = 0  # module nesting (forward hooks)
        self._fwd_kind = FORWARD
        self._optimizer: int | None = None
        self._other: int | None = None
        self._others = 0
        self._opt_steps = 0  # optimizer steps of the primary optimizer so far
        self._hooked = 0
        self._redetections = 0
        self._saw_forward = False
        # An update the optimizer hooks cannot see (an optimizer step inside torch.compile, or one written
        # by hand): a watched parameter changed between two training forwards with no optimizer step
        # seen in between ends the step before the second forward (``_unseen_update``).
        self._watched: torch.nn.Parameter | None = None
        self._watched_version = -1
        self._stepped = False  # an optimizer step was seen since the last training forward
        self._forward_boundary = False  # a boundary is being taken inside a module's forward pre-hook
        self._finish_after_forward = False  # detection ends when that forward returns
        self._originals: list[tuple[Any, str, Any]] = []  # (owner, attribute, original)
        self._installed = False
        self._on = True
        self._step_callbacks: list[Any] = []
        self._global: list[Any] = []  # the global module hooks' handles while detecting
        self._open: list[torch.nn.Module] = []  # detection: modules whose forward is open (global hooks)
        self._warning_filter: Any = None
        self._compiled = False  # TorchDynamo compiled something: the global hooks never come back
        self._compile_watch: Any = None  # TorchDynamo's callback handler our start callback is on

    def add_step_callback(self, fn: Any) -> None:
        """``fn(step)`` on the training thread right after each step boundary (e.g. stabilizers)."""
        self._step_callbacks.append(fn)

    # ------------------------------------------------------------------ install / uninstall

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No step, phase or boundary is seen inside (the hooks return at their first line): work of
        hyperacc's own that is not training, such as a checkpoint's load (whose optimizer state is
        initialised by an optimizer step of its own, ``torch.distributed.checkpoint``)."""
        was, self._on = self._on, False
        try:
            yield
        finally:
            self._on = was

    def install(self) -> AutoTrace:
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        from torch.utils.data import dataloader

        if self._installed:
            return self
        self._installed = True
        if self._end_unseen not in self.tracer.before_close:
            self.tracer.before_close.append(self._end_unseen)
        self.clock.input_gap = True
        self.clock.on_end = self._boundary
        self._handles = [
            register_optimizer_step_pre_hook(self._opt_pre),
            register_optimizer_step_post_hook(self._opt_post),
        ]
        self._depth = 0
        if self._detecting:
            self._add_global_hooks()
        else:  # installed again after an uninstall: the outermost modules are known
            self._hook_outermost()
        self._watch_compiles()
        auto = self

        self._patch(dataloader._BaseDataLoaderIter, "__next__", self._timed(dataloader._BaseDataLoaderIter.__next__, DATA, fetch=True))
        # A DataLoader's iterator made again each epoch (persistent_workers False) starts its worker
        # processes there, before its first ``__next__``: input time too, not the rank's own.
        self._patch(dataloader.DataLoader, "__iter__", self._timed(dataloader.DataLoader.__iter__, DATA))
        self._patch(torch.autograd, "backward", self._timed(torch.autograd.backward, BACKWARD))

        from torch.amp.grad_scaler import GradScaler

        orig_scaler_step = GradScaler.step

        @functools.wraps(orig_scaler_step)
        def scaler_step(scaler: Any, *args: Any, **kwargs: Any) -> Any:
            if is_compiling() or not auto._on or get_ident() != auto.thread_id:
                return orig_scaler_step(scaler, *args, **kwargs)
            before = auto._opt_steps
            auto._enter(OPTIMIZER)
            try:
                return orig_scaler_step(scaler, *args, **kwargs)
            finally:
                auto._exit(OPTIMIZER)
                if auto._opt_steps == before and auto._on:
                    auto._request_end()  # the update was skipped (inf/NaN): the iteration still ends

        self._patch(GradScaler, "step", scaler_step)

        orig_init = DDP.__init__

        def __init__(ddp: Any, *args: Any, **kwargs: Any) -> None:
            orig_init(ddp, *args, **kwargs)
            auto._attach(ddp)

        __init__.__wrapped__ = orig_init  # type: ignore[attr-defined]
        self._patch(DDP, "__init__", __init__)

        # DDP broadcasts its buffers (BatchNorm statistics, a transformer's position ids) from rank 0 at
        # the start of every synchronised forward: a blocking collective inside the forward, where a
        # rank waits for a late one. Timed as a collective, the wait leaves the forward's self-time.
        orig_sync_buffers = getattr(DDP, "_sync_buffers", None)
        if orig_sync_buffers is not None:

            @functools.wraps(orig_sync_buffers)
            def sync_buffers(ddp: Any, *args: Any, **kwargs: Any) -> Any:
                if is_compiling() or not auto._on or get_ident() != auto.thread_id:
                    return orig_sync_buffers(ddp, *args, **kwargs)
                auto._enter(COMM)
                try:
                    return orig_sync_buffers(ddp, *args, **kwargs)
                finally:
                    auto._exit(COMM)

            self._patch(DDP, "_sync_buffers", sync_buffers)

        orig_compile = torch.compile

        @functools.wraps(orig_compile)
        def compile(*args: Any, **kwargs: Any) -> Any:  # noqa: A001 - torch.compile's own name
            result = orig_compile(*args, **kwargs)
            auto._watch_compiles()  # TorchDynamo is imported now: see each compilation start
            return result

        self._patch(torch, "compile", compile)

        import torch.distributed as dist

        if dist.is_available():
            orig_destroy = dist.destroy_process_group

            @functools.wraps(orig_destroy)
            def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
                if not args and kwargs.get("group") is None:
                    auto._flush_before_exit()  # the end of a script, which may leave through os._exit
                return orig_destroy(*args, **kwargs)

            self._patch(dist, "destroy_process_group", destroy_process_group)
        self.tracer.collectives.install()
        return self

    def _flush_before_exit(self) -> None:
        """Write what was recorded: a script that ends with ``os._exit`` (to avoid exit-time hangs and
        aborts of its backend) skips ``atexit``, and with it the final flush."""
        try:
            self.tracer.flush()
        except Exception as exc:  # noqa: BLE001
            switch_off("flushing before destroy_process_group", exc)

    def _timed(self, orig: Any, kind: int, fetch: bool = False) -> Any:
        """``orig`` timed as phase ``kind`` on the training thread; called as it is elsewhere, while
        compiling, or once automatic tracing is off. ``fetch``: a DataLoader iterator's ``__next__``,
        counted as the thread's own where the iterator has no worker processes (``data_own``)."""
        auto, clock = self, self.clock

        @functools.wraps(orig)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if is_compiling() or not auto._on or get_ident() != auto.thread_id:
                return orig(*args, **kwargs)
            auto._enter(kind)
            if fetch and not getattr(args[0], "_num_workers", 1):
                clock.own_fetches += 1
            try:
                return orig(*args, **kwargs)
            finally:
                auto._exit(kind)

        return timed

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._originals.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def uninstall(self) -> None:
        if not self._installed:
            return
        self._installed = False
        for h in self._handles + self._module_handles:
            h.remove()
        self._handles, self._module_handles = [], []
        self._remove_global_hooks()
        if self._compile_watch is not None:
            try:
                self._compile_watch.remove_start_callback(self._compile_starts)
            except Exception:  # noqa: BLE001 - gone already: nothing to undo
                pass
            self._compile_watch = None
        self._hooked = 0
        for owner, name, orig in reversed(self._originals):
            setattr(owner, name, orig)
        self._originals = []
        self.tracer.collectives.close()

    def close(self, *, stopping: bool = False) -> None:
        """Remove the hooks and flush the tracer (``stopping``: see ``Tracer.close``)."""
        self.uninstall()
        self.tracer.close(stopping=stopping)

    def _end_unseen(self, stopping: bool) -> None:
        """``Tracer.before_close``: at a normal end on the training thread, a last iteration whose update
        the hooks could not see (no forward follows it to end its step) ends here, when the watched
        parameter shows that update (``_unseen_update``)."""
        if stopping or not self._on or get_ident() != self.thread_id:
            return
        p = self._watched
        if (p is not None and self._saw_forward and not self._stepped and self.tracer.step_open
                and self.clock.depth == 0 and p._version != self._watched_version):  # fmt: skip
            self.tracer.end_step()  # the row only: no step callbacks (they may be closed), no next step

    def _fail(self, exc: BaseException) -> None:
        self._on = False
        self.tracer.collectives.on = False
        switch_off("automatic tracing hooks", exc)

    # ------------------------------------------------------------------ phase plumbing

    def _enter(self, kind: int) -> None:
        try:
            tr = self.tracer
            if not tr._open:
                tr.begin_step()
            self.clock.enter(kind, perf_counter_ns())
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def _exit(self, kind: int) -> None:
        try:
            self.clock.exit(kind, perf_counter_ns())
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def _request_end(self) -> None:
        try:
            if self.tracer._open:
                self.clock.request_end(perf_counter_ns())
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def _boundary(self, t: int) -> None:
        """The step ended (the clock calls this once no phase is open)."""
        tr = self.tracer
        finished = tr.current_step
        no_forward = not self._saw_forward
        self._saw_forward = False
        tr.end_step()
        if self._detecting and self._forward_boundary:
            # inside the global pre-hook: its post-hook must still close this forward
            self._finish_after_forward = True
        elif self._detecting:
            self._finish_detection()
        elif no_forward and self._redetections < _MAX_REDETECTIONS and not self._compiled:
            # a model built later (a new stage) has not been seen yet; never after a compilation, whose
            # guards would see the global hooks come and go
            self._restart_detection()
        ran = False
        for fn in self._step_callbacks:
            ran = True
            try:
                fn(finished)
            except Exception as exc:  # noqa: BLE001
                self._step_callbacks = [f for f in self._step_callbacks if f is not fn]
                switch_off(f"step callback {getattr(fn, '__qualname__', fn)!s}", exc)
        # What the callbacks did (a scheduled collection) lies between the steps, in neither.
        tr.begin_step(contiguous=not ran)

    # ------------------------------------------------------------------ hooks

    def _attach(self, ddp: Any) -> None:
        self._watch_compiles()
        try:
            self.tracer.attach_ddp(ddp)
        except Exception as exc:  # noqa: BLE001
            switch_off("gradient collective timing", exc)

    # ------------------------------------------------------------------ detection and torch.compile

    def _add_global_hooks(self) -> None:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self._global = [
            register_module_forward_pre_hook(self._global_pre),
            register_module_forward_hook(self._global_post, always_call=True),
        ]
        self._open = []
        if self._warning_filter is None:
            warnings.filterwarnings("ignore", message=_COMPILE_HOOK_WARNING, category=UserWarning)
            self._warning_filter = warnings.filters[0]

    def _remove_global_hooks(self) -> None:
        for h in self._global:
            h.remove()
        self._global = []
        entry, self._warning_filter = self._warning_filter, None
        if entry is not None and entry in warnings.filters:
            warnings.filters.remove(entry)
            mutated = getattr(warnings, "_filters_mutated", None) or getattr(warnings, "_filters_mutated_lock_held", None)
            if mutated is not None:
                mutated()  # the interpreter caches the filters' version

    def _watch_compiles(self) -> None:
        """Once TorchDynamo is imported (by the script, never by us): hear of every compilation's start."""
        if self._compile_watch is not None or self._compiled:
            return
        dynamo = sys.modules.get("torch._dynamo")
        handler = getattr(dynamo, "callback_handler", None)
        if handler is None:
            return
        try:
            handler.register_start_callback(self._compile_starts)
            self._compile_watch = handler
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def _compile_starts(self, *args: Any) -> None:
        """TorchDynamo starts compiling a frame (before it traces it or builds its guards)."""
        try:
            self._compiled = True
            if self._global and get_ident() == self.thread_id:
                self._end_detection_now()
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def _end_detection_now(self) -> None:
        """End detection inside a forward, before compiled code runs: the global hooks go, and each module
        whose forward they opened gets a one-shot post-hook in their place (a hook added during a call
        runs at its end), so the depth and the forward phase close as usual."""
        self._compiled = True
        opened, self._open = self._open, []
        for module in opened:
            handle: list[Any] = []

            def once(mod: torch.nn.Module, args: Any, output: Any, handle: list[Any] = handle) -> None:
                handle[0].remove()
                self._post(mod, args, output)

            handle.append(module.register_forward_hook(once, always_call=True))
        self._finish_detection(reset_depth=False)

    def _global_pre(self, module: torch.nn.Module, args: Any) -> None:
        if is_compiling():
            return
        if self._detecting and get_ident() == self.thread_id and self._on:
            if self._depth == 0:
                outer = self._outermost
                if len(outer) < _MAX_OUTERMOST and not any(m is module for m in outer):
                    outer.append(module)
                self._watch_compiles()
            self._open.append(module)
            self._pre(module, args)
            if self._depth == 1 and _holds_compiled(module):
                self._end_detection_now()  # before the compiled module is called
            return
        self._pre(module, args)

    def _global_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._open and self._open[-1] is module:
            self._open.pop()
        self._post(module, args, output)

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        if is_compiling() or get_ident() != self.thread_id or not self._on:
            return
        self._forward_begins(module)

    def _forward_begins(self, module: torch.nn.Module) -> None:
        """A module's forward begins on the training thread, tracing on (``_pre``'s tests passed)."""
        if self._depth == 0:
            kind = FORWARD if torch.is_grad_enabled() else EVAL
            self._fwd_kind = kind
            if kind == FORWARD:
                p = self._watched
                if p is not None and p._version == self._watched_version:
                    self._stepped = False  # no parameter changed since the last forward or optimizer step
                else:
                    self._unseen_update(module)
                self._saw_forward = True
            self._enter(kind)
        self._depth += 1

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if is_compiling() or get_ident() != self.thread_id or not self._on:
            return
        self._forward_ends()

    def _forward_ends(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._exit(self._fwd_kind)
            if self._finish_after_forward:
                self._finish_after_forward = False
                try:
                    self._finish_detection()
                except Exception as exc:  # noqa: BLE001
                    self._fail(exc)
        elif self._depth < 0:
            self._depth = 0

    def _unseen_update(self, module: torch.nn.Module) -> None:
        """At a training forward of an outermost module: if the watched parameter (the first plain
        trainable ``nn.Parameter`` of the first such module) changed since the last training forward
        and no optimizer step was seen in between, the update was one the hooks cannot see, and the
        step ends here, before this forward. Gradient accumulation changes no parameter between its
        micro-steps, so it ends no step. Sharded parameters (FSDP2's DTensors) are not watched."""
        try:
            stepped, self._stepped = self._stepped, False
            p = self._watched
            if p is None:
                p = next((q for q in module.parameters() if q.requires_grad and type(q) is torch.nn.Parameter), None)
                if p is None:
                    return
                self._watched, self._watched_version = p, p._version
                return
            version = p._version
            if version == self._watched_version:
                return
            self._watched_version = version
            if not stepped and self.tracer.step_open:
                self._forward_boundary = True
                try:
                    self._request_end()
                finally:
                    self._forward_boundary = False
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def _opt_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if is_compiling() or get_ident() != self.thread_id or not self._on:
            return
        if self._optimizer is None:
            self._optimizer = id(optimizer)
        self._enter(OPTIMIZER)

    def _opt_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if is_compiling() or get_ident() != self.thread_id or not self._on:
            return
        self._exit(OPTIMIZER)
        self._stepped = True
        if self._watched is not None:
            self._watched_version = self._watched._version  # this update was seen
        try:
            if id(optimizer) != self._optimizer:
                # A second optimizer stepping twice with no step of the first one in between: the first
                # was replaced (a new training stage), so this one marks the steps from now on.
                self._others = self._others + 1 if self._other == id(optimizer) else 1
                self._other = id(optimizer)
                if self._others < 2:
                    return
                self._optimizer = id(optimizer)
            self._other, self._others = None, 0
            self._opt_steps += 1
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)
            return
        self._request_end()

    def _restart_detection(self) -> None:
        self._redetections += 1
        self._detecting = True
        self._depth = 0
        self._add_global_hooks()

    def _finish_detection(self, *, reset_depth: bool = True) -> None:
        """After the first step: hook only the outermost modules, drop the global module hooks."""
        self._detecting = False
        self._remove_global_hooks()
        self._hook_outermost()
        if reset_depth:
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


def _holds_compiled(module: torch.nn.Module) -> bool:
    """Is ``module`` or one below it compiled (``torch.compile(m)``'s OptimizedModule, ``m.compile()``)?"""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:
        return False  # nothing was compiled in this process
    optimized = eval_frame.OptimizedModule
    return any(isinstance(m, optimized) or getattr(m, "_compiled_call_impl", None) is not None for m in module.modules())


class _ForwardWrapper:
    """Times ``module.forward`` through an instance attribute; ``remove()`` restores the class method.

    On a DDP model timed by ``DDPWait``, the wrapper also tells it, at each training forward, whether a
    synchronised backward follows (``DDPWait.arm``), in place of its forward pre-hook, which it removes:
    the model then keeps torch's fast call path.
    """

    def __init__(self, auto: AutoTrace, module: torch.nn.Module) -> None:
        self.module = module
        original = module.forward
        begins, ends, thread_id = auto._forward_begins, auto._forward_ends, auto.thread_id
        wait = getattr(module, "_hyperacc_rounds", None)
        self.wait = wait if isinstance(wait, DDPWait) and wait.pre_hook is not None else None
        arm = self.wait.arm if self.wait is not None else None
        grad_enabled = torch.is_grad_enabled

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if is_compiling():
                return original(*args, **kwargs)
            if arm is not None and grad_enabled():
                arm()
            if not auto._on or get_ident() != thread_id:
                return original(*args, **kwargs)
            begins(module)
            try:
                return original(*args, **kwargs)
            finally:
                if auto._on:
                    ends()

        self.forward = forward
        module.forward = forward
        if self.wait is not None:
            self.wait.pre_hook.remove()

    def remove(self) -> None:
        if vars(self.module).get("forward") is self.forward:
            del self.module.forward
        if self.wait is not None:
            self.wait.pre_hook = self.module.register_forward_pre_hook(self.wait._forward_pre)
            self.wait = None


_installed: AutoTrace | None = None


def install(tracer: Tracer) -> AutoTrace:
    """Install automatic tracing once per process (a second call returns the first one)."""
    global _installed
    if _installed is None or not _installed._installed:
        _installed = AutoTrace(tracer).install()
    return _installed


def installed() -> AutoTrace | None:
    return _installed if _installed is not None and _installed._installed else None

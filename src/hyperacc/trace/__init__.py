"""hyper-trace recording: per-rank, per-step phases and cause signals, the in-band exchange of arrival
and wait at the gradient all-reduce, and live per-window aggregation (docs/tracing.md).

- ``Tracer(run_dir)``: explicit ``step()`` / ``phase(name)`` context managers and decorators;
- ``install_auto(run_dir)``: the same tracer driven by global hooks, for an unmodified script;
- ``trace_from_env()``: a tracer configured by ``HYPERACC_RUN_DIR`` and ``HYPERACC_TRACE``.

This package measures and stores; it imports nothing from ``hyperacc.analysis``. What analyses while
the job runs (rank 0's live window aggregation, ``analysis/live_aggregate.py``) attaches itself to
every new tracer through ``tracer.on_tracer_start``, registered by ``hyperacc run`` (bootstrap) and the
framework callbacks.

One step, in automatic mode, and on which thread it runs (read in this order):

========================  ====================================================  ======================
where                     what                                                  thread
========================  ====================================================  ======================
``auto.py``               hooks: DataLoader ``__next__``, outermost modules'    training thread
                          ``forward``, ``autograd.backward``, optimizer
                          pre/post hooks, ``GradScaler.step``; each calls
                          ``clock.enter``/``exit`` and, at the optimizer's
                          end, asks for the step boundary
``step_clock.py``         ``StepClock``: the stack of open phases and a stamp   training thread
                          per change; exclusive time per phase computed from
                          the stamps at the step's end; a boundary requested
                          inside a phase waits for the outermost one to close,
                          then calls ``Tracer._boundary``
``ddp_wait.py``           ``DDPWait`` (default): DDP keeps its built-in C++     training thread
                          all-reduce; auto's forward wrapper (or a forward      (hooks; autograd's
                          pre-hook) notes a synchronised
                          backward, a parameter hook queues autograd final      final callbacks on
                          callbacks that stamp "graph done" and "reduced";      CPU, its device
                          ``collect()`` hands the clock the wait                thread on CUDA)
``inband.py``             ``GradientRounds.run`` (in-band exchange or pacing    autograd thread
                          only): DDP's comm hook per bucket: launch times, the  (launch); the process
                          all-reduce (+ in-band slots, ``inband_slots.py``);    group's thread
                          completion callbacks stamp the round's end            (completion)
``collectives.py``        the script's own collectives and ``Work.wait``:       training thread only
                          time blocked, charged as wait
``signals.py``            ``StepSignals.begin``/``end``: counter deltas (GC     training thread; GC
                          by ``gc.callbacks``, CPU time, faults, CUDA           callbacks on the
                          allocator)                                            collecting thread
``tracer.py``             ``end_step``: the clock, the hook and the signals     training thread
                          fill one preallocated int64 row; ``StepRing.commit``
                          (``ring.py``) publishes it by advancing a counter;
                          ``begin_step`` opens the next (probe, device events)
``tracer.py``             ``_flush_loop``/``flush``: take committed rows, a     flusher thread
                          plain record segment (``hyperacc.records``; the       (``hyperacc-trace-
                          node agent makes it Parquet), sinks (live             flush``)
                          aggregation, metrics), events, resource samples
                          (``resources.py``)
``device.py``             CUDA events recorded around phases; read back only    training thread
                          once complete, never waited for                       (no sync)
``tracer.py``             SIGTERM handler: ``close(stopping=True)`` flushes     main thread (signal)
                          every row, then the previous handler runs
========================  ====================================================  ======================

Nothing on the training thread allocates per step, takes a lock the flusher holds, or synchronises a
device; the flusher never blocks the training thread (docs/tracing.md, "No synchronisation, no
allocation, no lock on the hot path").
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

from hyperacc.trace.options import ENV_OPTIONS, ENV_RUN_DIR, TraceConfigError, TraceOptions

if TYPE_CHECKING:
    from hyperacc.trace.auto import AutoTrace
    from hyperacc.trace.inband import InBand
    from hyperacc.trace.tracer import Tracer, current

# Imported on first use (PEP 562): the options alone do not load torch, so ``hyperacc run`` (the node
# agent) checks --trace without importing it.
_LAZY = {"AutoTrace": "hyperacc.trace.auto", "InBand": "hyperacc.trace.inband",
         "Tracer": "hyperacc.trace.tracer", "current": "hyperacc.trace.tracer"}  # fmt: skip


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'hyperacc.trace' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value

__all__ = [
    "AutoTrace",
    "InBand",
    "TraceConfigError",
    "TraceOptions",
    "Tracer",
    "current",
    "install_auto",
    "trace_from_env",
]


def trace_from_env(**overrides: Any) -> Tracer | None:
    """A Tracer for ``HYPERACC_RUN_DIR`` with the options of ``HYPERACC_TRACE`` (JSON); None if unset."""
    run_dir = os.environ.get(ENV_RUN_DIR, "").strip()
    if not run_dir:
        return None
    from hyperacc.trace.tracer import Tracer

    options = TraceOptions.from_json(os.environ.get(ENV_OPTIONS))
    return Tracer(run_dir, options=options, **overrides)


def install_auto(run_dir: str | os.PathLike | None = None, **options: Any) -> AutoTrace:
    """Trace this process through global hooks (no change to the training script).

    ``run_dir`` defaults to ``HYPERACC_RUN_DIR``; options default to ``HYPERACC_TRACE``, overridden by
    keywords. A second call returns the installation already in place.
    """
    from hyperacc.trace import auto
    from hyperacc.trace.tracer import Tracer

    existing = auto.installed()
    if existing is not None:
        return existing
    if run_dir is None:
        run_dir = os.environ.get(ENV_RUN_DIR, "").strip()
        if not run_dir:
            raise TraceConfigError(f"no run directory: pass run_dir or set {ENV_RUN_DIR}")
    base = TraceOptions.from_json(os.environ.get(ENV_OPTIONS))
    tracer = Tracer(run_dir, options=base.replace(**options) if options else base)
    return auto.install(tracer)

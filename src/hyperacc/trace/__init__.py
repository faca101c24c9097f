"""hyper-trace recording: per-rank, per-step phases and cause signals, the in-band exchange of arrival
and wait at the gradient all-reduce, and live per-window aggregation (docs/tracing.md).

- ``Tracer(run_dir)``: explicit ``step()`` / ``phase(name)`` context managers and decorators;
- ``install_auto(run_dir)``: the same tracer driven by global hooks, for an unmodified script;
- ``trace_from_env()``: a tracer configured by ``HYPERACC_RUN_DIR`` and ``HYPERACC_TRACE``.
"""

from __future__ import annotations

import os
from typing import Any

from hyperacc.trace.auto import AutoTrace
from hyperacc.trace.inband import InBand
from hyperacc.trace.options import ENV_OPTIONS, ENV_RUN_DIR, TraceConfigError, TraceOptions
from hyperacc.trace.tracer import Tracer, current

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
    options = TraceOptions.from_json(os.environ.get(ENV_OPTIONS))
    return Tracer(run_dir, options=options, **overrides)


def install_auto(run_dir: str | os.PathLike | None = None, **options: Any) -> AutoTrace:
    """Trace this process through global hooks (no change to the training script).

    ``run_dir`` defaults to ``HYPERACC_RUN_DIR``; options default to ``HYPERACC_TRACE``, overridden by
    keywords. A second call returns the installation already in place.
    """
    from hyperacc.trace import auto

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

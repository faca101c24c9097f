"""The tracer never stops training: a failing part logs one line and switches itself off.

Every part of the tracer (disk writer, a sink, the aggregator, a hook, the probe) reports its first
exception here; the caller then turns that part off. One line per part per process, never a traceback
on the training path (docs/tracing.md, "Failure safety").
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("hyperacc.trace")

_reported: set[str] = set()
_lock = threading.Lock()  # taken only when something has already failed


def switch_off(part: str, exc: BaseException) -> None:
    """Log once that ``part`` failed with ``exc`` and is now off; training continues."""
    with _lock:
        if part in _reported:
            return
        _reported.add(part)
    log.warning(
        "hyperacc trace: %s failed (%s: %s); it is switched off, training continues",
        part,
        type(exc).__name__,
        exc,
    )


def reported() -> frozenset[str]:
    """Parts that have failed in this process (for tests and the final summary)."""
    return frozenset(_reported)

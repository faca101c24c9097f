"""The tracer never stops training: a failing part logs one line and switches itself off.

Every part of the tracer (disk writer, a sink, the aggregator, a hook, the probe) reports its first
exception here; the caller then turns that part off. One line per part per process, never a traceback
on the training path (docs/tracing.md, "Failure safety").
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("hyperacc.trace")

_reported: set[str] = set()
_lock = threading.Lock()  # taken only when something has already failed


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``exc`` as one line of a log: its type and the first line of its message, at most ``limit``
    characters. torch's C++ errors (``DistNetworkError``, ``DistStoreError``) carry their C++ backtrace
    in the message, tens of lines of ``frame #N``, which a log line must not."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def switch_off(part: str, exc: BaseException) -> None:
    """Log once that ``part`` failed with ``exc`` and is now off; training continues."""
    with _lock:
        if part in _reported:
            return
        _reported.add(part)
    log.warning("hyperacc trace: %s failed (%s); it is switched off, training continues", part, one_line(exc))


def reported() -> frozenset[str]:
    """Parts that have failed in this process (for tests and the final summary)."""
    return frozenset(_reported)


def job_store() -> Any:
    """The default process group's c10d store (scoped to this attempt of the job), or None."""
    try:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store() if dist.is_available() and dist.is_initialized() else None
    except Exception:  # noqa: BLE001 - no default group, or a torch without this helper
        return None


class OffOnEveryRank:
    """Parts that act alike on every rank (a GC schedule, a memory release, pacing): one that fails on a
    rank is switched off on every rank.

    ``publish(part, exc)`` sets ``<prefix><part>`` ("rank R: error") and ``<prefix>any`` in the job's
    c10d store from a thread of its own (a store that hangs never holds the caller). ``watch(parts)`` starts a thread that
    checks ``<prefix>any`` every ``poll_s`` (one store request) and, once it exists, leaves each part
    found in ``elsewhere`` (part -> "rank R: error") until every watched part was found; the training
    thread takes them at its next boundary (``take``; a dict test while there is nothing).
    ``prefix`` must name the same part on every rank (objects made in the same order on every rank)."""

    def __init__(self, prefix: str, rank: int, get_store: Callable[[], Any] = job_store,
                 poll_s: float = 1.0) -> None:  # fmt: skip
        self.prefix = prefix
        self.rank = rank
        self.get_store = get_store
        self.poll_s = poll_s
        self.elsewhere: dict[str, str] = {}
        self._found: set[str] = set()
        self._stop = threading.Event()

    def publish(self, part: str, exc: BaseException) -> None:
        text = f"rank {self.rank}: {one_line(exc)}"
        threading.Thread(target=self._publish, args=(part, text), daemon=True).start()

    def _publish(self, part: str, text: str) -> None:
        try:
            store = self.get_store()
            if store is not None:
                store.set(self.prefix + part, text)
                store.set(self.prefix + "any", part)
        except Exception as exc:  # noqa: BLE001 - the other ranks keep the part; this one said why
            log.warning("hyperacc: could not tell the other ranks that %s is off: %s", part, one_line(exc))

    def watch(self, parts: tuple[str, ...]) -> None:
        threading.Thread(target=self._watch, args=(parts,), name="hyperacc-off-watch", daemon=True).start()

    def _watch(self, parts: tuple[str, ...]) -> None:
        try:
            while not self._stop.wait(self.poll_s):
                store = self.get_store()
                if store is None or not store.check([self.prefix + "any"]):
                    continue
                for part in parts:
                    if part not in self._found and store.check([self.prefix + part]):
                        self._found.add(part)
                        self.elsewhere[part] = store.get(self.prefix + part).decode()[:300]
                if self._found >= set(parts):
                    return
        except Exception as exc:  # noqa: BLE001 - without the watcher each rank keeps its own parts
            # (quietly: the store goes away as a job ends, when rank 0, which holds it, exits first)
            log.debug("hyperacc: watching the other ranks' parts stopped: %s", one_line(exc))

    def take(self) -> list[tuple[str, str]]:
        """The parts found switched off on some rank since the last call (training thread)."""
        out = []
        for part in list(self.elsewhere):
            out.append((part, self.elsewhere.pop(part)))
        return out

    def close(self) -> None:
        self._stop.set()

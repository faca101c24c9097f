"""DataLoader workers under the stabilizers: their GC policy and their own cores.

A forked worker inherits "automatic GC off" from a rank under deterministic GC, and its cores from the
rank's binding; :class:`WorkerInit` puts both right in each worker before the user's own
``worker_init_fn`` runs. docs/stabilizers.md, "Deterministic GC" and "NUMA / CPU binding".
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from hyperacc.stabilize.affinity import set_process_affinity
from hyperacc.stabilize.gc_schedule import apply_worker_policy

log = logging.getLogger(__name__)


class WorkerInit:
    """A DataLoader ``worker_init_fn`` that applies the GC policy and the worker's own cores, then
    calls the user's function. Picklable, so it also works with the spawn start method."""

    def __init__(
        self,
        gc_policy: str | None,
        worker_cpus: tuple[tuple[int, ...], ...] = (),
        user_fn: Callable[[int], Any] | None = None,
    ) -> None:
        self.gc_policy = gc_policy
        self.worker_cpus = worker_cpus
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        if self.gc_policy is not None:
            apply_worker_policy(self.gc_policy)
        if self.worker_cpus:
            try:
                set_process_affinity(self.worker_cpus[worker_id % len(self.worker_cpus)])
            except OSError as exc:
                log.warning("hyperacc.stabilize: could not bind DataLoader worker %d: %s", worker_id, exc)
        if self.user_fn is not None:
            self.user_fn(worker_id)

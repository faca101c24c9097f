"""Stabilizers: turn random per-rank disturbances into bounded costs paid at the same step on every rank.

Under a synchronous all-reduce a pause on any one rank stalls all of them, so a per-rank pause of
probability p becomes a cluster spike of probability 1-(1-p)^N. Each part here removes one source of
such pauses or moves it to a step every rank shares:

- ``gc``: young collections left to CPython, full collections only at the same step index on every
  rank, every N steps or at an interval chosen from the measured cost, a pause budget and a cost
  budget, and a safety valve agreed through the c10d store (:mod:`hyperacc.stabilize.gc_schedule`);
- ``memory``: the host allocator holds freed memory and releases it on the same schedule
  (:mod:`hyperacc.stabilize.memory`);
- ``allocator``: ``expandable_segments:True`` for the CUDA caching allocator
  (:mod:`hyperacc.stabilize.allocator`);
- ``affinity``: NUMA/CPU binding of the rank and its DataLoader workers
  (:mod:`hyperacc.stabilize.affinity`);
- ``sync_audit``: counts barriers and host syncs per step, opt-in elision of per-step barriers
  (:mod:`hyperacc.stabilize.sync_audit`).

Use::

    stab = hyperacc.stabilize.stabilize(gc={"interval": "auto"}, affinity={"workers_per_rank": 4})
    loader = stab.attach(loader)          # workers: GC policy + their own cores
    for step, batch in enumerate(loader):
        ...; optimizer.step()
        stab.step(step)                    # the global step: the same number on every rank
    stab.close()

``from_env()`` builds the same from ``HYPERACC_STABILIZE`` (JSON of these keyword arguments, ``1`` for
the defaults, or the path of a TOML/JSON file). Every rule and default: docs/stabilizers.md.

The package is split by concern: ``config`` (options), ``stabilizer`` (the handle), ``start`` (entry
points and the launcher environment), ``workers`` (DataLoader workers), and one module per part.
"""


from hyperacc.stabilize.config import (
    AffinityOptions,
    AllocatorOptions,
    MemoryOptions,
    StabilizeConfig,
    config_from_dict,
    load_config,
)
from hyperacc.stabilize.gc_schedule import GCOptions
from hyperacc.stabilize.stabilizer import Stabilizer
from hyperacc.stabilize.start import ENV_VAR, from_env, launch_env, stabilize
from hyperacc.stabilize.sync_audit import AuditOptions
from hyperacc.stabilize.workers import WorkerInit

__all__ = [
    "ENV_VAR",
    "AffinityOptions",
    "AllocatorOptions",
    "AuditOptions",
    "GCOptions",
    "MemoryOptions",
    "StabilizeConfig",
    "Stabilizer",
    "WorkerInit",
    "config_from_dict",
    "from_env",
    "launch_env",
    "load_config",
    "stabilize",
]

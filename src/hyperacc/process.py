"""This process's place in the job (torchrun's environment) and the hooks that run when it ends.

Every part of hyperacc that needs the rank, world size or node of the current process reads them here
(``place()``: rank, local rank, node, world size, local world size, nodes, master address and port,
the elastic run id and restart count), and every part that must flush before the process exits registers with ``at_exit``: the hooks run at
normal interpreter exit (``atexit``) and also from ``run_exit_hooks()``, which a script that ends with
``os._exit`` (``hyperacc.harness.finish``) calls first, since ``os._exit`` skips ``atexit``.
"""

from __future__ import annotations

import atexit
import dataclasses
import math
import os
import sys
from collections.abc import Callable, Mapping

_exit_hooks: list[Callable[[], None]] = []


@dataclasses.dataclass(frozen=True)
class Place:
    """Where this process sits in the job, as torchrun's environment says (defaults outside torchrun:
    a single process). Read with ``place()``; a value that is not an integer counts as unset."""

    rank: int = 0  # RANK
    local_rank: int = 0  # LOCAL_RANK
    node: int = 0  # GROUP_RANK: this node's (agent's) rank
    world_size: int | None = None  # WORLD_SIZE; None outside a launcher
    local_world_size: int | None = None  # LOCAL_WORLD_SIZE: ranks on this node
    nodes: int | None = None  # GROUP_WORLD_SIZE: nodes (agents) in the job
    master_addr: str | None = None  # MASTER_ADDR: torchrun's store
    master_port: int | None = None  # MASTER_PORT
    run_id: str = "local"  # TORCHELASTIC_RUN_ID
    restart_count: int = 0  # TORCHELASTIC_RESTART_COUNT: restarts of the job so far
    max_restarts: int = 0  # TORCHELASTIC_MAX_RESTARTS

    def node_count(self, world_size: int | None = None) -> int:
        """Nodes in the job: GROUP_WORLD_SIZE, else the world over the ranks per node (one node when
        neither is known). ``world_size`` overrides WORLD_SIZE."""
        if self.nodes is not None:
            return self.nodes
        world = world_size if world_size is not None else (self.world_size or 1)
        local = self.local_world_size or world
        return max(math.ceil(world / max(local, 1)), 1)


def place(environ: Mapping[str, str] | None = None) -> Place:
    """This process's ``Place``, read from the environment now (``environ`` for another one)."""
    env = os.environ if environ is None else environ

    def number(name: str) -> int | None:
        try:
            return int(env[name])
        except (KeyError, ValueError):
            return None

    def text(name: str) -> str | None:
        value = env.get(name, "").strip()
        return value or None

    return Place(
        rank=number("RANK") or 0,
        local_rank=number("LOCAL_RANK") or 0,
        node=number("GROUP_RANK") or 0,
        world_size=number("WORLD_SIZE"),
        local_world_size=number("LOCAL_WORLD_SIZE"),
        nodes=number("GROUP_WORLD_SIZE"),
        master_addr=text("MASTER_ADDR"),
        master_port=number("MASTER_PORT"),
        run_id=text("TORCHELASTIC_RUN_ID") or "local",
        restart_count=number("TORCHELASTIC_RESTART_COUNT") or 0,
        max_restarts=number("TORCHELASTIC_MAX_RESTARTS") or 0,
    )


def env_int(name: str, default: int) -> int:
    """An integer from the environment; ``default`` when unset or not an integer."""
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def at_exit(fn: Callable[[], None]) -> None:
    """Run ``fn`` once when the process ends, whether through ``atexit`` or ``run_exit_hooks()``."""
    if fn not in _exit_hooks:
        _exit_hooks.append(fn)
        atexit.register(_run_one, fn)


def _run_one(fn: Callable[[], None]) -> None:
    if fn in _exit_hooks:
        _exit_hooks.remove(fn)
        fn()


def run_exit_hooks() -> None:
    """Run every registered hook now (in registration order); a failing hook is reported, not raised."""
    while _exit_hooks:
        fn = _exit_hooks.pop(0)
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - one failing flush must not stop the others
            print(f"hyperacc: final flush {getattr(fn, '__qualname__', fn)} failed: {exc}", file=sys.stderr)

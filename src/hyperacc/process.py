"""This process's place in the job (torchrun's environment) and the hooks that run when it ends.

Every part of hyperacc that needs the rank, world size or node of the current process reads them here,
and every part that must flush before the process exits registers with ``at_exit``: the hooks run at
normal interpreter exit (``atexit``) and also from ``run_exit_hooks()``, which a script that ends with
``os._exit`` (``hyperacc.harness.finish``) calls first, since ``os._exit`` skips ``atexit``.
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Callable

_exit_hooks: list[Callable[[], None]] = []


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

"""Suite-wide ordering for ``make test``'s parallel run (pytest-xdist, ``--dist loadfile``).

Workers take whole test files in collection order. The files that start real ranks take most of the
suite's wall time, much of it waiting (rendezvous, torchrun's monitor, timeouts), so they are handed
out first, longest-known first, and the many quick files fill the gaps at the end: otherwise one
worker is left alone with a long job after the others have finished. Order within a file is kept.
"""

from __future__ import annotations

import pytest

# files whose tests took 40 s or more in `make test` (pytest --durations, 2-core machine): started first
_FIRST = (
    "reliability/test_faults.py",
    "loop/test_elastic_drain.py",
    "loop/test_elastic_drain_from_verdict.py",
    "trace/test_trainers.py",
    "trace/test_no_harm.py",
    "trace/test_loops.py",
    "loop/test_live_remediation.py",
)


def _file(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0].removeprefix("tests/")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank: dict[str, tuple[int, int]] = {}
    for item in items:
        path = _file(item)
        mine = (0, _FIRST.index(path)) if path in _FIRST else (1 if item.get_closest_marker("multirank") else 2, 0)
        rank[path] = min(rank.get(path, mine), mine)
    items.sort(key=lambda item: rank[_file(item)])  # stable, and a file's tests stay together in their order

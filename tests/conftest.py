"""Suite-wide ordering for ``make test``'s parallel run (pytest-xdist, ``--dist loadfile``).

Workers take whole test files in collection order (pytest-xdist's own re-sorting of files by their
number of tests is switched off below). The files that start real ranks take most of the
suite's wall time, much of it waiting (rendezvous, torchrun's monitor, timeouts), so they are handed
out first, longest-known first, and the many quick files fill the gaps at the end: otherwise one
worker is left alone with a long job after the others have finished. Order within a file is kept.
"""

from __future__ import annotations

import pytest

# files whose tests took 40 s or more in `make test` (pytest --durations, 2-core machine, 2026-12-01, a
# run on a host loaded by other jobs besides), longest first: started first, in this order. The slow
# single-process files (test_layers, test_compare_command, test_sigterm, test_scale) are among them, so
# that none of them is left for the end either.
_FIRST = (
    "trace/test_trainers.py",
    "stabilize/test_stabilize_multirank.py",
    "reliability/test_faults.py",
    "present/test_run_live.py",
    "present/test_kineto_import.py",
    "trace/test_no_harm.py",
    "reliability/test_filesystem_and_ports.py",
    "loop/test_elastic_drain_from_verdict.py",
    "loop/test_live_remediation.py",
    "analysis/test_episodes.py",
    "present/test_two_agents.py",
    "trace/test_loops.py",
    "foundation/test_harness.py",
    "reliability/test_inband_round.py",
    "foundation/test_layers.py",
    "analysis/test_compare_command.py",
    "trace/test_sigterm.py",
    "trace/test_auto.py",
    "analysis/test_real_jobs.py",
    "trace/test_compaction_job.py",
    "loop/test_drain_decision.py",
    "analysis/test_scale.py",
    "analysis/test_between_steps.py",
    "reliability/test_signals.py",
    "loop/test_elastic_resume.py",
    "reliability/test_cli_fuzz.py",
    "trace/test_inband.py",
    "present/test_traced_job_live.py",
    "reliability/test_export_interrupt.py",
    "reliability/test_run_dir_reuse.py",
)


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist (3.6 on) re-sorts the files of `--dist loadfile` by their number of tests, most first,
    # unless told not to: that put the many-test single-process files first and the real jobs (a few
    # tests a file) last, whatever the order below. Keep the order this file gives.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def _file(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0].removeprefix("tests/")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank: dict[str, tuple[int, int]] = {}
    for item in items:
        path = _file(item)
        mine = (0, _FIRST.index(path)) if path in _FIRST else (1 if item.get_closest_marker("multirank") else 2, 0)
        rank[path] = min(rank.get(path, mine), mine)
    items.sort(key=lambda item: rank[_file(item)])  # stable, and a file's tests stay together in their order


@pytest.fixture
def cpu_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU job's process, also where an earlier test in this worker initialised CUDA on a GPU machine.

    Once CUDA is initialised in a process, hyperacc treats it as a CUDA run: the tracer adds device-clock
    columns (a row is ready only once its events were read back at a later step, docs/tracing.md,
    "Clocks"), and the sync audit turns on CUDA's sync debug mode. Tests that assert a CPU job's
    behaviour ask for this fixture; CI has no GPU, so it matters only where the suite runs on one.
    """
    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)

"""Suite-wide ordering for ``make test``'s parallel run (pytest-xdist, ``--dist loadfile``).

Workers take whole test files in collection order (pytest-xdist's own re-sorting of files by their
number of tests is switched off below). The files that start real ranks take most of the
suite's wall time, much of it waiting (rendezvous, torchrun's monitor, timeouts), so they are handed
out early, longest-known first, and the many quick files fill the gaps at the end: otherwise one
worker is left alone with a long job after the others have finished. Order within a file is kept.

A test marked ``alone`` judges a detection verdict of a real job under the load it makes itself (a
busy loop beside it, a 4-rank job on 2 cores): no other worker's real job runs beside it. The workers
hold a lock on the host (``_host``) while a ``multirank`` test runs, shared, or alone for such a test.
Beside another worker's 4-rank job a page-fault rank 1.35x in CPU time went unnamed, and a live episode
was never said to end (fresh-clone CI runs, 2026-12-05). The ``alone`` files open the suite, each
followed by enough single-process files to keep the other worker busy while it runs (``_OPENING``):
placed after the other real jobs, they met the other worker inside its last real-job file, and each
waited for the other's tests in turn (about 95 s of idle workers in a 10.5-minute run, 2026-12-05).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

# The opening: each ``alone`` file, then single-process files that take at least as long on the other
# worker (their seconds in `make test`, 2-core machine, 2026-12-05), so that the next ``alone`` file
# starts when the previous one has finished. pytest-xdist hands each worker two files ahead.
_OPENING = (
    "analysis/test_episodes.py",  # 38 s, its recorded jobs alone
    "analysis/test_compare_command.py",  # 11 s
    "reliability/test_cli_fuzz.py",  # 10 s
    "stabilize/test_stabilize_units.py",  # 9 s
    "analysis/test_scale.py",  # 9 s
    "foundation/test_layers.py",  # 6 s
    "analysis/test_cluster.py",  # 5 s
    "reliability/test_segments.py",  # 5 s
    "present/test_html_report.py",  # 4 s
    "trace/test_aggregate.py",  # 4 s
    "analysis/test_between_steps.py",  # 15 s, one job alone
    "trace/test_compile.py",  # 14 s
    "trace/test_sigterm.py",  # 10 s
    "analysis/test_real_jobs.py",  # 19 s, two jobs alone
    "reliability/test_watch_edges.py",  # 7 s
    "present/test_report_sections.py",  # 5 s
    "trace/test_tracer.py",  # 3 s
    "reliability/test_export_interrupt.py",  # 3 s
)
# Then the files whose tests took 40 s or more in `make test` (pytest --durations, 2-core machine,
# 2026-12-01, a run on a host loaded by other jobs besides), longest first, in this order.
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
    "present/test_two_agents.py",
    "trace/test_loops.py",
    "foundation/test_harness.py",
    "reliability/test_inband_round.py",
    "trace/test_auto.py",
    "trace/test_compaction_job.py",
    "reliability/test_signals.py",
    "loop/test_elastic_resume.py",
    "trace/test_inband.py",
    "present/test_traced_job_live.py",
    "reliability/test_run_dir_reuse.py",
)


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist (3.6 on) re-sorts the files of `--dist loadfile` by their number of tests, most first,
    # unless told not to: that put the many-test single-process files first and the real jobs (a few
    # tests a file) last, whatever the order below. Keep the order this file gives.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


_SYSTEM_TMP = tempfile.gettempdir()  # before the suite points ``tempfile`` at its own folder (below)


@pytest.fixture(scope="session", autouse=True)
def _job_folders_in_the_suites_own_temp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The folders ``harness.launch`` makes for a job given no ``workdir`` (and any other ``tempfile``
    folder a test leaves) go under pytest's temporary folder, which pytest prunes (the last three runs
    are kept), not the system's: each run of the suite left about 250 there."""
    old = tempfile.tempdir
    tempfile.tempdir = str(tmp_path_factory.mktemp("tempfile"))
    yield
    tempfile.tempdir = old


def _lock_dir(config: pytest.Config) -> Path | None:
    """The folder of the host lock, one per user, shared by every pytest-xdist worker of every run on
    this machine (two suites at once also take turns for their ``alone`` tests); None in one process.
    Nothing accumulates: the same two empty files are locked run after run, and a lock dies with its
    holder."""
    if getattr(config, "workerinput", None) is None:
        return None
    path = Path(_SYSTEM_TMP) / f"hyperacc-test-host-{os.getuid()}"
    path.mkdir(exist_ok=True)
    return path


@contextmanager
def _host(folder: Path, alone: bool) -> Iterator[None]:
    """Hold the host, shared or alone. The turnstile, taken first, lets a test waiting to be alone stop
    the shared holders that come after it (a readers-writer lock without the writer's starvation)."""
    with open(folder / "turnstile", "a") as turnstile, open(folder / "host", "a") as host:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(host, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(host, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    # outermost (tryfirst), so that the wait for the host is not counted in pytest-timeout's limit
    folder = _lock_dir(item.config)
    if folder is None or item.get_closest_marker("multirank") is None:
        yield
        return
    with _host(folder, alone=item.get_closest_marker("alone") is not None):
        yield


def _file(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0].removeprefix("tests/")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank: dict[str, tuple[int, int]] = {}
    for item in items:
        path = _file(item)
        if path in _OPENING:
            mine = (0, _OPENING.index(path))
        elif path in _FIRST:
            mine = (1, _FIRST.index(path))
        elif item.get_closest_marker("alone"):
            mine = (0, len(_OPENING))  # a new alone file: still before the other real jobs
        else:
            mine = (2 if item.get_closest_marker("multirank") else 3, 0)
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

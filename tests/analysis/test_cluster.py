"""``diagnose(..., cluster=ADDRESS)`` on a real local Dask cluster of two worker processes: the same
diagnosis as on one machine (docs/detection.md, "Analysis on a cluster")."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

distributed = pytest.importorskip("distributed", reason="the cluster path needs hyperacc[cluster] (Dask distributed)")


@pytest.fixture(scope="module")
def scheduler():
    from distributed import LocalCluster

    # Dask's nanny writes its workers' settings into this process's environment before it starts them
    # (MALLOC_TRIM_THRESHOLD_=65536 among them): put it back, or every later test of this pytest worker
    # starts its processes with glibc's allocator thresholds fixed
    environ = dict(os.environ)
    try:
        with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
            yield cluster.scheduler_address
    finally:
        for name in set(os.environ) - set(environ):
            del os.environ[name]
        os.environ.update(environ)


def _comparable(doc: dict) -> str:
    return json.dumps(doc, sort_keys=True, default=str)


def test_the_cluster_reduces_every_rank_and_the_diagnosis_is_the_same(faulty_run, faulty_diagnosis, scheduler):
    from distributed import Client

    from hyperacc.analysis import diagnose

    with Client(scheduler) as client:
        before = sum(client.run(lambda dask_worker: len(dask_worker.state.log)).values())
    on_cluster = diagnose(faulty_run, cluster=scheduler).to_dict()
    with Client(scheduler) as client:
        after = sum(client.run(lambda dask_worker: len(dask_worker.state.log)).values())
    assert after > before  # the workers did the reductions
    assert _comparable(on_cluster) == _comparable(faulty_diagnosis)
    assert on_cluster["stragglers"], "the faulty run's straggler is found on the cluster too"


def test_the_command_line_takes_the_cluster_address(faulty_run, scheduler):
    out = subprocess.run([sys.executable, "-m", "hyperacc", "analyze", str(faulty_run), "--json", "--cluster",
                          scheduler], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["ranks_analyzed"] == 8


def test_an_unreachable_scheduler_is_one_line_naming_it(faulty_run):
    out = subprocess.run([sys.executable, "-m", "hyperacc", "analyze", str(faulty_run), "--cluster",
                          "tcp://127.0.0.1:9"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "2s"})  # fmt: skip
    assert out.returncode == 2
    assert "tcp://127.0.0.1:9" in out.stderr and "dask-scheduler" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr

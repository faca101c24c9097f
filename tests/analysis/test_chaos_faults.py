"""The faults the detection matrix injects beyond the original ones: a competing process on the rank's
CPU, a slow launch path, a heavier real forward (bench/detection.py)."""

import os
import time

import pytest
import torch

from hyperacc import chaos
from hyperacc.chaos import Chaos, ChaosConfigError


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs CPU affinity")
def test_a_competitor_shares_the_ranks_cpu_and_dies_with_it(tmp_path):
    before = os.sched_getaffinity(0)
    cpu = min(before)
    try:
        c = Chaos({"seed": 1, "faults": [{"kind": "competitor", "ranks": [0], "cpu": cpu}]}, rank=0, node=0,
                  run_dir=tmp_path)  # fmt: skip
        (proc,) = c._competitors
        assert os.sched_getaffinity(0) == {cpu} and os.sched_getaffinity(proc.pid) == {cpu}
        assert proc.poll() is None
        c.close()
        assert proc.poll() is not None
    finally:
        os.sched_setaffinity(0, before)
    (row,) = chaos.read_ground_truth(tmp_path)
    assert row["kind"] == "competitor" and row["detail"] == {"cpus": [cpu], "procs": 1}


def test_a_slow_launch_path_burns_before_every_operator(tmp_path):
    c = Chaos({"seed": 1, "faults": [{"kind": "launch", "ranks": [0], "ms": 0.2}]}, rank=0, node=0, run_dir=tmp_path)
    a, b = torch.zeros(1), torch.ones(1)
    try:
        t0 = time.perf_counter_ns()
        for _ in range(20):
            torch.add(a, b, out=a)
        took = time.perf_counter_ns() - t0
    finally:
        c.close()
    assert took >= 20 * 0.2e6  # each call waited its 0.2 ms before running
    assert a.item() == 20.0  # and then ran
    assert chaos.read_ground_truth(tmp_path)[0]["kind"] == "launch"


def test_a_matmul_slowdown_does_real_tensor_work_and_bad_settings_are_refused():
    c = Chaos({"seed": 1, "faults": [{"kind": "slowdown", "ranks": [0], "factor": 1.0, "work": "matmul"}]},
              rank=0, node=0)  # fmt: skip
    t0 = time.perf_counter_ns()
    c.compute_end(0, compute_ns=3_000_000)
    assert time.perf_counter_ns() - t0 >= 3_000_000
    c.close()
    with pytest.raises(ChaosConfigError, match="work must be 'spin' or 'matmul'"):
        Chaos({"faults": [{"kind": "slowdown", "ranks": [0], "work": "gpu"}]}, rank=0)
    with pytest.raises(ChaosConfigError, match="procs must be >= 1"):
        Chaos({"faults": [{"kind": "competitor", "ranks": [0], "procs": 0}]}, rank=0)

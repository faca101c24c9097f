"""Chaos injects what it says it injected, reproducibly, and refuses bad configurations."""

import json
import os
import platform
import subprocess
import sys
import time
from collections import Counter

import pytest
from scipy import stats

from hyperacc import chaos, harness
from hyperacc.chaos import Chaos, ChaosConfigError

CONFIG = {
    "seed": 5,
    "faults": [
        {"kind": "spike", "ranks": "all", "rate": 0.05, "ms": 3, "dist": "exp"},
        {"kind": "data_stall", "ranks": [1], "rate": 0.1, "ms": 2},
        {"kind": "slowdown", "ranks": [2], "factor": 0.5},
    ],
}


def _drive(c: Chaos, steps: int) -> dict[int, dict[str, float]]:
    """Run the explicit API and measure the time each injection point really took."""
    took: dict[int, dict[str, float]] = {}
    for step in range(steps):
        c.step_begin(step)
        t0 = time.perf_counter_ns()
        c.data(step)
        t1 = time.perf_counter_ns()
        c.compute_end(step, compute_ns=1_000_000)
        t2 = time.perf_counter_ns()
        took[step] = {"data": (t1 - t0) / 1e6, "compute": (t2 - t1) / 1e6}
    c.close()
    return took


def test_ground_truth_matches_what_was_injected(tmp_path):
    took = _drive(Chaos(CONFIG, rank=1, node=0, run_dir=tmp_path), 400)
    truth = chaos.read_ground_truth(tmp_path)
    assert {r["rank"] for r in truth} == {1}
    spikes = {r["step"]: r["magnitude_ms"] for r in truth if r["kind"] == "spike"}
    stalls = {r["step"]: r["magnitude_ms"] for r in truth if r["kind"] == "data_stall"}
    assert "slowdown" not in {r["kind"] for r in truth}  # rank 2 only
    # every recorded injection really cost at least its magnitude where it was injected
    for step, ms in spikes.items():
        assert took[step]["compute"] >= ms * 0.999
    for step, ms in stalls.items():
        assert took[step]["data"] >= ms * 0.999
    # and rates are what was asked for (binomial two-sided test, generous alpha)
    assert stats.binomtest(len(spikes), 400, 0.05).pvalue > 1e-4
    assert stats.binomtest(len(stalls), 400, 0.1).pvalue > 1e-4


def test_same_seed_same_faults_other_seed_other_faults(tmp_path):
    runs = []
    for i, seed in enumerate((5, 5, 6)):
        _drive(Chaos({**CONFIG, "seed": seed}, rank=0, node=0, run_dir=tmp_path / str(i)), 300)
        runs.append([(r["step"], r["kind"], r["magnitude_ms"]) for r in chaos.read_ground_truth(tmp_path / str(i))])
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_slowdown_burns_its_share_of_compute(tmp_path):
    c = Chaos(CONFIG, rank=2, node=0, run_dir=tmp_path)
    t0 = time.perf_counter_ns()
    c.compute_end(0, compute_ns=20_000_000)
    assert time.perf_counter_ns() - t0 >= 10_000_000  # factor 0.5 of 20 ms
    c.close()
    assert [r["kind"] for r in chaos.read_ground_truth(tmp_path)] == ["slowdown"]


def test_gc_pressure_makes_automatic_collections_fire(tmp_path):
    c = Chaos({"seed": 0, "faults": [{"kind": "gc_pressure", "live": 50_000, "garbage": 20_000}]},
              rank=0, node=0, run_dir=tmp_path)
    for step in range(30):
        c.step_begin(step)
    c.close()
    kinds = Counter(r["kind"] for r in chaos.read_ground_truth(tmp_path))
    assert kinds["gc_pressure"] == 30
    assert kinds["gc_pause"] > 0


def test_cold_read_evicts_and_reads(tmp_path):
    c = Chaos({"seed": 0, "faults": [{"kind": "cold_read", "rate": 1.0, "mb": 1}]}, rank=0, node=0, run_dir=tmp_path)
    c.step_begin(0)
    c.close()
    [row] = chaos.read_ground_truth(tmp_path)
    assert row["kind"] == "cold_read" and row["detail"] == {"mb": 1}
    assert not list(tmp_path.glob("chaos/*.bin"))  # its scratch file is removed


_CHURN = """
import json, resource, sys
import numpy as np
from hyperacc.chaos import Chaos

def faults_per_use():
    blocks = [np.ones(256 * 1024 // 8) for _ in range(2)]  # warm: the heap has grown past them once
    del blocks
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(50):
        a = np.ones(256 * 1024 // 8)  # a 256 KiB block, written, then freed
        del a
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 50

plain = faults_per_use()
Chaos({"seed": 0, "faults": [{"kind": "page_churn", "kb": 64}]}, rank=0, node=0, run_dir=sys.argv[1]).close()
print(json.dumps([plain, faults_per_use()]))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="page_churn sets glibc's malloc thresholds")
def test_page_churn_makes_every_use_of_a_large_block_fault_in_fresh_pages(tmp_path):
    # in a process of its own: it changes the C allocator of the process it runs in
    # glibc's defaults in the plain half: a MALLOC_* variable in the environment fixes the thresholds
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", _CHURN, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    plain, churned = json.loads(out.stdout)
    assert plain < 8 and churned >= 60, (plain, churned)  # 64 pages of 4 KiB in each fresh block
    [row] = chaos.read_ground_truth(tmp_path)
    assert row["kind"] == "page_churn" and row["detail"] == {"kb": 64.0, "applied": True}


@pytest.mark.parametrize("config,needle", [
    ("{not json", "not valid JSON"),
    ({"faults": [{"kind": "page_churn", "kb": 1}]}, "kb"),
    ({"faults": [{"kind": "meteor"}]}, "kind"),
    ({"faults": [{"kind": "spike", "rate": 2}]}, "rate"),
    ({"faults": [{"kind": "spike", "colour": "red"}]}, "colour"),
    ({"seed": 1, "speed": 3}, "speed"),
    ({"faults": [{"kind": "spike", "dist": "cauchy"}]}, "dist"),
])
def test_bad_configuration_is_refused_with_its_name(config, needle):
    with pytest.raises(ChaosConfigError, match=needle):
        Chaos(config, rank=0)


@pytest.mark.multirank
def test_unmodified_script_is_disturbed_from_the_environment(tmp_path):
    config = {"seed": 1, "faults": [{"kind": "spike", "ranks": [1], "rate": 0.2, "ms": 5},
                                    {"kind": "data_stall", "ranks": [0], "rate": 0.2, "ms": 5}]}
    job = harness.launch("examples/train_ddp.py", ["--steps", "40", "--hidden", "64", "--features", "64"],
                         nproc=2, timeout=120,
                         env={"HYPERACC_CHAOS": json.dumps(config), "HYPERACC_RUN_DIR": str(tmp_path)})
    assert job.ok, job.explain()
    truth = chaos.read_ground_truth(tmp_path)
    kinds = {(r["rank"], r["kind"]) for r in truth}
    assert kinds == {(1, "spike"), (0, "data_stall")}
    # one record per injected step, never twice (a loss module is an outermost module too)
    steps = [r["step"] for r in truth if r["kind"] == "spike"]
    assert len(steps) == len(set(steps)) and steps
    assert job.results()[0]["checksum"] == job.results()[1]["checksum"]

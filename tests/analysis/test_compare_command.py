"""``hyperacc compare`` as CI runs it: a separate process on real run directories, judged by its exit status.

Also the coordination view, resource findings and merged run directories of ``hyperacc analyze``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from hyperacc import store
from hyperacc.analysis import diagnose
from hyperacc.analysis.synthetic import SyntheticFault, SyntheticRun, write_run
from hyperacc.schema import RESOURCE_SCHEMA

BASE = SyntheticRun(ranks=8, steps=600, seed=3)
# Ranks 1-3 pause for GC in 5 % of their steps: more spikes, a longer tail.
GC = SyntheticRun(ranks=8, steps=600, seed=4, faults=(SyntheticFault("gc", (1, 2, 3), rate=0.05, ms=30.0),))


SUBPROCESS = pytest.mark.slow  # runs the CLI in its own interpreter, as a user does


def hyperacc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hyperacc", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("compare")
    return {
        "base": write_run(root / "base", BASE),
        "same": write_run(root / "same", SyntheticRun(ranks=8, steps=600, seed=5)),
        "gc": write_run(root / "gc", GC),
        "small": write_run(root / "small", SyntheticRun(ranks=4, steps=600, seed=6)),
    }


@SUBPROCESS
def test_a_worse_run_breaks_its_limits_and_exits_1(runs) -> None:
    r = hyperacc("compare", str(runs["base"]), str(runs["gc"]), "--fail-on", "p99=+10%,spike_rate=+2pp", "--json")
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    assert sorted(b.split(": ")[1] for b in doc["broken"]) == ["p99=+10%", "spike_rate=+2pp"]
    rate = next(c for c in doc["changes"] if c["name"] == "spike_rate")
    assert rate["low"] > 0 and rate["worse"]  # the interval of the difference excludes zero
    text = hyperacc("compare", str(runs["base"]), str(runs["gc"]), "--fail-on", "p99=+10%")
    assert text.returncode == 1 and "limit broken" in text.stderr and "p99=+10%" in text.stderr


@SUBPROCESS
def test_a_run_like_the_baseline_passes_and_exits_0(runs) -> None:
    r = hyperacc("compare", str(runs["base"]), str(runs["same"]), "--fail-on", "p99=+10%,spike_rate=+2pp,steps_per_s=-10%")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Within limits" in r.stdout


@SUBPROCESS
@pytest.mark.parametrize(
    "limits, message",
    [("p99<10", "cannot read the limit"), ("p98=+1%", "which is no figure"), ("p99=+x%", "cannot read the limit")],
)
def test_a_bad_limit_is_one_line_and_exits_2(runs, limits: str, message: str) -> None:
    r = hyperacc("compare", str(runs["base"]), str(runs["same"]), "--fail-on", limits)
    assert r.returncode == 2 and message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


@SUBPROCESS
def test_a_missing_run_and_a_single_run_exit_2(runs, tmp_path) -> None:
    r = hyperacc("compare", str(runs["base"]), str(tmp_path / "nowhere"))
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    one = hyperacc("compare", str(runs["base"]))
    assert one.returncode == 2 and "at least two runs" in one.stderr


@SUBPROCESS
def test_runs_at_two_world_sizes_get_the_efficiency_curve_and_the_simulation(runs) -> None:
    r = hyperacc("compare", str(runs["small"]), str(runs["base"]), "--json")
    assert r.returncode == 0, r.stderr
    sc = json.loads(r.stdout)["scaling"]
    assert [p["world_size"] for p in sc["measured"]] == [4, 8]
    assert sc["measured"][0]["efficiency"] == 1.0 and 0 < sc["measured"][1]["efficiency"] < 1.5
    assert all(p["cv"] is not None for p in sc["measured"])
    assert [p["world_size"] for p in sc["simulated"]["points"]] == [4, 8]


@SUBPROCESS
def test_analyze_shows_the_distribution_the_coordination_cost_and_the_failure_modes(runs) -> None:
    doc = diagnose(runs["gc"], batch_size=16).to_dict()
    c = doc["coordination"]
    d = c["distribution"]
    assert d["p50_ns"] <= d["p90_ns"] <= d["p99_ns"] <= d["p999_ns"]
    assert d["samples_per_s"] == pytest.approx(d["steps_per_s"] * 16 * 8)
    cost = c["cost"]
    assert cost["wait_share"] == pytest.approx(cost["collective_share"] + cost["late_share"], rel=1e-6)
    assert c["spread_trend"] and c["spread_trend"][0]["first_step"] == 10  # after the warm-up
    modes = {m["mode"]: m for m in c["failure_modes"]}
    assert set(modes) == {"sync_amplification", "fabric_contention", "locality", "runtime"}
    assert modes["runtime"]["verdict"] == "likely" and "gc" in modes["runtime"]["evidence"]
    assert modes["fabric_contention"]["verdict"] == "no"
    text = hyperacc("analyze", str(runs["gc"]))
    assert text.returncode == 0
    for words in ("p99.9", "Coordination:", "Lost time by failure mode", "sync_amplification", "Resources:"):
        assert words in text.stdout


def test_the_coordination_view_changes_no_verdict(runs) -> None:
    a = diagnose(runs["gc"]).to_dict()
    for key in ("verdict", "stragglers", "spikes", "causes", "projection", "evidence"):
        assert a[key] == diagnose(runs["gc"], batch_size=64).to_dict()[key]


def _resources(run: Path, rank: int, rss_mb: np.ndarray, seconds: float = 60.0, cpu_cores: float = 1.0) -> None:
    n = rss_mb.size
    t = (1_700_000_000 + np.linspace(0, seconds, n)) * 1e9
    table = pa.table({
        "rank": pa.array([rank] * n, pa.int32()), "node": pa.array([rank // 4] * n, pa.int32()),
        "t_ns": pa.array(t.astype(np.int64)), "step": pa.array(np.arange(n) * 10, pa.int64()),
        "rss_bytes": pa.array((rss_mb * 2**20).astype(np.int64)),
        "cpu_ns": pa.array((np.linspace(0, seconds, n) * cpu_cores * 1e9).astype(np.int64)),
        "cuda_allocated_bytes": pa.nulls(n, pa.int64()), "cuda_reserved_bytes": pa.nulls(n, pa.int64()),
        "cuda_peak_bytes": pa.nulls(n, pa.int64()),
    }, schema=RESOURCE_SCHEMA)  # fmt: skip
    store.resource_writer(run, rank).write(table)


@SUBPROCESS
def test_memory_creep_and_a_rank_out_of_line_are_found(tmp_path) -> None:
    run = write_run(tmp_path / "run", SyntheticRun(ranks=8, steps=300, seed=2))
    rng = np.random.default_rng(0)
    for rank in range(8):
        rss = 2000 + rng.normal(0, 5, 61)
        if rank == 2:
            rss = rss + np.linspace(0, 900, 61)  # +900 MiB in a minute: creep
        if rank == 6:
            rss = rss + 1500  # holds 75 % more than the others all along: imbalance, not creep
        if rank == 4:
            rss[30] += 3000  # one transient peak: neither
        _resources(run, rank, rss, cpu_cores=3.0 if rank == 5 else 1.0)
    res = diagnose(run).to_dict()["resources"]
    assert [(c["rank"], c["metric"]) for c in res["creep"]] == [(2, "rss_bytes")]
    assert res["creep"][0]["growth_bytes"] == pytest.approx(900 * 2**20, rel=0.1)
    assert sorted((i["rank"], i["metric"]) for i in res["imbalance"]) == [(5, "cpu_util"), (6, "rss_bytes")]
    text = hyperacc("analyze", str(run))
    assert "memory creep on rank 2" in text.stdout and "imbalance: rank 6" in text.stdout


def test_too_few_samples_say_so_instead_of_judging(tmp_path) -> None:
    run = write_run(tmp_path / "run", SyntheticRun(ranks=2, steps=100, seed=2))
    for rank in range(2):
        _resources(run, rank, np.linspace(1000, 3000, 5), seconds=4)
    res = diagnose(run).to_dict()["resources"]
    assert res["creep"] == [] and "not enough samples" in res["judged"]["creep"]
    assert "not enough ranks" in res["judged"]["imbalance"]


@SUBPROCESS
def test_two_run_directories_of_one_job_are_merged_and_others_refused(tmp_path) -> None:
    # The same job written as two agents' local run directories: ranks 0-3 on one, 4-7 on the other.
    whole = write_run(tmp_path / "whole", BASE)
    parts = [tmp_path / "node0", tmp_path / "node1"]
    for part, ranks in zip(parts, (range(4), range(4, 8)), strict=True):
        for rank in ranks:
            for sub in ("meta",):
                (part / sub).mkdir(parents=True, exist_ok=True)
                name = f"rank-{rank:05d}.json"
                (part / sub / name).write_bytes((whole / sub / name).read_bytes())
            seg = whole / "steps" / f"rank-{rank:05d}"
            (part / "steps" / seg.name).mkdir(parents=True)
            for f in seg.iterdir():
                (part / "steps" / seg.name / f.name).write_bytes(f.read_bytes())
    alone = diagnose(parts[0]).to_dict()
    assert alone["missing_ranks"] == [4, 5, 6, 7]
    merged = diagnose(parts).to_dict()
    full = diagnose(whole).to_dict()
    assert merged["missing_ranks"] == [] and merged["ranks_analyzed"] == 8
    for key in ("verdict", "stragglers", "spikes", "coordination"):
        assert merged[key] == full[key]
    r = hyperacc("analyze", f"{parts[0]},{parts[1]}", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["ranks_analyzed"] == 8
    # a rank written by two directories, and a directory of another world size, are refused with one line
    twice = hyperacc("analyze", f"{parts[0]},{whole}")
    assert twice.returncode == 1 and "rank 0 has step records in both" in twice.stderr  # what they hold: 1
    other = write_run(tmp_path / "other", SyntheticRun(ranks=4, steps=100))
    sizes = hyperacc("analyze", f"{parts[0]},{other}")
    assert sizes.returncode == 1 and "world size" in sizes.stderr and "Traceback" not in sizes.stderr
    cmp = hyperacc("compare", f"{parts[0]},{parts[1]}", str(whole), "--fail-on", "p99=+1%")
    assert cmp.returncode == 0, cmp.stdout + cmp.stderr  # the same job: nothing changed

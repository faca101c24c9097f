"""Stabilizers in real torchrun jobs (gloo) on this machine."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hyperacc import harness
from hyperacc.stabilize.affinity import plan_affinity

WORKERS = Path(__file__).parent / "workers"
pytestmark = pytest.mark.multirank


def marked_line(script: Path, marker: str) -> str:
    for n, line in enumerate(script.read_text().splitlines(), start=1):
        if line.rstrip().endswith(f"# {marker}"):
            return f"{script}:{n}"
    raise AssertionError(f"{marker} not in {script}")


def test_affinity_masks_equal_the_plan() -> None:
    nproc, workers = 2, 2
    job = harness.launch(WORKERS / "affinity_rank.py", [str(workers)], nproc=nproc, timeout=120)
    assert job.ok, job.explain()
    plan = plan_affinity(nproc, workers)  # what the plan says for this machine
    for res in job.results():
        assert res["disabled"] == {}
        want = plan.ranks[res["local_rank"]]
        assert res["binding"] == want.to_dict()
        main = sorted(want.main_cpus)
        assert all(mask == main for mask in res["threads"].values()), res["threads"]
        assert res["torch_threads"] == want.threads
        seen = {s["worker"]: s for s in res["workers"]}
        assert sorted(seen) == list(range(workers))
        for w, s in seen.items():
            assert s["cpus"] == sorted(want.worker_cpus[w])
            assert s["gc"] is True  # workers do not inherit the disabled GC
            assert s["user"] is True  # the user's worker_init_fn still ran


def test_gc_valve_collects_at_the_same_step_on_every_rank() -> None:
    job = harness.launch(WORKERS / "valve_rank.py", nproc=2, timeout=120)
    assert job.ok, job.explain()
    r0, r1 = job.results()

    def collections(res: dict, prefix: str) -> list[int]:
        return [
            r["step"] for r in res["records"] if r["kind"] == "gc_collect" and r["detail"].startswith(prefix)
        ]

    assert collections(r0, "scheduled") == collections(r1, "scheduled") == [50, 100, 150]
    valve0, valve1 = collections(r0, "valve"), collections(r1, "valve")
    assert valve0, f"no valve collection; rank 1 records: {r1['records']}"
    assert valve0 == valve1
    assert all("proposer=1" in r["detail"] and "late" not in r["detail"]
               for r in r0["records"] if r["kind"] == "gc_collect" and r["detail"].startswith("valve"))  # fmt: skip
    assert not [r for r in r0["records"] if r["kind"] == "gc_valve_proposed"]  # rank 0 never grew
    assert [r for r in r1["records"] if r["kind"] == "gc_valve_proposed"]
    # memory release rides on the same schedule and on the valve
    rel0 = [r["step"] for r in r0["records"] if r["kind"] == "memory_release"]
    assert set(valve0) | {50, 100, 150} <= set(rel0)


def test_audit_finds_barrier_and_item_and_elision_keeps_results() -> None:
    script = WORKERS / "train_audit_rank.py"
    job = harness.launch(script, nproc=2, timeout=150)
    assert job.ok, job.explain()
    barrier_site = marked_line(script, "BARRIER-LINE")
    item_site = marked_line(script, "ITEM-LINE")
    setup_site = marked_line(script, "SETUP-BARRIER")
    for res in job.results():
        # None of the stabilizers changes training results.
        assert res["audited"] == res["base"]
        assert res["elided"] == res["base"]
        assert res["summary"]["disabled"] == {}
        assert res["summary"]["gc"]["scheduled"] >= 3

        sites = {(s["kind"], s["site"]): s for s in res["audit"]["sites"]}
        barrier = sites[("barrier", barrier_site)]
        assert barrier["calls"] == 20 and barrier["redundant"] and barrier["in_loop"]
        assert barrier_site in res["audit"]["redundant_barriers"]
        item = sites[("host_sync", item_site)]
        assert item["calls"] == 20 and not item["redundant"]

        el = {(s["kind"], s["site"]): s for s in res["elision"]["sites"]}[("barrier", barrier_site)]
        assert el["calls"] + el["elided"] == 20
        assert el["calls"] == 3  # step 0 (with set-up), steps 1 and 2; elided from step 3 on
        assert res["elision"]["elided"] == 17
    assert os.path.exists(setup_site.rsplit(":", 1)[0])

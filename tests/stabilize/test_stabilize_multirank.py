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


def test_gc_auto_interval_is_agreed_and_shortened_on_every_rank() -> None:
    job = harness.launch(WORKERS / "gc_auto_rank.py", nproc=2, timeout=180)
    assert job.ok, job.explain()
    r0, r1 = job.results()

    def plans(res: dict) -> list[tuple[int, int]]:
        return [(int(r["value"]), r["step"]) for r in res["records"] if r["kind"] == "gc_auto_interval"]

    def candidates(res: dict) -> list[int]:
        return [int(r["value"]) for r in res["records"] if r["kind"] == "gc_auto_candidate"]

    p0, p1 = plans(r0), plans(r1)
    assert p0 == p1 and len(p0) >= 2, (p0, p1)  # the first agreement, then shorter ones
    assert p0[0][0] == 20  # calibration without heavy garbage: pauses far below 20 ms, capped at max_interval
    intervals = [p[0] for p in p0]
    assert intervals == sorted(intervals, reverse=True) and intervals[-1] < 20  # only ever shortened
    # the agreed interval is the smallest candidate of any rank, round by round
    c0, c1 = candidates(r0), candidates(r1)
    assert [min(a, b) for a, b in zip(c0, c1, strict=True)] == intervals

    def scheduled(res: dict) -> list[int]:
        return [r["step"] for r in res["records"] if r["kind"] == "gc_collect" and r["detail"].startswith("scheduled")]

    s0, s1 = scheduled(r0), scheduled(r1)
    assert s0 == s1  # the same steps on every rank, through every change of plan
    steps = 400  # the job's
    bounds = [p[1] for p in p0] + [steps]
    for (interval, begin), end in zip(p0, bounds[1:], strict=True):
        # each plan's grid holds until the next plan starts or the job ends: a plan agreed in the last
        # steps can start after them (a rank was seen to agree on one from step 400, then another)
        end = min(end, steps)
        if end > begin:
            assert [x for x in s0 if begin <= x < end] == list(range(begin, end, interval))


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
        assert res["dry"] == res["base"]
        assert res["summary"]["disabled"] == {}
        assert res["summary"]["gc"]["scheduled"] >= 3

        sites = {(s["kind"], s["site"]): s for s in res["audit"]["sites"]}
        barrier = sites[("barrier", barrier_site)]
        assert barrier["calls"] == 20 and barrier["redundant"] and barrier["in_loop"]
        assert barrier_site in res["audit"]["redundant_barriers"]
        # CPU tensors: no host sync waits on a device, and AdamW's/the sampler's own .item() are not counted
        assert [s for s in res["audit"]["sites"] if s["kind"] == "host_sync"] == []
        assert res["audit"]["visibility"].startswith("CPU-only run")
        dry = {(s["kind"], s["site"]): s for s in res["dry_run"]["sites"] if s["kind"] == "host_sync"}
        checksum_site = marked_line(script, "CHECKSUM-LINE")
        assert sorted(dry) == sorted([("host_sync", item_site), ("host_sync", checksum_site)])
        assert dry[("host_sync", item_site)]["calls"] == 20 and dry[("host_sync", item_site)]["in_loop"]
        assert dry[("host_sync", checksum_site)]["calls"] == 1 and not dry[("host_sync", checksum_site)]["in_loop"]

        el = {(s["kind"], s["site"]): s for s in res["elision"]["sites"]}[("barrier", barrier_site)]
        assert el["calls"] + el["elided"] == 20
        assert el["calls"] == 3  # step 0 (with set-up), steps 1 and 2; elided from step 3 on
        assert res["elision"]["elided"] == 17
    assert os.path.exists(setup_site.rsplit(":", 1)[0])


def test_a_gc_part_that_fails_on_one_rank_is_switched_off_on_every_rank() -> None:
    job = harness.launch(WORKERS / "off_rank.py", nproc=2, timeout=180)
    assert job.ok, job.explain()
    r0, r1 = job.results()
    assert "injected" in r1["summary"]["disabled"]["gc"], r1["summary"]["disabled"]
    assert r0["summary"]["disabled"]["gc"].startswith("rank 1: RuntimeError: injected"), r0["summary"]["disabled"]
    for res in (r0, r1):
        assert "memory" not in res["summary"]["disabled"]  # only the failing part
        assert res["gc_after"]["enabled"] and res["gc_after"]["threshold"][2] < 1 << 30  # automatic GC back
    [off0] = [r for r in r0["records"] if r["kind"] == "stabilizer_off"]
    assert off0["detail"] == f"gc: switched off on {r0['summary']['disabled']['gc']}", off0
    assert off0["step"] >= 20, off0  # after rank 1's failure at step 20
    collected = [r["step"] for r in r0["records"] if r["kind"] == "gc_collect"]
    assert collected and max(collected) < off0["step"], (collected, off0)  # none after the switch-off
    released = [r["step"] for r in r0["records"] if r["kind"] == "memory_release"]
    assert released and max(released) > off0["step"], released  # memory release goes on

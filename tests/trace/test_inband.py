"""The in-band exchange on real DDP jobs (gloo, torchrun): every rank sees every rank's values, the
culprit is the rank that waited least, gradients are untouched, failing pacers/listeners switch off."""

from __future__ import annotations

from pathlib import Path

import pyarrow.compute as pc
import pytest

from hyperacc import harness, store

JOB = Path(__file__).parent / "jobs" / "inband_job.py"


def same(seen_ns: int, own_ns: int) -> bool:
    """A value that travelled as float32 milliseconds: ~7 significant digits."""
    if own_ns < 0 or seen_ns < 0:
        return own_ns < 0 and seen_ns < 0
    return abs(seen_ns - own_ns) <= 1e-6 * own_ns + 2


@pytest.mark.multirank
def test_four_ranks_share_values_and_name_the_culprit(tmp_path: Path) -> None:
    run = tmp_path / "run"
    steps = 12
    job = harness.launch(JOB, ["--run-dir", str(run), "--steps", str(steps)], nproc=4, timeout=240)
    assert job.ok, job.explain()
    results = job.results()
    slow = results[0]["slow"]

    assert all(res["exchanging"] for res in results)
    table = store.read_steps(run)
    by_rank = {r: table.filter(pc.equal(table["rank"], r)).to_pylist() for r in range(4)}

    # Round r carries round r-1's values: the listener hears of steps 0 .. steps-2, the same on every rank,
    # and what it hears of a rank is that rank's own recorded wait of that step.
    seen = results[0]["seen"]
    assert [s[0] for s in seen] == list(range(steps - 1))
    for other in results[1:]:
        assert other["seen"] == seen
    for step, arrivals, waits in seen:
        for rank in range(4):
            own_wait = by_rank[rank][step]["comm_wait_ns"]
            assert same(waits[rank], own_wait), (step, rank, waits[rank], own_wait)
        assert all(w > 0 for w in waits)
        assert all(a > 0 for a in arrivals) if step > 0 else all(a == -1 for a in arrivals)
    # min_wait_rank of step s names the culprit of step s-1; the sleeping rank from step 2 on
    culprits = [row["min_wait_rank"] for row in by_rank[0] if row["step"] >= 4]
    for r in range(1, 4):
        assert [row["min_wait_rank"] for row in by_rank[r] if row["step"] >= 4] == culprits
    assert culprits.count(slow) >= 0.8 * len(culprits), culprits

    def median(values: list[int]) -> float:
        values = sorted(values)
        return values[len(values) // 2]

    late = [row for row in by_rank[slow] if row["step"] >= 2]
    assert median([row["self_ns"] for row in late]) >= 45e6  # it slept 50 ms before its backward
    for r in set(range(4)) - {slow}:
        rows = [row for row in by_rank[r] if row["step"] >= 2]
        assert median([row["comm_wait_ns"] for row in rows]) > median([row["comm_wait_ns"] for row in late])

    # The slots are stripped: gradients equal those of untouched DDP up to the summation order of the
    # longer buffer (at more than 2 ranks the ring's chunk boundaries move).
    for res in results:
        assert max(res["max_diff"]) < 1e-6


@pytest.mark.multirank
def test_two_ranks_gradients_bit_identical_and_failing_parts_switch_off(tmp_path: Path) -> None:
    run = tmp_path / "run"
    steps = 12
    job = harness.launch(
        JOB, ["--run-dir", str(run), "--steps", str(steps), "--faults"], nproc=2, timeout=240
    )
    assert job.ok, job.explain()
    for res in job.results():
        assert all(res["exact"]), res["max_diff"]  # two-rank sums do not depend on the order
        assert [s[0] for s in res["seen"]] == list(range(steps - 1))  # the good listener kept going
    stderr = job.ranks[0].stderr
    assert stderr.count("pacing delay failed") == 1, stderr[-3000:]
    assert stderr.count("listener failure injected") == 1, stderr[-3000:]

    table = store.read_steps(run)
    rank0 = table.filter(pc.equal(table["rank"], 0)).to_pylist()
    rank1 = table.filter(pc.equal(table["rank"], 1)).to_pylist()
    assert [(r["pace_on"], r["pace_delay_ns"]) for r in rank0[:8]] == [(False, 0)] * 3 + [
        (True, 2_000_000)
    ] * 5
    assert all(r["pace_delay_ns"] == 0 for r in rank1[:8])
    assert all(r["pace_delay_ns"] is None for r in rank0[8:])  # the pacer raised at step 8: switched off
    assert all(r["self_ns"] is not None and r["comm_wait_ns"] is not None for r in rank0 + rank1)


@pytest.mark.multirank
def test_half_precision_buckets_carry_the_values_in_their_own_dtype() -> None:
    job = harness.launch(Path(__file__).parent / "jobs" / "half_job.py", nproc=2, timeout=180)
    assert job.ok, job.explain()
    r0, r1 = job.results()
    for dtype in ("torch.float16", "torch.bfloat16"):
        assert r0[dtype]["exchanging"] and r1[dtype]["exchanging"]
        assert r0[dtype]["seen"] == r1[dtype]["seen"]  # every rank decoded the same values
        assert [s[0] for s in r0[dtype]["seen"]] == [0, 1, 2, 3]
        assert all(w > 0 for _, waits in r0[dtype]["seen"] for w in waits)

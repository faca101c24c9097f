"""The work between steps (docs/detection.md, "The work between steps"): in a loop without a DataLoader
the input gap is GC, the rank's own host work, or input, by what the step records measure."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from hyperacc import harness
from hyperacc.analysis import diagnose
from hyperacc.analysis.attribution import attribute_spikes, gap_causes
from hyperacc.analysis.diagnosis import _straggler_phrase, kind_word
from hyperacc.analysis.live import _straggler_line
from hyperacc.analysis.options import DetectionOptions
from hyperacc.analysis.stragglers import detect_stragglers
from hyperacc.analysis.windows import summarize_windows

JOB = Path(__file__).parent / "jobs" / "nanogpt_faults.py"
MS = 1_000_000


def test_gap_causes_split_by_cpu_and_gc_time():
    o = DetectionOptions()
    gap = np.array([40, 40, 40, 40, 60]) * MS
    gc = np.array([22, 2, 0, 6, 0]) * MS
    cpu = np.array([16, 16, 0.1, 0.2, 0.5]) * MS
    zero = np.zeros(5)
    # GC explains half or is the only signal -> gc; CPU grew -> host_work; neither -> data (input)
    assert list(gap_causes(gap, gc, cpu, zero, zero, o)) == ["gc", "host_work", "data", "gc", "data"]
    # CPU growth within its noise is no work; it is no evidence of waiting either once it accounts for
    # half the gap or more (a busy loop preempted on a loaded host): unknown, never input
    noisy = np.full(3, 40 * MS)
    assert list(gap_causes(gap[:3], np.zeros(3), np.array([16, 20, 30]) * MS, zero[:3], noisy, o)) == [
        "data", "unknown", "unknown"]  # fmt: skip


def _rank(rank: int, n: int, gap_ms: float, cpu_ms: float, gc_ms: float, rng: np.random.Generator,
          stall: np.ndarray | None = None) -> dict[str, np.ndarray]:  # fmt: skip
    data = gap_ms * MS * (1 + 0.02 * rng.standard_normal(n))
    if stall is not None:
        data = data + stall
    fwd = 2 * MS * (1 + 0.02 * rng.standard_normal(n))
    self_ns = data + fwd
    return {
        "rank": np.full(n, rank), "node": np.zeros(n, dtype=int), "step": np.arange(n),
        "step_ns": self_ns + 5 * MS, "self_ns": self_ns, "data_ns": data, "forward_ns": fwd,
        "comm_wait_ns": np.full(n, 5.0 * MS), "gc_ns": gc_ms * MS * (1 + 0.02 * rng.standard_normal(n)),
        "cpu_ns": (cpu_ms + 2) * MS * (1 + 0.02 * rng.standard_normal(n)), "data_gap": np.ones(n),
    }  # fmt: skip


def _windows(ranks: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    o = DetectionOptions()
    parts = [summarize_windows(c, o) for c in ranks]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


@pytest.mark.parametrize(
    ("gap", "cpu", "gc", "kind"),
    [(10, 6, 1, "host_work"), (10, 6, 6, "gc"), (10, 0.2, 0, "data")],
)
def test_a_slow_input_gap_is_named_by_where_the_time_went(gap, cpu, gc, kind):
    rng = np.random.default_rng(3)
    ranks = [_rank(r, 400, 0.4, 0.3, 0.0, rng) for r in range(1, 5)] + [_rank(0, 400, gap, cpu, gc, rng)]
    found = detect_stragglers(_windows(ranks), DetectionOptions())
    assert [(s.rank, s.metric, s.kind, s.between_steps) for s in found] == [(0, "data_ns", kind, True)]
    # the gap is the time outside the timed phases before the step's last backward: the text sends the
    # user to both places it can lie (an outside job's busy loop between a forward and its backward)
    if kind in ("gc", "host_work"):
        text = _straggler_phrase(dataclasses.asdict(found[0]))
        assert "between `optimizer.step()` and the next forward, or between a forward and its backward" in text
    # live says the metric as offline does: the time between steps, not a "data wait" (an outside job's
    # rank working between its steps was told "host-work straggler: data wait 20.71x" live)
    live = _straggler_line(found[0], None)
    assert f"is a {kind_word(kind)} straggler: time between steps " in live and "data wait" not in live, live


def test_a_gap_spike_without_cpu_growth_is_input_with_cpu_growth_host_work():
    rng = np.random.default_rng(4)
    cols = _rank(0, 300, 0.4, 0.3, 0.0, rng)
    idx = np.array([100, 200])
    cols["data_ns"][idx] += 60 * MS  # both spikes: 60 ms longer gap
    cols["cpu_ns"][200] += 40 * MS  # the second one worked for it
    causes, _ = attribute_spikes(cols, idx, np.full(2, 60.0 * MS), cols["self_ns"], DetectionOptions())
    assert list(causes) == ["data", "host_work"]
    cols["data_gap"][:] = 0  # a DataLoader fetch: the data wait is input whatever the CPU did
    causes, _ = attribute_spikes(cols, idx, np.full(2, 60.0 * MS), cols["self_ns"], DetectionOptions())
    assert list(causes) == ["data", "data"]


@pytest.mark.multirank
@pytest.mark.alone
def test_gc_and_host_work_after_optimizer_step_are_never_input_a_blocking_read_is(tmp_path: Path) -> None:
    # rank 0 builds 30,000 reference cycles after every optimizer.step(): its own host work between
    # steps, and the automatic GC that frees them; rank 2 waits 50 ms for every 10th batch (a blocking
    # read); the loop reads batches by hand (no DataLoader). 4 ranks on 2 cores: every rank is also
    # preempted in its gap, which is no input wait either (CI saw such spikes called data). With another
    # 4-rank job beside it (as the suite's other worker may run) a step's self-time swings 6-50 ms, and a
    # 20 ms read was mostly no spike at all (named data on 7 and 1 of its 29 reads in two such runs; 50 ms
    # reads: 25-28 in three).
    run_dir = tmp_path / "run"
    opts = {"run-dir": str(run_dir), "trace": json.dumps({"flush_every_s": 1.0})}
    args = ["--steps", "300", "--cycles-rank", "0", "--cycles", "30000", "--input-rank", "2", "--input-ms", "50"]
    job = harness.launch(JOB, args, nproc=4, timeout=400, traced=opts)
    assert job.ok, job.explain()
    d = diagnose(run_dir).to_dict()
    found = d["stragglers"] + d["episodes"]
    # one finding of rank 0 (a straggler, or an episode of it); an episode that began later on top of its
    # straggler (a burst of its collections) is rank 0's too
    assert found and {s["rank"] for s in found} == {0}, d["verdict"]
    assert len(d["stragglers"]) + len([e for e in d["episodes"] if e["since_step"] <= 60]) == 1, d["verdict"]
    s = found[0]
    assert s["kind"] in ("gc", "host_work") and s["between_steps"], d["verdict"]
    assert s["gc_ns"] > s["cluster_gc_ns"] + 1e6
    assert "data straggler" not in d["verdict"], d["verdict"]
    assert not [line for line in d["next_step"] if line.startswith("rank 0") and "loader workers" in line], d
    assert "of GC per step" in d["verdict"], d["verdict"]
    # the blocked reads are rank 2's, and only rank 2 is said to stall in data loading
    assert [e["rank"] for e in d["rank_causes"] if e["cause"] == "data"] == [2], d["rank_causes"]
    by_cause = {r["rank"]: r.get("by_cause") or {} for r in d["spikes"]["per_rank"]}
    assert by_cause[2]["data"]["spikes"] >= 15, by_cause[2]  # of 29 blocked reads after the warm-up


def test_a_slow_gap_whose_cpu_time_grew_within_the_others_spread_is_not_called_input():
    # the other ranks' CPU time per step differs widely, so a CPU excess of more than half the gap is
    # within their spread: neither work nor waiting is shown, and the text says so
    rng = np.random.default_rng(5)
    ranks = [_rank(r, 400, 0.4, cpu, 0.0, rng) for r, cpu in zip(range(1, 5), (0.3, 6.0, 12.0, 18.0), strict=True)]
    found = detect_stragglers(_windows([*ranks, _rank(0, 400, 10, 25, 0, rng)]), DetectionOptions())
    gap = [s for s in found if s.metric == "data_ns"]
    assert [(s.rank, s.kind, s.between_steps) for s in gap] == [(0, "unknown", True)], found
    text = _straggler_phrase(dataclasses.asdict(gap[0]))
    assert "unexplained straggler" in text and "neither its own work nor a wait for input" in text, text
    assert "input (no DataLoader" not in text

"""diagnose() on run directories with known faults, written through store.SegmentWriter."""

import dataclasses
import json
import logging
import os

import numpy as np
import pytest
from analysis_runs import DATA_RANK, FAULTY, GC_RANK, SLOW_RANK

from hyperacc import store, theory
from hyperacc.analysis import diagnose
from hyperacc.analysis.synthetic import SyntheticFault, SyntheticRun, write_run
from hyperacc.chaos import read_ground_truth


def truth_steps(run_dir, rank, kind, first=10):
    return {
        t["step"]
        for t in read_ground_truth(run_dir)
        if t["rank"] == rank and t["kind"] == kind and t["step"] >= first
    }


def test_the_slow_rank_is_the_only_straggler_and_found_within_300_steps(faulty_diagnosis):
    d = faulty_diagnosis
    assert [(s["rank"], s["kind"]) for s in d["stragglers"]] == [(SLOW_RANK, "compute")]
    s = d["stragglers"][0]
    assert s["confirmed_step"] < 300 and s["since_step"] <= 60
    assert 1.10 < s["slowdown"] < 1.20
    assert s["comm_wait_ns"] < s["cluster_comm_wait_ns"]  # the culprit waits least
    assert f"Rank {SLOW_RANK}" in d["verdict"] and "compute straggler" in d["verdict"]


def test_data_stall_rank_spike_rate_interval_covers_the_injected_rate(faulty_run, faulty_diagnosis):
    row = next(r for r in faulty_diagnosis["spikes"]["per_rank"] if r["rank"] == DATA_RANK)
    injected = len(truth_steps(faulty_run, DATA_RANK, "data_stall")) / row["steps"]
    assert row["ci_low"] <= injected <= row["ci_high"]
    assert row["ci_low"] <= 0.03 <= row["ci_high"]
    assert row["cause"] == "data"
    data = row["by_cause"]["data"]  # the data spike rate, with its own interval
    assert data["spikes"] == row["spikes"] and data["ci_low"] <= injected <= data["ci_high"]


def test_every_spike_lands_on_an_injected_fault_with_the_right_cause(faulty_run, faulty_diagnosis):
    events = faulty_diagnosis["spikes"]["events"]
    assert events, "events list the largest spikes"
    stalls = truth_steps(faulty_run, DATA_RANK, "data_stall")
    pauses = truth_steps(faulty_run, GC_RANK, "gc_pause")
    for e in events:
        if e["rank"] == DATA_RANK:
            assert e["step"] in stalls and e["cause"] == "data" and e["phase"] == "data_ns"
        else:
            assert (e["rank"], e["cause"]) == (GC_RANK, "gc") and e["step"] in pauses
    per_rank = {r["rank"]: r for r in faulty_diagnosis["spikes"]["per_rank"]}
    assert per_rank[GC_RANK]["spikes"] == len(pauses) and per_rank[GC_RANK]["cause"] == "gc"
    quiet = [r for r in per_rank if r not in (DATA_RANK, GC_RANK)]
    assert all(per_rank[r]["spikes"] == 0 for r in quiet)


def test_causes_are_ranked_by_time_lost(faulty_diagnosis):
    causes = faulty_diagnosis["causes"]
    assert [c["cause"] for c in causes] == ["data", "gc"]
    assert causes[0]["time_lost_ns"] > causes[1]["time_lost_ns"]
    assert sum(c["share"] for c in causes) == pytest.approx(1.0)


def test_projection_uses_the_theory(faulty_diagnosis):
    p = faulty_diagnosis["projection"]
    assert p["ranks_per_node"] == FAULTY.ranks_per_node and p["target"] == theory.DEFAULT_TARGET
    row = next(r for r in p["rows"] if r["nodes"] == 256)
    assert row["p_cluster"] == pytest.approx(theory.cluster_spike_probability(p["p_rank"], 4, 256))
    assert row["required_p_rank"] == pytest.approx(theory.required_rate(p["target"], 256, 4))
    assert any("256-node" in e or "64-node" in e for e in faulty_diagnosis["evidence"])


def test_document_keys_and_plain_json(faulty_diagnosis):
    d = faulty_diagnosis
    for key in ("schema_version", "run_dir", "world_size", "nodes", "steps", "missing_ranks", "verdict",
                "evidence", "next_step", "stragglers", "spikes", "causes", "projection"):  # fmt: skip
        assert key in d
    assert set(d["spikes"]) >= {"per_rank", "per_node", "cluster", "events"}
    assert set(d["stragglers"][0]) >= {"rank", "node", "kind", "metric", "slowdown", "since_step",
                                      "windows_flagged", "windows_seen"}  # fmt: skip
    json.loads(json.dumps(d, allow_nan=False))
    assert (d["world_size"], d["nodes"], d["steps"], d["missing_ranks"]) == (8, 2, 2000, [])


def test_a_clean_run_flags_nothing(clean_run):
    d = diagnose(clean_run).to_dict()
    assert d["stragglers"] == []
    assert d["spikes"]["cluster"]["spike_steps"] == 0 and d["causes"] == []
    assert d["verdict"].startswith("Steady")


def test_a_slow_node_is_reported_as_a_node_problem(tmp_path):
    spec = SyntheticRun(ranks=12, steps=600, ranks_per_node=2, seed=5,
                        faults=(SyntheticFault("slowdown", (4, 5), factor=0.2),))  # fmt: skip
    d = diagnose(write_run(tmp_path / "run", spec)).to_dict()
    assert sorted((s["rank"], s["kind"]) for s in d["stragglers"]) == [(4, "node"), (5, "node")]
    assert d["verdict"].startswith("Node 2 is slow (2 of its 2 ranks")


def test_communication_spikes_are_the_networks(tmp_path):
    spec = SyntheticRun(ranks=6, steps=1500, seed=8, faults=(SyntheticFault("comm", rate=0.01, ms=25),))
    run = write_run(tmp_path / "run", spec)
    d = diagnose(run).to_dict()
    truth = {t["step"] for t in read_ground_truth(run) if t["kind"] == "comm" and t["step"] >= 10}
    comm = [c for c in d["causes"] if c["cause"] == "communication"]
    assert comm and comm[0]["spikes"] == len(truth)
    assert all(r["spikes"] == 0 for r in d["spikes"]["per_rank"])  # no rank is blamed for the network
    assert d["spikes"]["cluster"]["spike_steps"] == len(truth)
    assert d["nodes"] == 2 and any("check the network" in s for s in d["next_step"]), d["next_step"]
    # the same job on one node: no network link between its ranks, and the advice does not send the user
    # to one
    one = diagnose(write_run(tmp_path / "one", dataclasses.replace(spec, ranks_per_node=6))).to_dict()
    assert one["nodes"] == 1 and [c["cause"] for c in one["causes"]][:1] == ["communication"], one["causes"]
    advice = [s for s in one["next_step"] if s.startswith("communication spikes")]
    assert advice and "no network link" in advice[0] and "check the network" not in advice[0], one["next_step"]


def test_missing_ranks_and_truncated_segments_are_not_fatal(tmp_path, caplog):
    spec = SyntheticRun(ranks=6, steps=400, seed=2, missing=(4,), segment_steps=100,
                        faults=(SyntheticFault("slowdown", (1,), factor=0.2),))  # fmt: skip
    run = write_run(tmp_path / "run", spec)
    seg = run / "steps" / "rank-00002" / "seg-000003.parquet"
    seg.write_bytes(seg.read_bytes()[:200])  # a SIGKILL mid-write
    with caplog.at_level(logging.WARNING):
        d = diagnose(run).to_dict()
    assert d["missing_ranks"] == [4] and d["ranks_analyzed"] == 5 and d["world_size"] == 6
    assert any("seg-000003" in r.message for r in caplog.records)
    assert [s["rank"] for s in d["stragglers"]] == [1]
    per_rank = {r["rank"]: r for r in d["spikes"]["per_rank"]}
    assert (per_rank[2]["steps"], per_rank[0]["steps"]) == (290, 390)  # the unreadable 100 steps are skipped
    assert any("[4]" in e for e in d["evidence"])


def test_segments_from_store_writer_in_any_order_and_duplicated_steps(tmp_path):
    spec = SyntheticRun(ranks=4, steps=300, seed=1)
    run = write_run(tmp_path / "run", spec)
    # a resumed writer appends an overlapping segment: the last record of a step wins
    t = store.read_steps(run).filter(np.array(store.read_steps(run).column("rank")) == 0).slice(100, 20)
    store.step_writer(run, 0).write(t)
    d = diagnose(run).to_dict()
    assert next(r for r in d["spikes"]["per_rank"] if r["rank"] == 0)["steps"] == 290


def test_bad_run_dirs_give_one_clear_error(tmp_path):
    with pytest.raises(store.RunDirError, match="does not exist"):
        diagnose(tmp_path / "nope")
    (tmp_path / "empty" / "meta").mkdir(parents=True)
    with pytest.raises(store.RunDirError, match="no step records"):
        diagnose(tmp_path / "empty")
    os.makedirs(tmp_path / "plain")
    with pytest.raises(store.RunDirError, match="not a hyperacc run directory"):
        diagnose(tmp_path / "plain")


def test_unknown_or_impossible_options_are_refused(clean_run):
    with pytest.raises(ValueError, match="unknown detection option"):
        diagnose(clean_run, z_treshold=3)
    with pytest.raises(ValueError, match="persist_k"):
        diagnose(clean_run, persist_k=6, persist_n=5)


def test_thresholds_change_the_answer(faulty_run):
    loose = diagnose(faulty_run, min_slowdown=0.5).to_dict()  # 15 % is no longer enough
    assert loose["stragglers"] == []
    assert loose["spikes"]["per_rank"] == diagnose(faulty_run).to_dict()["spikes"]["per_rank"]


def test_too_little_data_says_what_was_not_judged(tmp_path):
    d = diagnose(write_run(tmp_path / "two", SyntheticRun(ranks=2, steps=300, ranks_per_node=1))).to_dict()
    assert d["verdict"] == "Steady: no spike in 290 steps (stragglers are not judged with 2 rank(s))."
    short = diagnose(write_run(tmp_path / "short", SyntheticRun(ranks=4, steps=8))).to_dict()
    assert short["verdict"].startswith("Nothing to judge yet") and short["spikes"]["cluster"]["steps"] == 0


def test_what_if_says_a_saving_smaller_than_its_figures_last_digit_as_the_saving() -> None:
    from hyperacc.analysis.diagnosis import what_if_sentences

    job = 19_900_000_000
    culprits = [
        {"what": "straggler", "rank": 1, "since_step": 50, "saved_ns": 1.2e9, "job_ns_without": job - 1.2e9, "saved_frac": 1.2e9 / job},
        {"what": "spikes", "rank": 1, "cause": "compute", "saved_ns": 37.1e6, "job_ns_without": job - 37.1e6, "saved_frac": 37.1e6 / job},
    ]  # fmt: skip
    both = {"saved_ns": 1.24e9, "job_ns_without": job - 1.24e9, "saved_frac": 1.24e9 / job}
    lines = what_if_sentences({"job_ns": job, "culprits": culprits, "all": both})
    assert lines[0] == "Without rank 1's slowness since step 50 the job would have taken 18.7 s instead of 19.9 s (-6 %)."
    # not "19.9 s instead of 19.9 s"
    assert lines[1] == "Without rank 1's compute spikes the job would have taken 37.1 ms less than its 19.9 s (-0.19 %).", lines
    assert lines[2].startswith("Without both culprits together: 18.7 s instead of 19.9 s"), lines


def test_one_stall_that_lost_most_of_the_time_is_said_with_what_it_cost(tmp_path):
    # An outside job (2026-12-07): one rank's training thread blocked 8 s once, in a 15 s job; the verdict
    # read "No straggler, but 10 % of steps spiked ..., a floor the ranks share (no rank stands out)".
    stall = SyntheticFault("host", ranks=(2,), ms=5000, every=10**6, start_step=300)
    noise = SyntheticFault("data_stall", ranks=tuple(range(8)), rate=0.02, ms=20)
    d = diagnose(write_run(tmp_path / "stall", SyntheticRun(ranks=8, steps=1000, seed=3, faults=(stall, noise))))
    (s,) = d.stalls
    assert (s["rank"], s["step"], s["cause"]) == (2, 300, "host") and 4.5e9 < s["excess_ns"] < 5.5e9, s
    assert "Rank 2 (node 0) stalled 5" in d.verdict and "at step 300" in d.verdict, d.verdict
    assert "Without rank 2's stall at step 300 the job would have taken" in d.verdict
    assert 4e9 < s["job_time_lost_ns"] < 5.5e9 and not d.stragglers
    assert any(line.startswith("rank 2, step 300: one stall of that rank") for line in d.next_step)
    # the same spike floor without the stall, and the stall beside a floor that lost more: no stall said
    assert diagnose(write_run(tmp_path / "floor", SyntheticRun(ranks=8, steps=1000, seed=3, faults=(noise,)))).stalls == []
    heavy = SyntheticFault("data_stall", ranks=tuple(range(8)), rate=0.05, ms=200)
    busy = diagnose(write_run(tmp_path / "busy", SyntheticRun(ranks=8, steps=1000, seed=3, faults=(stall, heavy))))
    assert busy.stalls == [] and "stalled" not in busy.verdict
    # two ranks stalled alike at one step: the job waited for both, so neither alone cost it the step
    both = SyntheticFault("host", ranks=(2, 5), ms=5000, every=10**6, start_step=300)
    twice = diagnose(write_run(tmp_path / "both", SyntheticRun(ranks=8, steps=1000, seed=3, faults=(both, noise))))
    assert twice.stalls == [], twice.stalls

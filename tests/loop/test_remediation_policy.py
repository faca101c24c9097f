"""The remediation policy on hand-made findings; the executor and the files it writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hyperacc.analysis.stragglers import Straggler
from hyperacc.remediation import events
from hyperacc.remediation.config import RemediationConfig, RemediationConfigError
from hyperacc.remediation.drain import close_request, read_request, request_drain
from hyperacc.remediation.exclusion import add_exclusions, read_exclusions
from hyperacc.remediation.executor import RemediationExecutor
from hyperacc.remediation.policy import Finding, JobState, decide, drain_refusal

AUTO = RemediationConfig(mode="auto", min_nodes=2, max_drains=1, run_dir="/unused")
JOB = JobState(step=800, nodes=("a", "b", "c"), window_steps=50)


def slow_node(node: str = "c", slowdown: float | None = 1.3, at: int = 500, last: int = 700, **kw) -> Finding:
    return Finding(kind="node", rank=4, node=node, rank_kind=kw.pop("rank_kind", "compute"), slowdown=slowdown,
                   confirmed_step=at, last_step=last, **kw)  # fmt: skip


def rules(decisions):
    return [(d.rule, d.action, d.status, d.target) for d in decisions]


def test_a_persistent_slow_node_is_drained_at_the_next_checkpoint():
    [d] = decide([slow_node()], [], JOB, AUTO)
    assert (d.rule, d.action, d.status, d.target, d.at) == ("drain-slow-node", "drain", "act", "c", "next checkpoint")
    assert "1.30x the median since step 500" in d.reason


def test_a_drain_waits_until_the_verdict_has_held_long_enough():
    assert decide([slow_node(last=560)], [], JOB, AUTO) == []  # 60 steps < 2 windows of 50
    assert rules(decide([slow_node(last=600)], [], JOB, AUTO)) == [("drain-slow-node", "drain", "act", "c")]


def test_never_on_an_unconfirmed_inactive_or_immaterial_verdict():
    assert decide([slow_node(confirmed=False)], [], JOB, AUTO) == []
    assert decide([slow_node(active=False)], [], JOB, AUTO) == []
    assert decide([slow_node(slowdown=1.05)], [], JOB, AUTO) == []  # below drain_min_slowdown
    assert decide([slow_node(slowdown=None)], [], JOB, AUTO) == []


def test_bounds_refuse_once_with_the_reason():
    two = JobState(step=800, nodes=("b", "c"))
    [d] = decide([slow_node()], [], two, AUTO)
    assert d.status == "refused" and "may not go below min_nodes=2" in d.reason
    history = [d.to_event("auto")]
    assert decide([slow_node()], history, two, AUTO) == []  # said once
    done = [{"kind": "drain", "status": "executed", "target": "x", "step": 300}]
    [d] = decide([slow_node()], done, JOB, AUTO)
    assert d.status == "refused" and "max_drains=1" in d.reason
    host = JobState(step=800, nodes=("a", "b", "c"), undrainable={"c": "its torchrun agent hosts the rendezvous store"})
    [d] = decide([slow_node()], [], host, AUTO)
    assert d.status == "refused" and "rendezvous store" in d.reason
    [d] = decide([slow_node()], [], JOB, RemediationConfig(mode="auto", run_dir="/x"))
    assert d.status == "refused" and "min_nodes is not set" in d.reason
    [d] = decide([slow_node()], [], JobState(step=800, nodes=("a", "b", "c"), restarts_left=0), AUTO)
    assert d.status == "refused" and "--max-restarts" in d.reason


def test_one_drain_at_a_time_and_the_slowest_node_first():
    [d] = decide([slow_node("b", 1.2), slow_node("c", 1.5)], [], JOB, AUTO)
    assert d.target == "c"
    pending = [{"kind": "decision", "action": "drain", "status": "requested", "target": "c"}]
    assert decide([slow_node("b", 1.2)], pending, JOB, AUTO) == []  # the job has not acted yet
    acted = [*pending, {"kind": "drain", "status": "executed", "target": "c", "step": 700}]
    more = RemediationConfig(mode="auto", min_nodes=1, max_drains=2, run_dir="/x")
    assert rules(decide([slow_node("b", 1.2)], acted, JOB, more)) == [("drain-slow-node", "drain", "act", "b")]
    cool = RemediationConfig(mode="auto", min_nodes=1, max_drains=2, drain_cooldown_steps=500, run_dir="/x")
    assert decide([slow_node("b", 1.2)], acted, JOB, cool) == []


def test_software_causes_are_switched_on_live_not_drained():
    gc_node = slow_node(rank_kind="gc")
    got = rules(decide([gc_node], [], JOB, AUTO))
    assert got == [("gc-schedule", "gc_schedule", "act", "all ranks")]
    [d] = decide([gc_node], [], JOB, AUTO)
    assert d.step == JOB.step + AUTO.gc_lead_steps and d.at == f"step {d.step}"
    assert decide([gc_node], [d.to_event("auto", "done")], JOB, AUTO) == []  # once per run
    spikes = Finding(kind="gc", source="spikes", share=0.3, spikes=12)
    assert rules(decide([spikes], [], JOB, AUTO)) == [("gc-schedule", "gc_schedule", "act", "all ranks")]
    assert decide([Finding(kind="gc", source="spikes", share=0.05, spikes=12)], [], JOB, AUTO) == []
    alloc = Finding(kind="allocator", source="spikes", share=0.4, spikes=5)
    got = decide([alloc], [], JOB, AUTO)
    assert rules(got) == [("memory-release", "memory_release", "act", "all ranks"),
                          ("memory-release", "advise", "advise", "all ranks")]  # fmt: skip
    assert any("expandable_segments:True" in s for s in got[1].settings)
    # a rank whose allocator returns and maps its memory again at every step: holding freed memory ends it
    paging = Finding(kind="page_faults", rank=2, node="a", slowdown=1.3, confirmed_step=100, last_step=200)
    got = decide([paging], [], JOB, AUTO)
    assert rules(got) == [("memory-release", "memory_release", "act", "all ranks")]  # no CUDA/tcmalloc advice
    assert "page-fault straggler" in got[0].reason
    # page-fault spikes (memory faulted in again at some steps): the same switch, without the restart advice
    spiky = Finding(kind="page_faults", source="spikes", share=0.6, spikes=25)
    got = decide([spiky], [], JOB, AUTO)
    assert rules(got) == [("memory-release", "memory_release", "act", "all ranks")]
    assert "page_faults explains 60 %" in got[0].reason
    assert decide([Finding(kind="page_faults", source="spikes", share=0.6, spikes=1)], [], JOB, AUTO) == []


def test_other_findings_get_their_knob_once():
    data = Finding(kind="data", rank=3, node="b", slowdown=1.8, confirmed_step=100, last_step=200)
    [d] = decide([data], [], JOB, AUTO)
    assert (d.rule, d.status, d.target) == ("advise-data", "advise", "rank 3")
    assert "num_workers" in d.settings[0]
    assert decide([data], [d.to_event("auto", "advised")], JOB, AUTO) == []
    one_rank = Finding(kind="compute", rank=2, node="a", slowdown=1.4, confirmed_step=100, last_step=400)
    assert rules(decide([one_rank], [], JOB, AUTO)) == [("advise-compute", "advise", "advise", "rank 2")]


def test_off_decides_nothing_and_dry_run_decides_the_same():
    assert decide([slow_node()], [], JOB, RemediationConfig(mode="off")) == []
    dry = RemediationConfig(mode="dry-run", min_nodes=2, run_dir="/x")
    assert rules(decide([slow_node()], [], JOB, dry)) == rules(decide([slow_node()], [], JOB, AUTO))


def test_findings_from_the_analysis():
    s = Straggler(rank=4, node=2, kind="node", metric="self_ns", slowdown=1.4, since_step=100, windows_flagged=4,
                  windows_seen=5, confirmed_step=300, until_step=600, active=True, excess_ns=2e6,
                  self_slowdown=1.4, comm_wait_ns=1e5, cluster_comm_wait_ns=3e6, metrics=["self_ns"],
                  rank_kind="compute")  # fmt: skip
    f = Finding.from_straggler(s, {2: "node-c"})
    assert (f.kind, f.rank_kind, f.node, f.confirmed_step, f.last_step, f.slowdown) == (
        "node", "compute", "node-c", 300, 600, 1.4)  # fmt: skip
    assert Finding.from_straggler(s.to_dict()).node == "node2"
    job = JobState.from_membership({"nodes": [{"name": "a", "why_not": "hosts it"}, {"name": "node-c", "why_not": None}],
                                    "restarts_left": 1}, step=700)  # fmt: skip
    assert job.nodes == ("a", "node-c") and job.undrainable == {"a": "hosts it"} and job.restarts_left == 1
    cause = Finding.from_cause({"cause": "gc", "spikes": 9, "time_lost_ns": 1e9, "share": 0.5})
    assert (cause.kind, cause.source, cause.share) == ("gc", "spikes", 0.5)


def test_drain_refusal_bounds():
    assert drain_refusal(AUTO, nodes=3, drains_done=0, restarts_left=1, why_not=None) is None
    assert "min_nodes" in drain_refusal(AUTO, nodes=2, drains_done=0, restarts_left=1, why_not=None)
    assert "max_drains" in drain_refusal(AUTO, nodes=3, drains_done=1, restarts_left=1, why_not=None)


# ---------------------------------------------------------------- the executor and its files


def test_executor_dry_run_prints_and_records_but_does_nothing(tmp_path: Path):
    lines: list[str] = []
    ex = RemediationExecutor(RemediationConfig(mode="dry-run", min_nodes=2, run_dir=str(tmp_path)), echo=lines.append)
    written = ex.step([slow_node()], JOB)
    assert [(e["rule"], e["status"]) for e in written] == [("drain-slow-node", "would")]
    assert read_request(tmp_path) is None
    assert lines and lines[0].startswith("hyperacc remediation (dry-run): would drain c at next checkpoint")
    assert ex.step([slow_node()], JOB) == []  # decided once


def test_executor_auto_requests_drains_and_calls_live_handlers(tmp_path: Path):
    calls = []

    def gc_handler(decision):
        calls.append(decision.step)
        return "gc schedule armed"

    def broken(decision):
        raise RuntimeError("no valve")

    cfg = RemediationConfig(mode="auto", min_nodes=2, run_dir=str(tmp_path))
    ex = RemediationExecutor(cfg, handlers={"gc_schedule": gc_handler, "memory_release": broken}, echo=lambda _: None)
    spikes = [Finding(kind="gc", source="spikes", share=0.5, spikes=9), Finding(kind="allocator", source="spikes",
                                                                             share=0.5, spikes=9)]  # fmt: skip
    written = ex.step([slow_node(), *spikes], JOB)
    got = [(e["rule"], e["action"], e["status"]) for e in written]
    assert got == [("drain-slow-node", "drain", "requested"), ("gc-schedule", "gc_schedule", "done"),
                   ("memory-release", "memory_release", "failed"), ("memory-release", "advise", "advised")]  # fmt: skip
    assert calls == [JOB.step + cfg.gc_lead_steps]
    assert written[1]["detail"]["note"] == "gc schedule armed" and "no valve" in written[2]["detail"]["error"]
    request = read_request(tmp_path)
    assert request["node"] == "c" and request["rule"] == "drain-slow-node"
    assert [e["kind"] for e in events.read_events(tmp_path)] == ["decision"] * 4
    assert ex.step([slow_node(), *spikes], JOB) == []  # a drain is pending; the switches were decided once
    close_request(tmp_path, request, "executed")
    assert read_request(tmp_path) is None
    assert list((tmp_path / "remediation").glob("drain-request.*.executed.json"))
    without = RemediationExecutor(cfg, echo=lambda _: None)
    cfg_dir = tmp_path / "other"
    fresh = RemediationExecutor(RemediationConfig(mode="auto", run_dir=str(cfg_dir)), echo=lambda _: None)
    assert [e["status"] for e in fresh.step(spikes[:1], JOB)] == ["unavailable"]  # no handler: said, not done
    assert without.handlers == {}


def test_executor_needs_a_run_dir(monkeypatch):
    monkeypatch.delenv("HYPERACC_RUN_DIR", raising=False)
    with pytest.raises(RemediationConfigError, match="run directory"):
        RemediationExecutor(RemediationConfig(mode="auto"))
    assert RemediationExecutor(RemediationConfig(mode="off")).step([slow_node()], JOB) == []


def test_config_parsing(tmp_path: Path):
    assert RemediationConfig.parse("dry-run").mode == "dry-run"
    cfg = RemediationConfig.parse('{"mode": "auto", "min_nodes": 2, "drain_kinds": ["compute"]}')
    assert cfg.min_nodes == 2 and cfg.drain_kinds == ("compute",)
    f = tmp_path / "policy.json"
    f.write_text(json.dumps({"mode": "auto", "max_drains": 3}))
    assert RemediationConfig.parse(str(f)).max_drains == 3
    t = tmp_path / "policy.toml"
    t.write_text('[remediate]\nmode = "dry-run"\nmax_drains = 2\ndrain_kinds = ["compute", "host"]\n')
    cfg = RemediationConfig.parse(str(t))
    assert (cfg.mode, cfg.max_drains, cfg.drain_kinds) == ("dry-run", 2, ("compute", "host"))
    (tmp_path / "flat.toml").write_text('mode = "auto"\n')
    assert RemediationConfig.parse(str(tmp_path / "flat.toml")).mode == "auto"
    (tmp_path / "broken.toml").write_text("mode = \n")
    with pytest.raises(RemediationConfigError, match="not valid TOML"):
        RemediationConfig.parse(str(tmp_path / "broken.toml"))
    with pytest.raises(RemediationConfigError, match="cannot read"):
        RemediationConfig.parse(str(tmp_path / "missing.toml"))
    for bad, match in (("sometimes", "must be off, dry-run, auto"), ('{"mode": "maybe"}', "mode"),
                       ('{"max_drain": 1}', "unknown remediation option"), ('{"min_nodes": 0}', "min_nodes"),
                       ("[1]", "JSON object")):  # fmt: skip
        with pytest.raises(RemediationConfigError, match=match):
            RemediationConfig.parse(bad)
    assert RemediationConfig(run_dir=str(tmp_path)).resolved_exclude_file() == tmp_path / "hosts.exclude"


def test_exclusion_file_is_append_only_and_deduplicated(tmp_path: Path):
    path = tmp_path / "sub" / "hosts.exclude"
    assert add_exclusions(path, []) == [] and path.exists() and read_exclusions(path) == []
    assert add_exclusions(path, ["n1", "n2", "n1"]) == ["n1", "n2"]
    path.write_text(path.read_text() + "# a person's note\nn3\n")
    assert add_exclusions(path, ["n2", "n4"]) == ["n4"]
    assert read_exclusions(path) == ["n1", "n2", "n3", "n4"]
    assert read_exclusions(tmp_path / "missing") == []


def test_event_log_survives_a_torn_line(tmp_path: Path):
    events.append_event(tmp_path, {"kind": "drain", "status": "executed", "step": 3})
    with events.events_path(tmp_path).open("a") as fh:
        fh.write('{"kind": "dra')  # a crash while writing
    events.append_event(tmp_path, {"kind": "resume", "step": 3})
    assert [e["kind"] for e in events.read_events(tmp_path)] == ["drain", "resume"]
    request_drain(tmp_path, "n1", reason="r")
    assert read_request(tmp_path)["node"] == "n1"

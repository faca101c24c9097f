"""The whole loop on a real elastic job: 3 agents x 2 gloo ranks (--nnodes 2:3, c10d), every rank started
through hyperacc's bootstrap as `hyperacc run --remediate auto` starts it, node-c's ranks made slow by
chaos. Rank 0's live detector confirms the slow node, the policy decides its drain once the verdict has
held, node-c leaves at the next checkpoint boundary, the others re-rendezvous and continue from that
checkpoint on 2 nodes (no step twice, none lost), and node-c is in the exclusion file.

One job serves both halves of the loop: the decision (from the verdict) and the drain itself (the
request file that the decision writes, `drain.request_drain`, is the same one a person writes by hand;
tests/loop/test_remediation_policy.py covers the hand-written request, and ``dry-run``'s "would" with
nothing drained, on the real executor; until 2026-12-05 a second real 2-node job checked that too)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from elastic_job import ElasticJob

from hyperacc.remediation.drain import read_membership
from hyperacc.remediation.events import read_events
from hyperacc.remediation.exclusion import read_exclusions

pytestmark = pytest.mark.multirank
EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py")
# the decision comes some 250 steps after the node is first slow (the windows are judged 100 steps
# late, confirmed over several windows, then held two): 800 steps leave it room on a slow machine
STEPS, EVERY, WINDOW = 800, 40, 20
# every rank of node-c does 60 % more work per step (only node-c's ranks read this variable)
SLOW = {"seed": 5, "faults": [{"kind": "slowdown", "ranks": list(range(6)), "factor": 0.6}]}


def test_a_slow_node_verdict_drains_it_and_the_job_finishes_on_two_nodes(tmp_path: Path) -> None:
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    remediate = {"mode": "auto", "min_nodes": 2, "max_drains": 1, "run_dir": str(run_dir)}
    job = ElasticJob(
        tmp_path, EXAMPLE,
        ["--steps", str(STEPS), "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(EVERY), "--log-every", "1",
         "--batch-size", "32", "--features", "128", "--hidden", "128", "--classes", "2", "--lr", "0.05"],
        names=["node-a", "node-b", "node-c"], nproc=2, nnodes="2:3", max_restarts=1,
        # restarts need torchrun's own store for the workers (docs/remediation.md, pytorch#135712)
        env={"HYPERACC_RUN_DIR": str(run_dir), "HYPERACC_TRACE": json.dumps({"window": WINDOW}),
             "HYPERACC_REMEDIATE": json.dumps(remediate), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        agent_env={"node-c": {"HYPERACC_CHAOS": json.dumps(SLOW)}},
        # heartbeat expiry (2 s x 3) and last call (8 s) bound the re-rendezvous after the drain
        rdzv_conf="join_timeout=300,last_call_timeout=8,keep_alive_interval=2,keep_alive_max_attempt=3",
        bootstrap=True,
    )  # fmt: skip
    try:
        members = job.wait_for(lambda: (m := read_membership(run_dir)) and m, 300, "the job's first round")
        codes = job.wait(timeout=540)
    finally:
        job.kill()
    explain = job.explain()
    target, survivors = "node-c", ["node-a", "node-b"]
    assert [n["name"] for n in members["nodes"]] == ["node-a", "node-b", "node-c"], members

    # the decision: a confirmed slow-node verdict that held, drained at the next checkpoint boundary
    history = read_events(run_dir)
    decided = [e for e in history if e.get("rule") == "drain-slow-node" and e.get("status") != "would"]
    drains = [e for e in history if e["kind"] == "drain"]
    assert [(e["status"], e["target"]) for e in drains] == [("executed", target)], (history, explain[-4000:])
    finding = decided[0]["detail"]["finding"]
    assert finding["kind"] == "node" and finding["last_step"] - finding["confirmed_step"] >= 2 * WINDOW, finding
    at = drains[0]["step"]
    assert at % EVERY == 0 and at > finding["last_step"] - 2 * WINDOW, (at, finding)

    # the drain: node-c stopped by its death signal, the others re-rendezvoused without it
    assert all(codes[n] == 0 for n in survivors), (codes, explain[-4000:])
    assert codes[target] not in (0, None), (codes, explain[-4000:])
    after = read_membership(run_dir)  # the round after the drain
    assert [n["name"] for n in after["nodes"]] == survivors
    # the drained node's word reached the survivors: they restarted at once, not after signal_timeout_s
    waited = [p for p in tmp_path.glob("logs/*/*/attempt_0/*/stderr.log") if "no word from the drained node" in p.read_text()]
    assert not waited, (waited, explain[-4000:])
    assert "rendezvous store" in (after["nodes"][0]["why_not"] or "")  # the first agent hosts it: never drained
    resumes = [e for e in history if e["kind"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] == at, history
    assert resumes[0]["detail"]["saved_world_size"] == 6 and resumes[0]["detail"]["world_size"] == 4
    assert read_exclusions(run_dir / "hosts.exclude") == [target]

    # the job finished on 2 nodes, from the drain's checkpoint
    results = [json.loads(p.read_text()) for p in sorted(job.results.glob("rank-*.json"))]
    assert len(results) == 4, explain[-4000:]
    assert {(r["world_size"], r["first_step"], r["restart_count"]) for r in results} == {(4, at, 1)}
    assert all(len(r["losses"]) == STEPS - at for r in results)

    # no step twice, none lost: the first attempt stopped at the boundary, the second started there
    before: dict[int, list[float]] = {}
    for name in ("node-a", "node-b", "node-c"):
        for step, values in job.losses(name, 0).items():
            before.setdefault(step, []).extend(values)
    assert sorted(before) == list(range(at)), sorted(before)
    assert all(len(v) == 6 for v in before.values())
    assert all(not job.losses(n, 1) or min(job.losses(n, 1)) == at for n in survivors)
    # the loss continues from the checkpoint: no reset to the untrained model
    first = float(np.mean(before[0]))
    last_before = float(np.mean([v for s in range(at - 3, at) for v in before[s]]))
    first_after = float(np.mean([r["losses"][k] for r in results for k in range(3)]))
    assert first_after < first - 0.5 * (first - last_before), (first, last_before, first_after)

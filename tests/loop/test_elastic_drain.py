"""A node told to drain leaves a real elastic job (3 agents x 2 ranks, --nnodes 2:3, c10d) at a checkpoint
boundary; the others re-rendezvous and continue from that checkpoint on 2 nodes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from elastic_job import ElasticJob

from hyperacc.remediation.drain import read_membership, request_drain
from hyperacc.remediation.events import read_events
from hyperacc.remediation.exclusion import read_exclusions

pytestmark = pytest.mark.multirank
EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py")
STEPS, EVERY = 60, 30


def test_a_drained_node_leaves_at_a_checkpoint_and_the_job_finishes_on_two_nodes(tmp_path: Path) -> None:
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    remediate = {"mode": "auto", "min_nodes": 2, "max_drains": 1, "run_dir": str(run_dir)}
    # node-c is told to drain before the job starts: it leaves at the first checkpoint boundary
    request_drain(run_dir, "node-c", reason="test: told to drain", rule="test")
    job = ElasticJob(
        tmp_path, EXAMPLE,
        ["--steps", str(STEPS), "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(EVERY), "--log-every", "1",
         "--batch-size", "16", "--features", "32", "--hidden", "64", "--classes", "2", "--lr", "0.05"],
        names=["node-a", "node-b", "node-c"], nproc=2, nnodes="2:3", max_restarts=1,
        # restarts need torchrun's own store for the workers (docs/remediation.md, pytorch#135712)
        env={"HYPERACC_REMEDIATE": json.dumps(remediate), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        # heartbeat expiry (2 s x 3) and last call (8 s) bound the re-rendezvous after the drain
        rdzv_conf="join_timeout=300,last_call_timeout=8,keep_alive_interval=2,keep_alive_max_attempt=3",
    )  # fmt: skip
    try:
        members = job.wait_for(lambda: (m := read_membership(run_dir)) and m, 300, "the job's first round")
        codes = job.wait(timeout=420)
    finally:
        job.kill()
    explain = job.explain()
    assert [n["name"] for n in members["nodes"]] == ["node-a", "node-b", "node-c"], members
    target, survivors = "node-c", ["node-a", "node-b"]
    after = read_membership(run_dir)  # the round after the drain
    assert [n["name"] for n in after["nodes"]] == survivors
    assert "rendezvous store" in (after["nodes"][0]["why_not"] or "")  # the first agent hosts it: never drained
    assert all(codes[n] == 0 for n in survivors), (codes, explain)
    assert codes[target] not in (0, None), (codes, explain)  # stopped by its death signal

    history = read_events(run_dir)
    drains = [e for e in history if e["kind"] == "drain"]
    assert [(e["status"], e["target"]) for e in drains] == [("executed", target)], history
    at = drains[0]["step"]
    assert at == EVERY  # the first boundary after the request
    resumes = [e for e in history if e["kind"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] == at, history
    assert resumes[0]["detail"]["saved_world_size"] == 6 and resumes[0]["detail"]["world_size"] == 4
    assert read_exclusions(run_dir / "hosts.exclude") == [target]

    # the job finished on 2 nodes, from the drain's checkpoint
    results = [json.loads(p.read_text()) for p in sorted(job.results.glob("rank-*.json"))]
    assert len(results) == 4, explain
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

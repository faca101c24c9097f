"""From a real node verdict to a drain decision: 2 nodes x 2 gloo ranks (static rendezvous on loopback),
node 1 made slow by chaos, ``--remediate dry-run``. Rank 0's live detector confirms the node, the
verdict holds ``drain_hold_windows`` windows, and the policy decides to drain that node (logged as
``would``: the job has no checkpointer to carry a drain out). The drain itself, in an elastic job, is
tests/loop/test_elastic_drain_from_verdict.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hyperacc import harness
from hyperacc.remediation.events import read_events

pytestmark = pytest.mark.multirank
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py"
CHAOS = {"seed": 3, "faults": [{"kind": "slowdown", "ranks": [2, 3], "factor": 0.6}]}


def test_a_confirmed_slow_node_verdict_decides_its_drain(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    remediate = {"mode": "dry-run", "min_nodes": 1}
    opts = {"run-dir": str(run_dir), "trace": json.dumps({"window": 20}), "chaos": json.dumps(CHAOS),
            "remediate": json.dumps(remediate)}  # fmt: skip
    args = ["--steps", "400", "--features", "128", "--hidden", "128", "--batch-size", "32"]
    job = harness.launch(EXAMPLE, args, nproc=2, nnodes=2, timeout=240, traced=opts, workdir=tmp_path / "job")
    assert job.ok, job.explain()
    history = read_events(run_dir)
    drains = [e for e in history if e.get("rule") == "drain-slow-node"]
    assert [(e["status"], e["target"]) for e in drains] == [("would", "node1")], (history, job.launcher_output[-3000:])
    finding = drains[0]["detail"]["finding"]
    assert finding["kind"] == "node" and finding["rank"] in (2, 3) and finding["slowdown"] >= 1.1, finding
    # decided only once the verdict had held two windows after its confirmation
    assert finding["last_step"] - finding["confirmed_step"] >= 2 * 20, finding
    # nothing was drained: dry-run acts on nothing
    assert not [e for e in history if e.get("kind") == "drain"], history

"""``hyperacc run --remediate``: GC pressure on one of 4 real gloo ranks; the live verdicts decide the GC
schedule, every rank switches it on at the one step they agreed, and from there the pressured rank's GC
pauses come only at collections every rank makes at the same step. ``dry-run`` decides the same and acts
on nothing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from hyperacc import harness, store
from hyperacc.analysis import diagnose
from hyperacc.cli import cli
from hyperacc.remediation.events import read_events

pytestmark = pytest.mark.multirank
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py"
STEPS = 360
ARGS = ["--steps", str(STEPS), "--features", "64", "--hidden", "64", "--batch-size", "16"]
CHAOS = {"seed": 1, "faults": [{"kind": "gc_pressure", "ranks": [3], "live": 100000, "garbage": 20000}]}


def _job(tmp_path: Path, mode: str) -> tuple[Path, list[dict]]:
    run_dir = tmp_path / "run"
    # a short lead keeps the test short: the agreed step is >= 10 steps and >= 1 s of training ahead
    remediate = {"mode": mode, "gc_lead_steps": 10, "switch_lead_s": 1.0}
    # the node agent judges what the ranks have flushed: at the default 5 s a flush, the first windows of
    # this 20-second job were judged about 9 s in (step 260-330 of 360 on a loaded host, too late to
    # verify the switch); flushed every second, they are judged a few seconds in
    opts = {"run-dir": str(run_dir), "trace": json.dumps({"window": 20, "flush_every_s": 1.0}), "chaos": json.dumps(CHAOS),
            "remediate": json.dumps(remediate)}  # fmt: skip
    job = harness.launch(EXAMPLE, ARGS, nproc=4, timeout=240, traced=opts, workdir=tmp_path / "job")
    assert job.ok, job.explain()
    decisions = [e for e in read_events(run_dir) if e.get("rule") == "gc-schedule"]
    assert len(decisions) == 1, (read_events(run_dir), job.launcher_output[-3000:])
    return run_dir, decisions


def _gc_spikes(run_dir: Path) -> list[tuple[int, int]]:
    doc = diagnose(run_dir, top_events=100_000).to_dict()
    return sorted((e["step"], e["rank"]) for e in doc["spikes"]["events"] if e.get("cause") == "gc")


def _collections(run_dir: Path, rank: int) -> set[int]:
    """Steps at which the switched-on stabilizer of ``rank`` collected (its events in the trace)."""
    table = store.read_events(run_dir)
    return {r["step"] for r in table.to_pylist() if r["kind"] in ("gc_collect", "gc_freeze") and r["rank"] == rank}


def _full_collections(run_dir: Path) -> list[tuple[int, int]]:
    """(step, rank) of every step whose records hold a full (generation 2) collection."""
    rows = store.read_steps(run_dir, columns=["rank", "step", "gc_max_gen"]).to_pylist()
    return sorted((r["step"], r["rank"]) for r in rows if r["gc_max_gen"] == 2)


def _switches(run_dir: Path) -> list[dict]:
    table = store.read_events(run_dir)
    return [r for r in table.to_pylist() if r["kind"] == "remediation"] if table.num_rows else []


def test_gc_pressure_switches_the_gc_schedule_on_at_one_agreed_step_on_every_rank(tmp_path: Path) -> None:
    run_dir, [decision] = _job(tmp_path, "auto")
    assert decision["status"] == "done" and decision["mode"] == "auto", decision
    assert "gc explains" in decision["reason"] or "GC straggler" in decision["reason"], decision
    # every rank started it at one agreed step, none late: the proposed step, or later when the ranks had
    # got closer to it than the lead by the time the last of them acknowledged it
    switches = _switches(run_dir)
    assert sorted(r["rank"] for r in switches) == [0, 1, 2, 3], switches
    [at] = {r["step"] for r in switches}
    assert at >= decision["step"], (decision, switches)
    assert at <= STEPS - 40, f"the switch came too late to verify anything (step {at})"
    assert all(f"agreed step {at}" in r["detail"] and "LATE" not in r["detail"] for r in switches), switches

    # from the switch on, every full collection on every rank is a scheduled one that every rank made at
    # the same step, never CPython's own: read from the step records (the generation each step
    # collected), which a busy host cannot blur as it can a spike's cause
    spikes = _gc_spikes(run_dir)
    aligned = set.intersection(*(_collections(run_dir, r) for r in range(4)))
    assert aligned and min(aligned) >= at - 1, aligned  # the freeze at the boundary that ends step at - 1
    full = _full_collections(run_dir)
    # a collection at the boundary after step c is recorded in step c or c + 1, as the step clock cuts it
    unscheduled = [(step, rank) for step, rank in full if step >= at and not {step, step - 1} & aligned]
    assert unscheduled == [], (at, sorted(aligned), unscheduled)
    # before: CPython's full collections on the pressured rank every few steps, and its GC spikes
    assert len([s for s, r in full if r == 3 and s < at]) >= 3, full
    assert len([s for s in spikes if s[1] == 3 and s[0] < at]) >= 3, spikes

    # analyze shows the decision and the switch (text and JSON)
    text = CliRunner().invoke(cli, ["analyze", str(run_dir)], terminal_width=400)
    assert text.exit_code == 0, text.output
    assert re.search(rf"ranks 0,1,2,3: gc_schedule switched on at step {at}", text.output), text.output
    assert "decision gc-schedule done all ranks" in text.output
    doc = json.loads(CliRunner().invoke(cli, ["analyze", str(run_dir), "--json"]).output)
    kinds = [(e["kind"], e.get("status")) for e in doc["remediation"]]
    assert ("decision", "done") in kinds and ("switch", None) in kinds, doc["remediation"]


def test_dry_run_decides_the_same_and_acts_on_nothing(tmp_path: Path) -> None:
    run_dir, [decision] = _job(tmp_path, "dry-run")
    assert decision["status"] == "would" and decision["mode"] == "dry-run", decision
    at = decision["step"]
    assert _switches(run_dir) == []
    # nothing changed: the pressured rank's collections go on spiking after the step it would have chosen
    spikes = _gc_spikes(run_dir)
    assert [s for s in spikes if s[0] >= at], (at, spikes)
    text = CliRunner().invoke(cli, ["analyze", str(run_dir)], terminal_width=400)
    assert "decision gc-schedule would all ranks" in text.output, text.output

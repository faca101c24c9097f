"""``make demo``: a real 4-rank training run on this machine, its diagnosis and its fixes.

1. Diagnose: ``hyperacc run`` starts the unmodified examples/train_ddp.py as 4 gloo ranks with three
   injected faults (rank 2 computes 50 % slower, rank 1's loader stalls on 3 % of steps, rank 3 is under
   GC pressure), then ``hyperacc analyze`` names the culprits, the causes and what the measured spike
   rate means at scale, and the injected ground truth is printed beside it.
2. Fix: the same job with ``--stabilize`` (deterministic GC: frozen heap, young collections left to
   CPython, full collections at the same step on every rank); the GC spikes of step 1 vanish.
3. Close the loop: a job under GC pressure with ``--remediate auto``; rank 0's live verdicts decide the
   GC schedule, every rank switches it on at one agreed step, and the GC spikes before and after it
   are counted (diagnose, act, verify).
4. Storage: cold LMDB reads with and without the sampler-aware prefetch (data-time p99).
5. See it: ``hyperacc report`` writes the self-contained HTML report and prints its path.
6. Compare: ``hyperacc compare`` sets the stabilized run beside the faulty one (step-time percentiles,
   CV, spike rate with its interval, coordination cost), with a CI gate (``--fail-on``) that passes.

Set ``HYPERACC_DEMO_STEPS`` to change the run length (default 400).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_ddp.py"
EXAMPLE_ARGS = ["--batch-size", "256"]  # enough compute per step that a 15 % slowdown is visible

FAULTS = {
    "seed": 7,
    "faults": [
        {"kind": "slowdown", "ranks": [2], "factor": 0.5},
        {"kind": "data_stall", "ranks": [1], "rate": 0.03, "ms": 60},
        {"kind": "gc_pressure", "ranks": [3], "live": 300000, "garbage": 6000},
    ],
}
STABILIZE = {"gc": {"interval": 100}}


def hyperacc(console: Console, *args: str, timeout: float = 600, quiet: bool = False) -> subprocess.CompletedProcess:
    """Run a hyperacc command as a user would type it, echoing the command line."""
    cmd = [sys.executable, "-m", "hyperacc", *args]
    shown = " ".join(shlex.quote(a) if len(a) < 60 else "'…'" for a in args)
    console.print(f"[dim]$ hyperacc {shown}[/dim]")
    env = {**os.environ, "COLUMNS": str(console.width)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout, text=True, capture_output=True)
    if proc.returncode != 0:
        console.print(proc.stdout[-4000:], proc.stderr[-4000:], markup=False)
        raise SystemExit(f"hyperacc {args[0]} failed (exit {proc.returncode})")
    if not quiet:
        console.print(proc.stdout.rstrip(), markup=False, highlight=False)
    return proc


def traced_run(console: Console, run_dir: Path, steps: int, *extra: str) -> float:
    t0 = time.monotonic()
    proc = hyperacc(
        console, "run", "--run-dir", str(run_dir), "--nproc-per-node", "4", "--chaos", json.dumps(FAULTS),
        *extra, "--", str(EXAMPLE.relative_to(ROOT)), "--steps", str(steps), *EXAMPLE_ARGS, quiet=True,
    )  # fmt: skip
    for line in (proc.stdout + proc.stderr).splitlines():
        if "hyperacc live:" in line:
            console.print(f"  [yellow]{line.strip()}[/yellow]", highlight=False)
    wall = time.monotonic() - t0
    console.print(f"  {steps} steps on 4 ranks in {wall:.0f} s")
    return wall


def ground_truth_table(run_dir: Path) -> Table:
    from hyperacc import chaos

    counts = Counter((r["rank"], r["kind"]) for r in chaos.read_ground_truth(run_dir))
    table = Table(title="what was injected (chaos ground truth)", title_justify="left")
    for col in ("rank", "fault", "count"):
        table.add_column(col)
    for (rank, kind), n in sorted(counts.items()):
        if kind == "gc_pressure":
            continue  # one record per step; the pauses it caused are the gc_pause rows
        table.add_row(str(rank), kind, str(n))
    return table


def gc_comparison(before: dict[str, Any], after: dict[str, Any]) -> Table:
    def row(doc: dict[str, Any]) -> dict[str, str]:
        gc = next((c for c in doc["causes"] if c["cause"] == "gc"), None)
        cluster = doc["spikes"]["cluster"]
        rank3 = next((r for r in doc["spikes"]["per_rank"] if r["rank"] == 3), None)
        return {
            "steps that spiked": f"{100 * cluster['rate']:.1f} %",
            "rank 3 spike rate": f"{100 * rank3['rate']:.1f} %" if rank3 else "-",
            "GC spikes": str(gc["spikes"] if gc else 0),
            "time lost to GC spikes": f"{(gc['time_lost_ns'] if gc else 0) / 1e9:.2f} s",
            "gc stragglers": str(sum(1 for s in doc["stragglers"] if s["kind"] == "gc")),
        }

    a, b = row(before), row(after)
    table = Table(title="automatic GC versus hyperacc's deterministic GC (same faults, same seed)", title_justify="left")
    for col in ("", "automatic GC", "--stabilize"):
        table.add_column(col, justify="right")
    for key in a:
        table.add_row(key, a[key], b[key])
    return table


LOOP_FAULTS = {"seed": 1, "faults": [{"kind": "gc_pressure", "ranks": [3], "live": 100000, "garbage": 20000}]}
LOOP_REMEDIATE = {"mode": "auto", "gc_lead_steps": 10, "switch_lead_s": 1.0}  # a short lead: a short demo
LOOP_STEPS = 360


def loop_stage(console: Console, run_dir: Path) -> None:
    """Diagnose, act, verify: ``--remediate auto`` on a GC-pressured job (docs/remediation.md)."""
    from hyperacc.analysis import diagnose
    from hyperacc.present.diagnosis import remediation_of

    t0 = time.monotonic()
    proc = hyperacc(
        console, "run", "--run-dir", str(run_dir), "--nproc-per-node", "4", "--trace", '{"window": 20}',
        "--chaos", json.dumps(LOOP_FAULTS), "--remediate", json.dumps(LOOP_REMEDIATE), "--",
        str(EXAMPLE.relative_to(ROOT)), "--steps", str(LOOP_STEPS), "--features", "64", "--hidden", "64",
        "--batch-size", "16", quiet=True,
    )  # fmt: skip
    for line in (proc.stdout + proc.stderr).splitlines():
        if "hyperacc remediation" in line and "advise" not in line:
            console.print(f"  [yellow]{line.strip()}[/yellow]", highlight=False)
    console.print(f"  {LOOP_STEPS} steps on 4 ranks in {time.monotonic() - t0:.0f} s")
    events = remediation_of(run_dir)
    decision = next((e for e in events if e.get("rule") == "gc-schedule"), None)
    if decision is None or decision.get("step") is None:
        console.print("  no GC schedule was decided in this run (the live verdicts did not confirm GC spikes)")
        return
    switch = next((e for e in events if e.get("kind") == "switch" and "gc_schedule" in str(e.get("detail"))), None)
    if switch is None:
        console.print(f"  the GC schedule proposed for step {decision['step']} was not switched on by any rank")
        return
    at, switched = int(switch["step"]), sorted(switch["ranks"])
    doc = diagnose(run_dir, top_events=100_000).to_dict()
    gc_steps = [e["step"] for e in doc["spikes"]["events"] if e.get("cause") == "gc"]
    steps = doc["steps"]
    table = Table(title=f"GC spikes before and after the agreed step {at} (switched on by ranks {switched})",
                  title_justify="left")  # fmt: skip
    for col in ("", "before the switch", "after the switch"):
        table.add_column(col, justify="right")
    before, after = sum(1 for s in gc_steps if s < at), sum(1 for s in gc_steps if s >= at)
    table.add_row("steps", str(at), str(max(steps - at, 0)))
    table.add_row("GC spikes", str(before), str(after))
    console.print(table)


def main() -> None:
    console = Console(width=None if sys.stdout.isatty() else 110)
    run_root = Path(os.environ.get("HYPERACC_DEMO_DIR", ROOT / "runs" / "demo")).resolve()
    if run_root.exists():
        shutil.rmtree(run_root)
    run_root.mkdir(parents=True)
    steps = int(os.environ.get("HYPERACC_DEMO_STEPS", "400"))
    t0 = time.monotonic()

    from hyperacc.analysis import diagnose

    console.rule("[bold]1. Diagnose: a 4-rank DDP job with three injected faults")
    diag_dir = run_root / "diagnose"
    traced_run(console, diag_dir, steps)
    hyperacc(console, "analyze", str(diag_dir))
    console.print(ground_truth_table(diag_dir))

    console.rule("[bold]2. Fix: the same job with deterministic GC")
    fixed_dir = run_root / "stabilized"
    traced_run(console, fixed_dir, steps, "--stabilize", json.dumps(STABILIZE))
    before, after = diagnose(diag_dir).to_dict(), diagnose(fixed_dir).to_dict()
    console.print(gc_comparison(before, after))

    console.rule("[bold]3. Close the loop: --remediate auto switches deterministic GC on, live")
    loop_stage(console, run_root / "remediate")

    console.rule("[bold]4. Storage: cold LMDB reads with and without sampler-aware prefetch")
    from hyperacc.data.pipeline import cold_read_comparison, cold_read_table

    console.print(cold_read_table(cold_read_comparison(run_root / "cold-read")), markup=False, highlight=False)

    console.rule("[bold]5. See it")
    hyperacc(console, "report", str(diag_dir), "-o", str(run_root / "report.html"))
    console.print(f"open {run_root / 'report.html'} in a browser (it works offline)")

    console.rule("[bold]6. Compare: the stabilized run against the faulty one, as a CI gate would")
    hyperacc(console, "compare", str(diag_dir), str(fixed_dir), "--fail-on", "p99=+10%,spike_rate=+5pp")
    console.print("exit status 0: no --fail-on limit broken (a worse p99 or spike rate would exit 1)")
    console.rule(f"[bold]demo finished in {time.monotonic() - t0:.0f} s; run directories under {run_root}")


if __name__ == "__main__":
    main()

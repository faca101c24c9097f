"""``hyperacc compare RUN_A RUN_B [...]``: runs side by side, differences from the first (the baseline),
95 % intervals where a figure is a rate, and ``--fail-on`` limits for a CI gate (exit status 1 when one is
broken). Runs at different world sizes also get the efficiency curve against linear scaling, the CV at
each size and the simulator's extrapolation from the smallest run. docs/presentation.md, "Compare".

One argument is one job; the run directories of one job's agents (local disks) are joined by commas.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import click

from hyperacc.commands.params import OneLineCommand, existing_run_dirs
from hyperacc.store import RunDirError

SIM_STEPS = 2000  # simulated steps per world size (the extrapolation beside the measured curve)
# What a figure needs when a run has none (the limit on it is then an error, exit status 2).
_MISSING = {
    "samples_per_s": "give --batch-size (samples per rank and step)",
    "spike_rate": "the run has no steps after the warm-up",
    "creep_ranks": "the run recorded no resource samples",
}


def comparison(
    docs: Sequence[Mapping[str, Any]], names: Sequence[str], limits_text: str | None, *, simulate: bool = True,
    run_dirs: Sequence[Any] = (),
) -> dict[str, Any]:  # fmt: skip
    """The comparison document of diagnosis documents (the first is the baseline). Raises
    ``CompareError`` for a limit that cannot be read or whose figure some run lacks."""
    from hyperacc.analysis.compare import (
        FIGURE_NAMES,
        CompareError,
        compare,
        figures_of,
        parse_limits,
        scaling,
        uncomputable,
    )

    limits = parse_limits(limits_text, FIGURE_NAMES)
    figs = [figures_of(d) for d in docs]
    for lim, missing in uncomputable(figs, limits)[:1]:
        where = ", ".join(f"{names[i]}{' (the baseline)' if i == 0 else ''}" for i in missing)
        raise CompareError(f"the limit {lim.text()} cannot be checked: {lim.name} could not be computed for "
                           f"{where}; {_MISSING.get(lim.name, 'that run did not measure it')}")  # fmt: skip
    changes = compare(figs, limits)
    out: dict[str, Any] = {
        "runs": [
            {"run": name, "world_size": d.get("world_size"), "nodes": d.get("nodes"), "steps": d.get("steps"),
             "figures": {k: {"value": f.value, "unit": f.unit, "better": f.better} for k, f in fg.items()}}
            for name, d, fg in zip(names, docs, figs, strict=True)
        ],  # fmt: skip
        "changes": [dataclasses.asdict(c) for c in changes],
        "limits": [lim.text() for lim in limits],
        "broken": [f"{names[c.run]}: {b}" for c in changes for b in c.broken],
        "scaling": None,
    }
    sizes = {int(d.get("world_size") or 0) for d in docs}
    if len(sizes) > 1:
        points = scaling([(int(d.get("world_size") or 0), fg) for d, fg in zip(docs, figs, strict=True)])
        out["scaling"] = {"measured": [dataclasses.asdict(p) for p in points], "simulated": None}
        if simulate and run_dirs:
            out["scaling"]["simulated"] = _extrapolate(docs, run_dirs, sorted(sizes))
    return _plain(out)


def _extrapolate(docs: Sequence[Mapping[str, Any]], run_dirs: Sequence[Any], sizes: list[int]) -> dict[str, Any]:
    """The simulator replaying the smallest run (``hyperacc simulate --from-run``) at each world size:
    the measured transfer replayed as is (``comm_scale="none"``), no pacing."""
    from hyperacc.sim.model import MeasuredRun, SimConfig, SimConfigError
    from hyperacc.sim.simulate import sweep

    base = min(range(len(docs)), key=lambda i: int(docs[i].get("world_size") or 0))
    nodes = max(1, int(docs[base].get("nodes") or 1))
    per_node = max(1, int(docs[base].get("world_size") or 1) // nodes)
    try:
        measured = MeasuredRun.from_run_dir(run_dirs[base])
        counts = sorted({max(1, math.ceil(n / per_node)) for n in sizes})
        cfg = SimConfig(nodes=counts[0], gpus_per_node=per_node, steps=SIM_STEPS, pacing=None, comm_scale="none")
        results = sweep(cfg, counts, measured)
    except (RunDirError, SimConfigError, ValueError) as exc:
        return {"error": str(exc)}
    return {
        "from": str(docs[base].get("run_dir")),
        "ranks_per_node": per_node,
        "points": [{"world_size": r.ranks, "efficiency": r.baseline.efficiency, "cv": r.baseline.cv,
                    "p50_ms": r.baseline.p50_ms, "p99_ms": r.baseline.p99_ms} for r in results],  # fmt: skip
        "assumptions": "compute of each rank replayed from the smallest run; the measured transfer replayed as "
        "is (no fabric model); no pacing",
    }


def _plain(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    return v


@click.command(cls=OneLineCommand)
@click.argument("runs", nargs=-1, required=True)
@click.option("--fail-on", "fail_on", default=None, metavar="LIMITS",
              help="Exit 1 when a limit is broken, e.g. 'p99=+10%,spike_rate=+2pp,steps_per_s=-5%'.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON.")
@click.option("--batch-size", type=click.IntRange(1, 1 << 40), default=None,
              help="Samples per rank and step, for samples/s.")  # fmt: skip
@click.option("--no-simulate", is_flag=True, help="Runs at several world sizes: skip the simulator's extrapolation.")
def command(runs: tuple[str, ...], fail_on: str | None, as_json: bool, batch_size: int | None, no_simulate: bool) -> None:
    """Compare RUNS side by side against the first (the baseline): step-time percentiles, CV, jitter,
    throughput, waiting and arrival spread, spike rate (with the 95 % interval of its change),
    stragglers, memory creep. With --fail-on, exit 1 when a limit is broken (a rate only when the
    change is significant).

    One argument is one job; join the run directories of one job's agents with commas.
    Example: hyperacc compare runs/main runs/pr --fail-on 'p99=+10%,spike_rate=+2pp'
    """
    from hyperacc.analysis import diagnose
    from hyperacc.analysis.compare import FIGURE_NAMES, CompareError, parse_limits

    if len(runs) < 2:
        raise click.UsageError("compare needs at least two runs: the baseline first, then the others")
    try:  # a bad limit is refused before any run is read
        parse_limits(fail_on, FIGURE_NAMES)
    except CompareError as exc:
        raise click.BadParameter(str(exc), param_hint="--fail-on") from None
    dirs = [existing_run_dirs(r, "RUNS") for r in runs]
    docs = []
    for text, d in zip(runs, dirs, strict=True):
        try:
            docs.append(diagnose(d, batch_size=batch_size).to_dict())
        except RunDirError as exc:
            click.echo(f"hyperacc compare: {text}: {exc}", err=True)
            sys.exit(1)
    try:
        doc = comparison(docs, list(runs), fail_on, simulate=not no_simulate, run_dirs=dirs)
    except CompareError as exc:  # a limit on a figure these runs do not have: never a pass
        raise click.BadParameter(str(exc), param_hint="--fail-on") from None
    if as_json:
        click.echo(json.dumps(doc, indent=2, allow_nan=False))
    else:
        render(doc)
    if doc["broken"]:
        if not as_json:
            click.echo("hyperacc compare: limit broken: " + "; ".join(doc["broken"]), err=True)
        sys.exit(1)


def _value(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "%":
        return f"{100 * v:.2f} %"
    if unit == "ms":
        return f"{v:.3g} ms"
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"


def _delta(c: Mapping[str, Any], unit: str) -> str:
    d = c.get("delta")
    if d is None:
        return "-"
    if unit == "%":
        text = f"{100 * d:+.2f} pp"
    else:
        text = _value(d, unit)
        text = text if text.startswith("-") else "+" + text
    rel = c.get("relative")
    return text + (f" ({100 * rel:+.1f} %)" if rel is not None and unit != "%" else "")


def render(doc: Mapping[str, Any]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    # a log or a pipe gets the whole table on one line per figure (a terminal: its own width)
    con = Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 120)
    runs = doc["runs"]
    base = runs[0]
    for i, run in enumerate(runs[1:], start=1):
        t = Table(title=f"{run['run']} against {base['run']} (baseline)", box=box.SIMPLE_HEAD)
        for col in ("figure", "baseline", "this run", "change", "95 % interval", ""):
            # numbers never wrap inside a cell; a narrow terminal folds the mark instead
            t.add_column(col, justify="left" if col in ("figure", "") else "right",
                         no_wrap=col not in ("figure", ""))  # fmt: skip
        for c in (c for c in doc["changes"] if c["run"] == i):
            unit = base["figures"][c["name"]]["unit"]
            interval = "-" if c["low"] is None else f"{100 * c['low']:+.2f}..{100 * c['high']:+.2f} pp"
            mark = "BROKEN " + ", ".join(c["broken"]) if c["broken"] else ("worse" if c["worse"] else "")
            t.add_row(c["name"], _value(c["base"], unit), _value(c["value"], unit), _delta(c, unit), interval,
                      f"[red]{mark}[/]" if c["broken"] else mark)  # fmt: skip
        con.print(t)
    sc = doc.get("scaling")
    if sc:
        sim = {p["world_size"]: p for p in ((sc.get("simulated") or {}).get("points") or [])}
        t = Table(title="Scaling against linear (per-rank batch held; efficiency = steps/s over the smallest run's)",
                  box=box.SIMPLE_HEAD)  # fmt: skip
        for col in ("ranks", "steps/s", "efficiency", "CV", "simulated efficiency", "simulated CV"):
            t.add_column(col, justify="right")
        for p in sc["measured"]:
            s = sim.get(p["world_size"], {})
            t.add_row(str(p["world_size"]), _value(p["steps_per_s"], ""), _value(p["efficiency"], ""),
                      _value(p["cv"], ""), _value(s.get("efficiency"), ""), _value(s.get("cv"), ""))  # fmt: skip
        simulated = sc.get("simulated") or {}
        if simulated.get("assumptions"):
            t.caption = f"simulated from {simulated['from']}: {simulated['assumptions']}"
        elif simulated.get("error"):
            t.caption = f"no simulation: {simulated['error']}"
        con.print(t)
    if doc["limits"]:
        con.print(("[red]Broken: " + "; ".join(doc["broken"]) + "[/]") if doc["broken"] else
                  f"[green]Within limits: {', '.join(doc['limits'])}[/]")  # fmt: skip

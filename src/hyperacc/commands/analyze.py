"""``hyperacc analyze RUN_DIR``: verdict, evidence and next step for a traced run.

Stragglers (culprit, not victims), spike rates per rank and node with 95 % intervals, causes ranked by
time lost, and the projection of the measured rate to larger clusters. ``--json`` prints the diagnosis
document (schema in docs/detection.md). Every threshold is an option; defaults in docs/detection.md.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import click

from hyperacc.analysis.options import DetectionOptions
from hyperacc.commands.params import (
    FINITE,
    Number,
    OneLineCommand,
    existing_run_dirs,
    option_error,
    typed_options,
)
from hyperacc.store import MAX_RANKS, RunDirError


def _pct(p: float | None) -> str:
    if p is None:
        return "-"
    pct = 100.0 * p
    return f"{pct:.1f} %" if pct >= 10 or pct == 0 else f"{pct:.2g} %"


def _ms(ns: float | None) -> str:
    if ns is None or (isinstance(ns, float) and math.isnan(ns)):
        return "-"
    return f"{ns / 1e6:.3g} ms" if ns < 1e9 else f"{ns / 1e9:.3g} s"


# Each detection setting and the option that sets it, so a rule broken in DetectionOptions names the option.
OPTION_OF = {
    "window_steps": "--window-steps", "persist_k": "--persist", "persist_n": "--persist",
    "z_threshold": "--z-threshold", "iqr_k": "--iqr-k", "outlier_rule": "--rule", "min_slowdown": "--min-slowdown",
    "spike_mad": "--spike-mad", "spike_floor_ns": "--spike-floor-ms", "spike_floor_rel": "--spike-floor-rel",
    "spike_window": "--spike-window", "spike_metric": "--spike-metric", "warmup_steps": "--warmup-steps",
    "target": "--target", "ranks_per_node": "--ranks-per-node", "top_events": "--top",
}  # fmt: skip
_COUNT_MAX = 1 << 53  # step counts beyond float64's exact integers are no step counts
_D = DetectionOptions()  # the defaults the help names, read from the options in force


def _persist(ctx: click.Context, param: click.Parameter, text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        k, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise click.BadParameter(f"expected K/N such as 3/5, got {text!r}") from None
    if not (0 <= k <= 10**6 and 0 <= n <= 10**6):
        raise click.BadParameter(f"K and N are numbers of windows (0 to 1,000,000), got {text!r}")
    return k, n


@click.command(cls=OneLineCommand)
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print the diagnosis document as JSON.")
@click.option("--window-steps", type=click.IntRange(1, 1_000_000), default=None,
              help=f"Steps per straggler window [{_D.window_steps}].")  # fmt: skip
@click.option(
    "--persist", default=None, metavar="K/N", callback=_persist,
    help=f"Straggler: outlier in K of the last N windows [{_D.persist_k}/{_D.persist_n}].",
)  # fmt: skip
@click.option("--z-threshold", type=FINITE, default=None, help=f"Modified z-score (median/MAD) threshold [{_D.z_threshold:g}].")
@click.option("--iqr-k", type=FINITE, default=None, help=f"Tukey fence multiplier [{_D.iqr_k:g}].")
@click.option("--rule", "outlier_rule", type=click.Choice(["and", "or"]), default=None,
              help=f"Outlier when MAD z AND IQR agree, or when either does [{_D.outlier_rule}].")  # fmt: skip
@click.option(
    "--min-slowdown", type=FINITE, default=None, help=f"Straggler must be this much above the median [{_D.min_slowdown:g}]."
)
@click.option(
    "--spike-mad", type=FINITE, default=None, help=f"Spike: robust deviations above the rolling median [{_D.spike_mad:g}]."
)
@click.option("--spike-floor-ms", type=Number(min=0, max=1e12), default=None, help=f"Spike: absolute floor in ms [{_D.spike_floor_ns / 1e6:g}].")
@click.option(
    "--spike-floor-rel", type=FINITE, default=None, help=f"Spike: floor relative to the typical step [{_D.spike_floor_rel:g}]."
)
@click.option("--spike-window", type=click.IntRange(max=_COUNT_MAX), default=None,
              help=f"Spike: rolling-median window in steps [{_D.spike_window}].")  # fmt: skip
@click.option("--spike-metric", type=click.Choice(["self_ns", "busy_ns"]), default=None,
              help=f"Series spikes are judged on [{_D.spike_metric}].")  # fmt: skip
@click.option("--warmup-steps", type=click.IntRange(0, _COUNT_MAX), default=None,
              help=f"Leading steps of each rank left out [{_D.warmup_steps}].")  # fmt: skip
@click.option(
    "--target", type=FINITE, default=None, help=f"Tolerated share of cluster steps that spike [{_D.target:g}]."
)
@click.option("--ranks-per-node", type=click.IntRange(1, MAX_RANKS), default=None,
              help="Ranks per node for the projection [measured].")  # fmt: skip
@click.option("--top", "top_events", type=click.IntRange(0, 1_000_000), default=None,
              help=f"Spike events to list [{_D.top_events}].")  # fmt: skip
@click.option("--workers", type=click.IntRange(1, 64), default=None,
              help="Threads reading ranks [2, at most the CPUs].")  # fmt: skip
@click.option("--batch-size", type=click.IntRange(1, 1 << 40), default=None,
              help="Samples per rank and step, for the throughput in samples/s.")  # fmt: skip
@click.option("--cluster", default=None, metavar="ADDRESS",
              help="Reduce the ranks on a Dask cluster (tcp://scheduler:8786) that reads RUN_DIR from a shared "
                   "file system; needs hyperacc[cluster].")  # fmt: skip
def command(
    as_json: bool, run_dir: str, persist: tuple[int, int] | None, spike_floor_ms: float | None,
    workers: int | None, batch_size: int | None, cluster: str | None, **opts: Any,
) -> None:  # fmt: skip
    """Diagnose RUN_DIR: stragglers, spike rates, causes, the step-time distribution, the cost of
    coordination and its failure modes, resources, and what it means at scale.

    RUN_DIR may list the run directories of one job's agents joined by commas (nodes with local disks):
    hyperacc analyze /data/run-node0,/data/run-node1
    """
    from hyperacc.analysis import diagnose
    from hyperacc.analysis.cluster import ClusterError

    options = {k: v for k, v in opts.items() if v is not None}
    if persist is not None:
        options["persist_k"], options["persist_n"] = persist
    if spike_floor_ms is not None:
        options["spike_floor_ns"] = int(spike_floor_ms * 1e6)
    dirs = existing_run_dirs(run_dir, "RUN_DIR")
    try:  # every threshold is checked before any record is read
        DetectionOptions.from_mapping(options)
    except (ValueError, TypeError) as exc:
        raise option_error(exc, OPTION_OF, typed=typed_options()) from None
    try:
        diagnosis = diagnose(dirs, workers=workers, batch_size=batch_size, cluster=cluster, **options)
    except RunDirError as exc:
        click.echo(f"hyperacc analyze: {exc}", err=True)
        sys.exit(1)
    except ClusterError as exc:  # --cluster names no usable cluster: bad input
        click.echo(f"hyperacc analyze: {exc}", err=True)
        sys.exit(2)
    doc = diagnosis.to_dict()
    from hyperacc.present.diagnosis import remediation_of

    doc["remediation"] = remediation_of(run_dir)  # what --remediate decided and did (docs/remediation.md)
    if as_json:
        click.echo(json.dumps(doc, indent=2, allow_nan=False, default=_jsonable))
        return
    _render(doc)


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _render(doc: dict[str, Any]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    con = Console()
    from hyperacc.present.diagnosis import print_verdict

    title = (f"hyperacc analyze: {doc['ranks_analyzed']} of {doc['world_size']} ranks, "
             f"{doc['nodes']} node{'' if doc['nodes'] == 1 else 's'}, {doc['steps']} steps")  # fmt: skip
    print_verdict(con, title, doc["verdict"], bool(doc["stragglers"]), doc["evidence"], doc["next_step"])

    if doc["stragglers"]:
        t = Table(title="Stragglers", box=box.SIMPLE_HEAD)
        for col in (
            "rank",
            "node",
            "kind",
            "metric",
            "slowdown",
            "since step",
            "windows",
            "wait / median wait",
        ):
            t.add_column(col, justify="right" if col not in ("kind", "metric") else "left")
        for s in doc["stragglers"]:
            t.add_row(
                str(s["rank"]), str(s["node"]), s["kind"], s["metric"],
                "-" if s["slowdown"] is None else f"{s['slowdown']:.2f}x", str(s["since_step"]),
                f"{s['windows_flagged']}/{s['windows_seen']}",
                f"{_ms(s.get('comm_wait_ns'))} / {_ms(s.get('cluster_comm_wait_ns'))}",
            )  # fmt: skip
        con.print(t)

    spikes = doc["spikes"]
    ranks = sorted(spikes["per_rank"], key=lambda r: (-r["rate"], r["rank"]))
    shown = ranks[:16]
    t = Table(title="Spike rate per rank (95 % Wilson interval)", box=box.SIMPLE_HEAD)
    for col in ("rank", "node", "steps", "spikes", "rate", "interval", "main cause"):
        t.add_column(col, justify="left" if col == "main cause" else "right")
    for r in shown:
        t.add_row(
            str(r["rank"]), str(r["node"]), str(r["steps"]), str(r["spikes"]), _pct(r["rate"]),
            f"{_pct(r['ci_low'])} - {_pct(r['ci_high'])}", r.get("cause") or "-",
        )  # fmt: skip
    if len(ranks) > len(shown):
        t.caption = f"{len(ranks) - len(shown)} more ranks (highest rates shown); --json lists all"
    con.print(t)
    nodes = sorted(spikes["per_node"], key=lambda r: (-r["rate"], r["node"]))
    if len(nodes) > 1:
        t = Table(title="Spike rate per node (a step spikes when any of its ranks does)", box=box.SIMPLE_HEAD)
        for col in ("node", "steps", "spikes", "rate", "interval"):
            t.add_column(col, justify="right")
        for r in nodes[:16]:
            t.add_row(str(r["node"]), str(r["steps"]), str(r["spikes"]), _pct(r["rate"]),
                      f"{_pct(r['ci_low'])} - {_pct(r['ci_high'])}")  # fmt: skip
        con.print(t)
    c = spikes["cluster"]
    con.print(
        f"Cluster: {c['spike_steps']} of {c['steps']} steps spiked on at least one rank ({_pct(c['rate'])})."
    )

    if doc["causes"]:
        t = Table(title="Causes, ranked by time lost", box=box.SIMPLE_HEAD)
        for col in ("cause", "spikes", "time lost", "share"):
            t.add_column(col, justify="left" if col == "cause" else "right")
        for row in doc["causes"]:
            t.add_row(row["cause"], str(row["spikes"]), _ms(row["time_lost_ns"]), _pct(row["share"]))
        con.print(t)

    p = doc["projection"]
    t = Table(
        title=f"Projection at {_pct(p['p_rank'])} per rank"
        + (f" and {_pct(p['p_node'])} per node" if p.get("p_node") else "")
        + f", {p['ranks_per_node']} ranks per node",
        box=box.SIMPLE_HEAD,
    )
    for col in ("nodes", "ranks", "steps that spike", f"per-rank rate for <= {_pct(p['target'])}"):
        t.add_column(col, justify="right")
    for row in p["rows"]:
        need = _pct(row["required_p_rank"]) if row["required_p_rank"] is not None else "none (node-wide)"
        t.add_row(str(row["nodes"]), str(row["ranks"]), _pct(row["p_cluster"]), need)
    if any(row["required_p_rank"] is None for row in p["rows"]):
        t.caption = (f"none (node-wide): node-wide spikes alone ({_pct(p.get('p_node') or 0.0)} of each node's "
                     "steps) exceed the target there, so no per-rank rate can meet it")  # fmt: skip
    con.print(t)
    _render_coordination(con, doc.get("coordination") or {})
    _render_resources(con, doc.get("resources") or {})
    if doc.get("remediation"):
        con.print("[bold]Remediation[/bold] (RUN_DIR/remediation/events.jsonl and the ranks' switches)")
        for event in doc["remediation"]:
            con.print(f"  - {event['line']}", highlight=False, markup=False)
    if doc["missing_ranks"]:
        con.print(f"[yellow]Missing ranks (no step records): {doc['missing_ranks']}[/yellow]")


def _render_coordination(con: Any, c: dict[str, Any]) -> None:
    """Step-time distribution, coordination cost and failure modes (docs/detection.md, "Coordination")."""
    from rich import box
    from rich.table import Table

    d = c.get("distribution")
    if d:
        t = Table(title="Step time of the cluster (the slowest rank's step)", box=box.SIMPLE_HEAD)
        for col in ("steps", "p50", "p90", "p99", "p99.9", "CV", "jitter", "steps/s", "samples/s"):
            t.add_column(col, justify="right")
        t.add_row(str(d["steps"]), _ms(d["p50_ns"]), _ms(d["p90_ns"]), _ms(d["p99_ns"]), _ms(d["p999_ns"]),
                  _num(d["cv"]), _pct(d["jitter"]), _num(d["steps_per_s"]),
                  _num(d["samples_per_s"]) if d.get("samples_per_s") else "- (--batch-size)")  # fmt: skip
        con.print(t)
    cost = c.get("cost")
    if cost:
        con.print(
            f"Coordination: {_pct(cost['wait_share'])} of step time waiting in collectives: "
            f"{_pct(cost['collective_share'])} the collective's own cost, {_pct(cost['late_share'])} waiting for "
            f"late arrivals. Arrival spread p50 {_ms(cost['spread_p50_ns'])}, p99 {_ms(cost['spread_p99_ns'])}; "
            f"last third / first third of the run: spread {_num(cost['spread_trend'])}x, collective "
            f"{_num(cost['collective_trend'])}x ({c.get('clock', 'host')} clock).",
            highlight=False,
        )
    elif c:
        con.print("Coordination: not measured (no step with waits in collectives on two or more ranks on one clock).")
    modes = c.get("failure_modes") or []
    if modes:
        t = Table(title="Lost time by failure mode", box=box.SIMPLE_HEAD)
        for col in ("mode", "verdict", "share", "evidence"):
            t.add_column(col, justify="right" if col == "share" else "left", overflow="fold")
        for m in modes:
            t.add_row(m["mode"], m["verdict"], _pct(m["share"]), m["evidence"])
        con.print(t)


def _render_resources(con: Any, r: dict[str, Any]) -> None:
    """Memory creep and imbalance across ranks (docs/detection.md, "Resources")."""
    if not r:
        return
    if not r.get("samples"):
        con.print("Resources: no samples (RUN_DIR/resources is empty).")
        return
    judged = r.get("judged") or {}
    head = (f"Resources: {r['samples']} samples of {r['ranks']} ranks; creep: {judged.get('creep', '-')}; "
            f"imbalance: {judged.get('imbalance', '-')}.")  # fmt: skip
    con.print(head, highlight=False)
    for line in r.get("findings") or []:
        con.print(f"  - {line}", highlight=False)
    if not r.get("findings"):
        con.print("  - no memory creep and no rank out of line", highlight=False)


def _num(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3g}"

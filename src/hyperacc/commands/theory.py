"""``hyperacc theory``: what a per-rank spike rate means at scale."""

from __future__ import annotations

import dataclasses
import json

import click

from hyperacc import theory
from hyperacc.commands.params import FINITE, OneLineCommand, option_error, typed_options

MAX_SWEEP = 32  # node counts in one sweep: each costs up to ~1 s of numerical integration here
MAX_NODES = 10**9

# Each parameter of hyperacc.theory and the option that sets it, so its error names the option.
OPTION_OF = {
    "p_rank": "--p-rank", "p_node": "--p-node", "ranks_per_node": "--ranks-per-node", "target": "--target",
    "base": "--base-ms", "noise": "--noise-ms", "spike_size": "--spike-ms", "node_mtbf": "--node-mtbf-hours",
    "mtbf": "--node-mtbf-hours", "job_length": "--job-hours", "nodes": "--nodes",
}  # fmt: skip


def _counts(ctx: click.Context, param: click.Parameter, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated whole numbers, got {text!r}") from None
    if not values:
        raise click.BadParameter("give at least one node count")
    if any(not 1 <= v <= MAX_NODES for v in values):
        raise click.BadParameter(f"node counts must be in [1, {MAX_NODES:,}], got {text!r}")
    values = sorted(set(values), key=values.index)
    if len(values) > MAX_SWEEP:
        raise click.BadParameter(f"at most {MAX_SWEEP} node counts per sweep (got {len(values)})")
    return values


def _pct(p: float | None, digits: int = 2) -> str:
    if p is None:
        return "-"
    if p == 0:
        return "0 %"
    return f"{100 * p:.{digits}f} %" if p >= 1e-4 else f"{100 * p:.2e} %"


@click.command(cls=OneLineCommand)
@click.option("--nodes", default=None, type=click.IntRange(1, MAX_NODES),
              help="Node count to report (default: the sweep).")  # fmt: skip
@click.option("--sweep", "sweep_", default="1,8,64,256,1024", show_default=True, callback=_counts,
              help=f"Node counts, comma-separated (at most {MAX_SWEEP}).")  # fmt: skip
@click.option("--ranks-per-node", default=8, show_default=True, type=click.IntRange(1, MAX_NODES),
              help="Ranks (GPUs) per node.")  # fmt: skip
@click.option("--p-rank", default=0.005, show_default=True, type=FINITE, help="Per-rank spike rate per step.")
@click.option("--p-node", default=0.0, show_default=True, type=FINITE, help="Per-node (host-wide) rate.")
@click.option(
    "--target", default=theory.DEFAULT_TARGET, show_default=True, type=FINITE,
    help="Cluster spike probability to stay under; the table shows the per-rank rate it requires.",
)  # fmt: skip
@click.option("--base-ms", default=100.0, show_default=True, type=FINITE, help="Clean step time.")
@click.option("--noise-ms", default=5.0, show_default=True, type=FINITE, help="Std-dev of step noise.")
@click.option("--spike-ms", default=200.0, show_default=True, type=FINITE, help="Spike magnitude (mean/median).")
@click.option("--spike-dist", default="fixed", show_default=True, type=click.Choice(["fixed", "exp", "lognormal"]))
@click.option("--node-mtbf-hours", default=None, type=FINITE, help="Per-node MTBF, for the serial-system model.")
@click.option("--job-hours", default=None, type=FINITE, help="Job length for the survival probability.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def command(
    nodes: int | None,
    sweep_: list[int],
    ranks_per_node: int,
    p_rank: float,
    p_node: float,
    target: float,
    base_ms: float,
    noise_ms: float,
    spike_ms: float,
    spike_dist: str,
    node_mtbf_hours: float | None,
    job_hours: float | None,
    as_json: bool,
) -> None:
    """Cluster spike probability, required per-rank rate, expected step time and MTBF versus node count.

    Example: hyperacc theory --nodes 64 --ranks-per-node 8 --p-rank 0.005
    """
    counts = [nodes] if nodes is not None else sweep_
    if job_hours is not None:
        try:  # checked on its own: the sweep reads it only with --node-mtbf-hours
            theory.survival_probability(job_hours, 1.0)
        except theory.TheoryError as exc:
            raise option_error(exc, OPTION_OF, "--job-hours") from None
    try:
        model = theory.ClusterStepModel(
            base=base_ms, noise=noise_ms, p_rank=p_rank, spike_size=spike_ms, spike=spike_dist,
            ranks_per_node=ranks_per_node, p_node=p_node,
        )  # fmt: skip
        rows = theory.sweep(
            counts, p_rank=p_rank, ranks_per_node=ranks_per_node, p_node=p_node, target=target,
            model=model, node_mtbf_hours=node_mtbf_hours, job_hours=job_hours,
        )  # fmt: skip
    except theory.TheoryError as exc:
        typed = typed_options() | ({"--nodes"} if "--sweep" in typed_options() else set())
        raise option_error(exc, OPTION_OF, "--target", typed) from None

    if as_json:
        doc = {
            "inputs": {
                "p_rank": p_rank, "p_node": p_node, "ranks_per_node": ranks_per_node, "target": target,
                "base_ms": base_ms, "noise_ms": noise_ms, "spike_ms": spike_ms, "spike_dist": spike_dist,
                "node_mtbf_hours": node_mtbf_hours, "job_hours": job_hours,
            },
            "rows": [
                {**dataclasses.asdict(r), "step": ({**dataclasses.asdict(r.step), "cv": r.step.cv} if r.step else None)}
                for r in rows
            ],
        }  # fmt: skip
        click.echo(json.dumps(doc, indent=2))
        return

    from rich.console import Console
    from rich.table import Table

    title = (
        f"p_rank={_pct(p_rank, 3)}, p_node={_pct(p_node, 3)}, {ranks_per_node} ranks/node; "
        f"step = {base_ms:g} ms + N(0, {noise_ms:g}) + {spike_dist} spike of {spike_ms:g} ms"
    )
    table = Table(title=title, title_justify="left")
    for col in ("nodes", "ranks", "P(spike)", f"need p_rank (<={_pct(target, 0)})",
                "E\\[step] ms", "p50 ms", "p99 ms", "CV"):  # fmt: skip
        table.add_column(col, justify="right")
    if node_mtbf_hours:
        for col in ("MTBF h", "stops/day") + (("P(survive)",) if job_hours is not None else ()):
            table.add_column(col, justify="right")
    for r in rows:
        cells = [
            str(r.nodes), str(r.ranks), _pct(r.p_cluster, 1), _pct(r.required_p_rank, 3),
            f"{r.step.mean:.1f}", f"{r.step.p50:.1f}", f"{r.step.p99:.1f}", f"{r.step.cv:.3f}",
        ]  # fmt: skip
        if node_mtbf_hours:
            cells += [f"{r.mtbf_hours:.2f}", f"{r.interruptions_per_day:.2f}"]
            if job_hours is not None:
                cells.append(_pct(r.p_survive_job, 1))
        table.add_row(*cells)
    console = Console()
    if not console.is_terminal:
        console = Console(width=140)
    console.print(table)

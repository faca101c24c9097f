"""``hyperacc simulate``: bulk-synchronous training at several node counts, with and without pacing.

The model and every parameter are documented in docs/pacing.md ("The simulator").
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import click

from hyperacc.commands.params import Number, OneLineCommand, OutputDir, OutputFile
from hyperacc.pacing.controller import PacingConfig, PacingConfigError

MAX_RANKS = 65536
# With --from-run the compute comes from the trace: these options would have no effect, so they are
# refused when given (docs/pacing.md, "Trace-driven").
COMPUTE_OPTIONS = ("base_ms", "noise_cv", "locality_gpu", "locality_node", "spike_rate", "spike_ms", "spike_dist",
                   "node_spike_rate", "node_spike_ms", "sync_every", "sync_ms")  # fmt: skip
# The measured transfer replaces the fabric's own draws: background load is not applied to it.
REPLAY_IGNORES = ("background_load",)
# Only used to scale the measured transfer to another shape.
FABRIC_SCALING = ("exposed_mb", "intra_gbps", "inter_gbps", "nodes_per_leaf", "oversubscription")


# Physical ranges of the simulator's quantities: beyond them its float32 nanoseconds overflow.
TIME_MS = Number(max=1e9)  # ~11.6 days
SIZE_MB = Number(max=1e9)
GBPS = Number(min=1e-3, max=1e6)
FACTOR = Number(min=-1e6, max=1e6)  # fractions, probabilities, costs, gains (their rules: hyperacc.sim)
MAX_STEPS = 10_000_000  # per-step results are kept (~17 bytes a step): 10 M steps is ~170 MB
MAX_NODE_COUNTS = 32


def _as_option(message: str) -> str:
    """'spike_rate=2 is invalid' (or 'pacing.gain=3.0 is invalid', the options layer's form) ->
    '--spike-rate 2 is invalid' / '--pace-gain 3.0 is invalid': name the option the user typed."""
    m = re.match(r"(pacing[ .])?(\w+)=(\S+) (.*)", message)
    if not m:
        return message
    prefix = "pace-" if m.group(1) else ""
    return f"--{prefix}{m.group(2).replace('_', '-')} {m.group(3)} {m.group(4)}"


def _node_counts(text: str, gpus_per_node: int) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise click.UsageError(f"--nodes {text!r}: give node counts as integers, e.g. --nodes 1,2,4,8") from None
    if not counts or any(c < 1 for c in counts):
        raise click.UsageError(f"--nodes {text!r}: every node count must be >= 1, e.g. --nodes 1,2,4,8")
    too_big = [c for c in counts if c * gpus_per_node > MAX_RANKS]
    if too_big:
        raise click.UsageError(
            f"--nodes {too_big[0]} x --gpus-per-node {gpus_per_node} exceeds {MAX_RANKS} ranks; use fewer nodes"
        )
    if len(set(counts)) > MAX_NODE_COUNTS:
        raise click.UsageError(f"--nodes: at most {MAX_NODE_COUNTS} node counts (got {len(set(counts))})")
    return sorted(set(counts))


@click.command(cls=OneLineCommand)
@click.option(
    "--nodes",
    "nodes_text",
    default="1,2,4,8,16,32,64",
    show_default=True,
    help="Node counts, comma-separated.",
)
@click.option("--gpus-per-node", type=click.IntRange(min=1, max=MAX_RANKS), default=8, show_default=True)
@click.option("--steps", type=click.IntRange(max=MAX_STEPS), default=5000, show_default=True,
              help="Steps simulated per node count.")  # fmt: skip
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option(
    "--samples-per-rank", type=int, default=32, show_default=True, help="Samples per rank per step."
)
@click.option(
    "--from-run",
    "from_run",
    type=click.Path(file_okay=False, path_type=Path),
    help="Resample compute from a traced run directory.",
)
# compute
@click.option("--base-ms", type=TIME_MS, default=100.0, show_default=True, help="Mean compute per step.")
@click.option(
    "--noise-cv", type=FACTOR, default=0.02, show_default=True, help="Gaussian noise of compute (fraction)."
)
@click.option(
    "--locality-gpu",
    type=FACTOR,
    default=0.0,
    show_default=True,
    help="Max fixed offset of a GPU slot (fraction).",
)
@click.option(
    "--locality-node",
    type=FACTOR,
    default=0.0,
    show_default=True,
    help="Max fixed offset of a node (fraction).",
)
@click.option(
    "--spike-rate", type=FACTOR, default=0.0, show_default=True, help="Per-rank spike probability per step."
)
@click.option("--spike-ms", type=TIME_MS, default=50.0, show_default=True)
@click.option(
    "--spike-dist", type=click.Choice(["fixed", "exp", "lognormal"]), default="exp", show_default=True
)
@click.option(
    "--node-spike-rate",
    type=FACTOR,
    default=0.0,
    show_default=True,
    help="Per-node spike probability per step.",
)
@click.option("--node-spike-ms", type=TIME_MS, default=50.0, show_default=True)
@click.option(
    "--sync-every",
    type=int,
    default=0,
    show_default=True,
    help="Stabilizer: synchronous pause every N steps.",
)
@click.option(
    "--sync-ms", type=TIME_MS, default=0.0, show_default=True, help="Stabilizer: length of that pause."
)
# fabric
@click.option(
    "--exposed-mb",
    type=SIZE_MB,
    default=100.0,
    show_default=True,
    help="Gradient MB whose all-reduce is exposed.",
)
@click.option(
    "--intra-gbps", type=GBPS, default=200.0, show_default=True, help="GB/s per GPU inside a node."
)
@click.option(
    "--inter-gbps", type=GBPS, default=50.0, show_default=True, help="GB/s per node into the fabric."
)
@click.option("--nodes-per-leaf", type=int, default=16, show_default=True)
@click.option(
    "--oversubscription", type=FACTOR, default=1.0, show_default=True, help="Leaf uplink oversubscription."
)
@click.option(
    "--background-load", type=FACTOR, default=0.0, show_default=True, help="Mean uplink load of other jobs."
)
# early-arrival cost
@click.option(
    "--spin-cost", type=FACTOR, default=0.0, show_default=True, help="Slowdown per spinning node peer (beta)."
)
@click.option(
    "--sleep-cost", type=FACTOR, default=0.0, show_default=True, help="Cost of a paced peer, fraction of spin."
)
@click.option(
    "--burst-cost",
    type=FACTOR,
    default=0.0,
    show_default=True,
    help="All-reduce penalty of synchronous starts.",
)
# pacing
@click.option(
    "--pacing/--no-pacing", default=True, show_default=True, help="Also simulate with pacing, side by side."
)
@click.option("--pace-gain", type=FACTOR, default=PacingConfig.gain, show_default=True)
@click.option("--pace-max-delay-ms", type=Number(max=1e9), default=PacingConfig.max_delay_ns / 1e6, show_default=True)
@click.option("--pace-max-frac", type=FACTOR, default=PacingConfig.max_delay_frac, show_default=True)
@click.option(
    "--pace-every", type=int, default=1, show_default=True, help="Controller updates every N steps."
)
# output
@click.option(
    "--plot",
    "plot",
    type=OutputFile(make_parents=False),
    help="Write a plot: .png (matplotlib) or .html (plotly).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.option(
    "--write-run",
    type=OutputDir(),
    help="Write the simulated steps as a run directory (one node count).",
)
@click.option("--replay-block", type=click.IntRange(min=1, max=MAX_STEPS), default=50, show_default=True,
              help="--from-run: consecutive measured steps replayed together.")
@click.option("--comm-scale", type=click.Choice(["fabric", "none"]), default="fabric", show_default=True,
              help="--from-run: scale the measured transfer to the target shape with the fabric model, or not.")
@click.pass_context
def command(ctx: click.Context, nodes_text: str, gpus_per_node: int, from_run: Path | None, plot: Path | None,
            as_json: bool, write_run: Path | None, pacing: bool, replay_block: int, comm_scale: str,
            **opts: float) -> None:  # fmt: skip
    """Simulate bulk-synchronous data-parallel training at scale (docs/pacing.md)."""
    from hyperacc.sim import (
        ComputeModel,
        EarlyArrivalCost,
        FabricModel,
        MeasuredRun,
        SimConfig,
        SimConfigError,
    )
    from hyperacc.sim.simulate import simulate, sweep
    from hyperacc.store import RunDirError

    if from_run is not None:
        from hyperacc.commands.params import existing_run_dirs

        existing_run_dirs(str(from_run), "--from-run")
    _check_replay_options(ctx, from_run, comm_scale)
    counts = _node_counts(nodes_text, gpus_per_node)
    if write_run is not None and len(counts) != 1:
        raise click.UsageError("--write-run writes one simulated job: give a single --nodes value")
    plot = Path(plot) if plot is not None else None
    if plot is not None and plot.suffix.lower() not in (".png", ".html"):
        raise click.UsageError(f"--plot {plot}: the file must end in .png or .html")
    try:
        pace = (
            PacingConfig(
                gain=opts["pace_gain"],
                max_delay_ns=int(opts["pace_max_delay_ms"] * 1e6),
                max_delay_frac=opts["pace_max_frac"],
            )
            if pacing
            else None
        )
        cfg = SimConfig(
            nodes=counts[0],
            gpus_per_node=gpus_per_node,
            steps=int(opts["steps"]),
            seed=int(opts["seed"]),
            samples_per_rank=int(opts["samples_per_rank"]),
            compute=ComputeModel(
                base_ms=opts["base_ms"],
                noise_cv=opts["noise_cv"],
                locality_gpu=opts["locality_gpu"],
                locality_node=opts["locality_node"],
                spike_rate=opts["spike_rate"],
                spike_ms=opts["spike_ms"],
                spike_dist=str(opts["spike_dist"]),
                node_spike_rate=opts["node_spike_rate"],
                node_spike_ms=opts["node_spike_ms"],
                sync_every=int(opts["sync_every"]),
                sync_ms=opts["sync_ms"],
            ),  # fmt: skip
            fabric=FabricModel(
                exposed_mb=opts["exposed_mb"],
                intra_gbps=opts["intra_gbps"],
                inter_gbps=opts["inter_gbps"],
                nodes_per_leaf=int(opts["nodes_per_leaf"]),
                oversubscription=opts["oversubscription"],
                background_load=opts["background_load"],
            ),  # fmt: skip
            cost=EarlyArrivalCost(
                spin_cost=opts["spin_cost"], sleep_cost=opts["sleep_cost"], burst_cost=opts["burst_cost"]
            ),
            pacing=pace,
            pace_every=int(opts["pace_every"]),
            replay_block=replay_block,
            comm_scale=comm_scale,
        )
        measured = MeasuredRun.from_run_dir(from_run) if from_run is not None else None
    except (SimConfigError, PacingConfigError) as exc:
        raise click.UsageError(_as_option(str(exc))) from None
    except RunDirError as exc:
        raise click.ClickException(f"--from-run: {exc}") from None
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    err = Console(stderr=True)
    total = cfg.steps * len(counts)
    with Progress(
        TextColumn("simulating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=err, transient=True, disable=not err.is_terminal,
    ) as bar:  # fmt: skip
        task = bar.add_task("steps", total=total)
        try:
            if write_run is not None:
                results = [simulate(cfg, measured, lambda k: bar.advance(task, k), write_run=write_run)]
            else:
                results = sweep(cfg, counts, measured, lambda k: bar.advance(task, k), keep_steps=False)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None

    from hyperacc.sim.simulate import replay_assumptions

    assumptions = (
        {r.nodes: replay_assumptions(dataclasses.replace(cfg, nodes=r.nodes), measured) for r in results}
        if measured is not None else {}
    )  # fmt: skip
    if as_json:
        payload = {
            "config": dataclasses.asdict(cfg)
            | {"nodes": counts, "from_run": str(from_run) if from_run else None},
            "assumptions": {str(k): v for k, v in assumptions.items()},
            "results": [r.to_dict() for r in results],
        }
        click.echo(json.dumps(payload, indent=2, default=str))
    else:
        _print_assumptions(assumptions)
        _print_table(results, measured is not None)
    if plot is not None:
        written = write_plot(results, plot)
        click.echo(f"plot written to {written}", err=as_json)
    if write_run is not None:
        click.echo(f"simulated run directory written to {write_run}", err=as_json)


def _check_replay_options(ctx: click.Context, from_run: Path | None, comm_scale: str) -> None:
    """Refuse an option that would silently do nothing: a compute option with --from-run (the trace is
    the compute), background load with --from-run, fabric options with --comm-scale none, and the
    replay options without --from-run."""
    from click.core import ParameterSource

    def given(name: str) -> bool:
        return ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)

    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    if from_run is None:
        unused = [n for n in ("replay_block", "comm_scale") if given(n)]
        if unused:
            raise click.ClickException(f"{flag(unused[0])} applies to --from-run only; drop it or add --from-run RUN_DIR")
        return
    refused = [n for n in COMPUTE_OPTIONS if given(n)]
    if refused:
        raise click.ClickException(
            f"{flag(refused[0])} has no effect with --from-run (the compute is replayed from the trace); drop it, "
            "or simulate without --from-run"
        )
    refused = [n for n in REPLAY_IGNORES if given(n)]
    if refused:
        raise click.ClickException(
            f"{flag(refused[0])} has no effect with --from-run (the measured transfer is replayed); drop it"
        )
    if comm_scale == "none":
        refused = [n for n in FABRIC_SCALING if given(n)]
        if refused:
            raise click.ClickException(
                f"{flag(refused[0])} only scales the measured transfer, which --comm-scale none keeps as measured; "
                "drop one of them"
            )


def _print_assumptions(assumptions: dict[int, list[str]]) -> None:
    """Every assumption of a trace-driven run; lines that differ between node counts are shown per count."""
    if not assumptions:
        return
    sizes = sorted(assumptions)
    shared = [line for line in assumptions[sizes[0]] if all(line in assumptions[k] for k in sizes)]
    click.echo("assumptions (trace-driven, docs/pacing.md):")
    for line in shared:
        click.echo(f"  - {line}")
    for k in sizes:
        for line in assumptions[k]:
            if line not in shared:
                click.echo(f"  - {k} nodes: {line}")


def _print_table(results: list, from_run: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    paced = any(r.paced is not None for r in results)
    table = Table(title="Simulated bulk-synchronous training" + (" (trace-driven)" if from_run else ""))
    for col in (
        "nodes",
        "ranks",
        "mean ms",
        "p50 ms",
        "p99 ms",
        "CV",
        "samples/s",
        "eff.",
        "spike frac",
        "theory",
    ):
        table.add_column(col, justify="right")
    if paced:
        for col in ("paced mean", "paced p99", "paced CV", "d thrpt", "on %", "delay ms"):
            table.add_column(col, justify="right")
    for r in results:
        b = r.baseline
        row = [
            str(r.nodes), str(r.ranks), f"{b.mean_ms:.2f}", f"{b.p50_ms:.2f}", f"{b.p99_ms:.2f}", f"{b.cv:.3f}",
            f"{b.throughput:,.0f}", f"{b.efficiency:.3f}",
            f"{r.spike_fraction:.4f}±{r.spike_fraction_se:.4f}", f"{r.theory_spike_probability:.4f}",
        ]  # fmt: skip
        if paced and r.paced is not None:
            p = r.paced
            gain = (p.throughput / b.throughput - 1) * 100 if b.throughput else 0.0
            row += [
                f"{p.mean_ms:.2f}", f"{p.p99_ms:.2f}", f"{p.cv:.3f}", f"{gain:+.2f}%",
                f"{100 * p.pace_on_fraction:.0f}", f"{p.mean_delay_ms:.3f}",
            ]  # fmt: skip
        table.add_row(*row)
    console = Console(file=sys.stdout)
    if not console.is_terminal:
        console = Console(file=sys.stdout, width=200)
    console.print(table)


def write_plot(results: list, path: Path) -> Path:
    """Throughput, CV and spike fraction against node count: PNG with matplotlib, else HTML with plotly."""
    nodes = [r.nodes for r in results]
    ref = results[0]
    linear = [ref.baseline.throughput * r.ranks / ref.ranks for r in results]
    series = {
        "throughput": [r.baseline.throughput for r in results],
        "throughput paced": [r.paced.throughput if r.paced else None for r in results],
        "cv": [r.baseline.cv for r in results],
        "cv paced": [r.paced.cv if r.paced else None for r in results],
        "spike": [r.spike_fraction for r in results],
        "theory": [r.theory_spike_probability for r in results],
    }
    if path.suffix.lower() == ".png":
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            path = path.with_suffix(".html")
            click.echo(f"matplotlib is not installed: writing HTML to {path} instead", err=True)
        else:
            fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
            axes[0].plot(nodes, linear, "k--", label="linear")
            axes[0].plot(nodes, series["throughput"], "o-", label="baseline")
            axes[1].plot(nodes, series["cv"], "o-", label="baseline")
            if results[0].paced is not None:
                axes[0].plot(nodes, series["throughput paced"], "s-", label="paced")
                axes[1].plot(nodes, series["cv paced"], "s-", label="paced")
            axes[2].plot(nodes, series["spike"], "o", label="simulated")
            axes[2].plot(nodes, series["theory"], "-", label="1-(1-p)^N")
            for ax, title in zip(axes, ("samples/s", "step-time CV", "steps with a spike"), strict=True):
                ax.set_xscale("log", base=2)
                ax.set_xlabel("nodes")
                ax.set_title(title)
                ax.legend()
            fig.tight_layout()
            fig.savefig(path, dpi=120)
            plt.close(fig)
            return path
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=3, subplot_titles=("samples/s", "step-time CV", "steps with a spike"))
    fig.add_trace(go.Scatter(x=nodes, y=linear, name="linear", line={"dash": "dash"}), 1, 1)
    fig.add_trace(go.Scatter(x=nodes, y=series["throughput"], name="baseline", mode="lines+markers"), 1, 1)
    fig.add_trace(go.Scatter(x=nodes, y=series["cv"], name="baseline CV", mode="lines+markers"), 1, 2)
    if results[0].paced is not None:
        fig.add_trace(
            go.Scatter(x=nodes, y=series["throughput paced"], name="paced", mode="lines+markers"), 1, 1
        )
        fig.add_trace(go.Scatter(x=nodes, y=series["cv paced"], name="paced CV", mode="lines+markers"), 1, 2)
    fig.add_trace(
        go.Scatter(x=nodes, y=series["spike"], name="simulated spike fraction", mode="markers"), 1, 3
    )
    fig.add_trace(go.Scatter(x=nodes, y=series["theory"], name="1-(1-p)^N", mode="lines"), 1, 3)
    for col in (1, 2, 3):
        fig.update_xaxes(type="log", title_text="nodes", row=1, col=col)
    fig.write_html(str(path), include_plotlyjs=True, full_html=True)
    return path

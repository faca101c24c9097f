"""``hyperacc affinity --show``: the NUMA/CPU binding plan for the ranks of this node.

The plan is the one ``hyperacc.stabilize.stabilize(affinity=...)`` applies inside each rank; the rules
are in docs/stabilizers.md, "NUMA / CPU binding"."""

from __future__ import annotations

import json
import os
import re

import click

from hyperacc.commands.params import OneLineCommand, option_error

# A plan lists every rank and worker of one node: more than this on one node is a typing error, and
# a million ranks took minutes and gigabytes to plan.
MAX_LOCAL_RANKS = 4096
MAX_WORKERS = 1024
_OPTION_OF = {"nproc": "--nproc-per-node", "workers_per_rank": "--workers-per-rank", "main_cores": "--main-cores"}


@click.command("affinity", cls=OneLineCommand)
@click.option("--show", is_flag=True, default=True, help="Print the plan (the default and only action).")
@click.option(
    "--nproc-per-node",
    type=click.IntRange(max=MAX_LOCAL_RANKS),
    default=None,
    help="Ranks on this node (default: LOCAL_WORLD_SIZE, else the number of visible GPUs, else 1).",
)
@click.option(
    "--workers-per-rank", type=click.IntRange(max=MAX_WORKERS), default=0, show_default=True, help="DataLoader workers per rank."
)
@click.option("--main-cores", type=click.IntRange(min=1), default=None, help="Cores kept for each rank's main process.")
@click.option(
    "--sysfs-root",
    type=click.Path(file_okay=False),
    default="/sys",
    show_default=True,
    help="sysfs tree to read (a copy or a fake tree for what-if plans).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def command(
    show: bool, nproc_per_node: int | None, workers_per_rank: int, main_cores: int | None, sysfs_root: str,
    as_json: bool,
) -> None:  # fmt: skip
    """Show the NUMA/CPU binding plan for this node."""
    from hyperacc.stabilize.affinity import format_plan, plan_affinity, read_topology

    if not os.path.isdir(sysfs_root):
        raise click.UsageError(f"--sysfs-root {sysfs_root} is not a directory; pass a sysfs tree (default /sys)")
    try:
        real = os.path.realpath(sysfs_root) == os.path.realpath("/sys")
        topo = read_topology(
            sysfs_root, visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES") if real else None
        )
        nproc = nproc_per_node
        if nproc is None:
            env = os.environ.get("LOCAL_WORLD_SIZE")
            nproc = int(env) if env and env.isdigit() else (len(topo.gpus) or 1)
        plan = plan_affinity(
            nproc, workers_per_rank, sysfs_root=sysfs_root, topology=topo, main_cores=main_cores
        )
    except ValueError as exc:
        if re.search(r"\b(nproc|workers_per_rank|main_cores)\b", str(exc)):  # the planner's rule on an option
            raise option_error(exc, _OPTION_OF) from None
        raise click.ClickException(str(exc)) from None

    if as_json:
        click.echo(json.dumps(plan.to_dict(), indent=2))
    else:
        click.echo(format_plan(plan))

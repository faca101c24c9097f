"""``hyperacc affinity --show``: the NUMA/CPU binding plan for the ranks of this node.

The plan is the one ``hyperacc.stabilize.stabilize(affinity=...)`` applies inside each rank; the rules
are in docs/stabilizers.md, "NUMA / CPU binding"."""

from __future__ import annotations

import json
import os

import click


@click.command("affinity")
@click.option("--show", is_flag=True, default=True, help="Print the plan (the default and only action).")
@click.option(
    "--nproc-per-node",
    type=int,
    default=None,
    help="Ranks on this node (default: LOCAL_WORLD_SIZE, else the number of visible GPUs, else 1).",
)
@click.option(
    "--workers-per-rank", type=int, default=0, show_default=True, help="DataLoader workers per rank."
)
@click.option("--main-cores", type=int, default=None, help="Cores kept for each rank's main process.")
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
        raise click.ClickException(
            f"--sysfs-root {sysfs_root} is not a directory; pass a sysfs tree (default /sys)"
        )
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
        raise click.ClickException(str(exc)) from None

    if as_json:
        click.echo(json.dumps(plan.to_dict(), indent=2))
    else:
        click.echo(format_plan(plan))

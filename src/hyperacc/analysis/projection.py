"""The measured spike rate, projected to larger clusters with the spike theory (hyperacc.theory).

"At this rate a 256-node job spikes on 87 % of steps; you need <= 0.2 % per rank." Rules:
docs/detection.md ("Projection").
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from hyperacc import theory


def project(
    p_rank: float,
    ranks_per_node: int,
    target: float,
    nodes: Iterable[int],
    p_node: float = 0.0,
) -> dict[str, Any]:
    """Cluster spike probability at each size and the per-rank rate that would meet ``target`` there.

    ``required_p_rank`` is None where node-wide spikes alone already exceed the target.
    """
    rows = []
    for n in sorted(set(int(x) for x in nodes if int(x) >= 1)):
        p_cluster = theory.cluster_spike_probability(
            p_rank, ranks_per_node=ranks_per_node, nodes=n, p_node=p_node
        )
        try:
            required: float | None = theory.required_rate(
                target, n, ranks_per_node=ranks_per_node, p_node=p_node
            )
        except theory.TheoryError:
            required = None
        rows.append(
            {"nodes": n, "ranks": n * ranks_per_node, "p_cluster": p_cluster, "required_p_rank": required}
        )
    return {
        "p_rank": float(p_rank),
        "p_node": float(p_node),
        "ranks_per_node": int(ranks_per_node),
        "target": float(target),
        "rows": rows,
    }


def headline(projection: dict[str, Any]) -> str | None:
    """One sentence for the smallest projected size whose cluster spike rate exceeds the target (the
    largest size when none does), or None when there is nothing to project."""
    rows = projection.get("rows") or []
    if not rows:
        return None
    over = [r for r in rows if r["p_cluster"] > projection["target"]]
    row = over[0] if over else rows[-1]
    req = row["required_p_rank"]
    need = (
        f"you need <= {percent(req)} per rank"
        if req is not None
        else "node-wide spikes alone exceed the target"
    )
    article = "an" if str(row["nodes"])[0] == "8" or row["nodes"] in (11, 18) else "a"
    return (
        f"at {percent(projection['p_rank'])} per rank, {article} {row['nodes']}-node job ({projection['ranks_per_node']} "
        f"ranks per node) spikes on {percent(row['p_cluster'])} of steps; to stay at or under "
        f"{percent(projection['target'])} {need}"
    )


def percent(p: float) -> str:
    pct = 100.0 * p
    return f"{pct:.0f} %" if pct >= 10 or pct == 0 else f"{pct:.2g} %"

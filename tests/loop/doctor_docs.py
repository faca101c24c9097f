"""Hand-made doctor measurements (the document the ranks gather), with known slow ranks, nodes, links."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

# Typical costs per repetition on a healthy rank (ns) and the work of one repetition.
BASE = {
    "matmul": (210_000.0, 2.0 * 256**3),
    "memory": (5_400_000.0, 2.0 * 32 * 2**20),
    "dispatch": (1_150.0, 1.0),
    "jitter": (15_000.0, 1.0),
}
EXCHANGE_BYTES = 4 * 2**20
PAIR_NS = 8_000_000.0


def make_doc(
    nodes: int = 1,
    per_node: int = 4,
    rounds: int = 5,
    *,
    noise: float = 0.03,
    seed: int = 0,
    slow: Callable[[int, int, str, int], float] | None = None,
    link: Callable[[int, int, int], float] | None = None,
    options: dict[str, Any] | None = None,
    cpu_share: float = 1.0,
) -> dict[str, Any]:
    """``slow(rank, node, figure, round)`` and ``link(node_a, node_b, round)`` return cost factors;
    ``cpu_share``: the share of wall time every rank ran on a core."""
    rng = np.random.default_rng(seed)
    ranks = []
    for node in range(nodes):
        for local in range(per_node):
            rank = node * per_node + local
            figures = {}
            for name, (cost, work) in BASE.items():
                costs = []
                for r in range(rounds):
                    f = slow(rank, node, name, r) if slow else 1.0
                    costs.append(cost * f * float(rng.lognormal(0.0, noise)))
                figures[name] = {"cost_ns": costs, "work": [work] * rounds}
            exchanges = {}
            for other in range(nodes):
                if other == node:
                    continue
                large = []
                for r in range(rounds):
                    f = link(min(node, other), max(node, other), r) if link else 1.0
                    large.append(PAIR_NS * f * float(rng.lognormal(0.0, noise)))
                exchanges[str(other)] = {"small_ns": [200_000.0] * rounds, "large_ns": large}
            ranks.append({
                "rank": rank, "local_rank": local, "node": node, "host": f"host{node}", "device": "cpu",
                "figures": figures, "extra": {"cpu_share": [cpu_share] * rounds}, "skipped": {}, "errors": {},
                "allreduce": {"small_ns": [1e6] * rounds, "large_ns": [1.5e7] * rounds,
                              "large_bytes": EXCHANGE_BYTES, "world_size": nodes * per_node},
                "exchanges": exchanges, "exchange_bytes": EXCHANGE_BYTES if nodes > 1 else None,
            })  # fmt: skip
    return {"schema_version": 1, "options": {"rounds": rounds, **(options or {})}, "world_size": len(ranks),
            "ranks": ranks}  # fmt: skip

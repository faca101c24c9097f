"""What the doctor's rules find: a flag on one figure of a rank, node or pair, and a finding that
gathers the flags of one subject (``judge.py`` makes them, ``judge_words.py`` words them)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from hyperacc.preflight.figures import RANK_FIGURES, RESOURCES


@dataclasses.dataclass
class Flag:
    """One confirmed slow figure of one rank, node or link."""

    figure: str
    slowdown: float  # cost / median cost over the flagged rounds (2.0: twice as slow)
    value: float  # the subject's figure, median over rounds, in the figure's display unit
    median: float  # the median subject's figure, in the same unit
    rounds_flagged: int
    rounds_seen: int
    material: bool = True  # False: below min_slowdown, kept only as corroboration of a slow host CPU

    def to_dict(self) -> dict[str, Any]:
        f = RANK_FIGURES.get(self.figure)
        return {
            "figure": self.figure,
            "label": f.label if f else self.figure,
            "unit": f.unit if f else "",
            **{k: _plain(v) for k, v in dataclasses.asdict(self).items() if k != "figure"},
        }


@dataclasses.dataclass
class Finding:
    scope: str  # rank | node | link
    resources: list[str]  # keys of RESOURCES, the first is the main one
    flags: list[Flag]
    node: int | None = None
    host: str | None = None
    rank: int | None = None
    nodes: tuple[int, int] | None = None  # a link's two nodes
    hosts: list[str] = dataclasses.field(default_factory=list)  # hosts to leave out
    ranks: list[int] = dataclasses.field(default_factory=list)  # a node finding's slow ranks

    def to_dict(self) -> dict[str, Any]:
        return {
            "scope": self.scope,
            "rank": self.rank,
            "node": self.node,
            "host": self.host,
            "nodes": list(self.nodes) if self.nodes else None,
            "ranks": list(self.ranks),
            "resource": self.resources[0],
            "resources": list(self.resources),
            "resource_label": RESOURCES[self.resources[0]][0],
            "figures": [f.to_dict() for f in self.flags],
            "exclude_hosts": list(self.hosts),
            "advice": [RESOURCES[r][1] for r in self.resources],
        }


def _plain(value: Any) -> Any:
    """JSON-safe: numpy scalars to Python, NaN/inf to None, tuples to lists."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value

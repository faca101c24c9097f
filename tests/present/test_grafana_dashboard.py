"""The Grafana dashboard in docs/ queries only metrics the endpoint really exports, with their labels."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
from prometheus_client import generate_latest

from hyperacc.present.metrics import MetricsSink
from hyperacc.schema import STEP_SCHEMA

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "hyperacc-dashboard.json"


def _exported() -> dict[str, set[str]]:
    """Every sample name the sink exports, with the label names it carries."""
    sink = MetricsSink(world_size=1)
    rows = [{"rank": 0, "node": 0, "step": s, "step_ns": 10_000_000, "self_ns": 8_000_000, "comm_wait_ns": 2_000_000}
            for s in range(5)]  # fmt: skip
    sink(pa.Table.from_pylist(rows, schema=STEP_SCHEMA))
    out: dict[str, set[str]] = {}
    for family in sink.registry.collect():
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
        out.setdefault(family.name, set())  # series with no sample yet (a cause never seen) still exist
        for suffix in ("_total", "_bucket", "_count", "_sum"):
            out.setdefault(family.name + suffix, set())
    assert generate_latest(sink.registry)  # the registry renders
    return out


def test_every_query_names_an_exported_metric_and_its_labels():
    dash = json.loads(DASHBOARD.read_text())
    exported = _exported()
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    for expr in exprs:
        names = set(re.findall(r"\b(hyperacc_[a-z_]+)", expr))
        assert names, expr
        for name in names:
            assert name in exported, f"{name} is not exported (query: {expr})"
        for label in re.findall(r"by \(([^)]*)\)", expr):
            for key in (x.strip() for x in label.split(",")):
                if key in ("le",):
                    continue
                assert key in {"rank", "cause", "phase", "action", "kind"}, (key, expr)

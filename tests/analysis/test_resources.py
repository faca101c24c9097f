"""Resource imbalance is judged by the one cross-rank outlier rule, with the DetectionOptions in force."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from hyperacc import store
from hyperacc.analysis import DetectionOptions, diagnose
from hyperacc.analysis.resources import ResourceOptions, imbalance, resource_findings
from hyperacc.analysis.synthetic import SyntheticRun, write_run
from hyperacc.schema import RESOURCE_SCHEMA

MIB = 2**20
# Ranks 5 and 6 pass both tests; rank 7 passes the MAD z (13) but hides under the other ranks' Tukey
# fence (5 and 6 widen it): an outlier under the "or" rule only.
SPLIT = {0: 1000.0, 1: 1010.0, 2: 990.0, 3: 1005.0, 4: 995.0, 5: 2000.0, 6: 2100.0, 7: 1300.0}
# Rank 7 is above the other ranks' fence but its modified z is 3.4: an outlier once z_threshold < 3.4.
NEAR = {0: 1000.0, 1: 1100.0, 2: 900.0, 3: 1200.0, 4: 800.0, 5: 1000.0, 6: 1000.0, 7: 1500.0}


def _flagged(levels: dict[int, float], **detection) -> list[int]:
    opts = ResourceOptions(detection=DetectionOptions(**detection))
    return sorted(i.rank for i in imbalance({r: v * MIB for r, v in levels.items()}, "rss_bytes", opts))


def test_imbalance_follows_the_outlier_rule_option():
    assert _flagged(SPLIT) == [5, 6]
    assert _flagged(SPLIT, outlier_rule="or") == [5, 6, 7]


def test_imbalance_follows_the_thresholds():
    assert _flagged(NEAR) == []
    assert _flagged(NEAR, z_threshold=3.0) == [7]
    assert _flagged(NEAR, z_threshold=3.0, iqr_k=5.0) == []  # the others' Q3 + 5 IQR is 1550: not above


def test_imbalance_needs_min_ranks_of_the_detection_options():
    levels = {0: 1000.0, 1: 1000.0, 2: 1000.0, 3: 2000.0}
    assert _flagged(levels) == [3]
    assert _flagged(levels, min_ranks=5) == []
    cols = {"rank": np.arange(4), "t_ns": np.zeros(4), "rss_bytes": np.array(list(levels.values())) * MIB}
    judged = resource_findings(cols, ResourceOptions(detection=DetectionOptions(min_ranks=5)))["judged"]
    assert judged["imbalance"] == "not enough ranks (4, the rule needs 5)"


def test_imbalance_is_also_a_material_excess():
    assert _flagged(SPLIT) == [5, 6]
    opts = ResourceOptions(min_excess=1.05, detection=DetectionOptions())  # 2000 is +100 %, 2100 +110 %
    assert [i.rank for i in imbalance({r: v * MIB for r, v in SPLIT.items()}, "rss_bytes", opts)] == [6]


def _rss(run: Path, rank: int, level_mb: float, n: int = 30) -> None:
    t = (1_700_000_000 + np.linspace(0, 60, n)) * 1e9
    table = pa.table({
        "rank": pa.array([rank] * n, pa.int32()), "node": pa.array([rank // 4] * n, pa.int32()),
        "t_ns": pa.array(t.astype(np.int64)), "step": pa.array(np.arange(n) * 10, pa.int64()),
        "rss_bytes": pa.array(np.full(n, level_mb * MIB).astype(np.int64)),
        "cpu_ns": pa.array((np.linspace(0, 60, n) * 1e9).astype(np.int64)),
        "cuda_allocated_bytes": pa.nulls(n, pa.int64()), "cuda_reserved_bytes": pa.nulls(n, pa.int64()),
        "cuda_peak_bytes": pa.nulls(n, pa.int64()),
    }, schema=RESOURCE_SCHEMA)  # fmt: skip
    store.resource_writer(run, rank).write(table)


def test_analyze_passes_its_options_to_the_resource_rules(tmp_path):
    run = write_run(tmp_path / "run", SyntheticRun(ranks=8, steps=120, seed=5))
    for rank, level in SPLIT.items():
        _rss(run, rank, level)

    def ranks(**options) -> list[int]:
        res = diagnose(run, **options).to_dict()["resources"]
        return sorted(i["rank"] for i in res["imbalance"] if i["metric"] == "rss_bytes")

    assert ranks() == [5, 6]
    assert ranks(outlier_rule="or") == [5, 6, 7]

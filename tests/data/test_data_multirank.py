"""Real ranks through torchrun: every rank's epoch, read through make_loader, partitions the dataset."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hyperacc import harness
from hyperacc.data.lmdb_dataset import build_lmdb

SCRIPT = Path(__file__).with_name("rank_loader.py")


@pytest.mark.multirank
def test_ranks_partition_the_epoch_with_wraparound_padding(tmp_path):
    n, world = 103, 2
    db = build_lmdb(tmp_path / "db", np.arange(n, dtype=np.int64).reshape(n, 1))
    job = harness.launch(SCRIPT, [str(db)], nproc=world, timeout=180)
    assert job.ok, job.explain()
    results = sorted(job.results(), key=lambda r: r["rank"])
    per_rank = 52  # ceil(103 / 2), as DistributedSampler
    assert [r["len"] for r in results] == [per_rank] * world
    for r in results:
        assert r["indices"] == r["expected"]
    order: list[int] = [0] * (per_rank * world)
    for r in results:
        order[r["rank"] :: world] = r["indices"]
    assert sorted(order[:n]) == list(range(n))  # each index exactly once across ranks
    assert order[n:] == order[: per_rank * world - n]  # padding wraps around the permuted list

"""One rank of the multi-rank data test: read one epoch through make_loader and report the indices."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from hyperacc import harness
from hyperacc.data.lmdb_dataset import LMDBDataset
from hyperacc.data.pipeline import make_loader


def main() -> None:
    db = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dataset = LMDBDataset(db)
    loader = make_loader(dataset, 4, rank=rank, world_size=world, seed=7, prefetch_to="cpu", lookahead=8)
    loader.set_epoch(1)
    indices = torch.cat([batch.view(-1) for batch in loader]).tolist()
    # the sampler's own view must agree with what the dataset returned
    expected = loader.sampler.indices(0, len(loader.sampler)).tolist()
    harness.write_result({"rank": rank, "indices": indices, "expected": expected, "len": len(loader.sampler)})
    dataset.close()
    harness.finish()


if __name__ == "__main__":
    main()

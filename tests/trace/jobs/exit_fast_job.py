"""A one-rank gloo DDP script that ends as some training scripts do, with ``os._exit`` after
``destroy_process_group()`` (no ``atexit``, so no final flush there), traced as the bootstrap traces it.

argv: STORE_FILE RUN_DIR STEPS
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from hyperacc.trace import install_auto


def main() -> None:
    store, run_dir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    install_auto(run_dir, window=0, handle_sigterm=False)  # flush_every_s stays 5 s: no flush during the run
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()

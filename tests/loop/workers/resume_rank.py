"""A rank of a small job that checkpoints with hyperacc.elastic (and can stop early, as a crash would).

Dropout (RNG), AdamW (optimizer state), StepLR (scheduler) and the on-demand loader (data position)
all change the result if any of them is not restored exactly.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hyperacc import harness
from hyperacc.data.pipeline import make_loader
from hyperacc.elastic import Checkpointer


class Indexed(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 16, generator=g)
        self.y = (self.x.sum(dim=1) > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--stop-at", type=int, default=None)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--every", type=int, default=10)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 2)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.5)
    # its own generator: creating an iterator after a resume must not draw from the global RNG
    loader = make_loader(Indexed(240), 8, rank=rank, world_size=world, seed=3, drop_last=True,
                         generator=torch.Generator().manual_seed(1))
    torch.manual_seed(100 + rank)  # per-rank dropout streams
    step = 0
    ckpt = None
    if args.ckpt:
        ckpt = Checkpointer(args.ckpt, every=args.every, model=model, optimizer=optimizer,
                            scheduler=scheduler, loader=loader)  # fmt: skip
        step = ckpt.resume()
    first = step
    losses, seen = {}, {}
    epoch = loader.epoch
    while step < args.steps:
        loader.set_epoch(epoch)
        for x, y, idx in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            losses[step] = float(loss)
            seen[step] = [epoch, *idx.tolist()]
            step += 1
            if ckpt is not None:
                ckpt.step_end(step)
            if step == args.stop_at:
                harness.write_result({"first": first, "losses": losses, "seen": seen, "stopped": step})
                harness.finish()
            if step >= args.steps:
                break
        epoch += 1
    checksum = [float(t.double().sum()) for t in model.state_dict().values()]
    harness.write_result({"first": first, "losses": losses, "seen": seen, "checksum": checksum,
                          "lr": scheduler.get_last_lr()})  # fmt: skip
    harness.finish()


if __name__ == "__main__":
    main()

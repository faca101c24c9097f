"""A small data-parallel training job: an MLP classifier on synthetic data, one step read top to bottom.

Run it as any DDP script (gloo on CPU, NCCL on GPU)::

    torchrun --standalone --nproc-per-node 4 examples/train_ddp.py --steps 200
    hyperacc run --run-dir runs/demo --nproc-per-node 4 -- examples/train_ddp.py --steps 200

It knows nothing of hyperacc's tracer: ``hyperacc run`` instruments it from outside. Faults from
``HYPERACC_CHAOS`` and stabilizers from ``HYPERACC_STABILIZE`` are picked up when those are set, and
under the test harness each rank reports its step times and final parameters' checksum.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset


class SyntheticImages(Dataset):
    """Deterministic random 'images' with a learnable label: sample i is the same on every rank and epoch.

    Samples come from a fixed pool, so loading costs a copy, not a random-number generation per sample.
    """

    def __init__(self, size: int, features: int, classes: int, pool: int = 4096) -> None:
        self.size = size
        g = torch.Generator().manual_seed(1234)
        self.inputs = torch.randn(pool, features, generator=g)
        self.labels = (self.inputs @ torch.randn(features, classes, generator=g)).argmax(dim=1)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        j = i % len(self.inputs)
        return self.inputs[j], self.labels[j]


def build_model(features: int, hidden: int, classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(features, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, classes),
    )  # fmt: skip


def make_loader(args: argparse.Namespace, dataset: Dataset, rank: int, world: int) -> DataLoader:
    if args.sampler == "ondemand" or args.prefetch:
        from hyperacc.data.pipeline import make_loader as hyperacc_loader

        return hyperacc_loader(
            dataset, args.batch_size, rank=rank, world_size=world, sampler=args.sampler,
            seed=args.seed, num_workers=args.workers, prefetch_to=args.device if args.prefetch else None,
            drop_last=True,
        )  # fmt: skip
    sampler = torch.utils.data.DistributedSampler(dataset, world, rank, shuffle=True, seed=args.seed, drop_last=True)
    return DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers, drop_last=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--features", type=int, default=512)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--sampler", choices=["torch", "ondemand"], default="torch")
    p.add_argument("--prefetch", action="store_true", help="hyperacc's pinned prefetch to the device")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()

    backend = "nccl" if args.device.startswith("cuda") else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        args.device = f"cuda:{local}"
    device = torch.device(args.device)

    # Disturbances and stabilizers arrive from the environment, so this script stays plain.
    from hyperacc import chaos

    chaos.install_from_env()
    stabilizer = None
    if os.environ.get("HYPERACC_STABILIZE"):
        from hyperacc import stabilize

        stabilizer = stabilize.from_env()

    torch.manual_seed(args.seed)
    model = DDP(build_model(args.features, args.hidden, args.classes).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    dataset = SyntheticImages(max(args.steps * args.batch_size * world, 1024), args.features, args.classes)
    loader = make_loader(args, dataset, rank, world)

    step, epoch, losses, step_ms = 0, 0, [], []
    while step < args.steps:
        if hasattr(loader, "sampler") and hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        t0 = time.perf_counter()
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if stabilizer is not None:
                stabilizer.step(step)
            losses.append(loss.detach())
            t1 = time.perf_counter()
            step_ms.append((t1 - t0) * 1e3)
            t0 = t1
            step += 1
            if step >= args.steps:
                break
        epoch += 1

    if stabilizer is not None:
        stabilizer.close()
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    from hyperacc import harness

    harness.write_result(
        {
            "rank": rank,
            "node": int(os.environ.get("GROUP_RANK", "0")),
            "step_ms": step_ms,
            "losses": [float(v) for v in torch.stack(losses).cpu()],
            "checksum": checksum,
        }
    )
    harness.finish()


if __name__ == "__main__":
    main()

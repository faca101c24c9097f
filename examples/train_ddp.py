"""A small data-parallel training job: an MLP classifier on synthetic data, one step read top to bottom.

Run it as any DDP script (gloo on CPU, NCCL on GPU)::

    torchrun --standalone --nproc-per-node 4 examples/train_ddp.py --steps 200
    hyperacc run --run-dir runs/demo --nproc-per-node 4 -- examples/train_ddp.py --steps 200

It knows nothing of hyperacc's tracer: ``hyperacc run`` instruments it from outside. Faults from
``HYPERACC_CHAOS`` and stabilizers from ``HYPERACC_STABILIZE`` are picked up when those are set, and
under the test harness each rank reports its step times and final parameters' checksum.

With ``--checkpoint-dir`` it is resumable (``hyperacc.elastic``): it saves every ``--checkpoint-every``
steps, continues from the newest checkpoint when started again (also with another number of ranks, as
in an elastic job after a drain), and uses the on-demand sampler, whose position is part of the
checkpoint. Without it, nothing of that runs.
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

        # A resumable run gives the DataLoader its own generator: a new iterator after a resume must not
        # draw from the global RNG, or the restored RNG state would be one draw off.
        extra = {"generator": torch.Generator().manual_seed(args.seed)} if args.checkpoint_dir else {}
        return hyperacc_loader(
            dataset, args.batch_size, rank=rank, world_size=world, sampler=args.sampler,
            seed=args.seed, num_workers=args.workers, prefetch_to=args.device if args.prefetch else None,
            drop_last=True, **extra,
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
    p.add_argument("--sampler", choices=["torch", "ondemand"], default=None,
                   help="torch (default) or ondemand (the default with --checkpoint-dir)")  # fmt: skip
    p.add_argument("--prefetch", action="store_true", help="hyperacc's pinned prefetch to the device")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--checkpoint-dir", default=None, help="save here and resume from here (hyperacc.elastic)")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    p.add_argument("--dataset-size", type=int, default=None,
                   help="samples per epoch (default: steps x batch x ranks, at most 2^20; 2^20 with "
                   "--checkpoint-dir, so that the epoch does not change with the number of ranks)")  # fmt: skip
    p.add_argument("--log-every", type=int, default=0, help="print each rank's loss every N steps")
    args = p.parse_args()
    if args.checkpoint_dir and args.sampler == "torch":
        p.error("--checkpoint-dir needs --sampler ondemand: DistributedSampler keeps no position to resume from")
    args.sampler = args.sampler or ("ondemand" if args.checkpoint_dir else "torch")

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
    # One epoch covers the run, up to 2^20 samples; a longer run goes over them again, epoch by epoch.
    # The sampler lists an epoch's indices in every rank: a 10^6-step run's own epoch held 1.8 GB in its
    # one rank, and at two ranks the first step came 11 s later than with 2^13 samples (2-core machine).
    samples = 1 << 20 if args.checkpoint_dir else min(1 << 20, max(args.steps * args.batch_size * world, 1024))
    size = args.dataset_size or samples
    dataset = SyntheticImages(size, args.features, args.classes)
    loader = make_loader(args, dataset, rank, world)

    step, epoch, losses, step_ms = 0, 0, [], []
    ckpt = None
    if args.checkpoint_dir:
        from hyperacc.elastic import Checkpointer

        ckpt = Checkpointer(args.checkpoint_dir, every=args.checkpoint_every, model=model, optimizer=optimizer,
                            loader=loader)  # fmt: skip
        step = ckpt.resume()  # 0 on a fresh start
        epoch = loader.epoch
    first_step = step
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
            if args.log_every and step % args.log_every == 0:
                print(f"rank {rank} step {step} loss {float(loss):.6f} world {world}", flush=True)
            step += 1
            if ckpt is not None:
                ckpt.step_end(step)  # saves every --checkpoint-every steps; a drained node leaves here
            if step >= args.steps:
                break
        epoch += 1

    if stabilizer is not None:
        stabilizer.close()
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    from hyperacc import harness

    result = {
        "rank": rank,
        "node": int(os.environ.get("GROUP_RANK", "0")),
        "step_ms": step_ms,
        "losses": [float(v) for v in torch.stack(losses).cpu()] if losses else [],
        "checksum": checksum,
    }
    if ckpt is not None:
        result.update(first_step=first_step, world_size=world, restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    harness.write_result(result)
    harness.finish()


if __name__ == "__main__":
    main()

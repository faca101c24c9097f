"""Rank script: the training loops people write, with no hyperacc in them (run under `hyperacc run`).

``--loop`` picks one:

- ``nanogpt``: nanoGPT's shape: batches read by hand from an ``np.memmap`` in ``get_batch`` (no
  DataLoader), gradient accumulation with ``require_backward_grad_sync`` (the next batch is read
  between a micro-step's forward and its backward), a GradScaler whose update is skipped on the steps
  given by ``--skip-steps`` (an inf gradient is planted), an evaluation under ``no_grad`` every
  ``--eval-every`` steps, and ``--late-rank`` sleeping before the synchronised backward of every third
  iteration;
- ``prefetch``: a DataLoader consumed through hyperacc's DevicePrefetcher (its own thread);
- ``fsdp2``: ``fully_shard`` (FSDP2) on CPU with gloo;
- ``two_models``: two DDP models trained in the same step;
- ``explicit``: a hand-written gradient all-reduce, ``async_op`` given by position, then ``wait()``;
- ``compiled``: nanoGPT's order, ``torch.compile(model, fullgraph=True)`` then DDP, and for the last
  ``--compiled-updates`` iterations an optimizer step compiled too (``aot_eager``: no C++ compiler needed);
- ``manual``: gradient accumulation and an update written by hand (no ``torch.optim``);
- ``ddp_options``: DDP with ``find_unused_parameters=True`` and a branch of the model left out every
  third iteration, a batch norm, a block run under activation checkpointing (``torch.utils.checkpoint``,
  not reentrant), two optimizers (SGD and AdamW on disjoint parameters) stepped one after the other, and
  ``--late-rank`` sleeping before the forward of every third iteration (1, 4, ...).

Each rank reports its final parameters' checksum and losses; under the harness, ``--plain-check``
trains an untouched copy beside it where that makes sense.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hyperacc import harness


def mlp(width: int = 64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 8))


def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """16 random samples of the MLP's input and class labels, drawn from ``g``."""
    return torch.randn(16, 32, generator=g), torch.randint(0, 8, (16,), generator=g)


def checksum(model: nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def nanogpt(args: argparse.Namespace, rank: int, world: int) -> dict:
    data_path = os.path.join(tempfile.gettempdir(), f"hyperacc-loops-{os.getpid()}.bin")
    rng = np.random.default_rng(rank)
    rng.standard_normal(4096 * 33, dtype=np.float32).tofile(data_path)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        data = np.memmap(data_path, dtype=np.float32, mode="r").reshape(-1, 33)
        ix = rng.integers(0, len(data), 16)
        block = torch.from_numpy(np.array(data[ix]))
        return block[:, :32], (block[:, 32] > 0).long()

    model = DDP(mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    skip = {int(s) for s in args.skip_steps.split(",") if s}
    losses = []
    x, y = get_batch()
    for it in range(args.steps):
        if args.eval_every and it % args.eval_every == 0:
            with torch.no_grad():
                model.eval()
                float(nn.functional.cross_entropy(model(x), y))
                model.train()
        for micro in range(args.accum):
            model.require_backward_grad_sync = micro == args.accum - 1
            loss = nn.functional.cross_entropy(model(x), y) / args.accum
            x, y = get_batch()  # the next batch, read between forward and backward as nanoGPT does
            if rank == args.late_rank and it % 3 == 1 and model.require_backward_grad_sync:
                time.sleep(args.late_ms / 1e3)  # this rank reaches the gradient all-reduce late
            scaler.scale(loss).backward()
        if it in skip:
            next(model.parameters()).grad[0, 0] = float("inf")  # the scaler skips this update
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss) * args.accum)
    os.unlink(data_path)
    hooks = len(model._comm_hooks)  # 0: DDP kept its built-in all-reduce
    pre_hooks = len(model._forward_pre_hooks)  # 0: nothing sends the model down torch's hooked call path
    return {"losses": losses, "checksum": checksum(model), "scale": float(scaler.get_scale()), "comm_hooks": hooks,
            "forward_pre_hooks": pre_hooks}


def prefetch(args: argparse.Namespace, rank: int, world: int) -> dict:
    from hyperacc.data.prefetch import DevicePrefetcher

    g = torch.Generator().manual_seed(rank)
    data = torch.utils.data.TensorDataset(torch.randn(512, 32, generator=g), torch.randint(0, 8, (512,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    model = DDP(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for x, y in DevicePrefetcher(loader, device="cpu"):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
        if len(losses) >= args.steps:
            break
    return {"losses": losses, "checksum": checksum(model)}


def fsdp2(args: argparse.Namespace, rank: int, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    model = mlp(128)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(args.steps):
        x, y = batch(g)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, "checksum": float(sum(float(p.to_local().double().sum()) for p in model.parameters()))}


def two_models(args: argparse.Namespace, rank: int, world: int) -> dict:
    a, b = DDP(mlp()), DDP(mlp(32))
    opt = torch.optim.SGD(list(a.parameters()) + list(b.parameters()), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(args.steps):
        x, y = batch(g)
        loss = nn.functional.cross_entropy(a(x), y) + nn.functional.cross_entropy(b(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, "checksum": checksum(a) + checksum(b)}


def explicit(args: argparse.Namespace, rank: int, world: int) -> dict:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(args.steps):
        x, y = batch(g)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        works = [dist.all_reduce(p.grad, dist.ReduceOp.SUM, None, True) for p in model.parameters()]
        for w in works:
            w.wait()
        for p in model.parameters():
            p.grad /= world
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, "checksum": checksum(model)}


def compiled(args: argparse.Namespace, rank: int, world: int) -> dict:
    from torch._dynamo.utils import counters

    model = DDP(torch.compile(mlp(), backend="aot_eager", fullgraph=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled_step = torch.compile(opt.step, backend="aot_eager")
    g = torch.Generator().manual_seed(rank)
    losses = []
    for i in range(args.steps):
        x, y = batch(g)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        (compiled_step if i >= args.steps - args.compiled_updates else opt.step)()
        opt.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, "checksum": checksum(model), "graph_breaks": sum(counters["graph_break"].values())}


def manual(args: argparse.Namespace, rank: int, world: int) -> dict:
    model = DDP(mlp())
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(args.steps):
        for micro in range(args.accum):
            model.require_backward_grad_sync = micro == args.accum - 1
            x, y = batch(g)
            loss = nn.functional.cross_entropy(model(x), y) / args.accum
            loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.05 * p.grad
                p.grad = None
        losses.append(float(loss))
    return {"losses": losses, "checksum": checksum(model)}


class _Branchy(nn.Module):
    """An input layer, a batch norm (buffers DDP broadcasts at each forward), a checkpointed block, a branch
    used on two iterations of three, an output layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.block, self.branch, self.out = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 8)
        self.norm = nn.BatchNorm1d(64)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = torch.relu(self.norm(self.inp(x)))
        h = checkpoint(lambda t: torch.relu(self.block(t)), h, use_reentrant=False)
        if use_branch:
            h = h + torch.relu(self.branch(h))
        return self.out(h)


def ddp_options(args: argparse.Namespace, rank: int, world: int) -> dict:
    net = _Branchy()
    model = DDP(net, find_unused_parameters=True)
    opts = [torch.optim.SGD([*net.inp.parameters(), *net.block.parameters()], lr=0.05),
            torch.optim.AdamW([*net.branch.parameters(), *net.out.parameters()], lr=1e-3)]  # fmt: skip
    g = torch.Generator().manual_seed(rank)
    losses = []
    for i in range(args.steps):
        x, y = batch(g)
        if rank == args.late_rank and i % 3 == 1:
            time.sleep(args.late_ms / 1e3)  # the other rank waits in DDP's broadcast of the buffers
        loss = nn.functional.cross_entropy(model(x, i % 3 != 0), y)
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return {"losses": losses, "checksum": checksum(model)}


LOOPS = {"nanogpt": nanogpt, "prefetch": prefetch, "fsdp2": fsdp2, "two_models": two_models, "explicit": explicit,
         "compiled": compiled, "manual": manual, "ddp_options": ddp_options}  # fmt: skip


def main() -> None:
    # ``A --then B --then C``: several loops, one after the other in one process group, each with its own
    # arguments (every loop seeds what it draws): the untraced references of tests/trace/test_loops.py
    # start one job, not one each
    parts: list[list[str]] = [[]]
    for a in sys.argv[1:]:
        if a == "--then":
            parts.append([])
        else:
            parts[-1].append(a)
    runs = [parser().parse_args(part) for part in parts]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = [LOOPS[args.loop](args, rank, world) for args in runs]
    harness.write_result({"rank": rank, **(results[0] if len(runs) == 1 else {"loops": results})})
    harness.finish()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--loop", choices=sorted(LOOPS), required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--skip-steps", default="")
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--late-rank", type=int, default=-1, help="nanogpt: this rank sleeps before the synchronised;"
                   " ddp_options: before the forward")
    p.add_argument("--late-ms", type=float, default=300.0, help="backward of every third iteration (1, 4, ...)")
    p.add_argument("--compiled-updates", type=int, default=0, help="compiled: iterations whose optimizer step is compiled")
    return p


if __name__ == "__main__":
    main()

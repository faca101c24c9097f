"""A DDP rank whose host memory grows and shrinks at random steps (per-rank seeded bursts of buffers
that live a few steps, as decoded samples or staging buffers do), reporting step times and RSS.

Stabilizers come from ``HYPERACC_STABILIZE`` (``hyperacc.stabilize.from_env``), so the same script
runs with and without them. Used by bench/stabilizers.py through the harness."""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hyperacc import harness
from hyperacc.stabilize import from_env
from hyperacc.stabilize.memory import rss_bytes

PAGE = 4096


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--burst-mb", type=int, default=64)
    p.add_argument("--block-kb", type=int, default=256)
    p.add_argument("--rate", type=float, default=0.05, help="probability of a burst per step and rank")
    p.add_argument("--life", type=int, default=3, help="steps a burst's buffers stay alive")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    stab = from_env()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 512), torch.randint(0, 10, (32,))
    rng = np.random.default_rng([args.seed, rank])
    block = args.block_kb * 1024
    nblocks = args.burst_mb * 1024 // args.block_kb
    touch = b"x" * len(range(0, block, PAGE))
    live: list[tuple[int, list[bytearray]]] = []
    step_ms, rss_mb, bursts = [], [], []
    t0 = time.perf_counter()
    for step in range(args.steps):
        if rng.random() < args.rate:
            buffers = []
            for _ in range(nblocks):
                b = bytearray(block)
                b[::PAGE] = touch  # write every page, as a decoder filling the buffer would
                buffers.append(b)
            live.append((step + args.life, buffers))
            bursts.append(step)
        live = [(end, bufs) for end, bufs in live if end > step]
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if stab is not None:
            stab.step(step)
        t1 = time.perf_counter()
        step_ms.append((t1 - t0) * 1e3)
        rss_mb.append(rss_bytes() / 2**20)
        t0 = t1
    summary = stab.close() if stab is not None else None
    harness.write_result({"rank": rank, "step_ms": step_ms, "rss_mb": rss_mb, "bursts": bursts,
                          "stabilizer": summary})  # fmt: skip
    harness.finish()


if __name__ == "__main__":
    main()

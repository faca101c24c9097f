"""What timing DDP's gradient all-reduce costs a rank: built-in all-reduce timed from autograd against a
Python communication hook, against untimed DDP.

Two gloo ranks hold four copies of the model of examples/train_ddp.py (an MLP 512-512-512-10, batch 32),
each wrapped in DDP a different way:

- ``untimed``: plain DDP, its built-in C++ all-reduce (the baseline);
- ``DDPWait``: the same, timed by hyperacc's default (trace/ddp_wait.py: a forward pre-hook, a parameter
  hook and two autograd final callbacks; no communication hook);
- ``GradientRounds``: hyperacc's communication hook, the path the in-band exchange and pacing need
  (trace/inband.py), with nothing exchanged;
- ``allreduce_hook``: torch's own Python ``allreduce_hook``, for reference: what any Python hook costs.

Blocks of iterations of each model alternate in one process, so load drift on a shared machine falls on
all arms alike; per block, the process CPU time of all the rank's threads per iteration. Ratios are per
block against the untimed block next to it; printed: median and a 95 % t-interval of the mean.

    .venv/bin/python bench/ddp_timing.py --quick
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
T975 = {4: 2.776, 9: 2.262, 14: 2.145, 19: 2.093, 29: 2.045}


def interval(ratios: list[float]) -> tuple[float, float]:
    n = len(ratios)
    mean = statistics.fmean(ratios)
    t = T975.get(n - 1, 2.0)
    half = t * statistics.stdev(ratios) / math.sqrt(n)
    return mean - half, mean + half


def worker(reps: int, block: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    sys.path.insert(0, str(ROOT / "examples"))
    sys.path.insert(0, str(ROOT / "src"))
    from train_ddp import build_model

    from hyperacc.trace.inband import Exchange

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    arms: dict[str, tuple] = {}
    arms["untimed"] = (DDP(build_model(512, 512, 10)), None)
    light = Exchange(want=False, agree_timeout_s=5)
    m = DDP(build_model(512, 512, 10))
    arms["DDPWait"] = (m, light.attach(m))
    hooked = Exchange(want=False, agree_timeout_s=5)
    hooked.pacer = object()  # a pacer asks for the hook path; with no exchange it is never consulted
    m = DDP(build_model(512, 512, 10))
    rounds = hooked.attach(m)
    rounds.pacer = None
    arms["GradientRounds"] = (m, rounds)
    m = DDP(build_model(512, 512, 10))
    m.register_comm_hook(None, default_hooks.allreduce_hook)
    arms["allreduce_hook"] = (m, None)
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, (m, _) in arms.items()}
    x, y = torch.randn(32, 512), torch.randint(0, 10, (32,))
    loss_fn = nn.CrossEntropyLoss()

    def iterate(name: str) -> None:
        model, timer = arms[name]
        opt = opts[name]
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        if timer is not None:
            timer.collect()
        opt.step()

    for name in arms:
        for _ in range(30):
            iterate(name)
    per_it: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(reps):
        for name in arms:
            t0 = time.process_time()
            for _ in range(block):
                iterate(name)
            per_it[name].append((time.process_time() - t0) / block * 1e3)
    if rank == 0:
        base = per_it["untimed"]
        print(f"{'arm':16s} {'CPU/iteration':>14s} {'ratio to untimed: median':>25s} {'95 % interval of the mean':>27s}")
        for name, values in per_it.items():
            ratios = [a / b for a, b in zip(values, base, strict=True)]
            lo, hi = interval(ratios) if name != "untimed" else (1.0, 1.0)
            print(f"{name:16s} {statistics.median(values):11.3f} ms {statistics.median(ratios):25.3f} "
                  f"{lo:18.3f}..{hi:.3f}")  # fmt: skip
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="10 blocks of 100 iterations per arm")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--block", type=int, default=100)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    reps = 10 if args.quick else args.reps
    if args.worker:
        worker(reps, args.block)
        return
    from _machine import describe

    print(describe())
    print(f"2 gloo ranks, {reps} alternated blocks of {args.block} iterations per arm")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(Path(__file__).resolve()), "--worker", "--reps", str(reps), "--block", str(args.block)]  # fmt: skip
    sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()

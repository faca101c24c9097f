"""Rank script: the in-band exchange on a real DDP job (explicit tracer API).

Two identical models see the same inputs: ``traced`` carries the tracer's communication hook (with
the piggybacked slots), ``plain`` is untouched DDP. Every step compares their gradients, keeps what the
in-band listener delivered and this rank's own measured values, and the last rank sleeps before its
backward from step 2 on, so it is the culprit: it arrives last and waits least.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hyperacc import harness
from hyperacc.trace import Tracer


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


class Pacer:
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def delay_before(self, step: int) -> int:
        if step >= 8:
            raise RuntimeError("pacer failure injected by the test")
        return 2_000_000 if self.rank == 0 and step >= 3 else 0


def broken_listener(step: int, arrivals, waits) -> None:  # noqa: ANN001
    raise RuntimeError("listener failure injected by the test")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--sleep-ms", type=float, default=50.0)
    p.add_argument(
        "--faults",
        action="store_true",
        help="a pacer that delays rank 0 by 2 ms from step 3 and raises at step 8, "
        "and a listener that raises at once",
    )
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tracer = Tracer(args.run_dir, probe_every=0, window=0, flush_every_s=0.5, inband=True)
    # small buckets: several collectives per step, and the bucket rebuild after step 0 is exercised
    traced = DDP(build(), bucket_cap_mb=0.1, gradient_as_bucket_view=True)
    tracer.attach_ddp(traced)
    plain = DDP(build(), bucket_cap_mb=0.1)
    seen: list[list] = []
    tracer.inband.add_listener(lambda step, a, w: seen.append([step, a.tolist(), w.tolist()]))
    if args.faults:
        tracer.inband.set_pacer(Pacer(rank))
        tracer.inband.add_listener(broken_listener)
    slow = world - 1
    loss_fn = nn.CrossEntropyLoss()
    exact, max_diff = [], []
    for step in range(args.steps):
        g = torch.Generator().manual_seed(rank * 1000 + step)
        x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
        with tracer.step():
            with tracer.phase("forward"):
                loss = loss_fn(traced(x), y)
            if rank == slow and step >= 2:
                time.sleep(args.sleep_ms / 1e3)
            with tracer.phase("backward"):
                loss.backward()
        loss_fn(plain(x), y).backward()
        pairs = list(zip(traced.parameters(), plain.parameters(), strict=True))
        exact.append(all(torch.equal(a.grad, b.grad) for a, b in pairs))
        max_diff.append(max(float((a.grad - b.grad).abs().max()) for a, b in pairs))
        for m in (traced, plain):
            m.zero_grad(set_to_none=True)
    exchanging = tracer.inband.exchanging
    tracer.close()
    harness.write_result(
        {
            "rank": rank,
            "world": world,
            "exact": exact,
            "max_diff": max_diff,
            "seen": seen,
            "exchanging": exchanging,
            "slow": slow,
        }
    )
    harness.finish()


if __name__ == "__main__":
    main()

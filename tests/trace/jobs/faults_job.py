"""Rank script: plain DDP training, with faults that hyperacc must not change the outcome of.

- ``--die-rank R --die-step S``: rank R leaves with ``os._exit(3)`` at step S, before its forward. The
  other ranks must fail in their backward exactly as under plain torchrun: same exception, no
  optimizer step after it. Each surviving rank reports the exception it saw, then re-raises it.
- ``--buckets one|many``: a ``Linear(10, 10)`` (one gradient bucket) or an MLP with 0.01 MB buckets.
- ``--break-rank R --break-round K``: hyperacc's gradient timing fails inside rank R at round K (an
  internal error injected into the in-band slot writer, or, without the exchange, into the clock of the
  autograd callbacks that time DDP's built-in all-reduce); the job must train on, with the same
  collective shapes on every rank.
- ``--attach-ranks 0,2``: explicit API: only these ranks trace with ``Tracer(inband=True)`` and attach
  the model; the others do not trace at all.

Every rank reports the steps it finished, the optimizer steps it took and its parameters' checksum, and
``--twin`` trains an untouched DDP twin on the same inputs to compare gradients bit for bit.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hyperacc import harness


def build(buckets: str) -> tuple[nn.Module, float]:
    torch.manual_seed(0)
    if buckets == "one":
        return nn.Linear(10, 10), 25.0
    return nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)), 0.01


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--buckets", choices=["one", "many"], default="one")
    p.add_argument("--die-rank", type=int, default=-1)
    p.add_argument("--die-step", type=int, default=2)
    p.add_argument("--break-rank", type=int, default=-1)
    p.add_argument("--break-round", type=int, default=3)
    p.add_argument("--attach-ranks", default="")
    p.add_argument("--run-dir", default="")
    p.add_argument("--twin", action="store_true")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    net, cap = build(args.buckets)
    model = DDP(net, bucket_cap_mb=cap)
    twin = DDP(build(args.buckets)[0], bucket_cap_mb=cap) if args.twin else None
    tracer = None
    if args.attach_ranks and rank in {int(r) for r in args.attach_ranks.split(",")}:
        from hyperacc.trace import Tracer

        tracer = Tracer(args.run_dir, inband=True, agree_timeout_s=3.0, window=0, probe_every=0)
        tracer.attach_ddp(model)
    if rank == args.break_rank:
        from hyperacc.trace import inband

        original = inband.InBand.fill

        def fill(self, rnd, tail):  # noqa: ANN001, ANN202
            if rnd >= args.break_round:
                raise RuntimeError("in-band failure injected by the test")
            return original(self, rnd, tail)

        inband.InBand.fill = fill
        from hyperacc.trace import ddp_wait

        stamps = [0]

        def clock() -> int:
            stamps[0] += 1
            if stamps[0] > 2 * args.break_round:  # two stamps a round
                raise RuntimeError("gradient timing failure injected by the test")
            return time.perf_counter_ns()

        ddp_wait.perf_counter_ns = clock
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1) if twin is not None else None
    done, opt_steps, exact = 0, 0, []
    try:
        for step in range(args.steps):
            if rank == args.die_rank and step == args.die_step:
                os._exit(3)
            g = torch.Generator().manual_seed(rank * 1000 + step)
            x, y = torch.randn(8, 10, generator=g), torch.randint(0, 10, (8,), generator=g)
            if tracer is not None:
                tracer.begin_step()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            if twin is not None:
                nn.functional.cross_entropy(twin(x), y).backward()
                pairs = zip(model.parameters(), twin.parameters(), strict=True)
                exact.append(all(torch.equal(a.grad, b.grad) for a, b in pairs))
                twin_opt.step()
                twin_opt.zero_grad()
            opt.step()
            opt_steps += 1
            opt.zero_grad()
            if tracer is not None:
                tracer.end_step()
            done += 1
    except Exception as exc:
        harness.write_result(
            {"rank": rank, "error": type(exc).__name__, "message": str(exc)[:300], "steps": done,
             "optimizer_steps": opt_steps}  # fmt: skip
        )
        raise
    if tracer is not None:
        tracer.close()
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    harness.write_result(
        {"rank": rank, "error": None, "steps": done, "optimizer_steps": opt_steps, "checksum": checksum,
         "exact": exact}  # fmt: skip
    )
    harness.finish()


if __name__ == "__main__":
    main()

"""Rank script: the in-band round under every interleaving its three threads can produce.

A deep model in tiny buckets (about 40 collectives a step) on real gloo ranks, with the interpreter
switching threads every microsecond so a lost update would show. ``--hook`` picks who completes the
buckets: ``default`` (the tracer's own hook, gloo's worker threads, the in-band slots on the last
bucket), ``early`` (a user hook that waits for its collective, so every callback runs before the hook
returns, on the hook's thread), ``threads`` (a user hook whose futures are completed by 8 Python
threads at once). With ``--fail-step K`` one bucket's future fails at step K (the backward raises; the
script goes on, as a fault-tolerant loop would). No ``from __future__ import annotations``: DDP
checks the hook's annotations as types.
"""

import argparse
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hyperacc import harness
from hyperacc.trace import Tracer


def build() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(40):
        layers += [nn.Linear(32, 32), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(32, 4))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--hook", choices=("default", "early", "threads"), default="default")
    p.add_argument("--fail-step", type=int, default=-1)
    args = p.parse_args()
    sys.setswitchinterval(1e-6)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tracer = Tracer(args.run_dir, probe_every=0, window=0, flush_every_s=0.5, inband=True)
    model = DDP(build(), bucket_cap_mb=0.001)  # a bucket or two per layer
    tracer.attach_ddp(model)
    pool = ThreadPoolExecutor(8)
    step_now = [0]
    failed_at: list[int] = []

    def hook(_state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        buf.div_(dist.get_world_size())
        work = dist.all_reduce(buf, async_op=True)
        fut: torch.futures.Future = torch.futures.Future()
        fail = step_now[0] == args.fail_step and bucket.index() == 0

        def complete() -> None:
            work.wait()  # the collective runs on every rank either way: the ranks stay in step
            if fail:
                fut.set_exception(RuntimeError("bucket failure injected by the test"))
            else:
                fut.set_result(buf)

        if args.hook == "early":
            complete()  # done before the hook returns: `then` runs the callback here, at once
        else:
            pool.submit(complete)
        return fut

    if args.hook != "default":
        model.register_comm_hook(None, hook)
    loss_fn = nn.MSELoss()
    for step in range(args.steps):
        step_now[0] = step
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)
        try:
            with tracer.step():
                loss_fn(model(x), y).backward()
        except RuntimeError as exc:
            if "injected" not in str(exc):
                raise
            failed_at.append(step)
            model.zero_grad(set_to_none=True)
            continue
        model.zero_grad(set_to_none=True)
    threading.Thread(target=pool.shutdown).start()
    tracer.close()
    harness.write_result({"rank": rank, "failed_at": failed_at})
    harness.finish()


if __name__ == "__main__":
    main()

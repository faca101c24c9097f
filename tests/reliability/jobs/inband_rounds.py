"""Rank script: the in-band round under every interleaving its three threads can produce.

A deep model in tiny buckets (about 40 collectives a step) on real gloo ranks, with the interpreter
switching threads every microsecond so a lost update would show. ``--hook`` picks who completes the
buckets: ``default`` (the tracer's own hook, gloo's worker threads, the in-band slots on the last
bucket), ``early`` (a user hook that waits for its collective, so every callback runs before the hook
returns, on the hook's thread), ``threads`` (a user hook whose futures are completed by 8 Python
threads at once). With ``--fail-step K`` one bucket's future fails at step K (the backward raises; the
script goes on, as a fault-tolerant loop would). No ``from __future__ import annotations``: DDP
checks the hook's annotations as types.

``--configs HOOK:K,HOOK:K,...`` runs several of these one after another in the same ranks (one job
instead of one per configuration: starting ranks is most of a job's cost here), each with a model and a
tracer of its own, recording into ``RUN_DIR/HOOK_K``; the result holds ``failed_at`` per configuration.
"""

import argparse
import os
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


def config_dir(hook: str, fail_step: int) -> str:
    return f"{hook}_{fail_step}"


def run(run_dir: str, steps: int, hook_kind: str, fail_step: int) -> list[int]:
    """One configuration: a fresh model and tracer, ``steps`` steps; the steps whose backward failed."""
    tracer = Tracer(run_dir, probe_every=0, window=0, flush_every_s=0.5, inband=True)
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
        fail = step_now[0] == fail_step and bucket.index() == 0

        def complete() -> None:
            work.wait()  # the collective runs on every rank either way: the ranks stay in step
            if fail:
                fut.set_exception(RuntimeError("bucket failure injected by the test"))
            else:
                fut.set_result(buf)

        if hook_kind == "early":
            complete()  # done before the hook returns: `then` runs the callback here, at once
        else:
            pool.submit(complete)
        return fut

    if hook_kind != "default":
        model.register_comm_hook(None, hook)
    loss_fn = nn.MSELoss()
    for step in range(steps):
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
    return failed_at


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--hook", choices=("default", "early", "threads"), default="default")
    p.add_argument("--fail-step", type=int, default=-1)
    p.add_argument("--configs", default=None, help="HOOK:FAIL_STEP,...: each in turn, into RUN_DIR/HOOK_FAIL_STEP")
    args = p.parse_args()
    sys.setswitchinterval(1e-6)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.configs is None:
        harness.write_result({"rank": rank, "failed_at": run(args.run_dir, args.steps, args.hook, args.fail_step)})
    else:
        failed = {}
        for item in args.configs.split(","):
            hook_kind, fail_step = item.split(":")
            assert hook_kind in ("default", "early", "threads"), hook_kind
            name = config_dir(hook_kind, int(fail_step))
            failed[name] = run(os.path.join(args.run_dir, name), args.steps, hook_kind, int(fail_step))
        harness.write_result({"rank": rank, "failed_at": failed})
    harness.finish()


if __name__ == "__main__":
    main()

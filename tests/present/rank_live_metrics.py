"""One rank of a traced DDP job that serves Prometheus metrics while it trains (run by test_traced_job_live.py).

argv: RUN_DIR PORTS(comma, one per rank) AGG_PORT READY_DIR GO_FILE STEPS

Every rank serves its own metrics (a sink on its tracer) on PORTS[rank]; rank 0 also serves the whole
job's metrics, read from the run directory, on AGG_PORT. After STEPS steps a rank marks itself ready
and keeps training until the test has scraped (GO_FILE exists), so the scrape happens mid-run.
Faults come from HYPERACC_CHAOS.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hyperacc import chaos, harness
from hyperacc.present.metrics import MetricsSink, RunDirFollower, serve
from hyperacc.trace import Tracer


def main() -> None:
    run_dir, ports, agg_port = sys.argv[1], [int(p) for p in sys.argv[2].split(",")], int(sys.argv[3])
    ready_dir, go_file, steps = Path(sys.argv[4]), Path(sys.argv[5]), int(sys.argv[6])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    tracer = Tracer(run_dir, flush_every_s=0.5, inband=True)  # the culprit share is the in-band view
    sink = MetricsSink(world_size=world)
    tracer.add_sink(sink)
    server = serve(sink, ports[rank])
    follower = None
    if rank == 0:
        job = MetricsSink(world_size=world)
        serve(job, agg_port)
        follower = RunDirFollower(run_dir, job, interval=0.5).start()

    chaos.install_from_env()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256)))
    tracer.attach_ddp(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 256)

    def one_step() -> None:
        with tracer.step():
            with tracer.phase("forward"):
                loss = model(x).square().mean()
            with tracer.phase("backward"):
                loss.backward()
            with tracer.phase("optimizer"):
                opt.step()
                opt.zero_grad()

    for _ in range(steps):
        one_step()
    tracer.flush()
    (ready_dir / f"ready-{rank}").touch()

    # Train on until the test has scraped; rank 0 decides for all (every rank must run the same steps).
    deadline = time.monotonic() + 120
    flag = torch.zeros(1)
    extra = 0
    while True:
        flag[0] = 1.0 if rank == 0 and (go_file.exists() or time.monotonic() > deadline) else 0.0
        dist.broadcast(flag, 0)
        if flag[0] > 0:
            break
        one_step()
        extra += 1
    tracer.close()
    if follower is not None:
        follower.stop()
    server.shutdown()
    harness.write_result({"rank": rank, "extra_steps": extra, "pid": os.getpid()})
    harness.finish()


if __name__ == "__main__":
    main()

"""A traced DDP rank that serves Prometheus metrics on a port another process already holds (run by
test_filesystem_and_ports.py). argv: RUN_DIR PORT STEPS.

The endpoint cannot listen: one warning, and the rank trains on; its result says so.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hyperacc import harness
from hyperacc.present.metrics import MetricsSink, serve
from hyperacc.trace import Tracer


def main() -> None:
    run_dir, port, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    tracer = Tracer(run_dir, flush_every_s=0.2, window=0, probe_every=0)
    sink = MetricsSink()
    tracer.add_sink(sink)
    server = serve(sink, port)  # the port is taken by the test
    model = DDP(torch.nn.Linear(32, 32))
    tracer.attach_ddp(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 32)
    for _ in range(steps):
        with tracer.step():
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    tracer.close()
    harness.write_result({"rank": dist.get_rank(), "served": server is not None, "steps": steps,
                          "sink_on": sink.enabled})  # fmt: skip
    harness.finish()


if __name__ == "__main__":
    main()

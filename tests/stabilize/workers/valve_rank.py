"""Ranks with deterministic GC, young collections scheduled too; rank 1 makes cyclic garbage so its
safety valve (the young-object bound) fires. Every rank must
collect at the agreed step."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hyperacc import harness
from hyperacc.stabilize import stabilize


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    stab = stabilize(
        gc={"interval": 50, "young": "scheduled", "valve_objects": 150_000, "valve_rss_mb": None, "valve_poll_s": 0.05,
            "valve_lead_steps": 10, "valve_lead_s": 0.5},  # agreed step well inside the run
        allocator=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 64)
    for step in range(200):
        if rank == 1 and step >= 20:
            for _ in range(15_000):  # reference cycles: only a collection frees them
                a: list = []
                a.append(a)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.004)
        stab.step(step)
    summary = stab.close()
    harness.write_result({"records": stab.records, "summary": summary})
    harness.finish()


if __name__ == "__main__":
    main()

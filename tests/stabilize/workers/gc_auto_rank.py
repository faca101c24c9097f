"""Ranks with ``gc={"interval": "auto"}``: they calibrate, agree on one interval through the c10d store,
and after rank 1 starts making much more cyclic garbage that lives through its step (so it survives
CPython's young collections and reaches the scheduled full ones), agree on a shorter one. Every rank must
hold the same plan and collect at the same steps."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hyperacc import harness
from hyperacc.stabilize import stabilize

STEPS = 400
HEAVY_FROM = 150  # rank 1 makes 50k cycles per step from here (the first plan is agreed by then)
YOUNG = os.environ.get("GC_AUTO_YOUNG", "automatic")


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    stab = stabilize(
        gc={"interval": "auto", "young": YOUNG, "pause_budget_ms": 20, "max_interval": 20, "calibration_steps": 10,
            "valve": False, "valve_poll_s": 0.02, "valve_lead_s": 0.5},
        memory=False, allocator=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(32, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 32)
    for step in range(STEPS):
        held = []
        if rank == 1 and step >= HEAVY_FROM:
            for _ in range(50_000):  # reference cycles: only a collection frees them
                a: list = []
                a.append(a)
                held.append(a)  # alive until the step ends: young collections promote them
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.003)
        del held
        stab.step(step)
    summary = stab.close()
    harness.write_result({"records": stab.records, "summary": summary})
    harness.finish()


if __name__ == "__main__":
    main()

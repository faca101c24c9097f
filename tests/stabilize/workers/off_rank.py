"""Ranks with a GC schedule (every 10 steps) and scheduled memory release; rank 1's GC part fails at step
20 (an internal error, injected). Rank 1 switches its GC part off; rank 0 must switch its own off too, at
its next step boundary after it learns of it, and keep its memory release. The loop runs until both
ranks have the part off (the script's own all-reduce of a flag, not hyperacc's), then 20 steps more."""

from __future__ import annotations

import gc
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hyperacc import harness
from hyperacc.stabilize import stabilize

FAIL_AT = 20


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    stab = stabilize(gc={"interval": 10, "valve": False}, memory={"interval": 10}, allocator=False)
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(16, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 16)
    both_off_at = None
    step = 0
    while step < 5000 and (both_off_at is None or step < both_off_at + 20):
        if rank == 1 and step == FAIL_AT:

            def broken(step: int, reason: str) -> int:
                raise RuntimeError("injected")

            stab._gc.collect = broken  # an internal error of the GC part on this rank only
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.01)
        stab.step(step)
        off = torch.tensor([1.0 if "gc" in stab.disabled else 0.0])
        dist.all_reduce(off, op=dist.ReduceOp.MIN)
        if both_off_at is None and off.item() == 1.0:
            both_off_at = step
        step += 1
    gc_after = {"enabled": gc.isenabled(), "threshold": list(gc.get_threshold())}
    summary = stab.close()
    harness.write_result({"records": stab.records, "summary": summary, "steps": step, "gc_after": gc_after})
    harness.finish()


if __name__ == "__main__":
    main()

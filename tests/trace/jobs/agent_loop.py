"""A 2-rank gloo training loop with nothing of hyperacc in it (run under ``hyperacc run`` by
tests/trace/test_compaction_job.py): a tiny DDP model, SGD, 5 ms of sleep per step; rank 0 raises a
flag after SECONDS so that both ranks stop at the same step. Prints, on each rank at the end,
"rank R steps N pyarrow P windows W": P says whether pyarrow was ever loaded in the rank, W whether
the rank ran a live-window thread of its own.

argv: SECONDS
"""

from __future__ import annotations

import sys
import threading
import time

import torch
import torch.distributed as dist


def main() -> None:
    seconds = float(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    flag = torch.zeros(1)
    start = time.monotonic()
    steps = 0
    while True:
        opt.zero_grad()
        model(torch.ones(4, 8)).sum().backward()
        opt.step()
        time.sleep(0.005)
        steps += 1
        flag.fill_(1.0 if rank == 0 and time.monotonic() - start > seconds else 0.0)
        dist.all_reduce(flag)
        if flag.item() > 0:
            break
    windows = any(t.name == "hyperacc-trace-windows" for t in threading.enumerate())
    sys.stdout.write(f"rank {rank} steps {steps} pyarrow {'pyarrow' in sys.modules} windows {windows}\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

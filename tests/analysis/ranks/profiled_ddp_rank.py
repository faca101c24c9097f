"""One rank of a small DDP job (gloo, CPU) recorded with torch.profiler, as a user would record it.

argv: OUT_DIR STEPS SLOW_RANK SLOW_MS. Every rank writes OUT_DIR/rank<N>.json (export_chrome_trace);
rank SLOW_RANK spins SLOW_MS more inside its forward annotation. Run by test_kineto_import.py.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from hyperacc import harness


def main() -> None:
    out, steps, slow_rank, slow_ms = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 64)
    with profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=0, warmup=2, active=steps),
        on_trace_ready=lambda p: p.export_chrome_trace(f"{out}/rank{rank}.json"),
    ) as prof:
        for _ in range(steps + 2):
            with record_function("forward"):
                loss = model(x).square().mean()
                if rank == slow_rank:
                    end = time.perf_counter() + slow_ms / 1e3
                    while time.perf_counter() < end:
                        pass
            with record_function("backward"):
                loss.backward()
            with record_function("optimizer"):
                opt.step()
                opt.zero_grad()
            prof.step()
    harness.write_result({"rank": rank})
    harness.finish()


if __name__ == "__main__":
    main()

"""A 2-rank gloo job traced with a segment every 50 ms and compaction every few segments
(run by tests/trace/test_compaction_job.py under torchrun).

argv: RUN_DIR SECONDS COMPACT_EVERY. Every step sleeps 5 ms and all-reduces a flag; rank 0 raises the
flag after SECONDS, so both ranks stop at the same step. Prints "steps N" on each rank at the end.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from hyperacc.trace import Tracer


def main() -> None:
    run_dir, seconds, every = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tracer = Tracer(run_dir, flush_every_s=0.05, compact_every=every, window=0, probe_every=0,
                    resources_every_s=0.2)  # fmt: skip
    flag = torch.zeros(1)
    start = time.monotonic()
    steps = 0
    while True:
        with tracer.step():
            with tracer.phase("forward"):
                time.sleep(0.005)
            flag.fill_(1.0 if rank == 0 and time.monotonic() - start > seconds else 0.0)
            dist.all_reduce(flag)
        steps += 1
        if steps % 200 == 0:
            tracer.record_event("checkpoint", value=float(steps))
        if flag.item() > 0:
            break
    tracer.close()
    print(f"rank {rank} steps {steps}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

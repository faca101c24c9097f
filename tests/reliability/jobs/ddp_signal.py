"""A traced two-rank DDP job whose rank KILL_RANK sends itself a signal (run by test_faults.py).

argv: RUN_DIR TRACED(1/0) KILL_RANK KILL_STEP SIGNAL(TERM/KILL) WHERE(step/flush)

WHERE=step: the signal is sent at the start of step KILL_STEP, so exactly KILL_STEP steps were
recorded before it. WHERE=flush: it is sent from a sink, that is from inside the tracer's flush, once
the rank has recorded KILL_STEP steps (the sink sees each table the flush has just written).
Every rank writes how many steps it completed before each step to RUN_DIR/progress-RANK (one line
a step, flushed), so the test knows what was recorded when the signal came.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hyperacc import harness


def main() -> None:
    run_dir, traced, kill_rank, kill_step = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), int(sys.argv[4])
    signum = {"TERM": signal.SIGTERM, "KILL": signal.SIGKILL}[sys.argv[5]]
    where = sys.argv[6] if traced else "step"  # untraced there is no flush to signal from
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tracer = None
    if traced:
        from hyperacc.trace import Tracer

        tracer = Tracer(run_dir, flush_every_s=0.05, window=0, probe_every=0)
        if rank == kill_rank and where == "flush":
            seen = [0]

            def sink(table) -> None:  # runs in the flusher thread, inside flush()
                seen[0] += table.num_rows
                if seen[0] >= kill_step:
                    os.kill(os.getpid(), signum)

            tracer.add_sink(sink)
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(64, 64))
    if tracer is not None:
        tracer.attach_ddp(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 64)
    progress = open(Path(run_dir) / f"progress-{rank}", "w", buffering=1)
    for step in range(100_000):
        progress.write(f"{step}\n")
        if rank == kill_rank and where == "step" and step == kill_step:
            os.kill(os.getpid(), signum)
        if tracer is not None:
            with tracer.step():
                with tracer.phase("forward"):
                    loss = model(x).square().mean()
                with tracer.phase("backward"):
                    loss.backward()
                opt.step()
                opt.zero_grad()
        else:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    harness.finish()


if __name__ == "__main__":
    main()

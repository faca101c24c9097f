"""A rank that reports, then exits the plain way (destroy + interpreter exit), which is where gloo
intermittently aborts with SIGABRT. The harness must still count it as finished."""

import os
import sys

import torch
import torch.distributed as dist

from hyperacc import harness

dist.init_process_group("gloo")
t = torch.full((8,), float(dist.get_rank() + 1))
dist.all_reduce(t)
harness.write_result({"rank": dist.get_rank(), "sum": float(t[0]), "group_rank": int(os.environ["GROUP_RANK"]),
                      "world": dist.get_world_size()})
dist.destroy_process_group()
if len(sys.argv) > 1 and sys.argv[1] == "abort":
    os.abort()  # the worst case: the interpreter dies after the result was written

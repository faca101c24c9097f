"""Rank script: the in-band exchange on half-precision gradient buckets (float16, bfloat16).

Each dtype gets its own DDP model and tracer with ``inband=True``; a listener keeps what it heard.
"""

import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hyperacc import harness
from hyperacc.trace import Tracer

dist.init_process_group("gloo")
rank = dist.get_rank()
out = {}
for dtype in (torch.float16, torch.bfloat16):
    torch.manual_seed(0)
    m = DDP(nn.Linear(8, 8).to(dtype))
    run_dir = tempfile.mkdtemp()
    t = Tracer(run_dir, inband=True, window=0, probe_every=0)
    t.attach_ddp(m)
    seen: list = []
    t.inband.add_listener(lambda s, a, w, seen=seen: seen.append([s, w.tolist()]))
    for _ in range(5):
        with t.step():
            m(torch.randn(4, 8, dtype=dtype)).float().sum().backward()
    out[str(dtype)] = {"seen": seen, "exchanging": t.inband.exchanging}
    t.close()
    shutil.rmtree(run_dir, ignore_errors=True)
harness.write_result({"rank": rank, **out})
harness.finish()

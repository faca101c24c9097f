"""The floor of a hook-based step path in Python: what the fewest possible hooks cost the DDP example's
loop (examples/train_ddp.py: DataLoader, DDP, an MLP), for comparison with bench/tracer_cost.py.

Hooks of the same kinds as automatic tracing's (a DataLoader ``__next__`` wrapper, forward wrappers on
the DDP model and the loss module, an ``autograd.backward`` wrapper, global optimizer pre/post hooks, one
parameter hook and two autograd final callbacks for the gradient wait), each doing only its entry tests
and one stamp (time, code) into a preallocated list. ``stamps``: nothing else; ``full``: at each step's
end also ``getrusage``, the exclusive times computed from the stamps, and the row copied into a numpy
ring. Untraced and traced models alternate in blocks of 2 iterations in one process (world 1, gloo),
as in bench/tracer_cost.py.

    .venv/bin/python bench/hook_floor.py --pairs 800     # both modes, one after the other
"""
import argparse
import math
import os
import resource
import statistics
import sys
import threading
import time
from time import perf_counter_ns

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable
from torch.compiler import is_compiling
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, dataloader

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from train_ddp import SyntheticImages, build_model  # noqa: E402

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"), RANK="0", WORLD_SIZE="1")
torch.set_num_threads(1)
dist.init_process_group("gloo")
ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--pairs", type=int, default=1500)
ap.add_argument("--quick", action="store_true", help="200 pairs a mode")
ARGS = ap.parse_args()
MODE = "full"  # stamps | full


class St:
    on = False
    i = 0
    tid = threading.get_ident()


st = St()
buf = [0] * 4096
ring = np.zeros((1024, 40), dtype=np.int64)
row = [0] * 40
acc = [0] * 8
stack_k = [0] * 32
stack_t = [0] * 32
stack_c = [0] * 32
RU = resource.RUSAGE_THREAD
cnt = {"n": 0}


def stamp(code):
    i = st.i
    buf[i] = perf_counter_ns()
    buf[i + 1] = code
    st.i = i + 2


def boundary():
    t1 = perf_counter_ns()
    ru = resource.getrusage(RU)
    n = st.i
    st.i = 0
    if MODE == "stamps":
        return
    # replay: exclusive time per kind
    for k in range(8):
        acc[k] = 0
    d = 0
    for j in range(0, n, 2):
        t = buf[j]
        code = buf[j + 1]
        if code >= 0:
            stack_k[d] = code
            stack_t[d] = t
            stack_c[d] = 0
            d += 1
        else:
            d -= 1
            dur = t - stack_t[d]
            acc[stack_k[d]] += dur - stack_c[d]
            if d:
                stack_c[d - 1] += dur
    row[0] = t1
    row[1] = int((ru.ru_utime + ru.ru_stime) * 1e6)
    row[2] = ru.ru_nvcsw
    row[3] = ru.ru_nivcsw
    row[4] = ru.ru_minflt
    for k in range(8):
        row[5 + k] = acc[k]
    c = cnt["n"]
    ring[c & 1023] = row
    cnt["n"] = c + 1


orig_next = dataloader._BaseDataLoaderIter.__next__


def __next__(it):
    if not st.on or is_compiling() or threading.get_ident() != st.tid:
        return orig_next(it)
    stamp(0)
    try:
        return orig_next(it)
    finally:
        stamp(-1)


dataloader._BaseDataLoaderIter.__next__ = __next__
orig_backward = torch.autograd.backward


def backward(*a, **k):
    if not st.on or is_compiling() or threading.get_ident() != st.tid:
        return orig_backward(*a, **k)
    stamp(3)
    try:
        return orig_backward(*a, **k)
    finally:
        stamp(-1)


torch.autograd.backward = backward


def opt_pre(o, a, k):
    if not st.on or is_compiling() or threading.get_ident() != st.tid:
        return
    stamp(5)


def opt_post(o, a, k):
    if not st.on or is_compiling() or threading.get_ident() != st.tid:
        return
    stamp(-1)
    boundary()


from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook  # noqa: E402

register_optimizer_step_pre_hook(opt_pre)
register_optimizer_step_post_hook(opt_post)


def wrap_forward(module, ddp=None):
    original = module.forward

    def forward(*a, **k):
        if not st.on or is_compiling() or threading.get_ident() != st.tid:
            return original(*a, **k)
        if ddp is not None:
            ddp.armed = torch.is_grad_enabled() and ddp.model.require_backward_grad_sync
        stamp(2)
        try:
            return original(*a, **k)
        finally:
            stamp(-1)

    module.forward = forward


class Wait:
    def __init__(self, model):
        self.model = model
        self.armed = False
        self.queued = False
        self.cb1 = self.after_graph
        self.cb2 = self.after_reduce
        p = next(q for q in model.module.parameters() if q.requires_grad)
        p.register_post_accumulate_grad_hook(self.ready)

    def ready(self, p):
        if not (self.armed and st.on) or self.queued:
            return
        self.queued = True
        Variable._execution_engine.queue_callback(self.cb1)

    def after_graph(self):
        self.queued = self.armed = False
        stamp(4)
        Variable._execution_engine.queue_callback(self.cb2)

    def after_reduce(self):
        stamp(-1)


dataset = SyntheticImages(1 << 20, 512, 10)
loss_fn_p = nn.CrossEntropyLoss()
loss_fn_t = nn.CrossEntropyLoss()
torch.manual_seed(0)


def build(traced):
    model = DDP(build_model(512, 512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    lf = nn.CrossEntropyLoss()
    if traced:
        w = Wait(model)
        wrap_forward(model, w)
        wrap_forward(lf)
    return [model, opt, iter(DataLoader(dataset, batch_size=32, shuffle=True)), lf]


def iterate(arm):
    model, opt, batches, lf = arm
    x, y = next(batches)
    opt.zero_grad(set_to_none=True)
    lf(model(x), y).backward()
    opt.step()


plain, traced = build(False), build(True)
st.on = True
for _ in range(20):
    iterate(traced)
st.on = False
for _ in range(20):
    iterate(plain)
pairs = 200 if ARGS.quick else ARGS.pairs
block = 2
print(f"examples/train_ddp.py's loop, one process; {pairs} alternated pairs of {block}-iteration blocks a mode")
for MODE in ("stamps", "full"):
    times = {"plain": [], "traced": []}
    for p in range(pairs):
        for name in ("plain", "traced") if p % 2 == 0 else ("traced", "plain"):
            arm = traced if name == "traced" else plain
            st.on = name == "traced"
            t0 = time.thread_time()
            for _ in range(block):
                iterate(arm)
            times[name].append((time.thread_time() - t0) / block)
    d = [t - q for t, q in zip(times["traced"], times["plain"], strict=True)]
    base = statistics.fmean(times["plain"])
    m = statistics.fmean(d)
    h = 1.96 * statistics.stdev(d) / math.sqrt(len(d))
    print(f"{MODE:<7} untraced {base * 1e3:.3f} ms, added {m * 1e6:+.1f} us ({(m - h) * 1e6:+.1f}..{(m + h) * 1e6:+.1f}), "
          f"hooked / untraced {1 + m / base:.4f} ({1 + (m - h) / base:.4f}..{1 + (m + h) / base:.4f})")
dist.destroy_process_group()

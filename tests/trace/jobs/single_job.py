"""A plain single-process script, run through ``python -m hyperacc.bootstrap`` (automatic tracing).

Phase 1 (steps 0-5): data parallelism by hand, the script's own ``dist.all_reduce`` on every gradient
(plus one async all-reduce): the tracer times these explicit collectives. Phase 2 (steps 6-11): a DDP
model with the script's own communication hook, which halves the gradients: the tracer must wrap that
hook (it is called, its result is what DDP uses), never replace it.
"""

import json
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

calls = 0


def halving_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    global calls
    calls += 1
    buf = bucket.buffer().mul_(0.5)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))


def main() -> None:
    out, port = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(96, 32, generator=g), torch.randint(0, 4, (96,), generator=g))
    loss_fn = nn.CrossEntropyLoss()

    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in DataLoader(data, batch_size=16):
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        dist.all_reduce(torch.zeros(4), async_op=True).wait()
        opt.step()

    ddp = DDP(build())
    ddp.register_comm_hook(None, halving_hook)
    ref = build()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.0)
    halved = []
    for x, y in DataLoader(data, batch_size=16):
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        ref.zero_grad()
        loss_fn(ref(x), y).backward()
        halved.append(
            all(
                torch.equal(a.grad, b.grad * 0.5)
                for a, b in zip(ddp.parameters(), ref.parameters(), strict=True)
            )
        )
        opt.step()
    with open(out, "w") as fh:
        json.dump({"calls": calls, "halved": halved}, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

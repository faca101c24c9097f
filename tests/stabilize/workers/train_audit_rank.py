"""DDP training four times in one rank: without stabilizers, with all of them (sync audit on), with
barrier elision, and with the audit's dry run (CPU tensors counted as a GPU's). The loop holds a
per-step dist.barrier() and a loss.item(), AdamW and a shuffling DataLoader (whose own .item() calls
are torch's, not the user's)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from hyperacc import harness
from hyperacc.stabilize import stabilize

STEPS = 20


def train(stab=None) -> tuple[list[float], float]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(100 + rank)
    data = torch.randn(STEPS * 16, 32, generator=gen)
    loader = DataLoader(data, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(rank))
    losses = []
    for step, x in enumerate(loader):
        y = x[:, :1] * 0.5
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        dist.barrier()  # BARRIER-LINE
        losses.append(loss.item())  # ITEM-LINE
        if stab is not None:
            stab.step(step)
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))  # CHECKSUM-LINE
    return losses, checksum


def main() -> None:
    dist.init_process_group("gloo")
    dist.barrier()  # SETUP-BARRIER
    base = train()
    stab = stabilize(
        gc={"interval": 5, "valve_objects": 1000}, memory={"interval": 7}, affinity=True, sync_audit=True
    )
    audited = train(stab)
    audit = stab.audit_report()
    summary = stab.close()
    stab = stabilize(gc=False, memory=False, allocator=False, sync_audit={"elide_barriers": True})
    elided = train(stab)
    elision = stab.audit_report()
    stab.close()
    stab = stabilize(gc=False, memory=False, allocator=False, sync_audit={"cpu_as_device": True})
    dry = train(stab)
    dry_run = stab.audit_report()
    stab.close()
    harness.write_result(
        {"base": base, "audited": audited, "elided": elided, "dry": dry, "audit": audit, "elision": elision,
         "dry_run": dry_run,
         "summary": {k: v for k, v in summary.items() if k != "sync_audit"}}
    )  # fmt: skip
    harness.finish()


if __name__ == "__main__":
    main()

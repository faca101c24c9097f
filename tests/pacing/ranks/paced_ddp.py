"""One rank of a small DDP job with the tracer's in-band exchange, with or without pacing.

argv: MODE (on|off) RUN_DIR STEPS. Rank 0 is persistently slower, so pacing delays the others.
Reports hashes of the final parameters and of explicitly all-reduced tensors, and what pacing did.
"""

from __future__ import annotations

import hashlib
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hyperacc import harness
from hyperacc.pacing import PacingConfig
from hyperacc.pacing.runtime import PacingHook, paced
from hyperacc.trace import Tracer


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


# rank 0's lateness at each synchronisation point: well above what preemption adds to any rank's
# arrival on a loaded 2-core host (a few ms), so pacing sees a predictable spread under load too
LEAD_S = 0.025


def main() -> None:
    mode, run_dir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    tracer = Tracer(run_dir, window=0, probe_every=0, inband=True)
    inband = tracer.attach_ddp(model)
    # pacing switched on quickly; "off" keeps the same exchange but thresholds no spread can reach
    cfg = PacingConfig(warmup_steps=3, on_steps=3, gain=1.0, margin=0.5, max_delay_frac=0.3)
    never = PacingConfig(on_spread_ns=10**15, on_spread_frac=0.5, off_spread_frac=0.0)
    hook = PacingHook(cfg if mode == "on" else never).attach(inband)
    explicit = paced(dist.all_reduce, PacingHook(cfg if mode == "on" else never))
    gen = torch.Generator().manual_seed(100 + rank)
    reduced, plain = [], []
    for step in range(steps):
        with tracer.step(step):
            x = torch.randn(32, 64, generator=gen)
            y = torch.randn(32, 8, generator=gen)
            t = torch.randn(1000, generator=gen)
            p = t.clone()
            # rank 0 is the persistent straggler before each of the two synchronisation points, so
            # both the explicit collective and DDP's gradient all-reduce see it arrive late
            time.sleep(0.002 + (LEAD_S if rank == 0 else 0.0))
            explicit(t)
            time.sleep(0.002 + (LEAD_S if rank == 0 else 0.0))
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        dist.all_reduce(p)
        reduced.append(t)
        plain.append(p)
    exchanging = inband.exchanging  # read before close(), which stops the exchange
    tracer.close()
    harness.write_result(
        {
            "params": digest(model.parameters()),
            "explicit": digest(reduced),
            "explicit_vs_plain": max(float((a - b).abs().max()) for a, b in zip(reduced, plain, strict=True)),
            "exchanging": exchanging,
            "hook_enabled": hook.enabled,
            "hook_delays": hook.delays_applied,
            "hook_on": hook.controller.on,
            "explicit_enabled": explicit.hook.enabled,
            "explicit_delays": explicit.hook.delays_applied,
            "explicit_on": explicit.hook.controller.on,
        }
    )
    harness.finish()


if __name__ == "__main__":
    main()

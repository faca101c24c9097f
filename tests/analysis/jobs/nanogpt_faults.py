"""Rank script: a tiny transformer trained nanoGPT-style (batches cut by hand from a tensor, no
DataLoader, DDP over gloo), with faults the job injects itself (no ``hyperacc.chaos``):

- ``--cycles-rank R --cycles N``: rank R builds N reference cycles after every ``optimizer.step()``
  (its own host work between steps, and the automatic GC that collects them);
- ``--slow-rank R --slow-from A --slow-until B --slow-factor F``: on steps [A, B) rank R busy-loops
  inside its forward for (F - 1) times its own median step of steps 10-59 (a transient fail-slow);
  ``--slow-work sleep``: sleeps that long instead (a fail-slow off the CPU, as a blocking read);
  ``--slow-work between``: busy-loops that long after ``optimizer.step()`` instead (its own host work
  between steps, in the input gap of a loop without a DataLoader); ``--slow-work gapsleep``: sleeps
  that long there (a blocking read of the next batch, off the CPU);
- ``--fault R:A:B:F:WORK`` (repeatable, one per rank): the same fail-slow for rank R, so that one job
  holds several at different steps on different ranks;
- ``--input-rank R --input-ms M --input-every K``: every K-th step rank R waits M ms for its batch (a
  blocking read of the next batch, between ``optimizer.step()`` and the next forward).

Run under ``hyperacc run`` so the tracer records it without a line of hyperacc in the loop.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hyperacc import harness


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 32, block: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(block, width)
        self.layer = nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.0, batch_first=True)
        self.head = nn.Linear(width, vocab)
        self.spin_ns = 0
        self.sleep = False

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.spin_ns and self.sleep:  # the fail-slow off the CPU: a blocking wait inside the forward
            time.sleep(self.spin_ns / 1e9)
        elif self.spin_ns:  # the fail-slow: more work on the host, inside the forward
            end = time.perf_counter_ns() + self.spin_ns
            while time.perf_counter_ns() < end:
                pass
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.layer(x))


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--cycles-rank", type=int, default=-1)
    p.add_argument("--cycles", type=int, default=30_000)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-from", type=int, default=120)
    p.add_argument("--slow-until", type=int, default=180)
    p.add_argument("--slow-factor", type=float, default=2.0)
    p.add_argument("--slow-work", choices=("spin", "sleep", "between", "gapsleep"), default="spin")
    p.add_argument("--fault", action="append", default=[], metavar="R:A:B:F:WORK")
    p.add_argument("--input-rank", type=int, default=-1)
    p.add_argument("--input-ms", type=float, default=20.0)
    p.add_argument("--input-every", type=int, default=10)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    faults = {args.slow_rank: (args.slow_from, args.slow_until, args.slow_factor, args.slow_work)}
    for spec in args.fault:
        r, a, b, f, work = spec.split(":")
        faults[int(r)] = (int(a), int(b), float(f), work)
    slow_from, slow_until, slow_factor, slow_work = faults.get(rank, (0, 0, 1.0, "spin"))
    torch.manual_seed(0)
    raw = TinyGPT()
    raw.sleep = slow_work == "sleep"
    model = DDP(raw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, 64, (4096, 17), generator=torch.Generator().manual_seed(rank))
    gen = torch.Generator().manual_seed(100 + rank)

    def get_batch(it: int) -> tuple[torch.Tensor, torch.Tensor]:
        if rank == args.input_rank and it % args.input_every == args.input_every - 1:
            time.sleep(args.input_ms / 1e3)  # the read blocks: the batch is not there yet
        ix = torch.randint(0, data.shape[0], (16,), generator=gen)
        block = data[ix]
        return block[:, :16], block[:, 1:]

    own: list[int] = []
    raw_spin = 0
    t_prev = time.perf_counter_ns()
    for it in range(args.steps):
        if slow_until:
            if it == min(60, slow_from):  # the rank's own median step before the fault
                raw_spin = int((slow_factor - 1.0) * statistics.median(own[10:it] or own or [0]))
            raw.spin_ns = raw_spin if slow_from <= it < slow_until else 0
        between_ns, raw.spin_ns = (raw.spin_ns, 0) if slow_work in ("between", "gapsleep") else (0, raw.spin_ns)
        x, y = get_batch(it)
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if between_ns and slow_work == "gapsleep":  # its read of the next batch blocks
            time.sleep(between_ns / 1e9)
        elif between_ns:  # the rank's own work between optimizer.step() and the next forward
            end = time.perf_counter_ns() + between_ns
            while time.perf_counter_ns() < end:
                pass
        if rank == args.cycles_rank:
            for _ in range(args.cycles):  # garbage only the cyclic collector can free
                a, b = Node(), Node()
                a.other, b.other = b, a
        now = time.perf_counter_ns()
        own.append(now - t_prev)
        t_prev = now
    harness.write_result({"rank": rank, "loss": float(loss)})
    harness.finish()


if __name__ == "__main__":
    main()

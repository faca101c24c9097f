"""A nanoGPT-shaped training loop, written here for bench/rank_cost.py: no DataLoader, batches sliced from
a memory-mapped token file (``get_batch``), gradient accumulation with ``require_backward_grad_sync``,
GradScaler, ``clip_grad_norm_``, ``loss.item()`` every ``--log-every`` iterations, gloo DDP.

    torchrun --standalone --nproc-per-node 2 bench/workers/nanogpt_loop.py --data tokens.bin --iters 300
"""

from __future__ import annotations

import argparse
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, block: int, d: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--embd", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1337 + rank)
    data = np.memmap(args.data, dtype=np.uint16, mode="r")
    vocab = int(os.environ.get("NANOGPT_VOCAB", "512"))

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - args.block - 1, (args.batch,))
        x = torch.stack([torch.from_numpy(data[i : i + args.block].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + args.block].astype(np.int64)) for i in ix])
        return x, y

    model = DDP(GPT(vocab, args.block, args.embd, args.layers, heads=4))
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1, fused=False)
    scaler = torch.amp.GradScaler("cpu")
    x, y = get_batch()
    for it in range(args.iters):
        lr = 6e-4 * 0.5 * (1 + math.cos(math.pi * it / args.iters))
        for group in opt.param_groups:
            group["lr"] = lr
        for micro in range(args.accum):
            model.require_backward_grad_sync = micro == args.accum - 1
            loss = model(x, y) / args.accum
            x, y = get_batch()
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if it % args.log_every == 0 and rank == 0:
            print(f"iter {it}: loss {loss.item() * args.accum:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

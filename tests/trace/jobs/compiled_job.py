"""A one-rank gloo DDP job whose model is compiled with ``torch.compile`` (run by tests/trace/test_compile.py).

Modes, as people compile: ``wrap`` is ``DDP(torch.compile(model))`` (nanoGPT), ``blocks`` compiles each
block in place of itself (torchtitan), ``outer`` is ``torch.compile(DDP(model))`` (accelerate with
``torch_compile``). The backend counts the graphs it is handed, so a recompilation shows as one more.
Every warning is recorded. Prints one JSON line per mode: {"mode", "graphs", "warnings", "checksum"}.

argv: STORE_FILE RUN_DIR|- MODE [MODE ...]  (with a RUN_DIR, automatic tracing is installed first, as
the bootstrap does, and one mode is run: its first step is the one that finds the outermost modules)
"""

from __future__ import annotations

import json
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.ln(x))))


class Model(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def train(mode: str, backend: object) -> float:
    torch.manual_seed(0)
    model: nn.Module = Model()
    if mode == "wrap":
        model = DDP(torch.compile(model, backend=backend))
    elif mode == "blocks":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend=backend)
        model = DDP(model)
    elif mode == "outer":
        model = torch.compile(DDP(model), backend=backend)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        opt.zero_grad()
        model(torch.randn(8, 16, generator=g)).backward()
        opt.step()
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def main() -> None:
    store, run_dir, modes = sys.argv[1], sys.argv[2], sys.argv[3:]
    seen = warnings.catch_warnings(record=True)
    caught = seen.__enter__()
    warnings.simplefilter("always")
    auto = None
    if run_dir != "-":
        from hyperacc.trace import install_auto

        auto = install_auto(run_dir, window=0, handle_sigterm=False)
    graphs = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    for mode in modes:
        torch._dynamo.reset()
        graphs.clear()
        caught.clear()
        checksum = train(mode, backend)
        print(json.dumps({"mode": mode, "graphs": len(graphs), "warnings": [str(w.message)[:120] for w in caught],
                          "checksum": checksum}), flush=True)  # fmt: skip
    if auto is not None:
        auto.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

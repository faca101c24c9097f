"""What the tracer costs a training rank per iteration, to within 1 %: untraced and traced iterations
alternated inside one rank, a few iterations at a time.

Across separate runs (bench/rank_cost.py) this machine's CPU time per iteration drifts by tens of
percent over seconds (a shared VM), so two runs a minute apart cannot show 1 %. Here one rank runs under
``hyperacc run --quiet`` (the tracing a user gets, live windows in the node agent) and holds two copies
of the job's model: one built while automatic tracing was uninstalled (never attached) and one built
with it installed. Pairs of blocks of ``--block`` iterations alternate, the order flipping every pair;
during an untraced block automatic tracing is paused (its hooks return at their first line, as they do
after an internal error), so the arms differ by all the tracer's work but the hooks' entry test, a few
attribute reads a phase. (Uninstalling and installing the hooks between blocks instead would measure
a cold start: patching classes resets the interpreter's inline caches, and a block just after it ran
up to 0.2 ms slower on the DDP example here, more the shorter the block.) Measured:

- the training thread's CPU time per iteration of each block (``time.thread_time``): everything the
  tracer does on the training thread (hooks, step clock, signals, the row, DDP timing);
- the CPU time of hyperacc's own threads in the rank (the flusher: records, resource samples), read
  from their thread clocks and charged to the traced iterations (all of it, though they also ran
  during untraced blocks).

Printed: per-iteration CPU untraced and traced, the training thread's added time with the 95 %
interval of the mean paired difference, and the ratio (traced training thread + hyperacc's threads) /
untraced with that interval. Jobs: the nanoGPT-shaped loop of bench/workers/nanogpt_loop.py
(accumulation over 4 micro-steps with ``require_backward_grad_sync``, memmap-style batches, GradScaler,
``clip_grad_norm_``) and the loop of examples/train_ddp.py (DataLoader, DDP, an MLP); and, where they are
installed, examples/train_hf.py's HF Trainer job and examples/train_lightning.py's Lightning job (a
tiny GPT-2, DDP); ``--job cnn_bn``, a small CNN with batch norms (DDP broadcasts their buffers at every
forward, which the tracer times as a collective). A trainer owns its loop, so there the blocks alternate inside ``train()``/``fit()``,
switched from the trainer's own step callback, on the one model the trainer built (``_Alternation``).
One rank (the tracer's per-iteration work does not grow with the world size; the gradient all-reduce
is gloo's, on one rank).

    .venv/bin/python bench/tracer_cost.py --quick       # a few minutes (150 pairs a job)
    .venv/bin/python bench/tracer_cost.py               # 1,500 pairs a job, a few minutes each
    .venv/bin/python bench/tracer_cost.py --job hf      # one job
    python3 bench/tracer_cost.py --device cuda --pairs 800   # the two loops on the first GPU, NCCL
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _nanogpt(device: str) -> tuple:
    import numpy as np
    import torch
    from nanogpt_loop import GPT
    from torch.nn.parallel import DistributedDataParallel as DDP

    data = np.random.default_rng(0).integers(0, 512, 200_000).astype(np.uint16)

    def get_batch() -> tuple:
        ix = torch.randint(len(data) - 65, (8,))
        x = torch.stack([torch.from_numpy(data[i : i + 64].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1 : i + 65].astype(np.int64)) for i in ix])
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    def build() -> list:
        model = DDP(GPT(512, 64, 64, 2, 4).to(device))
        opt = torch.optim.AdamW(model.parameters(), lr=6e-4, fused=False)
        return [model, opt, torch.amp.GradScaler(device.split(":")[0]), get_batch()]

    def iterate(arm: list) -> None:
        model, opt, scaler, (x, y) = arm
        for micro in range(4):
            model.require_backward_grad_sync = micro == 3
            loss = model(x, y) / 4
            x, y = get_batch()
            scaler.scale(loss).backward()
        arm[3] = (x, y)
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return build, iterate


def _train_ddp(device: str) -> tuple:
    import torch
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader
    from train_ddp import SyntheticImages, build_model

    dataset = SyntheticImages(1 << 20, 512, 10)
    loss_fn = nn.CrossEntropyLoss()

    def build() -> list:
        model = DDP(build_model(512, 512, 10).to(device))
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        return [model, opt, iter(DataLoader(dataset, batch_size=32, shuffle=True))]

    def iterate(arm: list) -> None:
        model, opt, batches = arm
        x, y = next(batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    return build, iterate


def _cnn_bn(device: str) -> tuple:
    """A small CNN with batch norms (a ResNet's shape): DDP broadcasts their buffers at every forward."""
    import torch
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 3, 32, 32, generator=g).to(device), torch.randint(0, 10, (32,), generator=g).to(device)
    loss_fn = nn.CrossEntropyLoss()

    def build() -> list:
        net = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * 8 * 8, 10),
        )  # fmt: skip
        model = DDP(net.to(device))
        return [model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)]

    def iterate(arm: list) -> None:
        model, opt = arm
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    return build, iterate


JOBS = {"nanogpt": _nanogpt, "train_ddp": _train_ddp, "cnn_bn": _cnn_bn}


class _Alternation:
    """For a trainer that owns its loop: blocks of ``block`` steps alternate traced and paused, the order
    flipping every pair, driven from the trainer's own step callback (``at_step`` at each step's
    start). Both arms run the same model, the one the trainer built with automatic tracing installed,
    so the untraced arm still pays the hooks' entry test (a few attribute reads a phase): the added time
    is, if anything, a little under the tracer's whole cost."""

    def __init__(self, auto, pairs: int, block: int, warm: int = 10) -> None:
        self.auto, self.block, self.warm = auto, block, warm
        self.order = [arm for p in range(pairs) for arm in (("plain", "traced") if p % 2 == 0 else ("traced", "plain"))]
        self.times: dict[str, list[float]] = {"plain": [], "traced": []}
        self.arm: str | None = None
        self.t0 = self.bg = self.bg0 = 0.0
        self.calls = 0

    @property
    def steps(self) -> int:
        return self.warm + len(self.order) * self.block + 1

    def at_step(self) -> None:
        i, self.calls = self.calls, self.calls + 1
        if i < self.warm or (i - self.warm) % self.block:
            return
        now = time.thread_time()
        if self.arm is not None:
            self.times[self.arm].append((now - self.t0) / self.block)
        k = (i - self.warm) // self.block
        if k == 0:
            self.bg0 = _hyperacc_threads_cpu()
        if k >= len(self.order):
            if self.arm is not None:
                self.bg = _hyperacc_threads_cpu() - self.bg0
            self.arm, self.auto._on = None, True
            return
        self.arm = self.order[k]
        self.auto._on = self.arm == "traced"
        self.t0 = time.thread_time()

    def result(self) -> dict:
        return {**self.times, "bg_s": self.bg, "traced_iterations": len(self.times["traced"]) * self.block}


def _hf(alt: _Alternation) -> None:
    """examples/train_hf.py's job (a tiny GPT-2, HF Trainer, DDP over gloo), timed by a TrainerCallback."""
    import torch
    import transformers
    from train_hf import Tokens
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    class Step(TrainerCallback):
        def on_step_begin(self, *args: object, **kwargs: object) -> None:
            alt.at_step()

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256, n_positions=32))
    targs = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hf-cost-"), per_device_train_batch_size=4, max_steps=alt.steps,
        learning_rate=1e-3, logging_steps=10**9, save_strategy="no", report_to=[], use_cpu=True,
        ddp_backend="gloo", seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(model=model, args=targs, train_dataset=Tokens(4096, 32, 256), callbacks=[Step()])
    trainer.train()


def _lightning(alt: _Alternation) -> None:
    """examples/train_lightning.py's job (the same GPT-2 in a LightningModule, DDP), timed by a Callback."""
    import lightning as L
    import torch
    from train_lightning import Tokens
    from transformers import GPT2Config, GPT2LMHeadModel

    class TinyGPT(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256, n_positions=32))

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Step(L.Callback):
        def on_train_batch_start(self, *args: object, **kwargs: object) -> None:
            alt.at_step()

    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy="ddp", max_steps=alt.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tempfile.mkdtemp(prefix="pl-cost-"), callbacks=[Step()],
    )  # fmt: skip
    trainer.fit(TinyGPT(), torch.utils.data.DataLoader(Tokens(4096, 32, 256), batch_size=4, shuffle=False))


TRAINERS = {"hf": ("transformers", _hf), "lightning": ("lightning", _lightning)}


def _hyperacc_threads_cpu() -> float:
    total = 0.0
    for t in threading.enumerate():
        if t.name.startswith("hyperacc") and t.ident is not None:
            try:
                total += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except (OSError, ProcessLookupError):
                pass  # ended meanwhile
    return total


def worker(job: str, pairs: int, block: int, out: Path, device: str = "cpu") -> None:
    import torch
    import torch.distributed as dist

    from hyperacc.trace import auto as auto_mod

    sys.path[:0] = [str(HERE / "workers"), str(ROOT / "examples")]
    if job in TRAINERS:  # the trainer sets up the process group and owns the loop
        auto = auto_mod.installed()
        if auto is None:
            raise SystemExit("run this worker under `hyperacc run` (automatic tracing was not installed)")
        alt = _Alternation(auto, pairs, block)
        TRAINERS[job][1](alt)
        out.write_text(json.dumps(alt.result()))
        return
    if device.startswith("cuda"):  # one rank on the first GPU, NCCL: the device path of the tracer
        torch.cuda.set_device(0)
        device = "cuda:0"
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    auto = auto_mod.installed()
    if auto is None:
        raise SystemExit("run this worker under `hyperacc run` (automatic tracing was not installed)")
    torch.manual_seed(0)
    build, iterate = JOBS[job](device)
    auto.uninstall()
    plain = build()  # built untraced: never attached
    auto.install()
    traced = build()
    for _ in range(10):
        iterate(traced)
    auto.uninstall()
    for _ in range(10):
        iterate(plain)
    auto.install()
    auto._on = False
    bg0 = _hyperacc_threads_cpu()
    times: dict[str, list[float]] = {"plain": [], "traced": []}
    for p in range(pairs):
        for name in ("plain", "traced") if p % 2 == 0 else ("traced", "plain"):
            arm = traced if name == "traced" else plain
            auto._on = name == "traced"
            t0 = time.thread_time()
            for _ in range(block):
                iterate(arm)
            times[name].append((time.thread_time() - t0) / block)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    bg = _hyperacc_threads_cpu() - bg0
    auto._on = True
    out.write_text(json.dumps({**times, "bg_s": bg, "traced_iterations": pairs * block}))
    dist.destroy_process_group()


def report(job: str, res: dict) -> None:
    plain, traced = res["plain"], res["traced"]
    diffs = [t - p for t, p in zip(traced, plain, strict=True)]
    n = len(diffs)
    base = statistics.fmean(plain)
    mean_d = statistics.fmean(diffs)
    half = 1.96 * statistics.stdev(diffs) / math.sqrt(n)
    bg = res["bg_s"] / res["traced_iterations"]
    added = mean_d + bg
    print(f"{job:<10} {n:>6} {base * 1e3:>12.3f} {(base + mean_d) * 1e3:>12.3f} "
          f"{mean_d * 1e6:>+10.1f} ({(mean_d - half) * 1e6:+.1f}..{(mean_d + half) * 1e6:+.1f}) {bg * 1e6:>10.1f} "
          f"{1 + added / base:>9.4f} ({1 + (added - half) / base:.4f}..{1 + (added + half) / base:.4f})")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="150 pairs a job")
    p.add_argument("--pairs", type=int, default=1500)
    p.add_argument("--block", type=int, default=2, help="iterations per block")
    p.add_argument("--job", choices=("all", *JOBS, *TRAINERS), default="all",
                   help="all: the two loops, and HF Trainer and Lightning where installed")
    p.add_argument("--trace", default="", help="tracing options for `hyperacc run --trace` (default: its own)")
    p.add_argument("--device", default="cpu", help="cuda: the two loops on the first GPU over NCCL (trainers stay on CPU)")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    pairs = 150 if args.quick else args.pairs
    if args.worker:
        worker(args.worker, pairs, args.block, Path(args.out), args.device)
        return
    from _machine import describe

    print(describe())
    print(f"one rank under `hyperacc run --quiet`; {pairs} alternated pairs of {args.block}-iteration blocks a job")
    print(f"{'job':<10} {'pairs':>6} {'untraced ms':>12} {'traced ms':>12} {'training thread +us (95 %)':>30} "
          f"{'hyperacc threads us':>10} {'traced / untraced (95 %)':>26}")  # fmt: skip
    if args.job == "all" and args.device != "cpu":
        jobs = list(JOBS)
    elif args.job == "all":
        jobs = [*JOBS, *(name for name, (package, _) in TRAINERS.items() if importlib.util.find_spec(package))]
        for name in sorted(set(TRAINERS) - set(jobs)):
            print(f"{name:<10} skipped: {TRAINERS[name][0]} is not installed")
    else:
        jobs = [args.job]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    env.pop("HYPERACC_TRACE", None)
    with tempfile.TemporaryDirectory() as tmp:
        for job in jobs:
            out = Path(tmp) / f"{job}.json"
            cmd = [sys.executable, "-m", "hyperacc", "run", "--quiet", "--run-dir", str(Path(tmp) / job),
                   "--nproc-per-node", "1", *(["--trace", args.trace] if args.trace else []),
                   "--", str(Path(__file__).resolve()), "--worker", job,
                   "--pairs", str(pairs), "--block", str(args.block), "--out", str(out),
                   "--device", args.device]  # fmt: skip
            proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if proc.returncode != 0 or not out.exists():
                raise SystemExit(f"{job}: the traced rank failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            report(job, json.loads(out.read_text()))
    print("per iteration, CPU time; training thread: traced - untraced of the same pair (mean, 95 % interval); "
          "hyperacc threads: their whole CPU time / traced iterations; ratio: (untraced + both) / untraced")


if __name__ == "__main__":
    main()

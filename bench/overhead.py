"""What hyper-trace costs a training step, side by side with the same loops untraced (and torch.profiler).

Three measurements, each printed with its baseline beside it:

1. CPU cost per step, one process, in thread CPU time (what the training thread itself spends, so
   preemption by other work on a loaded host does not count): an empty step under the explicit API
   (``step()`` + 4 phases), and a tiny model's step (forward, backward, SGD, no DataLoader) with
   automatic tracing, with torch.profiler recording, and with neither, in alternating blocks.
2. A transformer-like DDP job without a DataLoader (nanoGPT's shape: batches sliced from a tensor,
   2 ranks, gloo): untraced and traced models alternate in blocks inside one job, so both see the same
   machine; median and p10 step wall time and their ratio (goal: under 1 %).
3. Hugging Face Trainer and PyTorch Lightning (examples/train_hf.py, examples/train_lightning.py, a
   tiny GPT-2, 2 ranks): whole jobs under plain torchrun and under ``hyperacc run``, alternating, with
   each step's wall and thread CPU time taken by the trainers' own callbacks.

    .venv/bin/python bench/overhead.py            # default sizes
    .venv/bin/python bench/overhead.py --quick    # a few minutes
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from time import perf_counter_ns, thread_time_ns

import torch
import torch.nn as nn
from _machine import describe as machine

ROOT = Path(__file__).resolve().parents[1]
MODES = ("untraced", "hyperacc", "torch.profiler")


def profiler() -> torch.profiler.profile:
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])


def quantile(values: list[int] | list[float], q: float) -> float:
    """Preemption on a shared machine only ever adds time: low quantiles show what the code costs."""
    ordered = sorted(values)
    return float(ordered[min(int(q * len(ordered)), len(ordered) - 1)])


# ---------------------------------------------------------------------- 1. CPU cost, one process


def empty_steps(tracer: object | None, n: int) -> float:
    """Thread CPU ns per empty step, with (``tracer``) or without the explicit API."""
    t0 = thread_time_ns()
    if tracer is None:
        for _ in range(n):
            pass
    else:
        step, phase = tracer.step, tracer.phase
        for _ in range(n):
            with step():
                with phase("data"):
                    pass
                with phase("forward"):
                    pass
                with phase("backward"):
                    pass
                with phase("optimizer"):
                    pass
    return (thread_time_ns() - t0) / n


def tiny_block(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, n: int) -> list[int]:
    """Thread CPU ns of each of ``n`` steps (no DataLoader: the batch is sliced from a tensor)."""
    cpu = []
    t0 = thread_time_ns()
    for i in range(n):
        j = (i * 4) % (len(x) - 4)
        loss = nn.functional.cross_entropy(model(x[j : j + 4]), y[j : j + 4])
        opt.zero_grad()
        loss.backward()
        opt.step()
        t1 = thread_time_ns()
        cpu.append(t1 - t0)
        t0 = t1
    return cpu[1:]


def cpu_cost(rounds: int, steps: int) -> dict[str, float]:
    from hyperacc.trace import Tracer
    from hyperacc.trace.auto import AutoTrace

    run_dir = tempfile.mkdtemp(prefix="hyperacc-bench-")
    torch.set_num_threads(1)  # intra-op threads spinning on a busy host would swamp the difference
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(1024, 16), torch.randint(0, 4, (1024,))

    explicit = Tracer(run_dir, rank=0, world_size=1, handle_sigterm=False, window=0, capacity=1 << 17)
    bare, traced = [], []
    for _ in range(rounds):
        bare.append(empty_steps(None, steps * 10))
        traced.append(empty_steps(explicit, steps * 10))
    explicit.close()

    tracer = Tracer(Path(run_dir) / "auto", rank=0, world_size=1, handle_sigterm=False, window=0)
    auto = AutoTrace(tracer)
    per_mode: dict[str, list[int]] = {m: [] for m in MODES}
    for r in range(rounds):
        for mode in MODES[r % 3 :] + MODES[: r % 3]:  # rotate the order: drift falls on every mode
            if mode == "hyperacc":
                auto.install()
                per_mode[mode] += tiny_block(model, opt, x, y, steps)
                auto.uninstall()
            elif mode == "torch.profiler":
                with profiler():
                    per_mode[mode] += tiny_block(model, opt, x, y, steps)
            else:
                per_mode[mode] += tiny_block(model, opt, x, y, steps)
    tracer.close()
    med = {m: statistics.median(v) for m, v in per_mode.items()}
    return {
        "explicit_ns": statistics.median(traced) - statistics.median(bare),
        "tiny_step_cpu_ns": med["untraced"],
        "auto_ns": med["hyperacc"] - med["untraced"],
        "profiler_ns": med["torch.profiler"] - med["untraced"],
    }


# ---------------------------------------------------------------------- 2. transformer-like DDP job


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.n1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.n2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*[Block(d) for _ in range(layers)])
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.blocks(self.emb(idx)))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def rank_job(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hyperacc import harness
    from hyperacc.trace import Tracer
    from hyperacc.trace.auto import AutoTrace

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    plain = DDP(TinyLM())
    tracer = Tracer(args.run_dir)  # default options: window aggregation, probe, signals
    auto = AutoTrace(tracer).install()
    torch.manual_seed(0)
    traced = DDP(TinyLM())  # attached by the automatic hooks
    auto.uninstall()
    models = {"untraced": plain, "hyperacc": traced}
    opts = {m: torch.optim.AdamW(models[m].parameters(), lr=1e-3) for m in models}
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 256, (4096,), generator=g)

    def get_batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(0, len(tokens) - 33, (8,), generator=g)
        block = torch.stack([tokens[j : j + 33] for j in ix.tolist()])
        return block[:, :-1], block[:, 1:]

    wall: dict[str, list[int]] = {m: [] for m in models}
    cpu: dict[str, list[int]] = {m: [] for m in models}
    for r in range(args.rounds):
        for mode in ("untraced", "hyperacc") if r % 2 == 0 else ("hyperacc", "untraced"):
            if mode == "hyperacc":
                auto.install()
            model, opt = models[mode], opts[mode]
            t0, c0 = perf_counter_ns(), thread_time_ns()
            for i in range(args.steps):
                x, y = get_batch(i)
                loss = model(x, y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                t1, c1 = perf_counter_ns(), thread_time_ns()
                if i:
                    wall[mode].append(t1 - t0)
                    cpu[mode].append(c1 - c0)
                t0, c0 = t1, c1
            if mode == "hyperacc":
                auto.uninstall()
            dist.barrier()
    tracer.close()
    harness.write_result(
        {
            m: {"median": statistics.median(wall[m]), "p10": quantile(wall[m], 0.1), "cpu": statistics.median(cpu[m])}
            for m in models
        }
    )
    harness.finish()


def ddp_job(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    from hyperacc import harness

    run_dir = tempfile.mkdtemp(prefix="hyperacc-bench-ddp-")
    job = harness.launch(
        Path(__file__).resolve(),
        ["--rank-job", "--run-dir", run_dir, "--steps", str(args.steps), "--rounds", str(args.rounds)],
        nproc=2, timeout=900,
    )  # fmt: skip
    if not job.ok:
        raise SystemExit(f"the DDP job failed:\n{job.explain()}")
    results = job.results()
    # The job's step time is the slowest rank's (they synchronise every step): the max over ranks.
    return {m: {k: max(r[m][k] for r in results) for k in ("median", "p10", "cpu")} for m in ("untraced", "hyperacc")}


# ---------------------------------------------------------------------- 3. HF Trainer, Lightning


def trainer_jobs(script: str, pairs: int, steps: int) -> dict[str, dict[str, list[float]]]:
    from hyperacc import harness

    out: dict[str, dict[str, list[float]]] = {m: {"wall": [], "cpu": []} for m in ("plain", "hyperacc")}
    for r in range(pairs):
        for mode in ("plain", "hyperacc") if r % 2 == 0 else ("hyperacc", "plain"):
            traced = None
            if mode == "hyperacc":
                traced = {"run-dir": tempfile.mkdtemp(prefix="hyperacc-bench-trainer-")}
            job = harness.launch(ROOT / "examples" / script, ["--steps", str(steps), "--timing"], nproc=2,
                                 timeout=900, traced=traced)  # fmt: skip
            if not job.ok:
                raise SystemExit(f"{script} ({mode}) failed:\n{job.explain()}")
            res = job.results()
            skip = min(10, steps // 5)  # start-up steps
            out[mode]["wall"].append(max(statistics.median(x["step_ns"][skip:]) for x in res))
            out[mode]["cpu"].append(statistics.mean(statistics.median(x["cpu_ns"][skip:]) for x in res))
    return out


# ---------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes (a few minutes)")
    p.add_argument("--rank-job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=None, help="steps per block")
    p.add_argument("--rounds", type=int, default=None, help="blocks per mode")
    p.add_argument("--pairs", type=int, default=None, help="plain/traced trainer job pairs")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON too")
    args = p.parse_args()
    if args.rank_job:
        rank_job(args)
        return
    args.steps = args.steps or (25 if args.quick else 50)
    args.rounds = args.rounds or (4 if args.quick else 12)
    args.pairs = args.pairs or (1 if args.quick else 3)
    trainer_steps = 60 if args.quick else 150

    print(f"machine: {machine()}")
    t0 = time.monotonic()
    fixed = cpu_cost(args.rounds, args.steps * 4)
    ddp = ddp_job(args)
    trainers = {}
    for script, package in (("train_hf.py", "transformers"), ("train_lightning.py", "lightning")):
        if importlib.util.find_spec(package) is None:
            print(f"({script} skipped: {package} is not installed)")
            continue
        trainers[script] = trainer_jobs(script, args.pairs, trainer_steps)
    us = 1e3
    print()
    print("1. CPU time per step, one process (thread CPU time)   hyperacc     torch.profiler")
    print(f"   empty step, explicit API (step + 4 phases)        {fixed['explicit_ns'] / us:7.1f} us         -")
    print(
        f"   tiny model step ({fixed['tiny_step_cpu_ns'] / us:.0f} us CPU), automatic mode   "
        f"{fixed['auto_ns'] / us:7.1f} us   {fixed['profiler_ns'] / us:9.1f} us"
    )
    print()
    print(f"2. transformer-like DDP job without a DataLoader: 2 ranks (gloo), {args.rounds} blocks x {args.steps} "
          "steps per mode, alternating")  # fmt: skip
    print(f"   {'mode':<12}{'median ms':>11}{'ratio':>8}{'p10 ms':>10}{'ratio':>8}{'CPU ms':>9}")
    base = ddp["untraced"]
    for mode in ("untraced", "hyperacc"):
        m, p10, c = ddp[mode]["median"], ddp[mode]["p10"], ddp[mode]["cpu"]
        print(
            f"   {mode:<12}{m / 1e6:>11.3f}{m / base['median']:>8.3f}{p10 / 1e6:>10.3f}"
            f"{p10 / base['p10']:>8.3f}{c / 1e6:>9.3f}"
        )
    if trainers:
        print()
        print(f"3. trainers, 2 ranks, {trainer_steps} steps, {args.pairs} plain/traced job pair(s), alternating")
        print(f"   {'job':<22}{'plain ms':>10}{'traced ms':>11}{'ratio':>8}{'CPU plain':>11}{'CPU traced':>12}{'ratio':>8}")
        for script, res in trainers.items():
            pw, tw = statistics.median(res["plain"]["wall"]), statistics.median(res["hyperacc"]["wall"])
            pc, tc = statistics.median(res["plain"]["cpu"]), statistics.median(res["hyperacc"]["cpu"])
            print(
                f"   {script:<22}{pw / 1e6:>10.2f}{tw / 1e6:>11.2f}{tw / pw:>8.3f}"
                f"{pc / 1e6:>11.2f}{tc / 1e6:>12.2f}{tc / pc:>8.3f}"
            )
    print(f"\n(done in {time.monotonic() - t0:.0f} s; goal: wall ratio < 1.01. On a shared, oversubscribed machine the")
    print(" CPU columns and p10 are the better estimate of what the tracer costs: preemption only adds wall time)")
    if args.json:
        print(json.dumps({"machine": machine(), "cpu": fixed, "ddp": ddp, "trainers": trainers}))


if __name__ == "__main__":
    sys.exit(main())

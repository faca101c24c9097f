"""Pacing benchmark: 4 gloo DDP ranks under chaos jitter, with and without pacing, several seeds.

Chaos (hyperacc.chaos, seeded): random compute spikes on random ranks (every rank, rate 3 % per step,
exponential, mean 20 ms) and rank 3 persistently 5 % slower. Each seed runs the same job three ways,
interleaved so that machine drift hits them alike:

- ``baseline``: the tracer's in-band exchange, no pacer (what a user runs without pacing);
- ``pacing (defaults)``: ``PacingHook(PacingConfig())``;
- ``pacing (eager)``: thresholds lowered so that pacing acts on sub-millisecond spreads.

Printed per variant: mean, p50 and p99 step time, CV, throughput (samples/s) and its ratio to the
baseline, the share of rank-steps that were delayed and the mean delay.

    .venv/bin/python bench/pacing.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

BATCH = 64
SKIP = 10  # start-up steps left out of the statistics
VARIANTS = ("baseline", "pacing (defaults)", "pacing (eager)")


def chaos_config(seed: int) -> dict:
    return {
        "seed": seed,
        "faults": [
            {"kind": "slowdown", "ranks": [3], "factor": 0.05},
            {"kind": "spike", "ranks": "all", "rate": 0.03, "ms": 20, "dist": "exp"},
        ],
    }


def pacing_config(variant: str):
    from hyperacc.pacing import PacingConfig

    if variant == "pacing (defaults)":
        return PacingConfig()
    if variant == "pacing (eager)":
        return PacingConfig(
            on_spread_ns=200_000, on_spread_frac=0.02, off_spread_ns=100_000, off_spread_frac=0.01
        )
    return None


def rank_job(variant: str, run_dir: str, steps: int, seed: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hyperacc import harness
    from hyperacc.chaos import Chaos
    from hyperacc.pacing.runtime import PacingHook
    from hyperacc.trace import Tracer

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(
        nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tracer = Tracer(run_dir, window=0, probe_every=0, inband=True)
    inband = tracer.attach_ddp(model)
    cfg = pacing_config(variant)
    hook = PacingHook(cfg).attach(inband) if cfg is not None else None
    chaos = Chaos(chaos_config(seed), run_dir=run_dir)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(BATCH, 512, generator=gen)
    y = torch.randint(0, 10, (BATCH,), generator=gen)
    step_ms, delays, on = [], [], []
    t_prev = time.perf_counter()
    for step in range(steps):
        chaos.step_begin(step)
        with tracer.step(step):
            t0 = time.perf_counter_ns()
            loss = nn.functional.cross_entropy(model(x), y)
            # slowdown and spikes burn CPU before backward, so the rank reaches the all-reduce late
            chaos.compute_end(step, compute_ns=3 * (time.perf_counter_ns() - t0))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        t = time.perf_counter()
        step_ms.append((t - t_prev) * 1e3)
        t_prev = t
        if hook is not None:
            delays.append(hook.last_delay_ns if hook.last_step == step else 0)
            on.append(bool(hook.controller.on))
    exchanging = inband.exchanging
    chaos.close()
    tracer.close()
    harness.write_result(
        {"rank": rank, "step_ms": step_ms, "delay_ns": delays, "on": on, "exchanging": exchanging}
    )
    harness.finish()


def spin_job() -> None:
    """Rank 1 waits ~300 ms in an all-reduce for rank 0: how much CPU does waiting burn?"""
    import torch
    import torch.distributed as dist

    from hyperacc import harness

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(600_000)  # about this job's gradient size
    dist.all_reduce(t)
    if rank == 0:
        time.sleep(0.3)
    c0, w0 = time.process_time(), time.perf_counter()
    dist.all_reduce(t)
    harness.write_result({"cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - w0})
    harness.finish()


def early_arrival_cost() -> tuple[float, float]:
    from hyperacc import harness

    job = harness.launch(__file__, ["--spin-job"], nproc=2, timeout=300)
    if not job.ok:
        raise SystemExit(f"spin check failed:\n{job.explain()}")
    waiter = job.results()[1]
    return waiter["wall_s"], waiter["cpu_s"]


def run_variant(variant: str, seed: int, steps: int, work: Path) -> dict:
    from hyperacc import harness

    slug = variant.replace(" ", "-").replace("(", "").replace(")", "")
    run_dir = work / f"{slug}-seed{seed}"
    job = harness.launch(
        __file__, ["--rank-job", variant, "--run-dir", str(run_dir), "--steps", str(steps), "--seed", str(seed)],
        nproc=4, timeout=900, env={"HYPERACC_CHAOS": ""},
    )  # fmt: skip
    if not job.ok:
        raise SystemExit(f"{variant} seed {seed} failed:\n{job.explain()}")
    res = job.results()
    if not all(r["exchanging"] for r in res):
        raise SystemExit(
            f"{variant} seed {seed}: the in-band exchange was not active; the comparison is void"
        )
    step_ms = np.array(res[0]["step_ms"][SKIP:])
    delays = np.array([r["delay_ns"][SKIP:] for r in res], float) if res[0]["delay_ns"] else np.zeros((4, 1))
    on = np.array([r["on"][SKIP:] for r in res], float) if res[0]["on"] else np.zeros((4, 1))
    return {"step_ms": step_ms, "delayed": float((delays > 0).mean()), "delay_ms": float(delays.mean() / 1e6),
            "on": float(on.mean())}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick", action="store_true", help="one seed, 80 steps per run (< 60 s on an idle machine)"
    )
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--json", help="also write the per-variant numbers to this file")
    p.add_argument("--rank-job", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--spin-job", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.spin_job:
        spin_job()
        return
    if args.rank_job:
        rank_job(args.rank_job, args.run_dir, args.steps, args.seed)
        return
    seeds = 1 if args.quick else args.seeds
    steps = 80 if args.quick else args.steps
    work = Path(tempfile.mkdtemp(prefix="hyperacc-pacebench-"))
    print(
        f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    )
    print(
        f"4 ranks (gloo, one host), {steps} steps per run ({SKIP} start-up steps dropped), seeds 0..{seeds - 1}"
    )
    print(f"chaos: {json.dumps(chaos_config(0)['faults'])}")
    wall, cpu = early_arrival_cost()
    print(
        f"early-arrival cost here: a rank waiting {wall * 1e3:.0f} ms in a gloo all-reduce used "
        f"{cpu * 1e3:.1f} ms of CPU ({100 * cpu / wall:.1f} %): "
        + ("waiting does not spin, so this is a pure max model" if cpu < 0.1 * wall else "waiting spins")
    )
    collected: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    t0 = time.monotonic()
    for seed in range(seeds):
        for variant in VARIANTS:
            collected[variant].append(run_variant(variant, seed, steps, work))
    print(f"({time.monotonic() - t0:.0f} s of runs)\n")

    header = f"{'variant':<20} {'mean ms':>8} {'p50 ms':>8} {'p99 ms':>8} {'CV':>6} {'samples/s':>10} {'vs base':>8}"
    print(header + f" {'paced on':>9} {'delayed':>8} {'delay ms':>9}")
    base_thr = None
    summary = {}
    for variant in VARIANTS:
        runs = collected[variant]
        ms = np.concatenate([r["step_ms"] for r in runs])
        mean = float(ms.mean())
        thr = 4 * BATCH / (mean / 1e3)
        per_seed_thr = [4 * BATCH / (r["step_ms"].mean() / 1e3) for r in runs]
        base_thr = base_thr or thr
        row = {
            "mean_ms": mean, "p50_ms": float(np.median(ms)), "p99_ms": float(np.percentile(ms, 99)),
            "cv": float(ms.std() / mean), "samples_per_s": thr, "ratio": thr / base_thr,
            "per_seed_samples_per_s": per_seed_thr,
            "on": float(np.mean([r["on"] for r in runs])), "delayed": float(np.mean([r["delayed"] for r in runs])),
            "delay_ms": float(np.mean([r["delay_ms"] for r in runs])),
        }  # fmt: skip
        summary[variant] = row
        print(
            f"{variant:<20} {row['mean_ms']:8.2f} {row['p50_ms']:8.2f} {row['p99_ms']:8.2f} {row['cv']:6.3f} "
            f"{thr:10.0f} {row['ratio']:7.3f}x {100 * row['on']:8.0f}% {100 * row['delayed']:7.1f}% "
            f"{row['delay_ms']:9.3f}"
        )
    # paired by seed: each variant against the baseline run just before it (machine drift cancels more)
    base_seeds = summary["baseline"]["per_seed_samples_per_s"]
    print("\nper seed, samples/s (ratio to that seed's baseline):")
    for v in VARIANTS:
        cells = [
            f"{t:.0f} ({t / b:.3f}x)"
            for t, b in zip(summary[v]["per_seed_samples_per_s"], base_seeds, strict=True)
        ]
        ratios = [t / b for t, b in zip(summary[v]["per_seed_samples_per_s"], base_seeds, strict=True)]
        summary[v]["paired_ratio_median"] = float(np.median(ratios))
        print(f"  {v:<20} " + ", ".join(cells) + f"   median ratio {np.median(ratios):.3f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()

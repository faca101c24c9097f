"""What hyperacc costs a training rank: memory, start-up and CPU per iteration, measured inside the ranks.

Plain ``torchrun`` and ``hyperacc run --quiet`` run the same job, alternated (plain, traced, plain, ...),
so load drift on a shared machine falls on both arms alike. Inside every rank a measurement shim
(bench/workers/cost_shim/sitecustomize.py, loaded in both arms) records, from torch's global optimizer
step hook:

- per-iteration CPU: process CPU time of all the rank's threads from iteration 50 to the end, divided by
  the iterations (steady state; start-up excluded);
- start-up CPU: process CPU time until the first iteration ended (the difference between arms is
  hyperacc's start-up cost per rank);
- the rank's peak RSS.

From outside, the whole process tree's largest process (that includes ``hyperacc run``'s own process,
the per-node agent) and its total CPU. Each pair gives ratios; the table prints their median and a 95 %
interval of the mean ratio (t-interval over pairs). Jobs: the nanoGPT-shaped loop written here
(bench/workers/nanogpt_loop.py: memmap batches, no DataLoader, gradient accumulation with
``require_backward_grad_sync``, GradScaler, ``clip_grad_norm_``, ``loss.item()`` every 10 iterations)
and examples/train_ddp.py (DataLoader, plain DDP); ``--components`` adds traced arms with one part of
the tracer on at a time over the bare step clock.

    .venv/bin/python bench/rank_cost.py --quick      # a few minutes
    .venv/bin/python bench/rank_cost.py --pairs 12 --components
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _machine import describe as machine

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SHIM = HERE / "workers" / "cost_shim"

BARE = {"signals": False, "probe_every": 0, "window": 0, "resources_every_s": 0, "handle_sigterm": False}
COMPONENTS = {  # one part on over the bare step clock (hooks, ring buffer, flusher)
    "clock+flusher": {},
    "signals": {"signals": True},
    "launch probe": {"probe_every": 100},
    "live windows": {"window": 50},
    "resource sampler": {"resources_every_s": 1.0},
    "SIGTERM handler": {"handle_sigterm": True},
    "in-band exchange": {"inband": True},
}


def job_commands(job: str, iters: int, data: Path) -> list[str]:
    if job == "nanogpt":
        return [str(HERE / "workers" / "nanogpt_loop.py"), "--data", str(data), "--iters", str(iters)]
    return [str(ROOT / "examples" / "train_ddp.py"), "--steps", str(iters), "--workers", "0"]


def run_arm(arm: str, trace: dict | None, job: str, iters: int, nproc: int, data: Path, work: Path,
            src: Path = ROOT / "src", metrics: bool = False) -> dict:  # fmt: skip
    out = Path(tempfile.mkdtemp(dir=work))
    env = dict(os.environ, RANK_COST_OUT=str(out), PYTHONPATH=os.pathsep.join([str(SHIM), str(src)]))
    env.pop("HYPERACC_TRACE", None)
    script = job_commands(job, iters, data)
    if arm == "plain":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *script]
    else:
        cmd = [sys.executable, "-m", "hyperacc", "run", "--quiet", "--run-dir", str(out / "run"),
               "--nproc-per-node", str(nproc)]  # fmt: skip
        if trace is not None:
            cmd += ["--trace", json.dumps(trace)]
        if metrics:  # every rank's Prometheus metrics served while the job runs
            from hyperacc.harness import free_port

            cmd += ["--metrics-port", str(free_port())]
        cmd += ["--", *script]
    proc = subprocess.run([sys.executable, str(HERE / "workers" / "tree_usage.py"), *cmd], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    tree = json.loads(proc.stderr.strip().splitlines()[-1])
    by_rank = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob("rank-*.json")}
    ranks = [by_rank[r] for r in sorted(by_rank)]
    if tree["rc"] != 0 or len(ranks) != nproc or any(r["steps"] <= 0 for r in ranks):
        raise SystemExit(f"{arm} run of {job} failed (exit {tree['rc']}): {proc.stderr[-2000:]}")
    return {
        "iter_cpu_ms": statistics.fmean(r["steady_cpu_s"] / r["steps"] for r in ranks) * 1e3,
        "startup_cpu_s": statistics.fmean(r["startup_cpu_s"] for r in ranks),
        "rank_rss_mib": max(r["maxrss_mib"] for r in ranks),
        # without a node agent rank 0 gathers the live windows; under hyperacc run it is a rank like the others
        "other_rss_mib": max(r["maxrss_mib"] for k, r in by_rank.items() if k != 0 or len(by_rank) == 1),
        "tree_rss_mib": tree["maxrss_mib"],
        "tree_cpu_s": tree["cpu_s"],
        "launcher_rss_mib": tree["own_rss_mib"],  # torchrun's launcher, or hyperacc run (the node agent)
        "launcher_cpu_s": tree["own_cpu_s"],
    }


def interval(ratios: list[float]) -> tuple[float, float]:
    """95 % t-interval of the mean ratio over pairs."""
    if len(ratios) < 2:
        return (math.nan, math.nan)
    t = {2: 12.71, 3: 4.30, 4: 3.18, 5: 2.78, 6: 2.57, 7: 2.45, 8: 2.36, 9: 2.31, 10: 2.26}.get(len(ratios), 2.1)
    half = t * statistics.stdev(ratios) / math.sqrt(len(ratios))
    mean = statistics.fmean(ratios)
    return (mean - half, mean + half)


def compare(job: str, arms: dict[str, dict | None], pairs: int, iters: int, nproc: int, data: Path,
            work: Path, sources: dict[str, Path] | None = None, metrics: bool = False) -> None:  # fmt: skip
    """``sources``: arms that run hyperacc from another source tree (a "before" worktree)."""
    sources = sources or {}
    results: dict[str, list[dict]] = {name: [] for name in ("plain", *arms)}
    for _ in range(pairs):
        results["plain"].append(run_arm("plain", None, job, iters, nproc, data, work))
        for name, trace in arms.items():
            results[name].append(run_arm(name, trace, job, iters, nproc, data, work, sources.get(name, ROOT / "src"),
                                         metrics))  # fmt: skip
    plain = results["plain"]
    print(f"\n{job}, {nproc} ranks, {iters} iterations, {pairs} alternated pairs")
    print(f"{'arm':<18} {'iter CPU ms':>11} {'ratio (95% interval)':>26} {'start-up CPU s':>15} "
          f"{'largest rank MiB':>17} {'ranks but 0 MiB':>16} {'largest process MiB':>20} {'launcher MiB':>13} "
          f"{'launcher CPU s':>15}")  # fmt: skip
    base = {k: statistics.median(r[k] for r in plain) for k in plain[0]}
    print(f"{'plain torchrun':<18} {base['iter_cpu_ms']:>11.2f} {'1':>26} {base['startup_cpu_s']:>15.2f} "
          f"{base['rank_rss_mib']:>17.0f} {base['other_rss_mib']:>16.0f} {base['tree_rss_mib']:>20.0f} "
          f"{base['launcher_rss_mib']:>13.0f} {base['launcher_cpu_s']:>15.2f}")  # fmt: skip
    for name in arms:
        rows = results[name]
        ratios = [r["iter_cpu_ms"] / p["iter_cpu_ms"] for r, p in zip(rows, plain, strict=True)]
        lo, hi = interval(ratios)
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        d_start = statistics.median(r["startup_cpu_s"] - p["startup_cpu_s"] for r, p in zip(rows, plain, strict=True))
        d_rank = med["rank_rss_mib"] - base["rank_rss_mib"]
        d_tree = med["tree_rss_mib"] - base["tree_rss_mib"]
        d_other = med["other_rss_mib"] - base["other_rss_mib"]
        text = f"{statistics.median(ratios):.3f} ({lo:.3f}..{hi:.3f})"
        print(f"{name:<18} {med['iter_cpu_ms']:>11.2f} {text:>26} {d_start:>+15.2f} {d_rank:>+17.0f} {d_other:>+16.0f} "
              f"{d_tree:>+20.0f} {med['launcher_rss_mib']:>13.0f} {med['launcher_cpu_s']:>15.2f}")  # fmt: skip
    print("ratio: per-iteration CPU inside the ranks, traced / plain of the same pair (median, and the 95 % "
          "interval of the mean); start-up and memory columns of traced arms: difference from plain; launcher: "
          "the launched command's own process, peak RSS and CPU time (torchrun's launcher in the plain arm, "
          "hyperacc run, the node agent, in the traced ones; torchrun is its child)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 pairs, the nanoGPT-shaped loop, default tracing only")
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--iters", type=int, default=400)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--components", action="store_true", help="also each part of the tracer on alone")
    p.add_argument("--job", choices=("both", "nanogpt", "train_ddp"), default="both",
                   help="which job to run (--quick runs the nanoGPT-shaped loop only)")
    p.add_argument("--before", type=Path, default=None,
                   help="a source tree (e.g. a git worktree of an earlier commit): one more arm runs hyperacc "
                        "from its src/, alternated with the others, for a before/after in one run")
    p.add_argument("--metrics", action="store_true",
                   help="the traced arms serve every rank's Prometheus metrics (hyperacc run --metrics-port)")
    args = p.parse_args()
    pairs, iters = (3, 200) if args.quick else (args.pairs, args.iters)
    print(f"machine: {machine()}")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = work / "tokens.bin"
        np.random.default_rng(0).integers(0, 512, 2_000_000, dtype=np.uint16).tofile(data)
        arms: dict[str, dict | None] = {"hyperacc run": None}
        sources: dict[str, Path] = {}
        if args.before is not None:
            arms["before"] = None
            sources["before"] = args.before.resolve() / "src"
        if args.components and not args.quick:
            arms |= {name: BARE | extra for name, extra in COMPONENTS.items()}
        jobs = ("nanogpt",) if args.quick and args.job == "both" else ("nanogpt", "train_ddp") if args.job == "both" else (args.job,)
        for job in jobs:
            compare(job, arms, pairs, iters, args.nproc, data, work, sources, args.metrics)
    print(f"\nbench/rank_cost.py took {time.monotonic() - t0:.0f} s; load average now "
          f"{', '.join(f'{v:.1f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()

"""On-demand distributed sampler vs torch's DistributedSampler: first index, throughput, peak RSS.

Each measurement runs in a fresh interpreter so its peak RSS is its own. Both samplers are rank 0 of
8 replicas with shuffling (DistributedSampler still builds the full permutation on every rank).

    .venv/bin/python bench/sampler.py           # N = 1e6, 1e7, 1e8 (+ 1e9 for the on-demand sampler)
    .venv/bin/python bench/sampler.py --quick   # N = 1e6, 1e7 (< 60 s)

A second table times the start of an epoch for small datasets: the exact shuffle
(``ExactPermutation``, used up to ``exact_max`` indices), DistributedSampler's ``torch.randperm`` and
the Feistel network, each the median of 7 builds in this process.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from _machine import describe as machine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

REPLICAS = 8


def measure(kind: str, n: int, count: int) -> dict:
    """Runs inside the child: build the sampler, time the first index and ``count`` indices."""
    # Imports happen before the clock starts, as in a training script.
    from torch.utils.data import DistributedSampler

    from hyperacc.data.sampler import OnDemandDistributedSampler

    t0 = time.perf_counter()
    if kind == "torch":
        sampler = DistributedSampler(range(n), num_replicas=REPLICAS, rank=0, shuffle=True, seed=0)
    else:
        sampler = OnDemandDistributedSampler(n, num_replicas=REPLICAS, rank=0, shuffle=True, seed=0)
    it = iter(sampler)
    next(it)
    first = time.perf_counter() - t0
    count = min(count, len(sampler) - 1)
    t1 = time.perf_counter()
    for _ in range(count):
        next(it)
    rate = count / (time.perf_counter() - t1) if count else float("nan")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux
    return {"first_s": first, "rate": rate, "count": count, "rss_mb": rss}


def run_child(kind: str, n: int, count: int) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, str(n), str(count)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        return {
            "error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"rc={out.returncode}"
        }
    return json.loads(out.stdout.strip().splitlines()[-1])


def baseline_rss() -> float:
    """Peak RSS of an interpreter that only imported torch (subtracted from nothing; for reference)."""
    cmd = [
        sys.executable,
        "-c",
        "import resource, torch; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)",
    ]
    return float(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip())


def fmt_s(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def epoch_start_table() -> None:
    """Time to the first index of an epoch for small N: exact shuffle vs randperm vs Feistel."""
    import statistics

    import torch

    from hyperacc.data.sampler import EXACT_MAX, ExactPermutation, OnDemandDistributedSampler

    print(f"epoch start for small datasets (the exact shuffle is used up to exact_max = {EXACT_MAX:,}):")
    print(f"{'N':>9} {'exact shuffle':>14} {'randperm':>10} {'Feistel':>10} {'exact memory':>13}")
    for n in (1_000, 16_384, 65_536, 262_144, 1_048_576):
        def timed(fn) -> float:
            times = []
            for rep in range(7):
                t0 = time.perf_counter()
                fn(rep)
                times.append(time.perf_counter() - t0)
            return statistics.median(times)

        exact = timed(lambda rep, n=n: ExactPermutation(n, rep)(0))
        randperm = timed(
            lambda rep, n=n: torch.randperm(n, generator=torch.Generator().manual_seed(rep)).tolist()[0]
        )
        feistel = timed(lambda rep, n=n: next(iter(OnDemandDistributedSampler(n, 1, 0, seed=rep, exact_max=0))))
        mem = ExactPermutation(n, 0)._perm.nbytes * 2  # the order and, once position_of is used, its inverse
        print(f"{n:>9,} {fmt_s(exact):>14} {fmt_s(randperm):>10} {fmt_s(feistel):>10} {mem / 2**10:>10.0f} KiB")
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N = 1e6 and 1e7 only (< 60 s)")
    ap.add_argument("--count", type=int, default=2_000_000, help="indices timed for throughput")
    ap.add_argument("--child", nargs=3, metavar=("KIND", "N", "COUNT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, n, count = args.child
        print(json.dumps(measure(kind, int(n), int(count))))
        return

    sizes = [10**6, 10**7] if args.quick else [10**6, 10**7, 10**8, 10**9]
    count = min(args.count, 500_000) if args.quick else args.count
    print(f"machine: {machine()}")
    epoch_start_table()
    print(f"rank 0 of {REPLICAS}, shuffle=True; throughput over the first {count:,} indices of the rank")
    print(f"peak RSS of a bare 'import torch' interpreter: {baseline_rss():.0f} MiB")
    print()
    cols = [
        ("N", 5),
        ("first: torch", 12),
        ("ondemand", 10),
        ("ratio", 7),
        ("idx/s: torch", 13),
        ("ondemand", 11),
        ("ratio", 6),
        ("RSS MiB: torch", 14),
        ("ondemand", 9),
        ("ratio", 6),
    ]
    header = " ".join(f"{name:>{width}}" for name, width in cols)
    print(header)
    print("-" * len(header))
    for n in sizes:
        ours = run_child("ondemand", n, count)
        ref = run_child("torch", n, count) if n <= 10**8 else {"skipped": "1e9 needs ~50 GB"}
        label = f"1e{len(str(n)) - 1}"
        if "error" in ours:
            print(f"{label:>5} on-demand sampler failed: {ours['error']}")
            continue
        if "first_s" in ref:
            cells = [
                label,
                fmt_s(ref["first_s"]),
                fmt_s(ours["first_s"]),
                f"{ref['first_s'] / ours['first_s']:.0f}x",
                f"{ref['rate']:,.0f}",
                f"{ours['rate']:,.0f}",
                f"{ours['rate'] / ref['rate']:.2f}x",
                f"{ref['rss_mb']:.0f}",
                f"{ours['rss_mb']:.0f}",
                f"{ref['rss_mb'] / ours['rss_mb']:.1f}x",
            ]
            note = ""
        else:
            cells = [label, "-", fmt_s(ours["first_s"]), "", "-", f"{ours['rate']:,.0f}", "", "-"]
            cells += [f"{ours['rss_mb']:.0f}", ""]
            note = f"  (DistributedSampler: {ref.get('error', ref.get('skipped'))})"
        print(" ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, cols, strict=True)) + note)
    print()
    print("ratios: first index and RSS = torch / ondemand (higher is better for ondemand);")
    print("        indices/s = ondemand / torch (below 1 means the on-demand sampler iterates slower).")


if __name__ == "__main__":
    main()

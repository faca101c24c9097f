"""`hyperacc watch` of a long job: what its first look costs, starting from the newest records against
reading the whole run first (what it did before ``SegmentCursor.start_at_tail``).

A run directory as the node agent leaves it after a day: every rank's steps and resource samples in one
compacted file per hour (``seg-lo-hi.parquet``, the compactor's names and row groups), at 1 step and 1
sample a second. Each arm runs in its own interpreter (so its peak memory is its own): a
``RunFollower`` makes its first ``poll`` and one ``snapshot``; printed are the wall time, the CPU time,
the peak RSS, and whether both arms' snapshots agree.

    .venv/bin/python bench/watch_scale.py            # 256 ranks x 24 hours
    .venv/bin/python bench/watch_scale.py --quick    # 64 ranks x 12 hours
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from _machine import describe as machine  # noqa: E402

from hyperacc import records, store  # noqa: E402
from hyperacc.schema import RESOURCE_SCHEMA, STEP_SCHEMA, RankMeta  # noqa: E402

HOUR = 3600


def write_run(root: Path, ranks: int, hours: int) -> None:
    """``ranks`` x ``hours`` compacted files of steps and of resource samples, one row a second."""
    rng = np.random.default_rng(0)
    for rank in range(ranks):
        records.write_meta(root, RankMeta(rank, rank % 8, rank // 8, ranks, 8, f"node{rank // 8}", 1000 + rank))
        for h in range(hours):
            step = np.arange(h * HOUR, (h + 1) * HOUR, dtype=np.int64)
            t = 1_700_000_000 * 10**9 + step * 10**9
            self_ns = rng.lognormal(np.log(80e6), 0.05, HOUR).astype(np.int64)
            wait = rng.lognormal(np.log(15e6), 0.3, HOUR).astype(np.int64)
            steps = pa.table({"rank": pa.array(np.full(HOUR, rank), pa.int32()), "node": pa.array(np.full(HOUR, rank // 8), pa.int32()),
                              "step": step, "t_start_ns": t, "step_ns": self_ns + wait, "self_ns": self_ns,
                              "comm_wait_ns": wait, "cpu_ns": (self_ns * 0.9).astype(np.int64)})  # fmt: skip
            samples = pa.table({"rank": pa.array(np.full(HOUR, rank), pa.int32()),
                                "node": pa.array(np.full(HOUR, rank // 8), pa.int32()), "t_ns": t,
                                "rss_bytes": 2_000_000_000 + rng.integers(0, 10**6, HOUR)})  # fmt: skip
            name = f"seg-{h * 720 + 1:06d}-{(h + 1) * 720:06d}.parquet"  # 720 flushes of 5 s an hour
            for kind, table, schema in (("steps", steps, STEP_SCHEMA), ("resources", samples, RESOURCE_SCHEMA)):
                folder = root / kind / f"rank-{rank:05d}"
                folder.mkdir(parents=True, exist_ok=True)
                pq.write_table(store.conform(table, schema), folder / name, row_group_size=1 << 20,
                               **store.parquet_options(schema))  # fmt: skip


def arm(run: str, whole: bool) -> dict:
    """One arm, in this interpreter: the first poll and a snapshot."""
    from hyperacc.present.live_view import RunFollower

    if whole:  # before: every cursor read its rank's whole history first
        store.SegmentCursor.start_at_tail = lambda self, rows: None  # type: ignore[method-assign]
    w, c = time.perf_counter(), time.process_time()
    follower = RunFollower([run], keep=200)
    follower.poll()
    snap = follower.snapshot(window=50)
    return {"wall_s": time.perf_counter() - w, "cpu_s": time.process_time() - c,
            "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "snapshot": None if snap is None else [snap.step, snap.ranks, round(snap.p50_ms, 6), round(snap.p99_ms, 6)]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 ranks x 12 hours")
    ap.add_argument("--ranks", type=int)
    ap.add_argument("--hours", type=int)
    ap.add_argument("--arm", choices=("tail", "whole"), help=argparse.SUPPRESS)
    ap.add_argument("run", nargs="?", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.arm:
        print(json.dumps(arm(args.run, args.arm == "whole")))
        return
    ranks = args.ranks or (64 if args.quick else 256)
    hours = args.hours or (12 if args.quick else 24)
    print(f"# hyperacc watch, first look: {machine()}")
    with tempfile.TemporaryDirectory(prefix="hyperacc-watch-") as tmp:
        t = time.perf_counter()
        write_run(Path(tmp), ranks, hours)
        size = sum(p.stat().st_size for p in Path(tmp).rglob("*.parquet"))
        print(f"# {ranks} ranks x {hours} hours, 1 step and 1 sample a second, one file per rank-hour and kind: "
              f"{2 * ranks * hours:,} files, {size / 2**20:.0f} MiB, written in {time.perf_counter() - t:.0f} s")  # fmt: skip
        out = {}
        for name in ("whole", "tail"):
            proc = subprocess.run([sys.executable, __file__, "--arm", name, tmp], capture_output=True, text=True, check=True)
            out[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    print("| first look | wall | CPU | peak RSS | snapshot (step, ranks, p50 ms, p99 ms) |")
    print("|---|---|---|---|---|")
    for name, label in (("whole", "reading the whole run first (before)"), ("tail", "from the newest records (now)")):
        r = out[name]
        print(f"| {label} | {r['wall_s']:.2f} s | {r['cpu_s']:.2f} s | {r['peak_mb']:.0f} MB | {r['snapshot']} |")
    a, b = out["tail"], out["whole"]
    print(f"# now / before: wall {a['wall_s'] / b['wall_s']:.3f}, CPU {a['cpu_s'] / b['cpu_s']:.3f}, peak RSS "
          f"{a['peak_mb'] / b['peak_mb']:.2f}; same snapshot: {a['snapshot'] == b['snapshot']}")  # fmt: skip


if __name__ == "__main__":
    main()

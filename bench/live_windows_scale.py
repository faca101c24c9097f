"""Rank 0's gathered window summaries (RUN_DIR/live/windows) at 1,024 ranks for one hour: what they take on
disk and what their compaction costs rank 0, against leaving one file per write.

One write every 5 s holds one window of every rank (random values in every column, which compress worse
than real ones); every ``compact_every`` (32) writes the aggregation thread rolls them into the open
period's file, as ``WindowAggregator`` does, and once more at the end.

    .venv/bin/python bench/live_windows_scale.py            # 1,024 ranks, one hour of 5 s windows
    .venv/bin/python bench/live_windows_scale.py --quick    # 256 ranks, 10 minutes
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
from _machine import describe as machine

from hyperacc import store
from hyperacc.analysis.windows import EXTRA_WINDOW_COLUMNS
from hyperacc.schema import WINDOW_SCHEMA


def window_table(rng: np.random.Generator, ranks: int, window: int) -> pa.Table:
    cols = {}
    for f in WINDOW_SCHEMA:
        if f.name == "rank":
            cols[f.name] = pa.array(np.arange(ranks), f.type)
        elif f.name == "window":
            cols[f.name] = pa.array(np.full(ranks, window), f.type)
        elif pa.types.is_integer(f.type):
            cols[f.name] = pa.array(rng.integers(0, 10**9, ranks), f.type)
        else:
            cols[f.name] = pa.array(rng.random(ranks) * 1e7, f.type)
    return pa.table(cols | {n: pa.array(rng.random(ranks)) for n in EXTRA_WINDOW_COLUMNS})


def run(root: Path, ranks: int, writes: int, every: int) -> tuple[int, int, float, float]:
    """(files, bytes, compaction CPU s, longest compaction s); ``every`` 0: no compaction."""
    (root / "meta").mkdir(parents=True)
    writer = store.live_windows_writer(root)
    rng = np.random.default_rng(0)
    cpu = worst = 0.0
    for k in range(writes):
        writer.write(window_table(rng, ranks, k))
        final = k == writes - 1
        if every and ((k + 1) % every == 0 or final):
            t = time.process_time()
            store.compact(writer.directory, None, every=1 if final else every)
            took = time.process_time() - t
            cpu, worst = cpu + took, max(worst, took)
    files = list(writer.directory.iterdir())
    return len(files), sum(p.stat().st_size for p in files), cpu, worst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="256 ranks, 10 minutes of windows")
    p.add_argument("--every-s", type=float, default=5.0, help="seconds between writes")
    args = p.parse_args()
    ranks, minutes = (256, 10) if args.quick else (1024, 60)
    writes = int(minutes * 60 / args.every_s)
    print(f"machine: {machine()}")
    print(f"{ranks} ranks, a write every {args.every_s:g} s for {minutes} min ({writes} writes)")
    print(f"{'':<22} {'files':>6} {'MiB':>8} {'B per rank-window':>18} {'compaction CPU':>15} {'% of a core':>12} {'longest':>8}")
    rows = {}
    for name, every in (("one file per write", 0), ("compacted (default)", 32)):
        with tempfile.TemporaryDirectory() as tmp:
            rows[name] = n, size, cpu, worst = run(Path(tmp), ranks, writes, every)
        print(f"{name:<22} {n:>6} {size / 2**20:>8.1f} {size / (ranks * writes):>18.0f} {cpu:>13.1f} s "
              f"{cpu / (minutes * 60) * 100:>11.2f} % {worst:>6.2f} s")  # fmt: skip
    (n0, b0, _, _), (n1, b1, _, _) = rows.values()
    print(f"compacted / one file per write: files {n1 / n0:.4f}, bytes {b1 / b0:.2f}")


if __name__ == "__main__":
    main()

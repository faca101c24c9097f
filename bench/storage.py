"""LMDB random-read latency: cold vs warm page cache, readahead on/off, with/without sampler-aware prefetch.

Every case reads the same samples in on-demand sampler order, one process, with ``--compute-ms`` of
idle time per sample standing in for the device step (the CPU is free while the GPU computes). Cold
cases evict the database file from the page cache first (fsync + posix_fadvise(DONTNEED)); the
fraction of the file still resident right after eviction is printed so a failed eviction shows.
The baseline is what a user gets by default: py-lmdb with readahead on and no prefetch.

    .venv/bin/python bench/storage.py           # 400 MB database, 1500 reads per case
    .venv/bin/python bench/storage.py --quick   # 60 MB database, 600 reads per case (< 60 s)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _machine import describe as machine

from hyperacc.data.lmdb_dataset import build_lmdb, evict_from_page_cache, resident_fraction  # noqa: E402
from hyperacc.data.pipeline import read_latencies  # noqa: E402

# (label, cold, readahead, prefetch)
CASES = [
    ("cold, readahead on, no prefetch (default)", True, True, False),
    ("cold, readahead off, no prefetch", True, False, False),
    ("cold, readahead on, prefetch", True, True, True),
    ("cold, readahead off, prefetch", True, False, True),
    ("warm, readahead off, no prefetch", False, False, False),
    ("warm, readahead off, prefetch", False, False, True),
]


def warm_up(db: Path) -> None:
    with open(db / "data.mdb", "rb") as fh:
        while fh.read(1 << 24):
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sample-bytes", type=int, default=100_000)
    ap.add_argument("--compute-ms", type=float, default=2.0)
    ap.add_argument("--lookahead", type=int, default=16)
    ap.add_argument("--workdir", default=None, help="where to build the database (default: a temp dir)")
    args = ap.parse_args()
    samples = 600 if args.quick else 4000
    reads = 600 if args.quick else 1500

    print(f"machine: {machine()}")
    with tempfile.TemporaryDirectory(prefix="hyperacc-storage-", dir=args.workdir) as tmp:
        db = Path(tmp) / "bench.lmdb"
        t0 = time.perf_counter()
        data = np.random.default_rng(0).integers(0, 256, (samples, args.sample_bytes), dtype=np.uint8)
        build_lmdb(db, data)
        del data
        size_mb = (db / "data.mdb").stat().st_size / 1e6
        print(
            f"database: {samples} samples x {args.sample_bytes / 1e3:.0f} kB = {size_mb:.0f} MB "
            f"(built in {time.perf_counter() - t0:.1f} s); {reads} random reads per case in sampler order; "
            f"compute {args.compute_ms} ms per sample; prefetch lookahead {args.lookahead}"
        )
        print()
        rows = []
        for label, cold, readahead, prefetch in CASES:
            if cold:
                evict_from_page_cache(db)
                resident = resident_fraction(db)
            else:
                warm_up(db)
                resident = resident_fraction(db)
            ms = read_latencies(
                db,
                prefetch=prefetch,
                readahead=readahead,
                compute_ms=args.compute_ms,
                lookahead=args.lookahead,
                limit=reads,
            )
            rows.append((label, resident, np.percentile(ms, 50), np.percentile(ms, 99), ms.max(), ms.mean()))

    base_p99, base_p50 = rows[0][3], rows[0][2]
    header = (
        f"{'case':<44} {'resident':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'mean ms':>8} "
        f"{'p50 vs base':>11} {'p99 vs base':>11}"
    )
    print(header)
    print("-" * len(header))
    for label, resident, p50, p99, mx, mean in rows:
        print(
            f"{label:<44} {resident:>8.2f} {p50:>8.3f} {p99:>8.3f} {mx:>8.2f} {mean:>8.3f} "
            f"{base_p50 / p50:>10.1f}x {base_p99 / p99:>10.1f}x"
        )
    print()
    print(
        "resident = fraction of the file in the page cache when the case started (cold cases: after eviction)."
    )
    print("'vs base' = baseline / case, baseline = first row (py-lmdb default); higher is better.")


if __name__ == "__main__":
    main()

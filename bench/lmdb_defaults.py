"""Which LMDB read settings to default to: readahead on/off x sampler-aware prefetch on/off, cold reads.

Every case reads the same samples in on-demand sampler order, one process, with ``--compute-ms`` of idle
time per sample standing in for the device step. Before every pass the database file is evicted from
the page cache (fsync + posix_fadvise(DONTNEED); the fraction still resident is printed). Cases take
turns pass by pass (the order rotates), ``--passes`` passes each, so load on the machine falls on all
of them. Two databases: one whose reads touch most of the file (``--samples`` of which ``--reads`` are
read) and one five times larger, where the same number of reads is sparse. The baseline is py-lmdb's
own default: readahead on, no prefetch. Wrap the run in ``flock /tmp/hyperacc-timing.lock``.

    .venv/bin/python bench/lmdb_defaults.py           # 205 MB and 1 GB, 1500 reads, 6 passes
    .venv/bin/python bench/lmdb_defaults.py --quick   # 60 MB and 300 MB, 400 reads, 3 passes
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _machine import describe as machine  # noqa: E402

from hyperacc.data.lmdb_dataset import build_lmdb, evict_from_page_cache, resident_fraction  # noqa: E402
from hyperacc.data.pipeline import read_latencies  # noqa: E402

# (label, readahead, prefetch)
CASES = [
    ("readahead on, no prefetch (py-lmdb default)", True, False),
    ("readahead off, no prefetch", False, False),
    ("readahead on, prefetch", True, True),
    ("readahead off, prefetch", False, True),
]


def build(path: Path, samples: int, sample_bytes: int) -> float:
    rng = np.random.default_rng(0)
    chunk = 1000
    arrays = (rng.integers(0, 256, sample_bytes, dtype=np.uint8).tobytes() for _ in range(samples))
    del chunk
    build_lmdb(path, arrays)
    return (path / "data.mdb").stat().st_size / 1e6


def run(db: Path, reads: int, passes: int, compute_ms: float, lookahead: int) -> dict[str, dict]:
    out: dict[str, dict] = {label: {"p50": [], "p99": [], "mean": [], "max": []} for label, *_ in CASES}
    resident = []
    for p in range(passes):
        order = CASES[p % len(CASES):] + CASES[: p % len(CASES)]
        for label, readahead, prefetch in order:
            evict_from_page_cache(db)
            resident.append(resident_fraction(db))
            ms = read_latencies(db, prefetch=prefetch, readahead=readahead, compute_ms=compute_ms,
                                lookahead=lookahead, seed=p, limit=reads)  # fmt: skip
            out[label]["p50"].append(float(np.percentile(ms, 50)))
            out[label]["p99"].append(float(np.percentile(ms, 99)))
            out[label]["mean"].append(float(ms.mean()))
            out[label]["max"].append(float(ms.max()))
    out["_resident"] = {"max": max(resident)}
    return out


def report(title: str, res: dict[str, dict]) -> None:
    print(title)
    header = f"{'case':<44} {'p50 ms':>8} {'p99 ms median [range]':>24} {'mean ms':>8} {'p99 vs default':>14}"
    print(header)
    print("-" * len(header))
    base = statistics.median(res[CASES[0][0]]["p99"])
    for label, *_ in CASES:
        r = res[label]
        p99 = statistics.median(r["p99"])
        cell = f"{p99:.2f} [{min(r['p99']):.2f}-{max(r['p99']):.2f}]"
        print(f"{label:<44} {statistics.median(r['p50']):>8.3f} {cell:>24} {statistics.median(r['mean']):>8.3f} "
              f"{base / p99:>13.1f}x")  # fmt: skip
    print(f"(largest fraction of the file still cached right after an eviction: {res['_resident']['max']:.2f})")
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sample-bytes", type=int, default=100_000)
    ap.add_argument("--samples", type=int, default=None, help="samples of the small database")
    ap.add_argument("--reads", type=int, default=None)
    ap.add_argument("--passes", type=int, default=None)
    ap.add_argument("--compute-ms", type=float, default=2.0)
    ap.add_argument("--lookahead", type=int, default=16)
    ap.add_argument("--workdir", default=None, help="where to build the databases (default: a temp dir)")
    args = ap.parse_args()
    samples = args.samples or (600 if args.quick else 2048)
    reads = args.reads or (400 if args.quick else 1500)
    passes = args.passes or (3 if args.quick else 6)
    print(f"machine: {machine()}")
    print(f"{reads} reads per pass in sampler order, {args.compute_ms:g} ms compute per sample, prefetch lookahead "
          f"{args.lookahead}, {passes} passes per case, page cache evicted before every pass")  # fmt: skip
    print()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hyperacc-lmdb-", dir=args.workdir) as tmp:
        for n in (samples, 5 * samples):
            db = Path(tmp) / f"db-{n}.lmdb"
            size = build(db, n, args.sample_bytes)
            res = run(db, min(reads, n), passes, args.compute_ms, args.lookahead)
            report(f"database: {n} samples x {args.sample_bytes / 1e3:.0f} kB = {size:.0f} MB; "
                   f"{min(reads, n) / n:.0%} of the samples read per pass", res)  # fmt: skip
            evict_from_page_cache(db)
    print("'vs default' = p99 of py-lmdb's default / p99 of the case (medians over passes); higher is better.")
    print(f"{machine()}\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()

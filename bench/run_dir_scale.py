"""Files and bytes a rank leaves on disk per hour, with the flusher's compaction (docs/tracing.md,
"Storage"), and the arithmetic for 1,024 ranks x 7 days.

One rank's hour is replayed through the tracer's own writers (``hyperacc.records.RecordWriter``: the
plain int64 record segments a rank flushes, rolled into Parquet by ``store.compact`` as the node agent
does): step records (a synthetic run's,
``hyperacc.analysis.synthetic``: full-precision lognormal phase times, the hardest case for
compression) in a segment every ``--flush-s`` seconds at ``--steps-per-s``, and resource samples at
1 Hz, each kind compacted every ``--every`` segments as the flusher does (``store.compact``) and once
more at the end (``close``). Printed: files alive at most and at the end, bytes per rank-step with and
without compaction, the time of one compaction (mean, max), and the totals for 1,024 ranks x 7 days.

    .venv/bin/python bench/run_dir_scale.py            # an hour at 10 steps/s, a segment every 5 s
    .venv/bin/python bench/run_dir_scale.py --quick    # a quarter of an hour (< 30 s)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
from _machine import describe as machine  # noqa: E402

from hyperacc import records, store  # noqa: E402
from hyperacc.analysis.synthetic import SyntheticRun, last_arrival, write_rank  # noqa: E402
from hyperacc.schema import RESOURCE_SCHEMA, STEP_SCHEMA  # noqa: E402


def _resources(seconds: int, steps_per_s: float) -> pa.Table:
    rng = np.random.default_rng(3)
    t = 1_700_000_000 * 10**9 + np.arange(seconds, dtype=np.int64) * 10**9 + rng.integers(0, 10**6, seconds)
    rss = 2_000_000_000 + np.cumsum(rng.integers(-4096, 8192, seconds)) * 4096
    cpu = np.cumsum(rng.integers(900_000_000, 1_000_000_000, seconds))
    return pa.table({"rank": pa.array(np.zeros(seconds, np.int32)), "node": pa.array(np.zeros(seconds, np.int32)),
                     "t_ns": t, "step": (np.arange(seconds) * steps_per_s).astype(np.int64), "rss_bytes": rss,
                     "cpu_ns": cpu, "cuda_allocated_bytes": pa.nulls(seconds, pa.int64()),
                     "cuda_reserved_bytes": pa.nulls(seconds, pa.int64()),
                     "cuda_peak_bytes": pa.nulls(seconds, pa.int64())}, schema=RESOURCE_SCHEMA)  # fmt: skip


def _int64_rows(table: pa.Table, schema_name: str) -> np.ndarray:
    """A table as the int64 rows a rank flushes (-1: not measured, booleans 0/1)."""
    cols = []
    for name in records.columns_of(schema_name):
        col = table.column(name)
        if pa.types.is_boolean(col.type):
            col = pc.cast(col, pa.int64())
        cols.append(pc.fill_null(pc.cast(col, pa.int64()), -1).to_numpy())
    return np.stack(cols, axis=1)


def _replay(directory: Path, schema: pa.Schema, table: pa.Table, rows: int, every: int) -> dict[str, float]:
    name = "STEP_SCHEMA" if schema.equals(STEP_SCHEMA) else "RESOURCE_SCHEMA"
    writer = records.RecordWriter(directory, name)
    matrix = _int64_rows(table, name)
    alive = uncompacted = 0
    times = []
    for lo in range(0, table.num_rows, rows):
        seg = writer.write_int64(matrix[lo : lo + rows])
        uncompacted += seg.stat().st_size if seg is not None else 0
        alive = max(alive, len(list(directory.iterdir())))
        t0 = time.perf_counter()
        if store.compact(directory, schema, every=every) is not None:
            times.append(time.perf_counter() - t0)
    store.compact(directory, schema, every=1, final=True)
    files = list(directory.iterdir())
    return {"segments": writer.written, "alive_max": alive, "files_end": len(files),
            "bytes": sum(p.stat().st_size for p in files), "uncompacted": uncompacted, "rows": table.num_rows,
            "compact_mean_ms": 1e3 * float(np.mean(times)) if times else 0.0,
            "compact_max_ms": 1e3 * max(times, default=0.0)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps-per-s", type=float, default=10.0)
    ap.add_argument("--flush-s", type=float, default=5.0)
    ap.add_argument("--every", type=int, default=32)
    args = ap.parse_args()
    seconds = 900 if args.quick else 3600
    steps = int(seconds * args.steps_per_s)
    print(f"machine: {machine()}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        spec = SyntheticRun(ranks=1, ranks_per_node=1, steps=steps, seed=1, segment_steps=steps)
        write_rank(root / "source", spec, 0, last_arrival(spec))
        steps_table = store.read_steps(root / "source")
        per_flush = max(1, int(args.steps_per_s * args.flush_s))
        s = _replay(root / "steps", STEP_SCHEMA, steps_table, per_flush, args.every)
        r = _replay(root / "resources", RESOURCE_SCHEMA, _resources(seconds, args.steps_per_s),
                    max(1, int(args.flush_s)), args.every)  # fmt: skip
    hours = seconds / 3600
    print(f"one rank, {seconds / 60:.0f} min at {args.steps_per_s:g} steps/s, a segment every {args.flush_s:g} s, "
          f"compaction every {args.every} segments")  # fmt: skip
    print(f"{'kind':<10} {'segments':>8} {'alive max':>9} {'files end':>9} {'B/row':>7} {'B/row uncompacted':>17} "
          f"{'compact ms mean/max':>20}")  # fmt: skip
    for name, d in (("steps", s), ("resources", r)):
        print(f"{name:<10} {d['segments']:>8} {d['alive_max']:>9} {d['files_end']:>9} {d['bytes'] / d['rows']:>7.1f} "
              f"{d['uncompacted'] / d['rows']:>17.1f} {d['compact_mean_ms']:>9.1f} / {d['compact_max_ms']:<8.1f}")  # fmt: skip
    per_step = (s["bytes"] + r["bytes"]) / s["rows"]
    per_step_before = (s["uncompacted"] + r["uncompacted"]) / s["rows"]
    # a period closes after an hour and 100,000 rows (the defaults), whichever is longer
    files_hour = sum(1 / max(1.0, 100_000 / (d["rows"] / hours)) for d in (s, r))
    rank_steps = 1024 * 7 * 24 * 3600 * args.steps_per_s
    print(f"bytes per rank-step (steps + resources): {per_step:.1f} compacted, {per_step_before:.1f} as flushed")
    print(f"1,024 ranks x 7 days at {args.steps_per_s:g} steps/s = {rank_steps:.3g} rank-steps: "
          f"{rank_steps * per_step / 1e9:.0f} GB and {1024 * 7 * 24 * files_hour:,.0f} files compacted "
          f"({files_hour:.2f} per rank-hour); as flushed: {rank_steps * per_step_before / 1e9:.0f} GB and "
          f"{1024 * 7 * 24 * 3600 / args.flush_s * 2:,.0f} files")  # fmt: skip


if __name__ == "__main__":
    main()

"""Time and peak memory of ``hyperacc analyze`` (``diagnose``) on a large run directory.

A synthetic run (hyperacc.analysis.synthetic: one 15 % slow rank, 2 % data stalls on another) of
RANKS x STEPS step records is written once, then analysed in a fresh process each time so that peak
RSS is that of the analysis alone. Side by side, what a user would otherwise do:

* load-all: ``store.read_steps`` of the columns the analysis needs (every rank in one pyarrow table),
  then per-rank, per-window medians with pyarrow's group-by (about what an in-memory, HTA-style
  analysis needs before it can judge anything);
* duckdb: per-rank, per-window medians over the Parquet files in SQL, 1,000 ranks a query (an
  out-of-core engine; it computes only the window summaries, not the spikes, causes or the diagnosis).

A baseline whose estimated memory exceeds half of this machine's RAM is skipped and says so.

    .venv/bin/python bench/analyze_scale.py            # 1,000 ranks x 100,000 steps (~10 GB on disk)
    .venv/bin/python bench/analyze_scale.py --quick    # 100 ranks x 10,000 steps (< 60 s)
    .venv/bin/python bench/analyze_scale.py --keep /tmp/big   # keep (or reuse) the run directory
    .venv/bin/python bench/analyze_scale.py --ranks 10000 --keep /tmp/big --no-segments   # the big run only

First, the segment-count case: the same records written as one segment per rank and as ``--segments``
(2,000) per rank, in Parquet and as the plain record segments ranks write between compactions,
analysed by ``diagnose`` and (Parquet only) by DuckDB in the same run (quick: 2 ranks x 20,000 steps;
full: 32 x 100,000, issue 21's figures), printed as ratios.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))

import numpy as np  # noqa: E402
from _machine import describe as machine  # noqa: E402

from hyperacc.analysis.synthetic import SyntheticFault, SyntheticRun, last_arrival, write_rank  # noqa: E402
from hyperacc.trace.options import TraceOptions  # noqa: E402

_SPEC: SyntheticRun | None = None
_ARRIVAL = None
_ROOT: Path | None = None


def _init(spec: SyntheticRun, arrival, root: Path) -> None:
    global _SPEC, _ARRIVAL, _ROOT
    _SPEC, _ARRIVAL, _ROOT = spec, arrival, root


def _write(rank: int) -> None:
    write_rank(_ROOT, _SPEC, rank, _ARRIVAL)


def generate(root: Path, ranks: int, steps: int, segment_steps: int | None = None) -> SyntheticRun:
    # what compaction leaves a finished run: a file per period of at least ``compact_min_rows`` rows
    segment_steps = segment_steps or min(steps, TraceOptions().compact_min_rows)
    spec = SyntheticRun(
        ranks=ranks, steps=steps, ranks_per_node=8, seed=42, segment_steps=segment_steps,
        faults=(SyntheticFault("slowdown", (ranks // 3,), factor=0.15),
                SyntheticFault("data_stall", (ranks // 2,), rate=0.02, ms=60)),
    )  # fmt: skip
    stamp = root / "bench-spec.json"
    key = json.dumps({"ranks": ranks, "steps": steps, "seed": spec.seed, "segment_steps": segment_steps})
    if stamp.is_file() and stamp.read_text() == key:
        print(f"reusing {root}")
        return spec
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    t0 = time.perf_counter()
    ctx = mp.get_context("fork")
    procs = os.cpu_count() or 1
    # The last rank's arrival per step: the maximum over ranks, computed by parts in parallel.
    parts = [SyntheticRun(**{**spec.__dict__, "missing": tuple(r for r in range(ranks) if r % procs != i)})
             for i in range(procs)]  # fmt: skip
    with ctx.Pool(procs) as pool:
        arrival = np.max(np.vstack(pool.map(last_arrival, parts)), axis=0)
    print(f"  arrivals computed ({time.perf_counter() - t0:.0f} s)", flush=True)
    with ctx.Pool(procs, initializer=_init, initargs=(spec, arrival, root)) as pool:
        for i, _ in enumerate(pool.imap_unordered(_write, range(ranks), chunksize=4)):
            if (i + 1) % max(1, ranks // 10) == 0:
                print(f"  wrote {i + 1}/{ranks} ranks ({time.perf_counter() - t0:.0f} s)", flush=True)
    stamp.write_text(key)
    size = sum(p.stat().st_size for p in root.rglob("*.parquet")) / 2**30
    print(f"generated {ranks} ranks x {steps} steps in {time.perf_counter() - t0:.0f} s ({size:.2f} GiB)")
    return spec


_CHILD = {
    "hyperacc diagnose()": """
from hyperacc.analysis import diagnose
d = diagnose(RUN).to_dict()
out = {"verdict": d["verdict"], "stragglers": [(s["rank"], s["kind"]) for s in d["stragglers"]]}
""",
    "load-all (store.read_steps + group-by)": """
import pyarrow as pa, pyarrow.compute as pc
from hyperacc import store
from hyperacc.analysis.columns import ANALYSIS_COLUMNS
t = store.read_steps(RUN, columns=list(ANALYSIS_COLUMNS))
t = t.append_column("window", pc.divide(t.column("step"), 50))
g = t.group_by(["rank", "window"]).aggregate([(c, "approximate_median") for c in ("self_ns", "data_ns", "comm_wait_ns")])
out = {"rows": t.num_rows, "windows": g.num_rows}
""",
    "duckdb (window medians in SQL)": """
import duckdb, glob
con = duckdb.connect()
con.execute("SET enable_progress_bar = false")
# One GROUP BY over at most 1,000 ranks' files at a time: over 10,000 ranks x 1e5 steps at once it
# spilled more than the 38 GiB of disk left and failed; batched by ranks, as a user would, it fits.
ranks = sorted(glob.glob(f"{RUN}/steps/rank-*"))
n = 0
for i in range(0, len(ranks), 1000):
    files = [f"{d}/seg-*.parquet" for d in ranks[i : i + 1000]]
    q = f\"\"\"SELECT rank, step // 50 AS w, median(self_ns) AS s, median(data_ns) AS d, median(comm_wait_ns) AS c
            FROM read_parquet({files!r}) GROUP BY rank, w\"\"\"
    # Summing the medians keeps the optimiser from dropping them.
    n += con.execute(f"SELECT count(*), sum(s), sum(d), sum(c) FROM ({q})").fetchone()[0]
out = {"windows": n}
""",
}


def run_child(label: str, run_dir: Path) -> dict:
    code = (
        "import json, resource, sys, time\n"
        f"sys.path.insert(0, {str(SRC)!r})\n"
        f"RUN = {str(run_dir)!r}\n"
        "t0 = time.perf_counter()\n" + _CHILD[label] + "\nout['seconds'] = time.perf_counter() - t0\n"
        "out['peak_rss_mb'] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024\n"
        "print('RESULT ' + json.dumps(out))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"error": f"exit {proc.returncode}: {tail[0][:120]}"}


def as_records(parquet_run: Path, run_dir: Path, segment_steps: int) -> None:
    """The run at ``parquet_run`` written again as the tracer writes it before compaction: one plain
    record segment (``seg-N.rec``, int64 rows, -1 where not measured) per ``segment_steps`` steps."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from hyperacc import records, store
    from hyperacc.schema import STEP_SCHEMA

    stamp = run_dir / "bench-spec.json"
    if stamp.is_file() and stamp.read_text() == str(segment_steps):
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.copytree(parquet_run, run_dir, ignore=shutil.ignore_patterns("steps"))
    for folder in sorted((parquet_run / "steps").iterdir()):
        table = pa.concat_tables([store.read_segment(p, STEP_SCHEMA) for p in store.live_segments(folder)])
        cols = []
        for f in STEP_SCHEMA:
            c = table.column(f.name)
            c = c.cast(pa.int8()) if pa.types.is_boolean(c.type) else c
            cols.append(pc.fill_null(c.cast(pa.int64()), -1).to_numpy())
        rows = np.stack(cols, axis=1)
        writer = records.RecordWriter(run_dir / "steps" / folder.name, "STEP_SCHEMA")
        for i in range(0, len(rows), segment_steps):
            writer.write_int64(rows[i : i + segment_steps])
    stamp.write_text(str(segment_steps))


def segment_count(root: Path, ranks: int, steps: int, segments: int, repeat: int = 3) -> None:
    """The same records as one segment per rank and as ``segments`` per rank, in Parquet (a run written
    before compaction existed) and as plain record segments (what ranks write between compactions):
    diagnose and DuckDB (which reads Parquet only)."""
    times: dict[tuple[str, str], float] = {}
    verdicts = set()
    per = -(-steps // segments)
    layouts = {"1": root / "seg-1", "n": root / f"seg-{segments}", "rec": root / f"rec-{segments}"}
    generate(layouts["1"], ranks, steps, segment_steps=steps)
    generate(layouts["n"], ranks, steps, segment_steps=per)
    as_records(layouts["1"], layouts["rec"], per)
    for key, run_dir in layouts.items():
        for label in ("hyperacc diagnose()", "duckdb (window medians in SQL)"):
            if key == "rec" and label.startswith("duckdb"):
                continue
            # The two layouts a ratio of diagnose's is taken between are timed ``repeat`` times (median):
            # single runs of the same few seconds differ by up to a third on this shared machine.
            runs = []
            for _ in range(repeat if key in ("1", "rec") and label.startswith("hyperacc") else 1):
                r = run_child(label, run_dir)
                if "error" in r:
                    print(f"{label}: {r['error']}")
                    return
                runs.append(r["seconds"])
                if "verdict" in r:
                    verdicts.add(json.dumps([r["verdict"], r["stragglers"]]))
            times[(label, key)] = float(np.median(runs))
    d1, dn, dr = (times[("hyperacc diagnose()", k)] for k in ("1", "n", "rec"))
    q1, qn = times[("duckdb (window medians in SQL)", "1")], times[("duckdb (window medians in SQL)", "n")]
    print(f"\nsegment count: {ranks} ranks x {steps} steps, 1 vs {segments} segments per rank "
          f"({ranks * segments:,} files)")  # fmt: skip
    print(f"(diagnose of 1 segment and of the records: median of {repeat} runs)")
    print(f"{'':28s} {'1 segment':>10s} {f'{segments} Parquet':>14s} {'ratio':>7s} {f'{segments} records':>14s} {'ratio':>7s}")
    print(f"{'hyperacc diagnose() s':28s} {d1:10.2f} {dn:14.2f} {dn / d1:6.2f}x {dr:14.2f} {dr / d1:6.2f}x")
    print(f"{'duckdb window medians s':28s} {q1:10.2f} {qn:14.2f} {qn / q1:6.2f}x {'-':>14s}")
    print(f"{'diagnose / duckdb':28s} {d1 / q1:9.2f}x {dn / qn:13.2f}x")
    print(f"same verdict and stragglers for the three layouts: {len(verdicts) == 1}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="100 ranks x 10,000 steps")
    ap.add_argument("--ranks", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--keep", type=Path, default=None, help="write (or reuse) the run directory here")
    ap.add_argument("--segments", type=int, default=2000, help="segments per rank of the segment-count case")
    ap.add_argument("--repeat", type=int, default=3, help="runs of the segment-count case's ratios (median)")
    ap.add_argument("--no-big", action="store_true", help="only the segment-count case")
    ap.add_argument("--no-segments", action="store_true", help="only the big run (skip the segment-count case)")
    args = ap.parse_args()
    ranks = args.ranks or (100 if args.quick else 1000)
    steps = args.steps or (10_000 if args.quick else 100_000)
    print(f"machine: {machine()}")
    tmp = None
    if args.keep is None:
        tmp = tempfile.mkdtemp(prefix="hyperacc-scale-")
        root = Path(tmp) / "run"
    else:
        root = args.keep
    try:
        # the segment-count case: quick 2 ranks x 20,000 steps, full 32 x 100,000 (issue 21's figures)
        seg_ranks, seg_steps = (2, 20_000) if args.quick else (32, 100_000)
        if not args.no_segments:
            segment_count(root.with_name(root.name + "-segments"), seg_ranks, seg_steps, args.segments, args.repeat)
        if args.no_big:
            return
        generate(root, ranks, steps)
        import psutil

        ram_mb = psutil.virtual_memory().total / 2**20
        # The load-all baseline holds 18 float64/int64 columns per step, plus pyarrow's concat copy.
        load_all_mb = ranks * steps * 18 * 8 * 2 / 2**20
        rows = []
        for label in _CHILD:
            if label.startswith("duckdb"):
                try:
                    import duckdb  # noqa: F401
                except ImportError:
                    rows.append((label, {"error": "duckdb not installed (pip install 'hyperacc[bench]')"}))
                    continue
            if label.startswith("load-all") and load_all_mb > ram_mb / 2:
                rows.append(
                    (
                        label,
                        {
                            "error": f"skipped: needs ~{load_all_mb / 1024:.0f} GiB of {ram_mb / 1024:.0f} GiB RAM"
                        },
                    )
                )
                continue
            print(f"running {label} ...", flush=True)
            rows.append((label, run_child(label, root)))
        base = rows[0][1]
        print(f"\n{ranks} ranks x {steps} steps = {ranks * steps:,} step records")
        print(
            f"{'analysis':42s} {'seconds':>9s} {'peak RSS MB':>12s} {'time vs diagnose':>17s} {'RSS vs diagnose':>16s}"
        )
        for label, r in rows:
            if "error" in r:
                print(f"{label:42s} {r['error']}")
                continue
            t_ratio = r["seconds"] / base["seconds"] if "seconds" in base else float("nan")
            m_ratio = r["peak_rss_mb"] / base["peak_rss_mb"] if "peak_rss_mb" in base else float("nan")
            print(
                f"{label:42s} {r['seconds']:9.1f} {r['peak_rss_mb']:12.0f} {t_ratio:16.2f}x {m_ratio:15.2f}x"
            )
            duck = dict(rows).get("duckdb (window medians in SQL)", {})
            if "seconds" in duck and not label.startswith("duckdb"):
                print(f"{'':42s} (this row vs duckdb: time {r['seconds'] / duck['seconds']:.2f}x, "
                      f"RSS {r['peak_rss_mb'] / duck['peak_rss_mb']:.2f}x)")  # fmt: skip
        if "verdict" in base:
            print(f"\ndiagnose verdict: {base['verdict']}")
            print(f"stragglers: {base['stragglers']} (injected: rank {ranks // 3} compute)")
        print(f"rows per second (diagnose): {ranks * steps / base.get('seconds', float('nan')):,.0f}")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

"""`hyperacc watch` of a long job: what its first look costs, starting from the newest records against
reading the whole run first (what it did before ``SegmentCursor.start_at_tail``); and of a job of
thousands of ranks: what a refresh costs when it reads every rank's new records, against the windows the
leader gathered (``present.job_view``, what watch reads above 256 ranks).

A run directory as the node agent leaves it after a day: every rank's steps and resource samples in one
compacted file per hour (``seg-lo-hi.parquet``, the compactor's names and row groups), at 1 step and 1
sample a second. Each arm runs in its own interpreter (so its peak memory is its own): a
``RunFollower`` makes its first ``poll`` and one ``snapshot``; printed are the wall time, the CPU time,
the peak RSS, and whether both arms' snapshots agree.

    .venv/bin/python bench/watch_scale.py            # 256 ranks x 24 hours; refreshes at 1,024 and 4,096 ranks
    .venv/bin/python bench/watch_scale.py --quick    # 64 ranks x 12 hours; refreshes at 512 ranks
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
from hyperacc.analysis.windows import SUMMARY_COLUMNS  # noqa: E402
from hyperacc.schema import (  # noqa: E402
    RESOURCE_SCHEMA,
    STEP_SCHEMA,
    RankMeta,
    live_events_dir,
    live_windows_dir,
    window_gathered_detail,
)

HOUR = 3600


def write_run(root: Path, ranks: int, hours: int) -> None:
    """``ranks`` x ``hours`` compacted files of steps and of resource samples, one row a second."""
    rng = np.random.default_rng(0)
    for rank in range(ranks):
        records.write_meta(root, RankMeta(rank, rank % 8, rank // 8, ranks, 8, f"node{rank // 8}", 1000 + rank,
                                          agent=f"node{rank // 8}:1"))  # fmt: skip
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


def refresh(run: str, ranks: int, hours: int, rounds: int = 5) -> dict:
    """A node agent's own view (``hyperacc run``) of a run directory every node shares, against a view of
    every rank: the CPU of one refresh after each rank flushed one more segment (5 steps), median of
    ``rounds``."""
    from hyperacc.present.live_view import RunFollower

    own, every = RunFollower([run], keep=200, agent="node0:1"), RunFollower([run], keep=200)
    own.poll()
    every.poll()
    columns = records.columns_of("STEP_SCHEMA")
    writers = [records.RecordWriter(Path(run) / "steps" / f"rank-{r:05d}", "STEP_SCHEMA") for r in range(ranks)]
    cpu: dict[str, list[float]] = {"own": [], "every": []}
    for k in range(rounds):
        for r, writer in enumerate(writers):
            rows = np.full((5, len(columns)), -1, dtype=np.int64)
            step = hours * HOUR + k * 5 + np.arange(5)
            for name, values in (("rank", r), ("node", r // 8), ("step", step), ("t_start_ns", step * 10**9),
                                 ("step_ns", 95_000_000), ("self_ns", 80_000_000), ("comm_wait_ns", 15_000_000)):  # fmt: skip
                rows[:, columns.index(name)] = values
            writer.write_int64(rows)
        for name, follower in (("own", own), ("every", every)):
            c = time.process_time()
            follower.poll()
            follower.snapshot(window=50)
            cpu[name].append(time.process_time() - c)
    return {name: float(np.median(v)) for name, v in cpu.items()}


def jobwide(root: Path, ranks: int, rounds: int = 3) -> dict:
    """A job of ``ranks`` ranks (8 a node) under ``hyperacc run``: each round every rank flushes 50 steps
    and the leader writes one gathered window and its ``window_gathered`` event, as ``LiveNode`` does;
    then each follower refreshes (``poll`` + ``snapshot``). The CPU of the first look and the median
    refresh of each."""
    from hyperacc.present.job_view import WindowFollower
    from hyperacc.present.live_view import RunFollower

    rng = np.random.default_rng(1)
    columns = records.columns_of("STEP_SCHEMA")
    writers = []
    for r in range(ranks):
        records.write_meta(root, RankMeta(r, r % 8, r // 8, ranks, 8, f"node{r // 8}", 1000 + r, agent=f"node{r // 8}:1"))
        writers.append(records.RecordWriter(root / "steps" / f"rank-{r:05d}", "STEP_SCHEMA"))
    windows = records.RecordWriter(live_windows_dir(root), "WINDOW_SCHEMA")
    events = records.RecordWriter(live_events_dir(root), "EVENT_SCHEMA")

    def flush(k: int, steps: int) -> None:
        for r, writer in enumerate(writers):
            rows = np.full((steps, len(columns)), -1, dtype=np.int64)
            step = k + np.arange(steps)
            self_ns = rng.lognormal(np.log(80e6), 0.05, steps).astype(np.int64)
            for name, values in (("rank", r), ("node", r // 8), ("step", step), ("t_start_ns", step * 10**8),
                                 ("step_ns", self_ns + 15_000_000), ("self_ns", self_ns), ("comm_wait_ns", 15_000_000),
                                 ("cpu_ns", self_ns)):  # fmt: skip
                rows[:, columns.index(name)] = values
            writer.write_int64(rows)
        w = (k + steps) // 50 - 1
        cols = list(SUMMARY_COLUMNS)
        vals = rng.random((ranks, len(cols))) * 1e7
        vals[:, cols.index("rank")], vals[:, cols.index("window")] = np.arange(ranks), w
        windows.write_json(vals.tolist(), cols)
        events.write_json([[0, w * 50, (k + steps) * 10**8, "window_gathered", None, float(ranks), window_gathered_detail([])]])

    flush(0, 200)
    out: dict = {}
    followers = {"records": RunFollower([root], keep=200), "windows": WindowFollower([root])}
    for name, f in followers.items():
        c = time.process_time()
        f.poll()
        f.snapshot(window=50)
        out[f"{name}_first"] = time.process_time() - c
    cpu: dict[str, list[float]] = {name: [] for name in followers}
    for k in range(rounds):
        flush(200 + 50 * k, 50)
        for name, f in followers.items():
            c = time.process_time()
            f.poll()
            snap = f.snapshot(window=50)
            cpu[name].append(time.process_time() - c)
            assert snap is not None and snap.ranks == ranks, (name, snap)
    return out | {name: float(np.median(v)) for name, v in cpu.items()}


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
    ap.add_argument("--jobwide", type=lambda s: [int(x) for x in s.split(",")], help="ranks of the refresh rows, e.g. 1024,4096")
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
        r = refresh(tmp, ranks, hours)
    print(f"\n# a refresh of hyperacc run's view on a run directory all {ranks // 8} nodes share, after every rank "
          f"flushed one segment (median of 5):")  # fmt: skip
    print(f"| view | CPU per refresh |\n|---|---|\n| every rank (before) | {r['every'] * 1e3:.0f} ms |\n"
          f"| its own node's 8 ranks (now) | {r['own'] * 1e3:.0f} ms |")  # fmt: skip
    print(f"# own / every: {r['own'] / r['every']:.3f}; all nodes' agents together read {ranks // 8} x fewer folders")
    print("\n# hyperacc watch of a whole job: every rank's new records against the leader's gathered windows; each")
    print("# round every rank flushed 50 steps and the leader wrote one window (CPU, median of 3 refreshes)")
    print("| ranks | first look: records | windows | a refresh: records | windows | windows / records |")
    print("|---|---|---|---|---|---|")
    for n in (args.jobwide or ([512] if args.quick else [1024, 4096])):
        with tempfile.TemporaryDirectory(prefix="hyperacc-watch-") as tmp:
            j = jobwide(Path(tmp), n)
        print(f"| {n:,} | {j['records_first']:.2f} s | {j['windows_first'] * 1e3:.0f} ms | {j['records'] * 1e3:.0f} ms | "
              f"{j['windows'] * 1e3:.1f} ms | {j['windows'] / j['records']:.4f} |")  # fmt: skip


if __name__ == "__main__":
    main()

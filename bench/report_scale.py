"""HTML report at scale: hyperacc's binned, top-k report vs drawing every rank x step with plotly.

The run directory is generated (a model, not a measurement: self-time ~ N(20 ms, 0.4 ms) per rank,
one rank 30 % slower, 0.2 % GC spikes of 60 ms), one Parquet segment per rank. hyperacc: ``diagnose``
then ``build_report``. Baseline: what a user would otherwise write, ``read_steps`` (all ranks) and a
plotly heatmap of every rank x step with the library embedded (``write_html``). Each runs in a fresh
interpreter so its peak RSS is its own.

    .venv/bin/python bench/report_scale.py           # 1,000 ranks x 100,000 steps (baseline not run)
    .venv/bin/python bench/report_scale.py --quick   # 200 ranks x 5,000 steps (< 60 s)
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _machine import describe as machine

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
BASELINE_LIMIT = 2e7  # rank x step cells; beyond this the naive page is gigabytes


def generate(run_dir: Path, ranks: int, steps: int, ranks_per_node: int = 8) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hyperacc.schema import STEP_SCHEMA, RankMeta, steps_dir
    from hyperacc.store import parquet_options, write_meta

    rng = np.random.default_rng(0)
    slow = ranks // 3
    step_idx = np.arange(steps, dtype=np.int64)
    base = 1_700_000_000_000_000_000
    for r in range(ranks):
        work = rng.normal(20e6, 0.4e6, steps) * (1.3 if r == slow else 1.0)
        gc = np.where(rng.random(steps) < 0.002, 60e6, 0.0)
        self_ns = np.round((work + gc) / 1000) * 1000  # microsecond resolution, as a tracer would store
        step_ns = np.full(steps, 27e6) + gc
        cols = {
            "rank": np.full(steps, r, dtype=np.int32), "node": np.full(steps, r // ranks_per_node, dtype=np.int32),
            "step": step_idx, "t_start_ns": base + step_idx * 27_000_000, "step_ns": step_ns.astype(np.int64),
            "self_ns": self_ns.astype(np.int64), "comm_wait_ns": (step_ns - self_ns).clip(0).astype(np.int64),
            "gc_ns": gc.astype(np.int64), "backward_ns": (0.6 * self_ns).astype(np.int64),
            "forward_ns": (0.4 * self_ns).astype(np.int64),
        }  # fmt: skip
        table = pa.table(
            {f.name: cols.get(f.name, pa.nulls(steps, f.type)) for f in STEP_SCHEMA}, schema=STEP_SCHEMA
        )
        d = steps_dir(run_dir, r)
        d.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, d / "seg-000001.parquet", **parquet_options(table.schema))
        write_meta(run_dir, RankMeta(rank=r, local_rank=r % ranks_per_node, node=r // ranks_per_node, world_size=ranks,
                                     local_world_size=ranks_per_node, hostname=f"n{r // ranks_per_node}", pid=r,
                                     source="simulator"))  # fmt: skip


def measure(kind: str, run_dir: str, out: str) -> dict:
    """Runs inside the child."""
    t0 = time.perf_counter()
    result: dict = {}
    if kind == "hyperacc":
        from hyperacc.analysis import diagnose
        from hyperacc.present.report import build_report

        diag = diagnose(run_dir).to_dict()
        result["diagnose_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        build_report(run_dir, out, diagnosis=diag)
        result["report_s"] = time.perf_counter() - t1
    else:
        import numpy as np
        import plotly.graph_objects as go

        from hyperacc.store import read_steps

        table = read_steps(run_dir, columns=["rank", "step", "self_ns"])
        ranks = table.column("rank").to_numpy()
        steps = table.column("step").to_numpy()
        grid = np.full((ranks.max() + 1, steps.max() + 1), np.nan)
        grid[ranks, steps] = table.column("self_ns").to_numpy() / 1e6
        fig = go.Figure(go.Heatmap(z=grid))
        fig.write_html(out, include_plotlyjs=True)
    result["wall_s"] = time.perf_counter() - t0
    result["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["bytes"] = Path(out).stat().st_size
    return result


def run_child(kind: str, run_dir: Path, out: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", kind, str(run_dir), str(out)], capture_output=True, text=True
    )
    if proc.returncode:
        tail = proc.stderr.strip().splitlines()
        return {"error": tail[-1] if tail else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--child", nargs=3, metavar=("KIND", "RUN_DIR", "OUT"))
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(*args.child)))
        return
    ranks, steps = (200, 5_000) if args.quick else (1_000, 100_000)
    print(f"machine: {machine()}")
    tmp = Path(tempfile.mkdtemp(prefix="hyperacc-bench-report-"))
    try:
        run_dir = tmp / "run"
        t0 = time.perf_counter()
        generate(run_dir, ranks, steps)
        disk = sum(f.stat().st_size for f in run_dir.rglob("*.parquet"))
        print(f"generated {ranks} ranks x {steps} steps ({ranks * steps:,} step records, {disk / 1e6:.0f} MB Parquet) "
              f"in {time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip
        ours = run_child("hyperacc", run_dir, tmp / "hyperacc.html")
        cells = ranks * steps
        base = (
            run_child("naive", run_dir, tmp / "naive.html")
            if cells <= BASELINE_LIMIT
            else {"error": "not run"}
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"\n{'':<28}{'wall s':>9}{'peak RSS MB':>13}{'HTML MB':>10}")
    if "error" in ours:
        print(f"{'hyperacc':<28} failed: {ours['error']}")
        return
    print(f"{'hyperacc diagnose+report':<28}{ours['wall_s']:>9.1f}{ours['rss_mb']:>13.0f}{ours['bytes'] / 1e6:>10.1f}"
          f"   (diagnose {ours['diagnose_s']:.1f} s, report {ours['report_s']:.1f} s)")  # fmt: skip
    if "error" in base:
        why = (
            "not run: every cell would be drawn" if base["error"] == "not run" else f"failed: {base['error']}"
        )
        print(f"{'plotly, every rank x step':<28}   {why} ({cells:,} cells)")
    else:
        print(
            f"{'plotly, every rank x step':<28}{base['wall_s']:>9.1f}{base['rss_mb']:>13.0f}{base['bytes'] / 1e6:>10.1f}"
        )
        print(f"{'ratio naive / hyperacc':<28}{base['wall_s'] / ours['wall_s']:>8.2f}x{base['rss_mb'] / ours['rss_mb']:>12.2f}x"
              f"{base['bytes'] / ours['bytes']:>9.2f}x")  # fmt: skip
    print(
        "\nhyperacc includes the whole diagnosis (every rank's spikes, stragglers, causes) that the naive page lacks."
    )


if __name__ == "__main__":
    main()

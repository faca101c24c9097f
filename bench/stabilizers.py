"""Stabilizers against the defaults a user would otherwise run, in one run of this script.

1. Deterministic GC: ``examples/train_ddp.py`` at 4 ranks with GC pressure injected by
   ``hyperacc.chaos`` (a long-lived heap and per-rank different garbage rates, so each rank's automatic
   collections fall on different steps), once with Python's automatic GC and once with
   ``HYPERACC_STABILIZE`` deterministic GC (freeze after set-up, a collection every N steps on every
   rank).
2. Memory release: ``bench/workers/memory_churn.py`` at 4 ranks, host memory that grows and shrinks in
   per-rank random bursts, once with glibc's default behaviour (trim on free, fault back in on the next
   burst) and once with the stabilizer (hold freed memory, ``malloc_trim(0)`` every N steps on every rank).

Variants alternate (A B, then B A with ``--repeats 2``) so the machine's background load falls on both.
Spikes are judged per rank on step time with the analyzer's rule (docs/detection.md, "Spikes").

    .venv/bin/python bench/stabilizers.py --quick
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from _machine import describe as machine  # noqa: E402

from hyperacc import harness  # noqa: E402
from hyperacc.analysis.options import DetectionOptions  # noqa: E402
from hyperacc.analysis.spikes import detect_spikes  # noqa: E402
from hyperacc.chaos import read_ground_truth  # noqa: E402

NPROC = 4
WARMUP = 10  # steps dropped at the start of every run (set-up, first-step freeze)
BATCH = 32  # examples/train_ddp.py default batch size


def launch(script: Path, args: list[str], env: dict[str, str], timeout: float) -> list[dict[str, Any]]:
    job = harness.launch(script, args, nproc=NPROC, timeout=timeout, env=env)
    if not job.ok:
        raise SystemExit(f"{script.name} failed:\n{job.explain()}")
    return sorted(job.results(), key=lambda r: r["rank"])


def spikes(step_ms: np.ndarray) -> np.ndarray:
    return detect_spikes(step_ms * 1e6, DetectionOptions()).spike


def order(names: list[str], repeats: int) -> list[str]:
    out: list[str] = []
    for rep in range(repeats):
        out.extend(names if rep % 2 == 0 else names[::-1])
    return out


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))


def fmt_ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


# ------------------------------------------------------------------ 1. deterministic GC


def gc_bench(steps: int, interval: int, live: int, repeats: int, timeout: float) -> None:
    garbage = [1500, 2000, 2500, 3000]  # per rank: their automatic collections drift apart
    chaos = {"seed": 1, "faults": [{"kind": "gc_pressure", "ranks": [r], "live": live, "garbage": g}
                                   for r, g in enumerate(garbage)]}  # fmt: skip
    variants = {
        "automatic GC": None,
        "hyperacc GC": {"gc": {"interval": interval}, "memory": False, "allocator": False},
    }
    print(
        f"\n== deterministic GC: examples/train_ddp.py, {NPROC} ranks, {steps} steps x {repeats} run(s) per variant; "
        f"chaos gc_pressure live={live} objects, garbage/step per rank={garbage}; GC every {interval} steps =="
    )
    per: dict[str, dict[str, Any]] = {n: {"ms": [[] for _ in range(NPROC)], "spike": [[] for _ in range(NPROC)],
                                          "gc_spike": [[] for _ in range(NPROC)], "sched_spike": [[] for _ in range(NPROC)], "pauses": [],
                                          "collections": [], "freeze": [], "wall": []}
                                      for n in variants}  # fmt: skip
    for name in order(list(variants), repeats):
        run = Path(tempfile.mkdtemp(prefix="hyperacc-bench-gc-"))
        (run / "meta").mkdir()
        env = {"HYPERACC_CHAOS": json.dumps(chaos), "HYPERACC_RUN_DIR": str(run)}
        if variants[name] is not None:
            env["HYPERACC_STABILIZE"] = json.dumps({**variants[name], "run_dir": str(run)})
        t0 = time.monotonic()
        results = launch(ROOT / "examples/train_ddp.py", ["--steps", str(steps)], env, timeout)
        per[name]["wall"].append(time.monotonic() - t0)
        truth = read_ground_truth(run)
        scheduled: set[int] = set()
        if variants[name] is not None:
            from hyperacc.store import read_events

            ev = read_events(run).to_pylist()
            per[name]["collections"].extend(e["duration_ns"] / 1e6 for e in ev if e["kind"] == "gc_collect")
            per[name]["freeze"].extend(e["duration_ns"] / 1e6 for e in ev if e["kind"] == "gc_freeze")
            scheduled = {e["step"] for e in ev if e["kind"] in ("gc_collect", "gc_freeze")}
        # chaos labels a pause with its step counter, which the optimizer hook has already advanced when
        # the stabilizer collects: a scheduled collection at example step s is recorded at s + 1.
        pause_steps = {g["step"] for g in truth if g["kind"] == "gc_pause"} - {s + 1 for s in scheduled}
        per[name]["pauses"].extend(
            g["magnitude_ms"] for g in truth if g["kind"] == "gc_pause" and g["step"] >= WARMUP
        )
        for res in results:
            ms = np.asarray(res["step_ms"], dtype=float)
            flags = spikes(ms)
            idx = np.arange(len(ms))
            # A GC pause recorded at chaos step s or s+1 lands in the example's step s (the stabilizer
            # collects after the optimizer hook has already opened the next chaos step).
            gc_hit = np.array([(s in pause_steps) or (s + 1 in pause_steps) for s in idx])
            sched_hit = np.array([s in scheduled for s in idx])
            r = res["rank"]
            per[name]["ms"][r].append(ms[WARMUP:])
            per[name]["spike"][r].append(flags[WARMUP:])
            per[name]["gc_spike"][r].append((flags & gc_hit & ~sched_hit)[WARMUP:])
            per[name]["sched_spike"][r].append((flags & sched_hit)[WARMUP:])

    a, b = list(variants)
    print(f"A = {a}, B = {b}")
    rows = {}
    for r in range(NPROC):
        row = {}
        for n in variants:
            ms = np.concatenate(per[n]["ms"][r])
            row[n] = {
                "spike": np.concatenate(per[n]["spike"][r]).mean(),
                "gc_spike": int(np.concatenate(per[n]["gc_spike"][r]).sum()),
                "sched_spike": int(np.concatenate(per[n]["sched_spike"][r]).sum()),
                "median": float(np.median(ms)),
                "p99": float(np.percentile(ms, 99)),
                "total_s": ms.sum() / 1e3 / len(per[n]["ms"][r]),
                "n": len(ms),
            }
        rows[r] = row
    print_table(
        ["rank", "spike rate A", "B", "spikes at random GC A", "B", "at scheduled GC B", "p99/median A", "B",
         "median ms A", "B"],
        [[str(r), f"{rows[r][a]['spike']:.2%}", f"{rows[r][b]['spike']:.2%}", str(rows[r][a]["gc_spike"]),
          str(rows[r][b]["gc_spike"]), str(rows[r][b]["sched_spike"]),
          f"{rows[r][a]['p99'] / rows[r][a]['median']:.2f}",
          f"{rows[r][b]['p99'] / rows[r][b]['median']:.2f}", f"{rows[r][a]['median']:.1f}",
          f"{rows[r][b]['median']:.1f}"] for r in range(NPROC)],
    )  # fmt: skip
    thr = {n: NPROC * BATCH * (rows[0][n]["n"] / repeats) / rows[0][n]["total_s"] for n in variants}
    print(
        f"throughput (samples/s, rank 0's clock): {a} {thr[a]:.0f}, {b} {thr[b]:.0f}, ratio {fmt_ratio(thr[b], thr[a])}"
    )
    pa, cb = per[a]["pauses"], per[b]["collections"]
    print(
        f"GC cost: {a}: {len(pa)} pauses >= 1 ms after warm-up, mean {np.mean(pa) if pa else 0:.1f} ms, "
        f"max {max(pa) if pa else 0:.1f} ms, at different steps on each rank"
    )
    print(
        f"         {b}: {len(cb)} scheduled collections (all ranks), mean {np.mean(cb) if cb else 0:.1f} ms, "
        f"max {max(cb) if cb else 0:.1f} ms, at the same steps on every rank; one-time freeze at the first step "
        f"mean {np.mean(per[b]['freeze']) if per[b]['freeze'] else 0:.0f} ms"
    )
    print(f"wall per run: {a} {np.mean(per[a]['wall']):.1f} s, {b} {np.mean(per[b]['wall']):.1f} s")


# ------------------------------------------------------------------ 2. memory release


def memory_bench(steps: int, interval: int, burst_mb: int, repeats: int, timeout: float) -> None:
    variants = {
        "glibc default": None,
        "hyperacc release": {"gc": False, "memory": {"interval": interval}, "allocator": False},
    }
    args = ["--steps", str(steps), "--burst-mb", str(burst_mb), "--rate", "0.05", "--life", "3"]
    print(
        f"\n== memory release: bench/workers/memory_churn.py, {NPROC} ranks, {steps} steps x {repeats} run(s); "
        f"per-rank random bursts of {burst_mb} MB (p=0.05/step, 3 steps alive); release every {interval} steps =="
    )
    per = {n: {"ms": [[] for _ in range(NPROC)], "spike": [[] for _ in range(NPROC)], "rss": [[] for _ in range(NPROC)],
               "burst_ms": [[] for _ in range(NPROC)], "release_ms": []} for n in variants}  # fmt: skip
    for name in order(list(variants), repeats):
        env = {"HYPERACC_STABILIZE": json.dumps(variants[name])} if variants[name] else {}
        results = launch(ROOT / "bench/workers/memory_churn.py", args, env, timeout)
        for res in results:
            r = res["rank"]
            ms = np.asarray(res["step_ms"], dtype=float)
            per[name]["ms"][r].append(ms[WARMUP:])
            per[name]["spike"][r].append(spikes(ms)[WARMUP:])
            per[name]["rss"][r].append(np.asarray(res["rss_mb"])[WARMUP:])
            per[name]["burst_ms"][r].extend(ms[s] for s in res["bursts"] if s >= WARMUP)
            if res.get("stabilizer"):
                st = res["stabilizer"]["memory"]
                per[name]["release_ms"].append(st["release_ms_mean"])
    a, b = list(variants)
    print(f"A = {a}, B = {b}")
    thr: dict[str, float] = {}
    rows = []
    for r in range(NPROC):
        cells = [str(r)]
        stats = {}
        for n in variants:
            ms = np.concatenate(per[n]["ms"][r])
            rss = np.concatenate(per[n]["rss"][r])
            bursts = per[n]["burst_ms"][r]
            stats[n] = [
                f"{np.concatenate(per[n]['spike'][r]).mean():.2%}",
                f"{np.percentile(ms, 99) / np.median(ms):.2f}",
                f"{np.mean(bursts):.0f}" if bursts else "-",
                f"{rss.mean():.0f}",
                f"{rss.max():.0f}",
            ]
            if r == 0:
                thr[n] = NPROC * BATCH * len(ms) / (ms.sum() / 1e3)
        for i in range(5):
            cells += [stats[a][i], stats[b][i]]
        rows.append(cells)
    print_table(
        ["rank", "spike rate A", "B", "p99/median A", "B", "burst step ms A", "B", "RSS mean MB A", "B",
         "RSS max MB A", "B"],
        rows,
    )  # fmt: skip
    print(
        f"throughput (samples/s, rank 0's clock): {a} {thr[a]:.0f}, {b} {thr[b]:.0f}, ratio {fmt_ratio(thr[b], thr[a])}"
    )
    rel = per[b]["release_ms"]
    print(f"scheduled malloc_trim(0): mean {np.mean(rel) if rel else 0:.2f} ms per release")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes (about a minute on 2 idle cores)")
    p.add_argument("--repeats", type=int, default=None, help="runs per variant (alternating order)")
    p.add_argument("--only", choices=["gc", "memory"], default=None)
    args = p.parse_args()
    repeats = args.repeats or (1 if args.quick else 2)
    print(machine())
    t0 = time.monotonic()
    if args.only in (None, "gc"):
        if args.quick:
            gc_bench(steps=150, interval=50, live=500_000, repeats=repeats, timeout=300)
        else:
            gc_bench(steps=600, interval=100, live=1_000_000, repeats=repeats, timeout=600)
    if args.only in (None, "memory"):
        if args.quick:
            memory_bench(steps=150, interval=50, burst_mb=128, repeats=repeats, timeout=300)
        else:
            memory_bench(steps=600, interval=50, burst_mb=128, repeats=repeats, timeout=600)
    print(f"\n{machine()}\ntotal {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

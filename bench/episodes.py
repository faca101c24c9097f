"""Episodes on real jobs: detection latency, false episodes on clean runs under load, and what-if figures
checked against re-runs without the fault (docs/detection.md, "Episodes" and "What-if").

Each run is 4 gloo ranks of a tiny transformer trained nanoGPT-style without a DataLoader
(tests/analysis/jobs/nanogpt_faults.py, 300 steps) through ``hyperacc run``, with ``--load`` busy
processes beside it. Runs alternate clean and faulty; a faulty run makes one rank busy-loop inside its
forward for steps 120-179, ``factor - 1`` times its own median step (the job injects it, not
``hyperacc.chaos``), or with ``--work sleep`` sleep that long (a fail-slow off the CPU, as a blocking
read; ``--work both``: each factor both ways). Per faulty run:

* offline: whether ``analyze`` reports the episode on that rank (and on no other), its range, and the
  steps from the onset to its ``confirmed_step``;
* live: the steps from the onset to the node agent's ``live_finding`` "rank R ... is slow since step";
* what-if: the job time ``analyze`` says the run would have taken without its culprits, against the job
  time of the clean runs recorded just before and just after it (the re-runs without the fault; their
  own difference is the noise of that check).

Per clean run: episodes, stragglers and live episode lines (all false).

    .venv/bin/python bench/episodes.py --quick          # 1 seed: 3 faulty + 4 clean runs (~5 min)
    .venv/bin/python bench/episodes.py --seeds 3 --clean 30 --runs /tmp/ep   # the table in the docs
    .venv/bin/python bench/episodes.py --rescore /tmp/ep  # score kept runs with the current rules
    .venv/bin/python bench/episodes.py --seeds 1 --clean 8 --work both   # off-CPU faults too
    .venv/bin/python bench/episodes.py --seeds 1 --clean 4 --work gapsleep   # waits between steps
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from _machine import describe as machine  # noqa: E402
from detection import TimingLock, background_load  # noqa: E402

JOB = ROOT / "tests" / "analysis" / "jobs" / "nanogpt_faults.py"
FACTORS = (1.2, 1.5, 2.0)
ONSET, END = 120, 180


def plan(seeds: int, clean: int, works: tuple[str, ...] = ("spin",)) -> list[dict[str, Any]]:
    """Alternating clean and faulty runs (every faulty run between two clean ones), then more clean."""
    runs: list[dict[str, Any]] = [{"name": "clean-0", "factor": None, "rank": None}]
    i = 0
    for seed in range(seeds):
        for work in works:
            for factor in FACTORS:
                i += 1
                name = f"slow{factor}-s{seed}" if work == "spin" else f"{work}{factor}-s{seed}"
                runs.append({"name": name, "factor": factor, "rank": (seed + i) % 4, "work": work})
                runs.append({"name": f"clean-{i}", "factor": None, "rank": None})
    for j in range(i + 1, clean):
        runs.append({"name": f"clean-{j}", "factor": None, "rank": None})
    return runs


def run_one(spec: dict[str, Any], run_dir: Path, load: int) -> str | None:
    from hyperacc import harness

    args = ["--steps", "300"]
    if spec["factor"] is not None:
        args += ["--slow-rank", str(spec["rank"]), "--slow-from", str(ONSET), "--slow-until", str(END),
                 "--slow-factor", str(spec["factor"]), "--slow-work", spec.get("work", "spin")]  # fmt: skip
    with background_load(load):
        job = harness.launch(JOB, args, nproc=4, timeout=600,
                             traced={"run-dir": str(run_dir), "trace": json.dumps({"flush_every_s": 1.0})})  # fmt: skip
    return None if job.ok else job.explain()[-500:]


def score(run_dir: Path, spec: dict[str, Any]) -> dict[str, Any]:
    from hyperacc import store
    from hyperacc.analysis import diagnose

    d = diagnose(run_dir).to_dict()
    live = [e for e in store.read_live_events(run_dir).to_pylist()
            if e["kind"] == "live_finding" and "is slow since step" in (e["detail"] or "")]  # fmt: skip
    out: dict[str, Any] = {**spec, "job_ns": (d["what_if"] or {}).get("job_ns"),
                           "without_ns": ((d["what_if"] or {}).get("all") or {}).get("job_ns_without")}  # fmt: skip
    r = spec["rank"]
    out["false"] = [e["rank"] for e in d["episodes"] + d["stragglers"] if e["rank"] != r]
    out["false_live"] = [e["detail"] for e in live if r is None or not e["detail"].startswith(f"rank {r} ")]
    if r is not None:
        eps = [e for e in d["episodes"] if e["rank"] == r]
        out["found"] = bool(eps)
        if eps:
            e = eps[0]
            out["range"] = (e["since_step"], e["until_step"])
            out["latency"] = e["confirmed_step"] - ONSET
            out["kind"] = e["kind"]
        mine = [e["step"] for e in live if e["detail"].startswith(f"rank {r} ")]
        out["live_latency"] = min(mine) - ONSET if mine else None
    return out


def report(rows: list[dict[str, Any]]) -> None:
    print("\nlatency: steps from the onset (step 120) to the verdict; range within 10 steps of 120-179")
    print(f"{'work':>8} {'slowdown':>9} {'found':>7} {'range ok':>9} {'offline (median, max)':>22} "
          f"{'live (median, max)':>19} {'kind':>9}")  # fmt: skip
    for work, f in [(w, f) for w in ("spin", "sleep", "gapsleep") for f in FACTORS]:
        mine = [x for x in rows if x["factor"] == f and x.get("work", "spin") == work]
        if not mine:
            continue
        found = [x for x in mine if x.get("found")]
        ok = [x for x in found if abs(x["range"][0] - ONSET) <= 10 and abs(x["range"][1] - (END - 1)) <= 10]
        off = [x["latency"] for x in found]
        live = [x["live_latency"] for x in mine if x.get("live_latency") is not None]
        kinds = sorted({x["kind"] for x in found})
        print(f"{work:>8} {f:>8}x {len(found):>3}/{len(mine):<3} {len(ok):>5}/{len(found):<3} "
              f"{_med_max(off):>22} {_med_max(live):>13} ({len(live)}/{len(mine)}) {','.join(kinds):>9}")  # fmt: skip
    clean = [x for x in rows if x["factor"] is None]
    false = sum(1 for x in clean if x["false"])
    false_live = sum(1 for x in clean if x["false_live"])
    print(f"\nclean runs under load: {len(clean)}; with a false episode or straggler: {false}; "
          f"with a false live episode line: {false_live}")
    faulty_false = sum(1 for x in rows if x["factor"] is not None and x["false"])
    print(f"faulty runs naming another rank too: {faulty_false}")
    print("\nwhat-if: the job time without the culprits, against the clean re-runs just before and after")
    print(f"{'run':>14} {'recorded':>9} {'what-if':>8} {'re-runs':>15} {'error':>7} {'re-runs differ':>15}")
    errs, noise = [], []
    by_name = {x["name"]: x for x in rows}
    order = [x["name"] for x in rows]
    for i, x in enumerate(rows):
        if x["factor"] is None or not x.get("without_ns"):
            continue
        before = next((by_name[n] for n in reversed(order[:i]) if by_name[n]["factor"] is None), None)
        after = next((by_name[n] for n in order[i + 1 :] if by_name[n]["factor"] is None), None)
        if not before or not after or not before["job_ns"] or not after["job_ns"]:
            continue
        clean_ns = (before["job_ns"] + after["job_ns"]) / 2
        err = (x["without_ns"] - clean_ns) / clean_ns
        differ = abs(before["job_ns"] - after["job_ns"]) / clean_ns
        errs.append(abs(err))
        noise.append(differ)
        print(f"{x['name']:>14} {x['job_ns'] / 1e9:>8.2f}s {x['without_ns'] / 1e9:>7.2f}s "
              f"{before['job_ns'] / 1e9:>6.2f}/{after['job_ns'] / 1e9:<6.2f}s {err * 100:>+6.1f}% {differ * 100:>14.1f}%")  # fmt: skip
    if errs:
        print(f"what-if |error|: median {median(errs) * 100:.1f} %, max {max(errs) * 100:.1f} % "
              f"(the clean re-runs themselves differ by median {median(noise) * 100:.1f} %, max {max(noise) * 100:.1f} %)")


def _med_max(v: list[float]) -> str:
    return f"{median(v):.0f}, {max(v):.0f}" if v else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one seed: 3 faulty and 4 clean runs")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--clean", type=int, default=30, help="clean runs in all (at least one per faulty run + 1)")
    ap.add_argument("--load", type=int, default=1, help="busy processes beside every run")
    ap.add_argument("--runs", type=Path, default=None, help="keep the run directories here")
    ap.add_argument("--rescore", type=Path, default=None, help="score the runs kept in this directory")
    ap.add_argument("--work", choices=("spin", "sleep", "gapsleep", "both"), default="spin",
                    help="the fault: a busy loop (more work), a sleep (off the CPU) in the forward, a sleep "
                    "between optimizer.step() and the next forward (a blocking read of the next batch), or "
                    "each factor both ways in the forward")
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    print(f"machine: {machine()}")
    if args.rescore:
        rows = []
        for d in sorted(args.rescore.iterdir(), key=lambda p: p.stat().st_mtime):
            spec = d / "spec.json"
            if spec.is_file():
                rows.append(score(d / "run", json.loads(spec.read_text())))
        report(rows)
        return
    seeds, clean = (1, 4) if args.quick else (args.seeds, args.clean)
    runs = plan(seeds, clean, ("spin", "sleep") if args.work == "both" else (args.work,))
    print(f"{len(runs)} runs of {JOB.name} (4 gloo ranks, 300 steps, hyperacc run), {args.load} busy process(es) beside")
    base = args.runs or Path(tempfile.mkdtemp(prefix="hyperacc-episodes-"))
    base.mkdir(parents=True, exist_ok=True)
    rows = []
    lock = TimingLock()
    try:
        for spec in runs:
            where = base / spec["name"]
            if (where / "spec.json").is_file():
                rows.append(score(where / "run", json.loads((where / "spec.json").read_text())))
                continue
            shutil.rmtree(where, ignore_errors=True)
            where.mkdir(parents=True)
            t0 = time.monotonic()
            with lock():
                err = run_one(spec, where / "run", args.load)
            if err:
                print(f"  {spec['name']}: {err}")
                continue
            (where / "spec.json").write_text(json.dumps(spec))
            rows.append(score(where / "run", spec))
            x = rows[-1]
            print(f"  {spec['name']}: {time.monotonic() - t0:.0f} s; found {x.get('found')}, offline "
                  f"+{x.get('latency')}, live +{x.get('live_latency')}, false {x['false']}", flush=True)  # fmt: skip
    finally:
        lock.release()
        if args.runs is None:
            shutil.rmtree(base, ignore_errors=True)
    report(rows)


if __name__ == "__main__":
    main()

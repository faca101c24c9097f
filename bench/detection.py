"""Detection quality on real jobs: a scored matrix of faults, seeds and host load, beside the peers' rules.

Each run is the example DDP job (examples/train_ddp.py) through ``hyperacc run`` (torchrun, gloo,
automatic tracing), one or more simulated nodes on this machine, with a fault injected by
``hyperacc.chaos`` and, in half the runs, a real busy process beside the job (background load). The run
directory is then diagnosed (``hyperacc.analysis.diagnose``) and scored against what was injected.

Scenarios (ranks as nodes x ranks per node; the faulty ranks and what a right verdict names):

    clean            1x4   nothing
    compute spin     1x4   rank 2 busy-loops after its forward (chaos slowdown 0.5)   straggler, compute
    compute matmul   1x4   rank 2 does real extra matrix products (slowdown, matmul)  straggler, compute
    data stalls      1x4   rank 1 stalls 40 ms in loading on 2 % of steps            rank 1, data
    gc pressure      1x4   rank 0 builds cyclic garbage every step (gc_pressure)      rank 0, gc
    host             1x4   rank 1 and two busy processes share one CPU (competitor)   straggler, host
                           (hidden 1024: a rank with a 2 ms self-time that sleeps in the collective
                           keeps its CPU against a busy neighbour, the scheduler favours the waker)
    launch           1x4   rank 3's operators take 50 us longer to launch (launch)    straggler, launch
    page faults      1x4   rank 2's allocator maps its 64 KiB+ blocks afresh (page_churn) straggler, page_faults
    node of 2        2x2   both ranks of node 1 slowed (slowdown 0.5)                 ranks 2, 3, node
    node of 3        3x2   both ranks of node 2 slowed                                ranks 4, 5, node
    30 % slow        1x10  ranks 1, 4, 7 slowed                                       stragglers, compute

Scoring, per run: a rank hyperacc names (a straggler, or a rank-specific spike cause) is a true
positive when a fault was injected into it, else a false positive; a faulty rank not named is a false
negative; the kind is right when the straggler's kind (or the rank-specific cause) is the injected one.
The peers' rules, re-implemented from their documentation, are scored on the same step records:

* NVRx (nvidia-resiliency-ext straggler detection): per rank, score = the best rank's median / own
  median (here of self-time, its section timers' analogue); a rank scoring under 0.75 is a straggler;
* TraceML: the culprit is the rank with the smallest visible backward time (backward plus the wait in
  the gradient collective, which runs inside ``loss.backward()``); it is flagged when its cost (the
  median rank's visible backward minus the culprit's) exceeds 10 % of the step time.

Neither names a kind. Runs are kept in ``--runs DIR`` (default: a temporary directory) and can be
scored again without running (``--rescore DIR``). Every job runs under the timing lock
(/tmp/hyperacc-timing.lock, held over about five minutes of runs at a time), so timing benchmarks of
other work never overlap with it.

    .venv/bin/python bench/detection.py --quick     # 4 runs, one seed, no load (a few minutes)
    BENCH_FULL=1 .venv/bin/python bench/detection.py   # the matrix: 11 scenarios x 3 seeds x 2 loads,
                                                        # clean x 15 seeds x 2 loads
    .venv/bin/python bench/detection.py --rescore DIR   # score kept runs with the current rules
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from _machine import describe as machine  # noqa: E402

from hyperacc.analysis import diagnose  # noqa: E402
from hyperacc.analysis.columns import discover, read_rank  # noqa: E402

LOCK = "/tmp/hyperacc-timing.lock"
DETECTORS = ("hyperacc", "NVRx score < 0.75", "TraceML min backward")


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    nnodes: int
    nproc: int
    faults: tuple[dict[str, Any], ...]
    expect: dict[int, str]  # faulty rank -> the kind (or rank-specific cause) a right verdict names
    script_args: tuple[str, ...] = ()


def _slow(ranks: list[int], factor: float = 0.5, work: str = "spin") -> dict[str, Any]:
    return {"kind": "slowdown", "ranks": ranks, "factor": factor, "work": work}


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("clean", 1, 4, (), {}),
    Scenario("compute spin", 1, 4, (_slow([2]),), {2: "compute"}),
    Scenario("compute matmul", 1, 4, (_slow([2], work="matmul"),), {2: "compute"}),
    Scenario("data stalls", 1, 4, ({"kind": "data_stall", "ranks": [1], "rate": 0.02, "ms": 40},), {1: "data"}),
    Scenario("gc pressure", 1, 4, ({"kind": "gc_pressure", "ranks": [0], "live": 300_000, "garbage": 20_000},),
             {0: "gc"}),
    Scenario("host", 1, 4, ({"kind": "competitor", "ranks": [1], "cpu": 1, "procs": 2},), {1: "host"},
             ("--hidden", "1024")),
    Scenario("launch", 1, 4, ({"kind": "launch", "ranks": [3], "ms": 0.05},), {3: "launch"}),
    Scenario("page faults", 1, 4, ({"kind": "page_churn", "ranks": [2], "kb": 64},), {2: "page_faults"}),
    Scenario("node of 2", 2, 2, (_slow([2, 3]),), {2: "node", 3: "node"}),
    Scenario("node of 3", 3, 2, (_slow([4, 5]),), {4: "node", 5: "node"}),
    Scenario("30 % slow", 1, 10, (_slow([1, 4, 7]),), {1: "compute", 4: "compute", 7: "compute"},
             ("--features", "256", "--hidden", "256")),
)  # fmt: skip


# ------------------------------------------------------------------------------------------ running


class TimingLock:
    """The shared timing lock, held over a few consecutive runs (about ``hold_s``) and then given back,
    so that other work's timing never overlaps these jobs and this matrix does not starve it either."""

    def __init__(self, hold_s: float = 300.0) -> None:
        self.hold_s = hold_s
        self._fh = None
        self._since = 0.0

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        if self._fh is not None and time.monotonic() - self._since > self.hold_s:
            self.release()
        if self._fh is None:
            self._fh = open(LOCK, "a+")  # noqa: SIM115
            fcntl.flock(self._fh, fcntl.LOCK_EX)
            self._since = time.monotonic()
        yield

    def release(self) -> None:
        if self._fh is not None:
            fcntl.flock(self._fh, fcntl.LOCK_UN)
            self._fh.close()
            self._fh = None


@contextlib.contextmanager
def background_load(procs: int) -> Iterator[None]:
    """Real busy processes beside the job (unpinned): the host is shared, as on a busy machine."""
    children = [subprocess.Popen([sys.executable, "-S", "-c", "while True: pass"]) for _ in range(procs)]
    try:
        yield
    finally:
        for c in children:
            c.kill()
            c.wait()


def run_job(sc: Scenario, run_dir: Path, seed: int, steps: int, load: bool, timeout: float) -> str | None:
    """Runs one traced job; returns an error text, or None."""
    from hyperacc import harness

    chaos = json.dumps({"seed": seed, "faults": list(sc.faults)})
    port = harness.free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs, logs = [], []
    for node in range(sc.nnodes):
        cmd = [sys.executable, "-m", "hyperacc", "run", "--run-dir", str(run_dir), "--nproc-per-node", str(sc.nproc),
               "--chaos", chaos, "--max-restarts", "0"]  # fmt: skip
        if sc.nnodes > 1:
            cmd += ["--nnodes", str(sc.nnodes), "--node-rank", str(node), "--master-addr", "127.0.0.1",
                    "--master-port", str(port)]  # fmt: skip
        cmd += ["--", str(ROOT / "examples" / "train_ddp.py"), "--steps", str(steps), "--seed", str(seed),
                *sc.script_args]  # fmt: skip
        log = run_dir.parent / f"{run_dir.name}.node{node}.log"
        logs.append(log)
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                      start_new_session=True))  # fmt: skip
    deadline = time.monotonic() + timeout
    with background_load(2 if load else 0):
        for p in procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                break
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, 9)
                p.wait()
    if not (run_dir / "steps").is_dir():
        tail = "".join(log.read_text(errors="replace")[-300:] for log in logs if log.exists())
        return f"no step records: {tail}"
    return None


# ------------------------------------------------------------------------------------------ scoring


def peer_rules(run_dir: Path) -> dict[str, list[int]]:
    """The peers' straggler rules on the same step records (module docstring)."""
    layout = discover(run_dir)
    self_med, vis_bwd, step_med = {}, {}, {}
    for rank, src in layout.sources.items():
        cols = read_rank(src.segments, ("rank", "node", "step", "step_ns", "self_ns", "backward_ns", "comm_wait_ns"))
        keep = cols["step"] >= (cols["step"][0] + 10 if cols["step"].size else 0)  # the same warm-up
        self_med[rank] = float(np.nanmedian(cols["self_ns"][keep]))
        vis_bwd[rank] = float(np.nanmedian((cols["backward_ns"] + np.nan_to_num(cols["comm_wait_ns"]))[keep]))
        step_med[rank] = float(np.nanmedian(cols["step_ns"][keep]))
    best = min(v for v in self_med.values() if v > 0)
    nvrx = [r for r, v in self_med.items() if v > 0 and best / v < 0.75]
    traceml: list[int] = []
    finite = {r: v for r, v in vis_bwd.items() if np.isfinite(v)}
    if len(finite) >= 2:
        culprit = min(finite, key=finite.get)
        cost = float(np.median(list(finite.values()))) - finite[culprit]
        if cost > 0.10 * float(np.median(list(step_med.values()))):
            traceml = [culprit]
    return {"NVRx score < 0.75": nvrx, "TraceML min backward": traceml}


def score_run(run_dir: Path) -> dict[str, Any]:
    info = json.loads((run_dir / "scenario.json").read_text())
    expect = {int(k): v for k, v in info["expect"].items()}
    d = diagnose(run_dir).to_dict()
    named: dict[int, str] = {}
    for e in d.get("rank_causes", []):
        named.setdefault(int(e["rank"]), e["cause"])
    for s in d["stragglers"]:
        named[int(s["rank"])] = s["kind"]  # a straggler's kind wins over a spike cause of the same rank
    # A rank-specific cause and a straggler of the same rank are one claim; the kind is right when
    # either names the injected kind.
    kinds: dict[int, set[str]] = defaultdict(set)
    for e in d.get("rank_causes", []):
        kinds[int(e["rank"])].add(e["cause"])
    for s in d["stragglers"]:
        kinds[int(s["rank"])].update({s["kind"], s.get("rank_kind", s["kind"])})
    out = {"scenario": info["name"], "load": info["load"], "seed": info["seed"], "expect": expect,
           "named": named, "verdict": d["verdict"], "stragglers": len(d["stragglers"]),
           "rank_causes": len(d.get("rank_causes", [])), "steps": d["steps_per_rank"]}  # fmt: skip
    res = {"hyperacc": _counts(set(named), expect, kinds)}
    out["false_stragglers"] = len({int(s["rank"]) for s in d["stragglers"]} - set(expect))
    out["false_causes"] = len({int(e["rank"]) for e in d.get("rank_causes", [])} - set(expect)
                              - {int(s["rank"]) for s in d["stragglers"]})  # fmt: skip
    for label, ranks in peer_rules(run_dir).items():
        res[label] = _counts(set(ranks), expect, None)
    out["results"] = res
    return out


def _counts(named: set[int], expect: dict[int, str], kinds: dict[int, set[str]] | None) -> dict[str, Any]:
    tp = named & set(expect)
    right = None if kinds is None else sum(1 for r in tp if expect[r] in kinds.get(r, set()))
    return {"tp": len(tp), "fp": len(named - set(expect)), "fn": len(set(expect) - named), "kind_right": right}


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def report(scores: list[dict[str, Any]]) -> None:
    """The matrix: per detector and load, precision, recall, kind accuracy, false stragglers per clean run."""
    print("\nPer scenario (hyperacc): runs, named right / faulty ranks, kind right, false names")
    by_sc: dict[tuple[str, bool], list] = defaultdict(list)
    for s in scores:
        by_sc[(s["scenario"], s["load"])].append(s)
    for (name, load), runs in sorted(by_sc.items(), key=lambda kv: ([x.name for x in SCENARIOS].index(kv[0][0])
                                                                       if kv[0][0] in [x.name for x in SCENARIOS]
                                                                       else 99, kv[0][1])):  # fmt: skip
        h = [r["results"]["hyperacc"] for r in runs]
        tp, fn, fp = sum(x["tp"] for x in h), sum(x["fn"] for x in h), sum(x["fp"] for x in h)
        kr = sum(x["kind_right"] or 0 for x in h)
        print(f"  {name:15s} {'loaded' if load else 'quiet ':6s} runs {len(runs):2d}  found {tp}/{tp + fn}  "
              f"kind right {kr}/{tp}  false {fp}")  # fmt: skip
    print("\n| detector | load | runs | precision | recall | kind accuracy | false stragglers per clean run |")
    print("|---|---|---|---|---|---|---|")
    # hyperacc's false stragglers on clean runs count stragglers only; its rank-specific spike causes
    # on clean runs are listed below the table
    for det in DETECTORS:
        for load in (False, True, None):
            sel = [s for s in scores if load is None or s["load"] == load]
            if not sel:
                continue
            faulty = [s for s in sel if s["expect"]]
            clean = [s for s in sel if not s["expect"]]
            r = [s["results"][det] for s in faulty]
            tp, fn = sum(x["tp"] for x in r), sum(x["fn"] for x in r)
            fp = sum(s["results"][det]["fp"] for s in sel)
            kind = "-" if det != "hyperacc" else ratio(sum(x["kind_right"] or 0 for x in r), tp)
            false = [s["false_stragglers"] if det == "hyperacc" else s["results"][det]["fp"] for s in clean]
            per_clean = f"{sum(false) / len(clean):.2f} ({sum(false)} in {len(clean)})" if clean else "-"
            label = {False: "quiet", True: "loaded", None: "all"}[load]
            print(f"| {det} | {label} | {len(sel)} | {ratio(tp, tp + fp)} | {ratio(tp, tp + fn)} | {kind} | "
                  f"{per_clean} |")  # fmt: skip


def report_causes(scores: list[dict[str, Any]]) -> None:
    clean = [s for s in scores if not s["expect"]]
    if clean:
        n = sum(s["false_causes"] for s in clean)
        print(f"\nhyperacc rank-specific spike causes on clean runs: {n} in {len(clean)} runs")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 runs, one seed, no load")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--clean-seeds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--runs", type=Path, default=None, help="keep the run directories here")
    ap.add_argument("--rescore", type=Path, default=None, help="score the runs kept in this directory")
    ap.add_argument("--only", default="", help="run only scenarios whose name contains this")
    ap.add_argument("--load", choices=("both", "quiet", "loaded"), default="both")
    args = ap.parse_args()
    quick = args.quick and os.environ.get("BENCH_FULL") != "1"
    print(f"machine: {machine()}")
    if args.rescore:
        scores = []
        for d in sorted(p for p in args.rescore.iterdir() if (p / "scenario.json").is_file()):
            try:
                scores.append(score_run(d))
            except Exception as exc:  # noqa: BLE001 - a broken run is reported, not fatal
                print(f"  {d.name}: cannot score ({exc})")
        report(scores)
        report_causes(scores)
        return
    if quick:
        plan = [(sc, 1, False) for sc in SCENARIOS if sc.name in ("clean", "compute spin", "data stalls", "node of 2")]
        steps = min(args.steps, 300)
    else:
        loads = {"both": (False, True), "quiet": (False,), "loaded": (True,)}[args.load]
        # seed by seed over every scenario and load, so that a partial matrix is already balanced
        most = max(args.seeds, args.clean_seeds)
        plan = [(sc, seed, load) for seed in range(1, most + 1) for sc in SCENARIOS if args.only in sc.name
                for load in loads if seed <= (args.clean_seeds if sc.name == "clean" else args.seeds)]  # fmt: skip
        steps = args.steps
    print(f"{len(plan)} traced runs of {steps} steps (examples/train_ddp.py through hyperacc run, gloo)")
    base = args.runs or Path(tempfile.mkdtemp(prefix="hyperacc-detect-"))
    base.mkdir(parents=True, exist_ok=True)
    scores = []
    timing_lock = TimingLock()
    try:
        for sc, seed, load in plan:
            run_dir = base / f"{sc.name.replace(' ', '_').replace('%', 'pct')}-{'load' if load else 'quiet'}-s{seed}"
            if (run_dir / "scenario.json").is_file():
                scores.append(score_run(run_dir))  # kept from an earlier invocation
                continue
            shutil.rmtree(run_dir, ignore_errors=True)
            t0 = time.monotonic()
            with timing_lock():
                load_avg = os.getloadavg()[0]
                err = run_job(sc, run_dir, seed, steps, load, timeout=max(240.0, steps * 1.5))
            if err:
                print(f"  {run_dir.name}: {err}")
                continue
            (run_dir / "scenario.json").write_text(json.dumps({
                "name": sc.name, "seed": seed, "load": load, "expect": sc.expect, "faults": sc.faults,
                "steps": steps, "load_avg_at_start": load_avg,
            }))  # fmt: skip
            s = score_run(run_dir)
            scores.append(s)
            print(f"  {run_dir.name}: {time.monotonic() - t0:.0f} s, load {load_avg:.1f}; named {s['named']} "
                  f"(expected {s['expect']}); NVRx {s['results']['NVRx score < 0.75']['tp']}+"
                  f"{s['results']['NVRx score < 0.75']['fp']}, TraceML {s['results']['TraceML min backward']['tp']}+"
                  f"{s['results']['TraceML min backward']['fp']}", flush=True)  # fmt: skip
    finally:
        timing_lock.release()
        if args.runs is None:
            shutil.rmtree(base, ignore_errors=True)
    report(scores)
    report_causes(scores)


if __name__ == "__main__":
    main()

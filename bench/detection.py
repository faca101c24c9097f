"""Detection quality against chaos ground truth: precision and recall of stragglers and spikes.

Each case runs the example DDP job (examples/train_ddp.py) through ``hyperacc run`` (torchrun, gloo,
automatic tracing) with faults injected by ``hyperacc.chaos``, then scores ``diagnose`` against the
ground truth the chaos module wrote (``RUN_DIR/chaos/rank-XXXXX.jsonl``). Side by side, the rules a
user would otherwise apply to the same step records:

* stragglers, "slowest step time": the rank with the largest median step time (what a per-rank
  step-time dashboard shows); and "relative score": a rank whose median self-time is 1/0.75 = 1.33x the
  best rank's or more (NVIDIA resiliency-ext's straggler score at its default threshold);
* spikes, "2x median": a step whose step time exceeds twice the rank's median step time (no cause).

Scoring (docs/detection.md, "Measured detection quality"):

* stragglers: per run, a true positive when the slowed rank is flagged (with kind compute), a false
  positive for every flagged rank that no fault was injected into (a rank under GC pressure really is
  slower); delay = the step at which it was confirmed. hyperacc is scored
  with its default rule (MAD z AND IQR fence) and with ``--rule or``;
* spikes: a ground-truth event (data_stall, spike, gc_pause, cold_read) of at least ``--min-ms`` counts
  as found when its rank has a spike at that step (+-1 step); its cause is right when it matches the
  injected kind (data_stall/cold_read -> data, spike -> compute, gc_pause -> gc). Precision counts
  spikes on the ranks faults were injected into (a loaded machine spikes on its own: those spikes are
  real, just not injected, and are reported separately as the other ranks' spike rate).

    .venv/bin/python bench/detection.py            # 5 scenarios x 3 seeds, 4 ranks x 600 steps
    .venv/bin/python bench/detection.py --quick    # one run with three faults, 300 steps (< 60 s here)
    .venv/bin/python bench/detection.py --synthetic  # the same scoring on synthetic runs (no torch)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from _machine import describe as machine  # noqa: E402

from hyperacc.analysis import diagnose  # noqa: E402
from hyperacc.analysis.columns import discover, read_rank  # noqa: E402
from hyperacc.analysis.options import DetectionOptions  # noqa: E402
from hyperacc.analysis.run_dir import reduce_rank  # noqa: E402
from hyperacc.chaos import read_ground_truth  # noqa: E402

KIND_CAUSE = {"data_stall": "data", "cold_read": "data", "spike": "compute", "gc_pause": "gc"}
RANKS = 4
STRAGGLER_DETECTORS = ("hyperacc stragglers (and)", "hyperacc stragglers (or)", "slowest step time",
                       "relative score < 0.75")  # fmt: skip


def scenarios(quick: bool) -> list[tuple[str, int, list[dict[str, Any]]]]:
    """(name, slowed rank or -1, chaos faults) for each case."""
    if quick:
        return [
            ("combined", 2, [
                {"kind": "slowdown", "ranks": [2], "factor": 0.15},
                {"kind": "data_stall", "ranks": [1], "rate": 0.03, "ms": 60},
                {"kind": "spike", "ranks": [3], "rate": 0.02, "ms": 40},
            ]),
        ]  # fmt: skip
    return [
        ("slowdown 15 %", 2, [{"kind": "slowdown", "ranks": [2], "factor": 0.15}]),
        ("data stall 3 %", -1, [{"kind": "data_stall", "ranks": [1], "rate": 0.03, "ms": 60}]),
        ("compute spike 2 %", -1, [{"kind": "spike", "ranks": [3], "rate": 0.02, "ms": 40}]),
        ("gc pressure", -1, [{"kind": "gc_pressure", "ranks": [0], "live": 300_000, "garbage": 20_000}]),
        ("clean", -1, []),
    ]


def traced_run(
    run_dir: Path, faults: list[dict[str, Any]], seed: int, steps: int, timeout: float
) -> str | None:
    chaos = json.dumps({"seed": seed, "faults": faults})
    cmd = [sys.executable, "-m", "hyperacc", "run", "--run-dir", str(run_dir), "--nproc-per-node", str(RANKS),
           "--chaos", chaos, "--", str(ROOT / "examples" / "train_ddp.py"), "--steps", str(steps),
           "--seed", str(seed)]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    if not (run_dir / "steps").is_dir():
        return f"exit {proc.returncode}, no step records: {(proc.stderr or proc.stdout)[-300:]}"
    return None


def synthetic_run(run_dir: Path, faults: list[dict[str, Any]], seed: int, steps: int) -> str | None:
    from hyperacc.analysis.synthetic import SyntheticFault, SyntheticRun, write_run

    kinds = {
        "slowdown": "slowdown",
        "data_stall": "data_stall",
        "spike": "compute_spike",
        "gc_pressure": "gc",
    }
    out = []
    for f in faults:
        kind = kinds[f["kind"]]
        if kind == "gc":
            out.append(SyntheticFault("gc", tuple(f["ranks"]), rate=0.01, ms=50))
        else:
            out.append(SyntheticFault(kind, tuple(f["ranks"]), rate=f.get("rate", 0.0), ms=f.get("ms", 0.0),
                                      factor=f.get("factor", 0.0)))  # fmt: skip
    write_run(
        run_dir, SyntheticRun(ranks=RANKS, steps=steps, ranks_per_node=RANKS, seed=seed, faults=tuple(out))
    )
    return None


def spike_steps(run_dir: Path, opts: DetectionOptions) -> dict[int, dict[int, str]]:
    """rank -> {step: cause} of diagnose's own per-rank reduction."""
    layout = discover(run_dir)
    out = {}
    for rank, src in layout.sources.items():
        cols = read_rank(src.segments)
        if cols["step"].size == 0:
            continue
        node = src.node if src.node is not None else int(cols["node"][0])
        f = reduce_rank(rank, node, cols, dataclasses.replace(opts, top_events=10**9))
        out[rank] = {e[3]: e[5] for e in f.events}
    return out


def baseline_spikes(run_dir: Path) -> dict[int, set[int]]:
    layout = discover(run_dir)
    out = {}
    for rank, src in layout.sources.items():
        cols = read_rank(src.segments, ("rank", "node", "step", "step_ns"))
        st = cols["step_ns"]
        ok = ~np.isnan(st)
        out[rank] = set(cols["step"][ok][st[ok] > 2 * np.median(st[ok])].tolist()) if ok.any() else set()
    return out


def baseline_stragglers(run_dir: Path) -> dict[str, list[int]]:
    layout = discover(run_dir)
    med_step, med_self = {}, {}
    for rank, src in layout.sources.items():
        cols = read_rank(src.segments, ("rank", "node", "step", "step_ns", "self_ns"))
        med_step[rank] = float(np.nanmedian(cols["step_ns"]))
        med_self[rank] = float(np.nanmedian(cols["self_ns"]))
    best = min(med_self.values())
    return {
        "slowest step time": [max(med_step, key=med_step.get)],
        "relative score < 0.75": [r for r, v in med_self.items() if v > 0 and best / v < 0.75],
    }


def score(run_dir: Path, slowed: int, injected_ranks: set[int], min_ms: float) -> dict[str, Any]:
    opts = DetectionOptions()
    d = diagnose(run_dir).to_dict()
    truth = [t for t in read_ground_truth(run_dir) if t["kind"] in KIND_CAUSE and t["magnitude_ms"] >= min_ms
             and t["step"] >= opts.warmup_steps]  # fmt: skip
    spikes = spike_steps(run_dir, opts)
    base = baseline_spikes(run_dir)
    res: dict[str, Any] = {"steps": d["steps"]}
    # A rank that faults were injected into really is slower (GC pressure, the injector's own work):
    # flagging it is no false positive. Every other rank is a victim or clean.
    faulty = injected_ranks | ({slowed} if slowed >= 0 else set())

    res["flagged"] = {s["rank"]: f"{s['kind']}/{s['metric']}" for s in d["stragglers"]}
    for rule, doc in (("and", d), ("or", diagnose(run_dir, outlier_rule="or").to_dict())):
        flagged = {s["rank"]: s for s in doc["stragglers"]}
        tp = int(slowed >= 0 and slowed in flagged and flagged[slowed]["kind"] in ("compute", "host"))
        res[f"hyperacc stragglers ({rule})"] = (tp, len([r for r in flagged if r not in faulty]), int(slowed >= 0),
                                                flagged[slowed]["confirmed_step"] if tp else None)  # fmt: skip
    for label, ranks in baseline_stragglers(run_dir).items():
        res[label] = (
            int(slowed in ranks),
            len([r for r in ranks if r not in faulty]),
            int(slowed >= 0),
            None,
        )

    truth_at = {(t["rank"], t["step"] + d) for t in truth for d in (-1, 0, 1)}

    def events(found: dict[int, Any]) -> tuple[int, int, int, int, int]:
        """(truth events found, with the right cause, truth events, flags on injected ranks, true flags)."""
        hit = right = 0
        for t in truth:
            steps = found.get(t["rank"], {})
            near = [s for s in (t["step"], t["step"] - 1, t["step"] + 1) if s in steps]
            if near:
                hit += 1
                # The injector and the tracer may see a step boundary on either side of a pause (a GC
                # that the injector triggers from the optimizer hook ends the tracer's previous step).
                if any(steps[s] == KIND_CAUSE[t["kind"]] for s in near):
                    right += 1
        flags = [(r, s) for r, v in found.items() if r in injected_ranks for s in v]
        return hit, right, len(truth), len(flags), sum((r, s) in truth_at for r, s in flags)

    def other_rate(found: dict[int, Any]) -> float:
        rates = [len(v) / max(d["steps"], 1) for r, v in found.items() if r not in injected_ranks]
        return float(np.mean(rates)) if rates else 0.0

    res["hyperacc spikes"] = (*events(spikes), other_rate(spikes))
    as_dict = {r: dict.fromkeys(v, "unknown") for r, v in base.items()}
    res["2x median spikes"] = (*events(as_dict), other_rate(as_dict))
    return res


def ratio(a: int, b: int) -> str:
    return f"{a / b:.2f}" if b else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--synthetic", action="store_true", help="score synthetic runs instead of traced jobs")
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument(
        "--min-ms", type=float, default=10.0, help="ground-truth events smaller than this are not scored"
    )
    ap.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    ap.add_argument("--only", default="", help="run only the scenarios whose name contains this")
    args = ap.parse_args()
    seeds = args.seeds or (1 if args.quick else 3)
    steps = args.steps or (300 if args.quick else 600)
    print(f"machine: {machine()}")
    print(
        f"{'synthetic' if args.synthetic else 'traced'} runs: {RANKS} ranks x {steps} steps, {seeds} seed(s)"
    )
    base_dir = args.keep or Path(tempfile.mkdtemp(prefix="hyperacc-detect-"))
    totals: dict[str, list] = defaultdict(lambda: [0, 0, 0, 0, 0, 0.0, 0])
    delays: dict[str, list[int]] = defaultdict(list)
    try:
        for name, slowed, faults in scenarios(args.quick):
            if args.only not in name:
                continue
            injected = {r for f in faults if f["kind"] != "slowdown" for r in f["ranks"]}
            for seed in range(1, seeds + 1):
                run_dir = base_dir / f"{name.replace(' ', '_').replace('%', 'pct')}-s{seed}"
                shutil.rmtree(run_dir, ignore_errors=True)
                t0 = time.monotonic()
                err = (synthetic_run(run_dir, faults, seed, steps) if args.synthetic
                       else traced_run(run_dir, faults, seed, steps, timeout=max(120.0, steps * 1.0)))  # fmt: skip
                if err:
                    print(f"  {name} seed {seed}: {err}")
                    continue
                r = score(run_dir, slowed, injected, args.min_ms)
                print(
                    f"  {name} seed {seed}: {time.monotonic() - t0:.0f} s; "
                    + json.dumps({k: v for k, v in r.items() if k != "steps"})
                )
                for key in STRAGGLER_DETECTORS:
                    tp, fp, pos, delay = r[key]
                    t = totals[key]
                    t[0] += tp
                    t[1] += fp
                    t[2] += pos
                    if delay is not None:
                        delays[key].append(delay)
                for key in ("hyperacc spikes", "2x median spikes"):
                    hit, right, n, flags, true_flags, other = r[key]
                    t = totals[key]
                    for i, v in enumerate((hit, right, n, flags, true_flags, other, 1)):
                        t[i] += v
    finally:
        if args.keep is None:
            shutil.rmtree(base_dir, ignore_errors=True)

    print(
        "\nStragglers (a slowed rank per slowdown case; a flag on a rank without faults is a false positive)"
    )
    print(f"{'detector':26s} {'precision':>9s} {'recall':>7s} {'TP':>4s} {'FP':>4s} {'slowed':>7s}")
    for key in STRAGGLER_DETECTORS:
        tp, fp, pos = totals[key][:3]
        print(f"{key:26s} {ratio(tp, tp + fp):>9s} {ratio(tp, pos):>7s} {tp:4d} {fp:4d} {pos:7d}")
    for key, steps_ in delays.items():
        print(f"{key}: confirmed at step median {int(np.median(steps_))}, max {max(steps_)}")
    print(f"\nSpikes (ground-truth events >= {args.min_ms:g} ms)")
    print(f"{'detector':26s} {'recall':>7s} {'cause ok':>9s} {'precision*':>10s} {'other ranks rate':>17s}")
    for key in ("hyperacc spikes", "2x median spikes"):
        hit, right, n, flags, true_flags, other, runs = totals[key]
        cause = ratio(right, hit) if key == "hyperacc spikes" else "-"
        print(
            f"{key:26s} {ratio(hit, n):>7s} {cause:>9s} {ratio(true_flags, flags):>10s} {other / max(runs, 1):16.1%}"
        )
    print(
        "* precision on the ranks faults were injected into: flagged steps within 1 step of an injected event"
    )
    print(
        "  over all flagged steps there; 'other ranks rate' is the spike rate of ranks nothing was injected into"
    )


if __name__ == "__main__":
    main()

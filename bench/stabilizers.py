"""Stabilizers against what a user would otherwise run, side by side in one run of this script.

1. Deterministic GC: a DDP loop (this file with ``--worker``) in two workloads: ``cycles`` keeps
   300,000 live container objects and makes 20,000 reference cycles per step that die at once;
   ``survivors`` keeps 1,000,000 live objects and makes 3,000 cycles per step that stay alive for 3
   steps (as activations or queued batches do), so they survive young collections and CPython's own
   full collections walk the whole live heap. Each rank makes 10 % more garbage than the one before, so
   automatic collections drift apart. Four schemes: Python's automatic GC; torchtitan's
   ``GarbageCollection(gc_freq=50)`` (``gc.disable()``, an initial ``gc.collect(1)``, then
   ``gc.collect(1)`` every 50 steps, as in torchtitan/tools/utils.py); hyperacc with a fixed interval of
   50 steps (freeze after set-up, ``gc.collect(2)`` at the same steps on every rank); hyperacc with
   ``interval="auto"`` (the default: interval from the measured cost and a pause budget).
2. Memory release: ``bench/workers/memory_churn.py``, host memory that grows and shrinks in per-rank
   random bursts, with glibc's default behaviour and with the stabilizer (hold freed memory,
   ``malloc_trim(0)`` every N steps on every rank).

Variants alternate (in order, then reversed with ``--repeats 2``) so the machine's background load falls
on all of them. Wrap the run in ``flock /tmp/hyperacc-timing.lock``.

    .venv/bin/python bench/stabilizers.py --quick
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import sys
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

NPROC = 4
WARMUP = 10  # steps dropped at the start of every run (set-up, first-step freeze)
BATCH = 32


def launch(script: Path, args: list[str], env: dict[str, str], timeout: float, nproc: int = NPROC) -> list[dict[str, Any]]:
    job = harness.launch(script, args, nproc=nproc, timeout=timeout, env=env)
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


class TorchtitanGC:
    """torchtitan's GarbageCollection (torchtitan/tools/utils.py), reproduced for the comparison."""

    def __init__(self, gc_freq: int = 50) -> None:
        self.gc_freq = gc_freq
        gc.disable()
        gc.collect(1)

    def run(self, step_count: int) -> None:
        if step_count > 1 and step_count % self.gc_freq == 0:
            gc.collect(1)


WORKLOADS = {  # name: (reference cycles per step on rank 0, live objects, steps a cycle stays alive)
    "cycles": (20_000, 300_000, 0),
    "survivors": (3_000, 1_000_000, 3),
}

GC_VARIANTS: dict[str, dict[str, Any] | str | None] = {
    "automatic GC": None,
    "torchtitan gc_freq=50": "torchtitan",
    "hyperacc interval 50": {"gc": {"interval": 50}, "memory": False, "allocator": False},
    "hyperacc auto": {"gc": {"interval": "auto"}, "memory": False, "allocator": False},
}


def gc_worker(args: argparse.Namespace) -> None:
    """One rank of the GC workload (run through the harness by gc_bench)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hyperacc.stabilize import stabilize

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(BATCH, 256), torch.randint(0, 10, (BATCH,))
    live = [{"i": i, "v": [i]} for i in range(args.live // 2)]  # 2 tracked containers each
    garbage = int(args.garbage * (1 + 0.1 * rank))
    alive: collections.deque[list] = collections.deque(maxlen=max(args.keep, 1))
    pauses: list[float] = []
    t_gc = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            t_gc[0] = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - t_gc[0])

    scheme = GC_VARIANTS[args.variant]
    titan = TorchtitanGC(50) if scheme == "torchtitan" else None
    stab = stabilize(scheme) if isinstance(scheme, dict) else None
    gc.callbacks.append(on_gc)
    step_ms: list[float] = []
    dist.barrier()
    t0 = time.perf_counter()
    for step in range(args.steps):
        a = time.perf_counter()
        if titan is not None:
            titan.run(step + 1)  # torchtitan calls it at the start of each step, counting from 1
        if args.keep:
            batch = []
            for _ in range(garbage):
                c: list = []
                c.append(c)
                batch.append(c)
            alive.append(batch)  # the cycles outlive this step by a few steps
            del batch
        else:
            for _ in range(garbage):  # each cycle is garbage as soon as the next one is made
                c = []
                c.append(c)
        del c
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if stab is not None:
            stab.step(step)
        step_ms.append((time.perf_counter() - a) * 1e3)
        if step == WARMUP - 1:
            pauses.clear()  # GC time counted after warm-up (freeze and calibration start are in it)
            t0 = time.perf_counter()
    loop_s = time.perf_counter() - t0
    gc.callbacks.remove(on_gc)
    summary = stab.close() if stab is not None else None
    del live
    harness.write_result({"rank": rank, "step_ms": step_ms, "pauses_ms": [p * 1e3 for p in pauses],
                          "loop_s": loop_s, "garbage": garbage,
                          "interval": None if summary is None else summary["gc"].get("interval")})  # fmt: skip
    harness.finish()


def gc_bench(workload: str, steps: int, nproc: int, repeats: int, timeout: float) -> None:
    garbage, live, keep = WORKLOADS[workload]
    names = list(GC_VARIANTS)
    alive = f", alive for {keep} steps" if keep else ", dying at once"
    print(
        f"\n== deterministic GC, workload '{workload}': a DDP loop, {nproc} ranks, {steps} steps x {repeats} run(s) "
        f"per scheme; {live:,} live objects, {garbage:,} reference cycles per step on rank 0 (+10 % per rank){alive} =="
    )
    per: dict[str, dict[str, list]] = {n: {"step": [], "gc_s": [], "max_ms": [], "thr": [], "wall": [],
                                           "interval": []} for n in names}  # fmt: skip
    for name in order(names, repeats):
        args = ["--worker", "--variant", name, "--steps", str(steps), "--garbage", str(garbage), "--live", str(live),
                "--keep", str(keep)]
        t0 = time.monotonic()
        results = launch(Path(__file__), args, {}, timeout, nproc=nproc)
        per[name]["wall"].append(time.monotonic() - t0)
        ms = np.max([np.asarray(r["step_ms"])[WARMUP:] for r in results], axis=0)  # the job's step: slowest rank
        per[name]["step"].append(ms)
        per[name]["gc_s"].append(np.mean([sum(r["pauses_ms"]) / 1e3 for r in results]))
        per[name]["max_ms"].append(max((max(r["pauses_ms"], default=0.0) for r in results), default=0.0))
        loop = max(r["loop_s"] for r in results)
        per[name]["thr"].append(nproc * BATCH * (steps - WARMUP) / loop)
        per[name]["interval"].append(sorted({r["interval"] for r in results}, key=str))
    base = names[0]
    rows = []
    thr_base = float(np.mean(per[base]["thr"]))
    for n in names:
        ms = np.concatenate(per[n]["step"])
        p50, p99 = np.percentile(ms, [50, 99])
        thr = float(np.mean(per[n]["thr"]))
        interval = "-" if n == base else ("50" if "torchtitan" in n else str(per[n]["interval"][-1][0]))
        rows.append([n, interval, f"{p50:.2f}", f"{p99:.2f}", f"{p99 / p50:.1f}", f"{np.mean(per[n]['gc_s']):.2f}",
                     f"{np.mean(per[n]['max_ms']):.0f}", f"{thr:.0f}", fmt_ratio(thr, thr_base)])  # fmt: skip
    print_table(["scheme", "interval", "step p50 ms", "p99 ms", "p99/p50", "GC s per rank", "max pause ms",
                 "samples/s", "vs automatic"], rows)  # fmt: skip
    print("step = the slowest rank's step time; GC s = pauses seen by gc.callbacks after warm-up, mean over ranks;")
    print("interval: what each scheme collected at (auto: the agreed interval); wall per run: "
          + ", ".join(f"{n} {np.mean(per[n]['wall']):.1f} s" for n in names))


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
    p.add_argument("--quick", action="store_true", help="small sizes (a few minutes on 2 idle cores)")
    p.add_argument("--repeats", type=int, default=None, help="runs per variant (alternating order)")
    p.add_argument("--only", choices=["gc", "memory"], default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--garbage", type=int, default=20_000, help=argparse.SUPPRESS)
    p.add_argument("--live", type=int, default=300_000, help=argparse.SUPPRESS)
    p.add_argument("--keep", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--workload", choices=[*WORKLOADS, "both"], default="both", help="GC workload(s)")
    p.add_argument("--nproc", type=int, default=2, help="ranks of the GC part")
    args = p.parse_args()
    if args.worker:
        gc_worker(args)
        return 0
    repeats = args.repeats or (1 if args.quick else 2)
    print(machine())
    t0 = time.monotonic()
    if args.only in (None, "gc"):
        for workload in WORKLOADS if args.workload == "both" else [args.workload]:
            gc_bench(workload, steps=200 if args.quick else 600, nproc=args.nproc, repeats=repeats, timeout=600)
    if args.only in (None, "memory"):
        if args.quick:
            memory_bench(steps=150, interval=50, burst_mb=128, repeats=repeats, timeout=300)
        else:
            memory_bench(steps=600, interval=50, burst_mb=128, repeats=repeats, timeout=600)
    print(f"\n{machine()}\ntotal {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Stabilizers against what a user would otherwise run, side by side in one run of this script.

1. Deterministic GC, in one process and in a 2-rank DDP job, three workloads: ``cycles`` keeps 300,000
   live container objects and makes 20,000 reference cycles per step that die at once; ``survivors``
   keeps 1,000,000 live objects and makes 3,000 cycles of two containers per step that stay alive for 3
   steps (as activations or queued batches do), so they survive young collections and CPython's own
   full collections walk the whole live heap; ``nanogpt`` trains a 2-layer GPT fed by a DataLoader whose
   dataset tokenizes text in the training process. In DDP each rank makes 10 % more garbage than the one
   before, so automatic collections drift apart. Four schemes: Python's automatic GC; torchtitan's
   ``GarbageCollection(gc_freq=50)`` (``gc.disable()``, an initial ``gc.collect(1)``, then
   ``gc.collect(1)`` every 50 steps, as in torchtitan/tools/utils.py); hyperacc's default
   (``stabilize()``: young collections automatic, full collections on the ``auto`` schedule); hyperacc
   with ``interval: 50``. Printed: the total time against automatic GC (median of the per-round
   ratios and a 90 % interval), p99/p50 of the step and against automatic GC's, the longest pause.
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
import subprocess
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


GC_WORKLOADS = ("cycles", "survivors", "nanogpt")
SYNTHETIC = {  # name: (reference cycles per step, live objects, steps a cycle stays alive)
    "cycles": (20_000, 300_000, 0),
    "survivors": (3_000, 1_000_000, 3),  # each cycle two containers
}

GC_VARIANTS: dict[str, dict[str, Any] | str | None] = {
    "automatic GC": None,
    "torchtitan gc_freq=50": "torchtitan",
    "hyperacc default": {"gc": {}, "memory": False, "allocator": False},
    "hyperacc interval 50": {"gc": {"interval": 50}, "memory": False, "allocator": False},
}
BASE = "automatic GC"


class Synthetic:
    """``cycles`` / ``survivors``: reference cycles beside a live set and a small model's step."""

    def __init__(self, workload: str, rank: int) -> None:
        import torch

        garbage, live, self.keep = SYNTHETIC[workload]
        self.live = [{"i": i, "v": [i]} for i in range(live // 2)]  # 2 tracked containers each
        self.garbage = int(garbage * (1 + 0.1 * rank))  # each rank makes 10 % more: collections drift apart
        self.alive: collections.deque[list] = collections.deque(maxlen=max(self.keep, 1))
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        self.x, self.y = torch.randn(BATCH, 256), torch.randint(0, 10, (BATCH,))

    def wrap(self, wrap: Any) -> None:
        import torch

        self.model = wrap(self.model)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)

    def step(self) -> None:
        import torch

        if self.keep:
            batch = []
            for _ in range(self.garbage):  # a cycle of two containers, as a node and its parent
                c: list = []
                c.append([c])
                batch.append(c)
            self.alive.append(batch)  # the cycles outlive this step by a few steps
            del batch
        else:
            for _ in range(self.garbage):  # each cycle is garbage as soon as the next one is made
                c = []
                c.append(c)
        del c
        loss = torch.nn.functional.cross_entropy(self.model(self.x), self.y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()


class NanoGPT:
    """``nanogpt``: a 2-layer GPT (n_embd 64, block 64, batch 8) fed by a DataLoader whose dataset
    tokenizes text on the fly in the training process (a word-level tokenizer: split, dict lookups, lists
    of ids and of (start, end) offsets, a dict per sample): the Python garbage a real input pipeline leaves beside autograd's."""

    def __init__(self, workload: str, rank: int) -> None:
        import torch

        torch.manual_seed(0)
        words = [f"w{i}" for i in range(2000)]
        rng = np.random.default_rng(rank)
        self.lines = [" ".join(words[j] for j in rng.integers(0, 2000, 80)) for _ in range(4000)]
        self.vocab = {w: i for i, w in enumerate(words)}
        layer = torch.nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True)
        self.model = torch.nn.Sequential(torch.nn.Embedding(2000, 64), torch.nn.TransformerEncoder(layer, 2),
                                         torch.nn.Linear(64, 2000))  # fmt: skip
        loader = torch.utils.data.DataLoader(self, batch_size=8, shuffle=True, num_workers=0,
                                             collate_fn=self.collate)  # fmt: skip
        self.loader = loader
        self.it = iter(loader)

    def __len__(self) -> int:
        return len(self.lines)

    def __getitem__(self, i: int) -> dict[str, Any]:
        line = self.lines[i]
        words = line.split()[:65]
        ids = [self.vocab[w] for w in words]
        offsets, pos = [], 0
        for w in words:  # (start, end) of every token in the text, as tokenizers return them
            offsets.append((pos, pos + len(w)))
            pos += len(w) + 1
        return {"ids": ids, "offsets": offsets, "text": line, "meta": {"index": i, "n": len(ids)}}

    @staticmethod
    def collate(samples: list[dict[str, Any]]) -> Any:
        import torch

        t = torch.tensor([s["ids"] for s in samples])
        return t[:, :-1], t[:, 1:]

    def wrap(self, wrap: Any) -> None:
        import torch

        self.model = wrap(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def step(self) -> None:
        import torch

        try:
            x, y = next(self.it)
        except StopIteration:
            self.it = iter(self.loader)
            x, y = next(self.it)
        logits = self.model(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()


def gc_worker(args: argparse.Namespace) -> None:
    """One process of the GC workload: alone (``--ddp`` off) or one rank of a DDP job (through the harness)."""
    import torch
    import torch.distributed as dist

    from hyperacc.stabilize import stabilize

    rank = 0
    if args.ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP

        dist.init_process_group("gloo")
        rank = dist.get_rank()
    torch.set_num_threads(1)
    work = (NanoGPT if args.workload == "nanogpt" else Synthetic)(args.workload, rank)
    work.wrap(DDP if args.ddp else (lambda m: m))
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
    if args.ddp:
        dist.barrier()
    t0 = time.perf_counter()
    for step in range(args.steps):
        a = time.perf_counter()
        if titan is not None:
            titan.run(step + 1)  # torchtitan calls it at the start of each step, counting from 1
        work.step()
        if stab is not None:
            stab.step(step)
        step_ms.append((time.perf_counter() - a) * 1e3)
        if step == WARMUP - 1:
            pauses.clear()  # GC time counted after warm-up (the freeze is in it)
            t0 = time.perf_counter()
    loop_s = time.perf_counter() - t0
    gc.callbacks.remove(on_gc)
    summary = stab.close() if stab is not None else None
    result = {"rank": rank, "step_ms": step_ms, "pauses_ms": [p * 1e3 for p in pauses], "loop_s": loop_s,
              "interval": None if summary is None else summary["gc"].get("interval")}  # fmt: skip
    if args.ddp:
        harness.write_result(result)
        harness.finish()
    else:
        Path(args.out).write_text(json.dumps(result))


def run_gc_once(workload: str, variant: str, steps: int, nproc: int, timeout: float) -> list[dict[str, Any]]:
    args = ["--worker", "--workload", workload, "--variant", variant, "--steps", str(steps)]
    if nproc > 1:
        return launch(Path(__file__), [*args, "--ddp"], {}, timeout, nproc=nproc)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        subprocess.run([sys.executable, __file__, *args, "--out", str(out)], check=True, timeout=timeout)
        return [json.loads(out.read_text())]


def ratio_interval(ratios: list[float]) -> str:
    """Median of the paired ratios and a 90 % interval of their mean (t on the logs): ``1.01 [0.99, 1.03]``."""
    logs = np.log(np.asarray(ratios))
    mid = float(np.exp(np.median(logs)))
    if len(logs) < 2:
        return f"{mid:.3f}"
    from scipy import stats

    half = stats.t.ppf(0.95, len(logs) - 1) * logs.std(ddof=1) / np.sqrt(len(logs))
    return f"{mid:.3f} [{np.exp(logs.mean() - half):.3f}, {np.exp(logs.mean() + half):.3f}]"


def gc_bench(workload: str, steps: int, nproc: int, repeats: int, timeout: float) -> dict[str, Any]:
    names = list(GC_VARIANTS)
    where = f"a DDP job of {nproc} ranks" if nproc > 1 else "one process"
    print(f"\n== deterministic GC, workload '{workload}', {where}: {steps} steps x {repeats} rounds, "
          "the schemes in turn (order reversed every other round) ==")  # fmt: skip
    per: dict[str, dict[str, list]] = {n: {"step": [], "gc_s": [], "max_ms": [], "total": [], "interval": []}
                                       for n in names}  # fmt: skip
    for rnd in range(repeats):
        for name in names if rnd % 2 == 0 else names[::-1]:
            results = run_gc_once(workload, name, steps, nproc, timeout)
            ms = np.max([np.asarray(r["step_ms"])[WARMUP:] for r in results], axis=0)  # the job's step: slowest rank
            per[name]["step"].append(ms)
            per[name]["total"].append(max(r["loop_s"] for r in results))
            per[name]["gc_s"].append(np.mean([sum(r["pauses_ms"]) / 1e3 for r in results]))
            per[name]["max_ms"].append(max((max(r["pauses_ms"], default=0.0) for r in results), default=0.0))
            per[name]["interval"].append(results[0]["interval"])
    rows, out = [], {}
    base_total = per[BASE]["total"]
    base_tail = None
    for n in names:
        ms = np.concatenate(per[n]["step"])
        tails = [float(np.percentile(m, 99) / np.median(m)) for m in per[n]["step"]]
        tail = float(np.median(tails))
        base_tail = tail if n == BASE else base_tail
        ratios = [t / b for t, b in zip(per[n]["total"], base_total, strict=True)]
        interval = {"automatic GC": "-", "torchtitan gc_freq=50": "50 (gen 1)"}.get(n, str(per[n]["interval"][-1]))
        rows.append([n, interval, f"{np.median(per[n]['total']):.2f}", "1" if n == BASE else ratio_interval(ratios),
                     f"{np.median(ms):.2f}", f"{tail:.1f}", "1" if n == BASE else f"{tail / base_tail:.2f}",
                     f"{np.mean(per[n]['gc_s']):.2f}", f"{max(per[n]['max_ms']):.0f}"])  # fmt: skip
        out[n] = {"total_ratio": ratios, "tail": tail}
    print_table(["scheme", "interval", "total s", "total vs automatic [90% CI]", "step p50 ms", "p99/p50",
                 "p99/p50 vs automatic", "GC s", "longest pause ms"], rows)  # fmt: skip
    print("total: the loop's wall time after warm-up (the slowest rank's); p99/p50 of the job's step (the slowest rank's)"
          ", median over rounds; GC s: pauses gc.callbacks saw, mean over ranks; interval: the agreed one for auto")
    return out


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
    p.add_argument("--repeats", type=int, default=None, help="rounds per variant (alternating order)")
    p.add_argument("--only", choices=["gc", "memory"], default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ddp", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--workload", choices=[*GC_WORKLOADS, "all"], default="all", help="GC workload(s)")
    p.add_argument("--nproc", type=int, choices=[1, 2], default=None,
                   help="GC part: 1 (one process) or 2 (DDP); both when not given")  # fmt: skip
    args = p.parse_args()
    if args.worker:
        gc_worker(args)
        return 0
    print(machine())
    t0 = time.monotonic()
    if args.only in (None, "gc"):
        for nproc in [args.nproc] if args.nproc else [1, 2]:
            repeats = args.repeats or ((3 if nproc > 1 else 5) if args.quick else (5 if nproc > 1 else 9))
            for workload in GC_WORKLOADS if args.workload == "all" else [args.workload]:
                # cycles: long enough that the one-off costs (the freeze, auto's calibration) weigh no more
                # than in a run of thousands of steps; survivors: 400 steps, where CPython's own full
                # collections (one in about 80 steps) are more than 1 % of the steps and show in p99
                # (over 1,000 steps they fall under it); --quick: 2/5 of these
                steps = {"cycles": 1000}.get(workload, 400)
                gc_bench(workload, steps=steps * 2 // 5 if args.quick else steps, nproc=nproc, repeats=repeats, timeout=600)
    if args.only in (None, "memory"):
        repeats = args.repeats or (1 if args.quick else 2)
        if args.quick:
            memory_bench(steps=150, interval=50, burst_mb=128, repeats=repeats, timeout=300)
        else:
            memory_bench(steps=600, interval=50, burst_mb=128, repeats=repeats, timeout=600)
    print(f"\n{machine()}\ntotal {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

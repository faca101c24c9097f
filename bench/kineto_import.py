"""Kineto trace import: hyperacc's streaming scan vs loading the whole JSON (what a user would write).

Baseline: ``json.load`` of the trace, then one pass over the event dicts collecting the same CUDA
runtime latencies (HolisticTraceAnalysis and most scripts load the whole document this way). Each
measurement runs in a fresh interpreter so its peak RSS is its own. Inputs: the real fixtures in
tests/fixtures/kineto and larger traces made from the NCCL fixture by repeating its steps
(timestamps, step numbers and correlation ids shifted), gzip-compressed like real traces.

    .venv/bin/python bench/kineto_import.py           # fixtures + 200 MB and 1 GB traces
    .venv/bin/python bench/kineto_import.py --quick   # fixtures + a 100 MB trace (< 60 s)
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _machine import describe as machine

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
FIXTURES = ROOT / "tests" / "fixtures" / "kineto"
BASELINE_LIMIT = 600e6  # bytes of JSON text; json.load of more would need ~10x that in RAM


def measure(kind: str, path: str) -> dict:
    """Runs inside the child. Imports happen before the clock starts and the RSS mark is taken."""
    from hyperacc.present.kineto import scan_trace

    start_rss = _reset_peak_rss()
    t0 = time.perf_counter()
    if kind == "hyperacc":
        tr = scan_trace(path)
        events, steps = tr.events_seen, tr.steps.num_rows
    else:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            doc = json.load(f)
        lat: dict[str, list[float]] = {}
        steps = 0
        for ev in doc["traceEvents"]:
            if ev.get("cat") == "cuda_runtime":
                lat.setdefault(ev["name"], []).append(ev.get("dur", 0.0))
            elif str(ev.get("name", "")).startswith("ProfilerStep#"):
                steps += 1
        for v in lat.values():
            v.sort()
        events = len(doc["traceEvents"])
    wall = time.perf_counter() - t0
    rss = _status_mb("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"wall_s": wall, "rss_mb": rss, "extra_mb": rss - start_rss, "events": events, "steps": steps}


def _status_mb(field: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _reset_peak_rss() -> float:
    """Resets the peak-RSS mark (Linux: clear_refs 5) so imports do not hide the work's own peak;
    returns the RSS now, in MB."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return _status_mb("VmRSS") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_child(kind: str, path: Path) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", kind, str(path)], capture_output=True, text=True
    )
    if out.returncode:
        return {
            "error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"
        }
    return json.loads(out.stdout.strip().splitlines()[-1])


def make_big(src: Path, copies: int, dest: Path) -> int:
    """A trace of ``copies`` repetitions of ``src``'s events, as one longer profiling window."""
    with gzip.open(src, "rt") as f:
        doc = json.load(f)
    events = doc.pop("traceEvents")
    body = ",\n".join(json.dumps(ev) for ev in events)
    head = json.dumps(doc)[:-1] + ', "traceEvents": [\n'
    span = 1_000_000.0  # us between copies
    ts_re = re.compile(r'"ts": ([0-9.]+)')
    corr_re = re.compile(r'"(correlation|id|External id)": (\d+)')
    step_re = re.compile(r"ProfilerStep#(\d+)")
    size = len(head) + 2
    with gzip.open(dest, "wt", compresslevel=1) as f:
        f.write(head)
        for k in range(copies):
            part = ts_re.sub(lambda m, k=k: f'"ts": {float(m.group(1)) + k * span:.3f}', body)
            part = corr_re.sub(lambda m, k=k: f'"{m.group(1)}": {int(m.group(2)) + k * 10_000_000}', part)
            part = step_re.sub(lambda m, k=k: f"ProfilerStep#{int(m.group(1)) + k * 100}", part)
            f.write(part + (",\n" if k < copies - 1 else "\n"))
            size += len(part) + 2
        f.write("]}")
    return size


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--child", nargs=2, metavar=("KIND", "PATH"))
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(*args.child)))
        return
    if not FIXTURES.is_dir():
        print(f"fixtures not found in {FIXTURES}; nothing to measure")
        return
    print(f"machine: {machine()}")
    inputs = [(f, len(gzip.open(f, "rb").read())) for f in sorted(FIXTURES.glob("*.json.gz"))]
    tmp = Path(tempfile.mkdtemp(prefix="hyperacc-bench-kineto-"))
    nccl = FIXTURES / "nccl_2rank_rank0.json.gz"
    for mb in [100] if args.quick else [200, 1000]:
        copies = max(1, round(mb * 1e6 / 9.78e6))
        dest = tmp / f"nccl_x{copies}.json.gz"
        t0 = time.perf_counter()
        size = make_big(nccl, copies, dest)
        print(f"made {dest.name}: {size / 1e6:.0f} MB of JSON ({dest.stat().st_size / 1e6:.0f} MB gzip) in "
              f"{time.perf_counter() - t0:.0f} s")  # fmt: skip
        inputs.append((dest, size))

    rows = []
    for path, size in inputs:
        ours = run_child("hyperacc", path)
        base = run_child("json.load", path) if size <= BASELINE_LIMIT else {"error": "not run (too large)"}
        rows.append((path.name, size, ours, base))
        print(f"  {path.name}: done", flush=True)

    print(f"\n{'trace':<26}{'JSON MB':>8}{'events':>11} | {'hyperacc s':>10}{'MB/s':>6}{'+MB':>6} | "
          f"{'json.load s':>11}{'MB/s':>6}{'+MB':>7} | {'time ratio':>10}{'memory ratio':>13}")  # fmt: skip
    for name, size, ours, base in rows:
        if "error" in ours:
            print(f"{name:<28} hyperacc failed: {ours['error']}")
            continue
        line = (f"{name:<26}{size / 1e6:>8.0f}{ours['events']:>11,} | {ours['wall_s']:>10.2f}"
                f"{size / 1e6 / ours['wall_s']:>6.0f}{ours['extra_mb']:>6.0f} | ")  # fmt: skip
        if "error" in base:
            line += f"{base['error']:>24} |"
        else:
            line += (f"{base['wall_s']:>11.2f}{size / 1e6 / base['wall_s']:>6.0f}{base['extra_mb']:>7.0f} | "
                     f"{base['wall_s'] / ours['wall_s']:>9.2f}x{base['extra_mb'] / max(ours['extra_mb'], 1):>12.1f}x")  # fmt: skip
        print(line)
    print("\n+MB: peak RSS above the RSS after imports (the memory the import itself needs). "
          "Ratios: json.load / hyperacc (above 1: hyperacc is faster / needs less memory).")  # fmt: skip
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()


if __name__ == "__main__":
    main()

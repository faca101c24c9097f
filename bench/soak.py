"""Reliability soak: a long traced job beside the same job untraced (memory, time, rows kept), then the
reliability suite's fuzzing with many more inputs and its fault matrix with other seeds.

    .venv/bin/python bench/soak.py           # 20,000 steps; 300 fuzz inputs per command; 3 fault seeds
    .venv/bin/python bench/soak.py --quick   # 2,000 steps; 60 fuzz inputs per command; 1 fault seed

The job is examples/train_ddp.py with 2 gloo ranks, through ``hyperacc run`` (traced) and through
torchrun alone (untraced), one after the other. Each rank's resident memory is sampled every second;
"growth" is the median of the last fifth of the run minus the median of its second fifth (after
start-up). docs/reliability.md quotes these figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from _machine import describe as machine  # noqa: E402

EXAMPLE = ROOT / "examples" / "train_ddp.py"


def _job(cmd: list[str], env: dict[str, str]) -> tuple[int, float, dict[int, list[tuple[float, float]]]]:
    """Run ``cmd``; (exit status, seconds, per rank pid: [(seconds, RSS MiB)])."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    launcher = psutil.Process(proc.pid)
    samples: dict[int, list[tuple[float, float]]] = {}
    while proc.poll() is None:
        try:
            kids = [c for c in launcher.children(recursive=True) if str(EXAMPLE) in " ".join(c.cmdline())]
            for c in kids:
                if "torch.distributed.run" in c.cmdline():
                    continue
                samples.setdefault(c.pid, []).append((time.monotonic() - t0, c.memory_info().rss / 2**20))
        except psutil.Error:
            pass
        time.sleep(1.0)
    return proc.returncode, time.monotonic() - t0, samples


def _growth(series: list[tuple[float, float]]) -> tuple[float, float]:
    """(median RSS MiB of the second fifth, of the last fifth)."""
    n = len(series)
    if n < 10:
        return float("nan"), float("nan")
    early = [m for _, m in series[n // 5 : 2 * n // 5]]
    late = [m for _, m in series[4 * n // 5 :]]
    return statistics.median(early), statistics.median(late)


def memory(steps: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    script = [str(EXAMPLE), "--steps", str(steps), "--features", "64", "--hidden", "64"]
    with tempfile.TemporaryDirectory(prefix="hyperacc-soak-") as tmp:
        run_dir = Path(tmp) / "run"
        traced = [sys.executable, "-m", "hyperacc", "run", "--run-dir", str(run_dir), "--nproc-per-node", "2",
                  "--", *script]  # fmt: skip
        plain = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *script]
        results = {}
        for name, cmd in (("untraced (torchrun)", plain), ("traced (hyperacc run)", traced)):
            results[name] = _job(cmd, env)
        from hyperacc.analysis.columns import discover, read_rank

        layout = discover(run_dir)
        rows = {r: read_rank(s.segments, ("step",))["step"].size for r, s in layout.sources.items()}
    print(f"\n{steps} steps, 2 ranks, examples/train_ddp.py (64 features)")
    print(f"{'job':24s} {'exit':>4s} {'seconds':>8s} {'RSS early MiB':>14s} {'RSS late MiB':>13s} {'growth MiB':>10s}")
    for name, (code, secs, samples) in results.items():
        for pid, series in sorted(samples.items()):
            early, late = _growth(series)
            print(f"{name:24s} {code:4d} {secs:8.1f} {early:14.1f} {late:13.1f} {late - early:10.1f}  (pid {pid})")
    t_plain, t_traced = results["untraced (torchrun)"][1], results["traced (hyperacc run)"][1]
    print(f"traced / untraced wall time: {t_traced / t_plain:.2f}")
    print(f"rows kept per rank: {rows} of {steps}")


def suite(what: str, env: dict[str, str]) -> int:
    t0 = time.monotonic()
    code = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", what], cwd=ROOT,
                           env={**os.environ, **env})  # fmt: skip
    print(f"{what} with {env}: exit {code} in {time.monotonic() - t0:.0f} s", flush=True)
    return code


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: memory, fuzz, faults")
    args = ap.parse_args()
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    print(f"machine: {machine()}")
    failed = 0
    if "memory" not in skip:
        memory(args.steps or (2_000 if args.quick else 20_000))
    if "fuzz" not in skip:
        examples = "60" if args.quick else "300"
        for what in ("tests/reliability/test_cli_fuzz.py", "tests/reliability/test_rundir_fuzz.py"):
            failed |= suite(what, {"HYPERACC_FUZZ_EXAMPLES": examples, "HYPERACC_FUZZ_RANDOM": "1"})
    if "faults" not in skip:
        for seed in range(1, 2 if args.quick else 4):
            failed |= suite("tests/reliability/test_faults.py", {"HYPERACC_FAULT_SEED": str(seed), "HYPERACC_FAULTS": "all"})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

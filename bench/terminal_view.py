"""What a progress bar's redraws cost the launcher: plain ``torchrun`` against ``hyperacc run`` (its
supervisor reads the job's output and redraws the lines above its live panel).

One rank runs bench/workers/redraw.py, which redraws one line ``--updates`` times (about 100 bytes each,
carriage return, flushed); the same job with 0 updates gives the fixed cost of launching, which is
subtracted. The whole process tree's CPU time (launcher, torchrun, rank) comes from
bench/workers/tree_usage.py; the arms alternate. Both run in a pseudo-terminal that the bench drains as a
terminal emulator would: there ``hyperacc run`` shows its live panel and passes the job's output through
its own pipe, the path whose cost this measures. Printed: CPU per arm and the redraws' share of it, and the ratio of
hyperacc's redraw CPU to plain torchrun's (issue 20's bar: under 2x).

    .venv/bin/python bench/terminal_view.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import pty
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _machine import describe as machine

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def run(arm: str, updates: int, work: Path) -> float:
    """CPU seconds of the whole process tree of one launch."""
    script = [str(HERE / "workers" / "redraw.py"), "--updates", str(updates)]
    if arm == "plain torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", *script]
    else:
        run_dir = Path(tempfile.mkdtemp(dir=work)) / "run"
        cmd = [sys.executable, "-m", "hyperacc", "run", "--run-dir", str(run_dir), "--nproc-per-node", "1",
               "--", *script]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), COLUMNS="120", LINES="40", TERM="xterm-256color")
    master, slave = pty.openpty()  # a terminal: hyperacc run shows its live panel and pipes the job through it
    err_file = work / f"err-{time.monotonic_ns()}"
    with open(err_file, "wb") as err_out:
        proc = subprocess.Popen([sys.executable, str(HERE / "workers" / "tree_usage.py"), *cmd], env=env,
                                stdin=slave, stdout=slave, stderr=err_out, start_new_session=True)  # fmt: skip
        os.close(slave)
        chunks = []
        while True:  # drain the terminal as an emulator would, until the last writer closes it
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        proc.wait(timeout=600)
    os.close(master)
    out, err = b"".join(chunks), err_file.read_bytes()
    tree = json.loads(err.decode(errors="replace").strip().splitlines()[-1])
    if tree["rc"] != 0:
        raise SystemExit(f"{arm} failed (exit {tree['rc']}): {err.decode(errors='replace')[-2000:]}")
    if updates and f"{updates}/{updates}".encode() not in out:
        raise SystemExit(f"{arm}: the last redraw did not reach the output")
    return float(tree["cpu_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 rounds")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--updates", type=int, default=20_000)
    args = p.parse_args()
    rounds = 2 if args.quick else args.rounds
    arms = ["plain torchrun", "hyperacc run"]
    print(f"machine: {machine()}")
    print(f"\n== {args.updates:,} carriage-return redraws of one line, 1 rank, {rounds} rounds, arms alternated ==")
    cpu: dict[tuple[str, int], list[float]] = {(a, u): [] for a in arms for u in (0, args.updates)}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(rounds):
            for arm in arms if rnd % 2 == 0 else arms[::-1]:
                for updates in (0, args.updates):
                    cpu[(arm, updates)].append(run(arm, updates, Path(tmp)))
    print(f"{'arm':<16} {'CPU, no output s':>17} {'CPU, redraws s':>15} {'redraws cost s':>15}")
    cost = {}
    for arm in arms:
        base = statistics.median(cpu[(arm, 0)])
        full = statistics.median(cpu[(arm, args.updates)])
        cost[arm] = max(full - base, 1e-3)
        print(f"{arm:<16} {base:>17.2f} {full:>15.2f} {full - base:>15.2f}")
    ratio = cost["hyperacc run"] / cost["plain torchrun"]
    print(f"redraw CPU, hyperacc run / plain torchrun: {ratio:.2f}x (medians of {rounds} rounds; the whole "
          "process tree: launcher, torchrun and the rank writing the output; a difference under about 0.1 s "
          "is this machine's run-to-run noise)")
    print(f"\nbench/terminal_view.py took {time.monotonic() - t0:.0f} s; load average now "
          f"{', '.join(f'{v:.1f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()

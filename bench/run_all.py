"""``make bench``: run every benchmark under bench/ in turn and print their side-by-side tables.

Each benchmark compares hyperacc with the baseline a user would otherwise use, in one run, and prints
ratios. By default each runs in its ``--quick`` mode (sized for a 2-core machine); ``BENCH_FULL=1``
runs the full sizes. ``BENCH_ONLY=sampler,yuv`` selects some.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    only = {s.strip() for s in os.environ.get("BENCH_ONLY", "").split(",") if s.strip()}
    full = os.environ.get("BENCH_FULL") == "1"
    scripts = sorted(p for p in HERE.glob("*.py") if p.name != "run_all.py" and not p.name.startswith("_"))
    if only:
        scripts = [p for p in scripts if p.stem in only]
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}")
    failed = []
    for script in scripts:
        print(f"\n=== bench/{script.name} ({'full' if full else 'quick'}) ===", flush=True)
        t0 = time.monotonic()
        rc = subprocess.call([sys.executable, str(script), *([] if full else ["--quick"])], cwd=HERE.parent)
        print(f"--- bench/{script.name}: exit {rc} in {time.monotonic() - t0:.0f} s", flush=True)
        if rc:
            failed.append(script.name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""A job that only redraws a progress line, tqdm-style: ``--updates`` carriage-return redraws of about
100 bytes each, flushed one by one, then a newline (bench/terminal_view.py)."""

from __future__ import annotations

import argparse
import sys

p = argparse.ArgumentParser()
p.add_argument("--updates", type=int, default=20_000)
n = p.parse_args().updates
for i in range(1, n + 1):
    bar = "#" * (40 * i // n)
    sys.stdout.write(f"\rtraining: {100 * i // n:3d}%|{bar:<40}| {i}/{n} [00:01<00:00, 9999.99it/s]")
    sys.stdout.flush()
sys.stdout.write("\n")

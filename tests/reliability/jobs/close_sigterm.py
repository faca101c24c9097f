"""One traced process that records STEPS steps, then closes the tracer (run by test_faults.py).

argv: RUN_DIR STEPS. Prints "closing" just before ``Tracer.close()`` and "closed" after it, so the
test can send SIGTERM while the tracer is closing. Nothing is flushed before close (no periodic
flush, a ring large enough for every step): every row depends on close, or on the SIGTERM handler.
"""

from __future__ import annotations

import sys
import time

from hyperacc.trace import Tracer


def main() -> None:
    run_dir, steps = sys.argv[1], int(sys.argv[2])
    tracer = Tracer(run_dir, rank=0, world_size=1, flush_every_s=3600, window=0, probe_every=0,
                    capacity=4 * steps)  # fmt: skip
    for _ in range(steps):
        with tracer.step():
            with tracer.phase("forward"):
                pass
    print("closing", flush=True)
    tracer.close()
    print("closed", flush=True)
    time.sleep(60)  # the test's SIGTERM ends it (the default action, after the tracer's handler)


if __name__ == "__main__":
    main()

"""Device-side phase times on CUDA: events recorded on the current stream, read back lazily.

Each traced step gets a slot of preallocated ``torch.cuda.Event`` objects. Phase boundaries record
events; ``resolve`` runs at the start of later steps and reads a slot only once every one of its
events reports ``query() == True``, so the host never waits for the device. Until a step is resolved
its row keeps the host-measured values and is not flushed; a step that finds every slot still pending
(the device is more than ``steps`` steps behind) keeps its host values. ``close`` may synchronise:
it runs when the job ends. docs/tracing.md, "Device timing".
"""

from __future__ import annotations

import numpy as np

from hyperacc.schema import STEP_COLUMNS

_STEP_NS = STEP_COLUMNS.index("step_ns")


class CudaStepTimer:
    def __init__(self, steps: int = 32, pairs: int = 24) -> None:
        import torch

        self.steps, self.pairs = steps, pairs
        per_slot = 2 * pairs + 2
        self.events = [[torch.cuda.Event(enable_timing=True) for _ in range(per_slot)] for _ in range(steps)]
        self.n_events = [0] * steps
        self.n_pairs = [0] * steps
        self.pair_col = np.zeros((steps, pairs), np.int64)
        self.pair_a = np.zeros((steps, pairs), np.int64)
        self.pair_b = np.zeros((steps, pairs), np.int64)
        self.row = [-1] * steps
        self.head = 0  # slots opened
        self.tail = 0  # slots resolved
        self.cur = -1  # slot of the step in progress, -1 when it has none
        self._sums = np.zeros(len(STEP_COLUMNS), np.float64)
        self._seen = np.zeros(len(STEP_COLUMNS), bool)

    def begin_step(self) -> int:
        """Open a slot and record the step's start event; returns its token (0) or -1 without a slot."""
        if self.head - self.tail >= self.steps:
            self.cur = -1
            return -1
        k = self.head % self.steps
        self.cur = k
        self.n_events[k] = 0
        self.n_pairs[k] = 0
        return self.mark()

    def mark(self) -> int:
        k = self.cur
        if k < 0:
            return -1
        n = self.n_events[k]
        if n >= len(self.events[k]):
            return -1
        self.events[k][n].record()
        self.n_events[k] = n + 1
        return n

    def pair(self, col: int, a: int, b: int) -> None:
        k = self.cur
        if k < 0 or a < 0 or b < 0:
            return
        n = self.n_pairs[k]
        if n >= self.pairs:
            return
        self.pair_col[k, n] = col
        self.pair_a[k, n] = a
        self.pair_b[k, n] = b
        self.n_pairs[k] = n + 1

    def end_step(self, row: int) -> bool:
        """Close the step's slot (its whole-step pair included); False when the step had no slot."""
        k = self.cur
        if k < 0:
            return False
        self.pair(_STEP_NS, 0, self.mark())
        self.row[k] = row
        self.head += 1
        self.cur = -1
        return True

    def oldest_pending_row(self) -> int | None:
        return self.row[self.tail % self.steps] if self.tail < self.head else None

    def resolve(self, buf: list[list[int]], capacity: int, *, wait: bool = False) -> None:
        """Write device times of completed slots into their rows of ``buf`` (oldest first)."""
        while self.tail < self.head:
            k = self.tail % self.steps
            events = self.events[k]
            n = self.n_pairs[k]
            if wait:
                for i in range(self.n_events[k]):
                    events[i].synchronize()
            elif not all(events[int(self.pair_b[k, i])].query() for i in range(n)):
                return
            sums, seen = self._sums, self._seen
            sums.fill(0.0)
            seen.fill(False)
            for i in range(n):
                col = int(self.pair_col[k, i])
                sums[col] += events[int(self.pair_a[k, i])].elapsed_time(events[int(self.pair_b[k, i])])
                seen[col] = True
            row = buf[self.row[k] % capacity]
            for col in np.flatnonzero(seen).tolist():
                row[col] = max(int(sums[col] * 1e6), 0)  # elapsed_time is in milliseconds
            self.tail += 1

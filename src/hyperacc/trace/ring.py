"""Finished step rows between the training thread and the flusher: a preallocated ring, no lock.

Rows are Python lists of ints: copying a finished row in (``buf[slot][:] = row``) is a single C-level
slice assignment, atomic under the GIL and cheaper than filling a numpy row. The writer (training
thread) fills ``buf[head % capacity]`` then advances ``head``; rows below ``ready`` are final (on CUDA
rows wait for their device times). The reader (flusher thread) copies ``[tail, ready)`` and discards
any row the writer may have overwritten while it copied, counting it as dropped.
"""

from __future__ import annotations

import time
from time import perf_counter_ns

import numpy as np

from hyperacc.trace.columns import MEASURED_PHASES, NCOLS, NODE, OTHER_NS, RANK, STEP_NS, T_START


class StepRing:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.buf: list[list[int]] = [[-1] * NCOLS for _ in range(capacity)]
        self.head = 0
        self.ready = 0
        self.tail = 0
        self.dropped = 0

    def commit(self, row: list[int]) -> int:
        """Copy a finished row in (training thread); returns its index."""
        index = self.head
        self.buf[index % self.capacity][:] = row
        self.head = index + 1
        return index

    def take(self, writer_stopped: bool = False) -> np.ndarray:
        """Rows ``[tail, ready)`` as an int64 matrix (flusher thread)."""
        ready, tail, cap = self.ready, self.tail, self.capacity
        if ready - tail > cap:
            self.dropped += ready - tail - cap
            tail = ready - cap
        if ready <= tail:
            return np.zeros((0, NCOLS), np.int64)
        buf = self.buf
        rows = np.array([buf[i % cap] for i in range(tail, ready)], dtype=np.int64)
        # The writer may be filling row ``head`` (slot of ``head - cap``) right now: every row with an
        # index <= head - cap may have been overwritten during the copy (< head - cap once it stopped).
        stale = self.head - cap + (0 if writer_stopped else 1) - tail
        if stale > 0:
            self.dropped += min(stale, len(rows))
            rows = rows[stale:]
        self.tail = ready
        return rows


def finish_rows(rows: np.ndarray, rank: int, node: int) -> np.ndarray:
    """Committed int64 rows as written to disk (in place): the rank and node, ``t_start_ns`` on the wall
    clock (perf_counter_ns while recording, one clock read per step) and ``other_ns``, the rest of the
    step. -1 stays "not measured" (``records.to_table`` makes it null)."""
    rows[:, RANK] = rank
    rows[:, NODE] = node
    started = rows[:, T_START] >= 0
    rows[:, T_START] = np.where(started, rows[:, T_START] + (time.time_ns() - perf_counter_ns()), -1)
    step_ns = rows[:, STEP_NS]
    phases = rows[:, list(MEASURED_PHASES)]
    measured = np.where(phases > 0, phases, 0).sum(axis=1)
    rows[:, OTHER_NS] = np.where(step_ns >= 0, np.maximum(step_ns - measured, 0), -1)
    return rows

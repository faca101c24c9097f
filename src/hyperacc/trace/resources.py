"""Resources of one rank (memory and CPU, CUDA memory), sampled from the flusher thread, never the
training thread: about once a second a few counters are read and kept as a RESOURCE_SCHEMA row, written
beside the step records with each flush. docs/tracing.md, "Resources".
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import numpy as np


class ResourceSampler:
    def __init__(self, rank: int, node: int, every_s: float = 1.0) -> None:
        import psutil

        self.rank, self.node, self.every_s = rank, node, every_s
        self._proc = psutil.Process()
        self._rows: deque[tuple[int, ...]] = deque()
        self._next = 0.0
        self.cuda_device: Any = None  # set once the script has initialised CUDA

    def due_now(self) -> None:
        """Make the next ``maybe_sample`` take a sample (a last one at close)."""
        self._next = 0.0

    def maybe_sample(self, step: int) -> None:
        """Take a sample when one is due (flusher thread)."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.every_s
        self.sample(step)

    def sample(self, step: int) -> None:
        rss = self._proc.memory_info().rss
        cpu = self._proc.cpu_times()
        allocated = reserved = peak = -1
        if self.cuda_device is not None:
            import torch

            allocated = torch.cuda.memory_allocated(self.cuda_device)
            reserved = torch.cuda.memory_reserved(self.cuda_device)
            peak = torch.cuda.max_memory_allocated(self.cuda_device)
        cpu_ns = int((cpu.user + cpu.system) * 1e9)
        self._rows.append((time.time_ns(), step, rss, cpu_ns, allocated, reserved, peak))

    def take(self) -> np.ndarray | None:
        """The samples taken since the last call as RESOURCE_SCHEMA int64 rows (-1: not measured), or
        None when there are none."""
        rows = self._rows
        if not rows:
            return None
        batch = []
        while rows:
            batch.append((self.rank, self.node) + rows.popleft())
        return np.array(batch, dtype=np.int64)

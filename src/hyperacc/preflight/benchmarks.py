"""The measurements one rank makes on its own: compute, memory, dispatch, jitter, copies, reads.

Each benchmark repeats one unit of work until its time slice ends and returns the round's cost: the
median over repetitions of nanoseconds per repetition (docs/doctor.md, "What is measured"). Host work is
timed in process CPU time, so a rank that merely shares its cores with other ranks (preemption) is not
made to look slow; device work, copies and reads are timed on the wall clock. The share of wall time a
rank actually ran is kept as the contention figure.

Fault injection reaches these measurements the way a slow host would (``hyperacc.chaos``, explicit
API): every repetition of host work is framed by ``compute_begin``/``compute_end`` (a ``slowdown``
burns its share of CPU, a ``spike`` its extra milliseconds), and every read by ``step_begin`` and
``data`` (``cold_read``, ``data_stall``).
"""

from __future__ import annotations

import os
import random
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

_MAX_FILES = 10_000  # files of the data path considered (walking stops there)


class NoChaos:
    """Stands in for ``hyperacc.chaos.Chaos`` when no fault is configured."""

    def step_begin(self, step: int) -> None:
        pass

    def compute_begin(self) -> None:
        pass

    def compute_end(self, step: int | None = None, compute_ns: int | None = None) -> None:
        pass

    def data(self, step: int | None = None) -> None:
        pass


class RoundResult(dict):
    """``{"cost_ns": median per repetition, "work": units per repetition, "reps", "cpu_share"}``."""


class LocalBenchmarks:
    """The per-rank benchmarks, prepared once (buffers, calibration) and run once per round."""

    def __init__(self, device: torch.device, opts: Any, chaos: Any, rank: int) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.opts = opts
        self.chaos = chaos if chaos is not None else NoChaos()
        self.rank = rank
        self._step = 0
        self.skipped: dict[str, str] = {}
        n = opts.matmul_n or (4096 if self.cuda else 256)
        dtype = torch.bfloat16 if self.cuda else torch.float32
        g = torch.Generator().manual_seed(rank)
        self._a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
        self._b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
        self._c = torch.empty(n, n, device=device, dtype=dtype)
        self._matmuls = 8 if self.cuda else 1  # per repetition: enough device work to time on a GPU
        self.matmul_work = 2.0 * n**3 * self._matmuls
        elems = opts.memory_mb * 2**20 // 4
        self._src = torch.ones(elems, dtype=torch.float32)
        self._dst = torch.empty_like(self._src)
        self.memory_work = 2.0 * elems * 4  # bytes read + written
        self._tiny = [torch.zeros(1, device=device), torch.ones(1, device=device), torch.empty(1, device=device)]
        self._dispatch_ops = 64
        if self.cuda:
            self._pinned = torch.empty(elems, dtype=torch.float32).pin_memory()
            self._dev = torch.empty(elems, dtype=torch.float32, device=device)
        else:
            for name in ("h2d", "d2h"):
                self.skipped[name] = "no CUDA device on this rank: host-device copies not measured"
        self._files = self._data_files(opts.data) if opts.data else []
        if not opts.data:
            for name in ("read_p50", "read_p99"):
                self.skipped[name] = "no --data path given"
        self._fds: dict[str, int] = {}
        self._rng = random.Random(rank * 7919 + 1)
        self._tick_n = self._calibrate_tick()
        # warm everything once: first calls allocate, compile and fault pages in
        self._matmul()
        self._memory()
        self._dispatch()
        self._sync()

    # ------------------------------------------------------------ units of work

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _matmul(self) -> None:
        for _ in range(self._matmuls):
            torch.matmul(self._a, self._b, out=self._c)

    def _memory(self) -> None:
        self._dst.copy_(self._src)

    def _dispatch(self) -> None:
        a, b, out = self._tiny
        for _ in range(self._dispatch_ops):
            torch.add(a, b, out=out)

    def _calibrate_tick(self) -> int:
        """Loop length of one jitter tick: about 50 us of pure Python work on this rank."""
        n = 1000
        while True:
            t0 = time.thread_time_ns()
            sum(range(n))
            dt = time.thread_time_ns() - t0
            if dt > 200_000 or n > 10_000_000:
                return max(1, int(n * 50_000 / max(dt, 1)))
            n *= 4

    # ------------------------------------------------------------ timing loops

    def _host_loop(
        self, fn: Callable[[], None], slice_s: float, device_work: bool = False, drain: bool = False
    ) -> RoundResult:
        """Repeat ``fn`` for ``slice_s`` seconds; cost per repetition in CPU time (wall, synchronised, for
        ``device_work``). ``drain``: wait for the device after each repetition, outside the timing, so
        that launches never block on a full queue."""
        chaos = self.chaos
        costs: list[int] = []
        cpu_total = 0
        t_start = time.perf_counter_ns()
        deadline = t_start + int(slice_s * 1e9)
        while True:
            self._step += 1
            chaos.step_begin(self._step)
            c0 = time.process_time_ns()
            w0 = time.perf_counter_ns()
            chaos.compute_begin()
            fn()
            if device_work:
                self._sync()
            chaos.compute_end(self._step)
            w1 = time.perf_counter_ns()
            c1 = time.process_time_ns()
            cpu_total += c1 - c0
            costs.append(w1 - w0 if device_work else c1 - c0)
            if drain:
                self._sync()
            if w1 >= deadline and len(costs) >= 3:
                break
        wall = time.perf_counter_ns() - t_start
        return RoundResult(
            cost_ns=float(np.median(costs)), reps=len(costs), cpu_share=min(1.0, cpu_total / max(wall, 1))
        )

    def matmul(self, slice_s: float) -> RoundResult:
        res = self._host_loop(self._matmul, slice_s, device_work=self.cuda)
        res["work"] = self.matmul_work
        return res

    def memory(self, slice_s: float) -> RoundResult:
        res = self._host_loop(self._memory, slice_s)
        res["work"] = self.memory_work
        return res

    def dispatch(self, slice_s: float) -> RoundResult:
        res = self._host_loop(self._dispatch, slice_s, drain=self.cuda)  # launches are only enqueued
        res["cost_ns"] /= self._dispatch_ops  # per op
        res["work"] = 1.0
        return res

    def jitter(self, slice_s: float) -> RoundResult:
        """Ticks of fixed Python work, timed on the wall clock. Ticks during which the thread was
        preempted (its involuntary context switches grew) are contention, not jitter, and are left out;
        the figure is the p99 tick minus the median tick."""
        chaos = self.chaos
        n = self._tick_n
        ticks: list[int] = []
        preempted = 0
        rusage = resource.getrusage
        who = resource.RUSAGE_THREAD
        t_start = time.perf_counter_ns()
        deadline = t_start + int(slice_s * 1e9)
        cpu0 = time.process_time_ns()
        while True:
            self._step += 1
            chaos.step_begin(self._step)
            s0 = rusage(who).ru_nivcsw
            w0 = time.perf_counter_ns()
            chaos.compute_begin()
            sum(range(n))
            chaos.compute_end(self._step)
            w1 = time.perf_counter_ns()
            if rusage(who).ru_nivcsw != s0:
                preempted += 1
            else:
                ticks.append(w1 - w0)
            if w1 >= deadline and len(ticks) >= 20:
                break
            if w1 >= deadline + int(slice_s * 1e9):  # never more than twice the slice
                break
        wall = time.perf_counter_ns() - t_start
        cpu = time.process_time_ns() - cpu0
        if len(ticks) < 20:
            return RoundResult(cost_ns=float("nan"), work=1.0, reps=len(ticks), cpu_share=min(1.0, cpu / wall))
        arr = np.asarray(ticks, dtype=np.float64)
        median = float(np.median(arr))
        return RoundResult(
            cost_ns=float(np.quantile(arr, 0.99) - median),
            work=1.0,
            reps=len(ticks),
            cpu_share=min(1.0, cpu / max(wall, 1)),
            tick_ns=median,
            preempted=preempted,
        )

    def _copy(self, direction: str, slice_s: float) -> RoundResult:
        dst, src = (self._dev, self._pinned) if direction == "h2d" else (self._pinned, self._dev)

        def fn() -> None:
            dst.copy_(src, non_blocking=True)

        res = self._host_loop(fn, slice_s, device_work=True)
        res["work"] = float(self._pinned.numel() * 4)
        return res

    def h2d(self, slice_s: float) -> RoundResult:
        return self._copy("h2d", slice_s)

    def d2h(self, slice_s: float) -> RoundResult:
        return self._copy("d2h", slice_s)

    # ------------------------------------------------------------ data path

    def _data_files(self, root: str) -> list[tuple[str, int]]:
        path = Path(root)
        files: list[tuple[str, int]] = []
        if path.is_file():
            candidates = [path]
        else:
            candidates = []
            for dirpath, _dirs, names in os.walk(path):
                for name in sorted(names):
                    candidates.append(Path(dirpath) / name)
                    if len(candidates) >= _MAX_FILES:
                        break
                if len(candidates) >= _MAX_FILES:
                    break
        for p in candidates:
            try:
                size = p.stat().st_size
            except OSError:
                continue
            if p.is_file() and size >= self.opts.read_bytes:
                files.append((str(p), size))
        if not files:
            for name in ("read_p50", "read_p99"):
                self.skipped[name] = f"no readable file of at least {self.opts.read_bytes} bytes under {root}"
        return files

    def _read_one(self, buf: bytearray) -> None:
        path, size = self._files[self._rng.randrange(len(self._files))]
        fd = self._fds.get(path)
        if fd is None:
            if len(self._fds) >= 64:
                os.close(self._fds.pop(next(iter(self._fds))))
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        n = len(buf)
        offset = self._rng.randrange(0, size - n + 1) & ~4095
        # Evict the range first: the figure is the storage's latency, not the page cache's.
        os.posix_fadvise(fd, offset, n, os.POSIX_FADV_DONTNEED)
        os.preadv(fd, [buf], offset)

    def reads(self, slice_s: float) -> tuple[RoundResult, RoundResult] | None:
        if not self._files:
            return None
        chaos = self.chaos
        buf = bytearray(self.opts.read_bytes)
        lat: list[int] = []
        deadline = time.perf_counter_ns() + int(slice_s * 1e9)
        while True:
            self._step += 1
            w0 = time.perf_counter_ns()
            chaos.step_begin(self._step)  # cold_read faults
            chaos.data(self._step)  # data_stall faults
            self._read_one(buf)
            w1 = time.perf_counter_ns()
            lat.append(w1 - w0)
            if w1 >= deadline and len(lat) >= 10:
                break
        arr = np.asarray(lat, dtype=np.float64)
        p50 = RoundResult(cost_ns=float(np.quantile(arr, 0.5)), work=1.0, reps=len(lat))
        p99 = RoundResult(cost_ns=float(np.quantile(arr, 0.99)), work=1.0, reps=len(lat))
        return p50, p99

    def close(self) -> None:
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()

"""Cause signals of one rank, as per-step deltas: GC pauses by generation, CPU time, page faults,
context switches and run-queue delay of the training thread, CUDA allocator counters, device syncs.

All counters are cumulative; nothing here allocates arrays or takes a lock on the training path.
See docs/tracing.md, "Cause signals".
"""

from __future__ import annotations

import gc
import os
import re
import resource
import threading
import warnings
from time import perf_counter_ns
from typing import Any

from hyperacc.trace.columns import COL as _C
from hyperacc.trace.failsafe import switch_off

_RUSAGE_WHO = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
_ALLOC_KEYS = (("alloc_retries", "num_alloc_retries"), ("device_allocs", "num_device_alloc"),
               ("sync_all_streams", "num_sync_all_streams"))  # fmt: skip
_SYNC_MESSAGE = re.compile("called a synchronizing CUDA operation")


class GcClock:
    """Pause time, count and highest generation of the cyclic GC, fed by ``gc.callbacks``.

    A collection pauses every Python thread, so it is charged to the step in progress whichever thread
    triggered it.
    """

    def __init__(self) -> None:
        self.total_ns = 0
        self.count = 0
        self.max_gen = -1  # highest generation since the last ``take_max_gen``
        self._t0 = 0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        try:
            if phase == "start":
                self._t0 = perf_counter_ns()
                return
            if self._t0:
                self.total_ns += perf_counter_ns() - self._t0
                self._t0 = 0
            self.count += 1
            gen = info.get("generation", -1)
            if gen > self.max_gen:
                self.max_gen = gen
        except Exception as exc:  # an exception here would be printed at every collection
            self.close()
            switch_off("GC signal", exc)

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


class HostSyncCounter:
    """Counts device synchronisations through torch's sync debug mode (CUDA only, opt-in).

    ``torch.cuda.set_sync_debug_mode("warn")`` makes every synchronising call issue a warning; those
    warnings are counted here and not shown. The CPU build raises on that call, so this stays off there.
    """

    def __init__(self) -> None:
        import torch

        self.count = 0
        self._previous_mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        warnings.filterwarnings("always", message=_SYNC_MESSAGE.pattern)
        self._show = warnings.showwarning
        warnings.showwarning = self._showwarning

    def _showwarning(self, message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
        if _SYNC_MESSAGE.search(str(message)):
            self.count += 1
            return
        self._show(message, category, *args, **kwargs)

    def close(self) -> None:
        import torch

        if warnings.showwarning == self._showwarning:
            warnings.showwarning = self._show
        try:
            torch.cuda.set_sync_debug_mode(self._previous_mode)
        except Exception:  # noqa: BLE001 - closing must not fail
            pass


_GC_NS, _GC_COUNT, _GC_MAX_GEN = _C["gc_ns"], _C["gc_count"], _C["gc_max_gen"]
_MAJOR_FAULTS, _INVOL_CTX, _CPU_NS = _C["major_faults"], _C["invol_ctx_switches"], _C["cpu_ns"]
_VOL_CTX, _MINOR_FAULTS, _SYS_CPU_NS = _C["vol_ctx_switches"], _C["minor_faults"], _C["sys_cpu_ns"]
_ALLOC_COLS = tuple(_C[name] for name, _ in _ALLOC_KEYS)
_HOST_SYNCS = _C["host_syncs"]
_RUN_DELAY_NS, _COMM_RUN_DELAY_NS = _C["run_delay_ns"], _C["comm_run_delay_ns"]


class RunDelay:
    """The kernel's run-queue delay of one thread (``/proc/self/task/TID/schedstat``, second field: the
    nanoseconds it was ready to run but waited for a CPU), read with one ``pread`` of a file kept open
    (about 1 us). ``read()`` is -1 where the kernel does not keep it (not Linux, no ``CONFIG_SCHED_INFO``)
    or from another thread than the one it was opened on."""

    def __init__(self) -> None:
        self.tid = threading.get_native_id()
        try:
            self._fd = os.open(f"/proc/self/task/{self.tid}/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = -1
        if self.read() < 0:
            self.close()

    @property
    def open(self) -> bool:
        return self._fd >= 0

    def read(self) -> int:
        if self._fd < 0 or threading.get_native_id() != self.tid:
            return -1
        try:
            return int(os.pread(self._fd, 80, 0).split()[1])
        except (OSError, ValueError, IndexError):
            return -1

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class StepSignals:
    """Deltas of cumulative counters over one step, written into the step's row at its end.

    Every counter is read at the step's end; the delta runs from the previous reading, which is the
    step's start when steps follow each other (automatic mode: one reading per step), or a reading taken
    at ``begin(contiguous=False)`` otherwise, so nothing from before the step (start-up collections,
    an evaluation between steps) is charged to it.
    """

    def __init__(self, *, alloc_every: int = 10) -> None:
        self.gc = GcClock()
        self._gc_ns = 0
        self._gc_count = 0
        self._faults = 0
        self._nivcsw = 0
        self._nvcsw = 0
        self._cpu_us = 0
        self._minflt = 0
        self._sys_us = 0
        self._delay: RunDelay | None = None
        self._delay_off = False
        self._delay_ns = -1
        self._wait_from = -1  # the delay when the current collective wait began (-1: none open)
        self._in_waits = -1  # the delay inside this step's collective waits (-1: none timed)
        self._rusage_on = True
        self.alloc_every = alloc_every
        self._alloc_prev = [0, 0, 0]
        self._alloc_on = False
        self._alloc_steps = 0
        self.syncs: HostSyncCounter | None = None
        self._syncs_prev = 0
        self.begin(contiguous=False)

    def enable_cuda(self) -> None:
        """CUDA was initialised after the tracer started: begin reading allocator counters."""
        if not self._alloc_on:
            self._alloc_on = True
            self._read_alloc(self._alloc_prev)

    def _read_alloc(self, out: list[int]) -> bool:
        try:
            stats = _alloc_stats()
            for i, (_, key) in enumerate(_ALLOC_KEYS):
                out[i] = int(stats.get(key, 0))
            return True
        except Exception as exc:  # noqa: BLE001
            self._alloc_on = False
            switch_off("CUDA allocator counters", exc)
            return False

    def begin(self, contiguous: bool = True) -> None:
        """Start of a step. ``contiguous``: the previous step ended just now, its end reading stands."""
        gcc = self.gc
        gcc.max_gen = -1
        if contiguous:
            return
        self._gc_ns, self._gc_count = gcc.total_ns, gcc.count
        if self._rusage_on:
            try:
                ru = resource.getrusage(_RUSAGE_WHO)
                self._faults, self._nivcsw, self._nvcsw = ru.ru_majflt, ru.ru_nivcsw, ru.ru_nvcsw
                self._cpu_us, self._minflt, self._sys_us = _cpu_us(ru), ru.ru_minflt, round(ru.ru_stime * 1e6)
            except OSError as exc:
                self._rusage_on = False
                switch_off("getrusage signals", exc)
        if self.syncs is not None:
            self._syncs_prev = self.syncs.count
        self._delay_ns = self._run_delay()
        self._in_waits = self._wait_from = -1

    def end(self, row: list[int]) -> None:
        gcc = self.gc
        total, count = gcc.total_ns, gcc.count
        row[_GC_NS] = total - self._gc_ns
        row[_GC_COUNT] = count - self._gc_count
        row[_GC_MAX_GEN] = gcc.max_gen
        self._gc_ns, self._gc_count = total, count
        if self._rusage_on:
            try:
                ru = resource.getrusage(_RUSAGE_WHO)
                # _cpu_us, inlined: this runs at every step's end
                faults, nivcsw, nvcsw, minflt = ru.ru_majflt, ru.ru_nivcsw, ru.ru_nvcsw, ru.ru_minflt
                sys_us = round(ru.ru_stime * 1e6)
                cpu = round(ru.ru_utime * 1e6) + sys_us
                row[_MAJOR_FAULTS] = faults - self._faults
                row[_INVOL_CTX] = nivcsw - self._nivcsw
                row[_VOL_CTX] = nvcsw - self._nvcsw
                row[_CPU_NS] = (cpu - self._cpu_us) * 1000
                row[_MINOR_FAULTS] = minflt - self._minflt
                row[_SYS_CPU_NS] = (sys_us - self._sys_us) * 1000
                self._faults, self._nivcsw, self._nvcsw, self._cpu_us = faults, nivcsw, nvcsw, cpu
                self._minflt, self._sys_us = minflt, sys_us
            except OSError as exc:
                self._rusage_on = False
                switch_off("getrusage signals", exc)
        if self._delay is not None:
            now = self._delay.read()
            if now < 0:  # steps moved to another thread: measured again from the next step
                now = self._run_delay()
            elif self._delay_ns >= 0:
                row[_RUN_DELAY_NS] = now - self._delay_ns
                row[_COMM_RUN_DELAY_NS] = self._in_waits
            self._delay_ns = now
            self._in_waits = self._wait_from = -1
        if self._alloc_on:
            self._alloc_steps += 1
            if self._alloc_steps >= self.alloc_every:
                # torch.cuda.memory_stats() builds a dict of every counter: read it every N steps, and
                # the delta covers the N steps since the previous reading.
                self._alloc_steps = 0
                prev = self._alloc_prev
                before = tuple(prev)
                if self._read_alloc(prev):
                    for col, now, then in zip(_ALLOC_COLS, prev, before, strict=True):
                        row[col] = now - then
        if self.syncs is not None:
            count = self.syncs.count
            row[_HOST_SYNCS] = count - self._syncs_prev
            self._syncs_prev = count

    def wait_begins(self) -> None:
        """A wait in a gradient collective begins on this thread (``DDPWait``: the graph is done)."""
        if self._delay is not None:
            self._wait_from = self._delay.read()

    def wait_ends(self) -> None:
        """That wait ended: its run-queue delay joins the step's ``comm_run_delay_ns``. Read only on the
        thread the delay is kept for (a backward's callbacks on a device thread are not measured)."""
        if self._delay is not None and self._wait_from >= 0:
            now = self._delay.read()
            if now >= 0:
                self._in_waits = max(self._in_waits, 0) + now - self._wait_from
            self._wait_from = -1

    def _run_delay(self) -> int:
        """The run-queue delay of the calling thread, the thread that runs the steps (the file reopened
        on it where steps moved to another thread); -1 where the kernel does not keep it, and then
        never tried again."""
        delay = self._delay
        if delay is None or delay.tid != threading.get_native_id():
            if delay is not None:
                delay.close()
            elif self._delay_off:
                return -1
            self._delay = delay = RunDelay()
            if not delay.open:
                self._delay, self._delay_off = None, True
                return -1
        return delay.read()

    def close(self) -> None:
        self.gc.close()
        if self._delay is not None:
            self._delay.close()
        if self.syncs is not None:
            self.syncs.close()
            self.syncs = None


def _alloc_stats() -> dict:
    """The CUDA caching allocator's counters of the current device. Its three top-level counters are the
    same in torch's nested dictionary as in ``torch.cuda.memory_stats()``, which flattens every nested
    counter in Python first (an H200 here: 152 us a call against 20 us for the nested one)."""
    import torch

    try:
        read = torch._C._cuda_memoryStats
        device = torch._C._cuda_getDevice()
    except AttributeError:  # a torch without the private call: the public one
        return torch.cuda.memory_stats()
    return read(device)


def _cpu_us(ru: resource.struct_rusage) -> int:
    """User + system CPU time in whole microseconds (the kernel accounts it to the nanosecond)."""
    return round(ru.ru_utime * 1e6) + round(ru.ru_stime * 1e6)

"""Deterministic release of freed host memory back to the operating system.

A host allocator returns memory on its own schedule: tcmalloc's background release (it can hold the
kernel's mmap lock while CUDA host calls wait), glibc trimming the heap inside whichever ``free`` crosses
its threshold. Each is a small random per-rank pause. Here the allocator is told to hold freed memory
and the release happens on the stabilizer's schedule, at the same step on every rank.

Which allocator serves ``malloc`` is found from the symbols visible in the process
(``ctypes.CDLL(None)``): google tcmalloc, gperftools tcmalloc, or glibc. With none of them nothing is
done. Rules and defaults: docs/stabilizers.md, "Deterministic memory release".
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import time

log = logging.getLogger(__name__)

# glibc mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Largest value glibc accepts for M_MMAP_THRESHOLD on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX).
GLIBC_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024
# mallopt takes an int: the largest trim threshold it can express.
GLIBC_TRIM_THRESHOLD_HOLD = 2**31 - 1

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclasses.dataclass(frozen=True)
class HostAllocator:
    """The allocator behind ``malloc`` in this process."""

    name: str  # "tcmalloc-google" | "tcmalloc-gperftools" | "glibc" | "none"
    lib: ctypes.CDLL | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def can_release(self) -> bool:
        return self.name != "none"


def _symbol(lib: ctypes.CDLL, name: str):
    try:
        return getattr(lib, name)
    except AttributeError:
        return None


def detect_host_allocator(lib: ctypes.CDLL | None = None) -> HostAllocator:
    """tcmalloc first: when it is preloaded, glibc's ``malloc_trim`` is still visible but useless."""
    try:
        lib = lib if lib is not None else ctypes.CDLL(None)
    except OSError:
        return HostAllocator("none")
    if _symbol(lib, "MallocExtension_Internal_ReleaseMemoryToSystem") is not None:
        return HostAllocator("tcmalloc-google", lib)
    if _symbol(lib, "MallocExtension_ReleaseFreeMemory") is not None:
        return HostAllocator("tcmalloc-gperftools", lib)
    if _symbol(lib, "malloc_trim") is not None and _symbol(lib, "gnu_get_libc_version") is not None:
        return HostAllocator("glibc", lib)
    return HostAllocator("none")


def rss_bytes() -> int:
    """Resident set size of this process, from /proc/self/statm (one small read, no allocation of note)."""
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return -1


def hold_freed_memory(alloc: HostAllocator) -> str:
    """Stop the allocator from returning memory on its own schedule. Returns what was done, in words.

    glibc: a fixed mmap threshold at its maximum (32 MiB) and the largest trim threshold, so ``free``
    no longer trims the heap and blocks up to 32 MiB are reused instead of unmapped and faulted in
    again. gperftools: release rate 0 when the process exports the setter, otherwise the launcher must
    set ``TCMALLOC_RELEASE_RATE=0`` (see :func:`launch_env`). google tcmalloc: background release
    rate 0."""
    if alloc.name == "glibc":
        ok = glibc_thresholds(alloc, GLIBC_MMAP_THRESHOLD_MAX, GLIBC_TRIM_THRESHOLD_HOLD)
        return "glibc mallopt: mmap threshold 32 MiB, no automatic trim" if ok else "glibc mallopt refused"
    if alloc.name == "tcmalloc-gperftools":
        setter = _symbol(alloc.lib, "MallocExtension_SetMemoryReleaseRate")
        if setter is not None:
            setter.argtypes = [ctypes.c_double]
            setter.restype = None
            setter(0.0)
            return "gperftools release rate 0"
        if os.environ.get("TCMALLOC_RELEASE_RATE") != "0":
            log.warning(
                "hyperacc.stabilize: gperftools tcmalloc releases memory in the background; set "
                "TCMALLOC_RELEASE_RATE=0 in the launcher's environment (`hyperacc run` does)"
            )
            return "gperftools background release still on (TCMALLOC_RELEASE_RATE not 0)"
        return "gperftools release rate 0 (TCMALLOC_RELEASE_RATE=0)"
    if alloc.name == "tcmalloc-google":
        setter = _symbol(alloc.lib, "MallocExtension_Internal_SetBackgroundReleaseRate")
        if setter is not None:
            setter.argtypes = [ctypes.c_size_t]
            setter.restype = None
            setter(0)
            return "google tcmalloc background release rate 0"
        return "google tcmalloc without a background release setter"
    return "no known allocator; nothing held"


def glibc_thresholds(alloc: HostAllocator, mmap: int, trim: int) -> bool:
    """Fix glibc's mmap and trim thresholds (bytes; fixing them ends its own adjustment of both); False
    where the allocator is not glibc or ``mallopt`` refused."""
    if alloc.name != "glibc" or alloc.lib is None:
        return False
    mallopt = alloc.lib.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, mmap) and mallopt(M_TRIM_THRESHOLD, trim))


def release(alloc: HostAllocator) -> int:
    """Return freed memory to the OS now; returns the time it took in ns (0 when nothing to call)."""
    if not alloc.can_release:
        return 0
    t0 = time.perf_counter_ns()
    if alloc.name == "glibc":
        trim = alloc.lib.malloc_trim
        trim.argtypes = [ctypes.c_size_t]
        trim.restype = ctypes.c_int
        trim(0)
    elif alloc.name == "tcmalloc-gperftools":
        fn = alloc.lib.MallocExtension_ReleaseFreeMemory
        fn.argtypes = []
        fn.restype = None
        fn()
    elif alloc.name == "tcmalloc-google":
        fn = alloc.lib.MallocExtension_Internal_ReleaseMemoryToSystem
        fn.argtypes = [ctypes.c_size_t]
        fn.restype = None
        fn(ctypes.c_size_t(-1).value)
    return time.perf_counter_ns() - t0


def launch_env() -> dict[str, str]:
    """Environment for processes a launcher starts: tcmalloc's background release off from the start
    (harmless where tcmalloc is not loaded)."""
    return {"TCMALLOC_RELEASE_RATE": "0"}

"""Synchronisation audit: which synchronisation points a training loop hits, how often, from where.

Every ``dist.barrier()`` makes all ranks wait for the slowest one; every host sync (``.item()`` of a GPU
tensor, ``torch.cuda.synchronize()``) makes the host wait for the device. Inside the step loop both turn
a small per-rank delay into a stall of every rank, and under DDP a per-step barrier is redundant: the
gradient all-reduce already synchronises the ranks.

Audit mode patches the synchronising calls while the audit is open and counts them per step with the
file:line of the calling code. A host sync counts only when it synchronises a device (the tensor is on
a GPU; ``.cpu()``/``.to("cpu")`` only from a device without ``non_blocking``) and only when the caller
is user code, not torch, hyperacc or the standard library (an optimizer's or a sampler's own ``.item()``
on a CPU tensor is not the user's sync). On CUDA, the sync debug mode adds the implicit syncs no
patch sees. It is a diagnostic mode: each counted call costs a frame walk. Elision (opt-in, never the
default) skips a barrier only at a call site that ran in every one of the previous ``elide_after``
steps, so setup barriers, barriers after the loop and periodic barriers (checkpoints) always run.
Rules: docs/stabilizers.md, "Synchronisation audit".
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import sysconfig
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

KINDS = ("barrier", "cuda_synchronize", "stream_synchronize", "event_synchronize", "host_sync")
# Tensor methods that copy a value to the host (a device sync for a GPU tensor).
HOST_SYNC_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")

_SKIP_DIRS: tuple[str, ...] = ()


def _skip_dirs() -> tuple[str, ...]:
    """torch, this package and the standard library: never the user's own code."""
    global _SKIP_DIRS
    if not _SKIP_DIRS:
        import torch

        here = os.path.dirname(os.path.abspath(__file__))
        hyperacc_dir = os.path.dirname(here)
        dirs = [os.path.dirname(os.path.abspath(torch.__file__)), hyperacc_dir]
        for key in ("stdlib", "platstdlib"):
            path = sysconfig.get_paths().get(key)
            if path:
                dirs.append(os.path.abspath(path))
        _SKIP_DIRS = tuple(d + os.sep for d in dirs)
    return _SKIP_DIRS


def _is_library(filename: str) -> bool:
    return filename.startswith(_skip_dirs()) or filename.startswith("<")


def caller_site(depth: int = 2) -> str:
    """file:line of the first frame outside torch, hyperacc and the standard library, starting
    ``depth`` frames up (the innermost frame when every frame is library code)."""
    frame = sys._getframe(depth)
    first = frame
    while frame is not None:
        filename = frame.f_code.co_filename
        if not _is_library(filename):
            return f"{filename}:{frame.f_lineno}"
        frame = frame.f_back
    if first is not None:
        return f"{first.f_code.co_filename}:{first.f_lineno}"
    return "?:0"


def user_caller(depth: int = 2) -> str | None:
    """file:line of the frame ``depth`` up when it is user code, else None (a library's own call)."""
    frame = sys._getframe(depth)
    filename = frame.f_code.co_filename
    return None if _is_library(filename) else f"{filename}:{frame.f_lineno}"


@dataclasses.dataclass
class SyncSite:
    kind: str
    site: str
    calls: int = 0  # calls that ran
    elided: int = 0  # barrier calls skipped by elision
    total_ns: int = 0  # time spent in the calls that ran (barriers and explicit synchronizes)
    windows: int = 0  # distinct step windows (after the first step) the site was hit in
    first_window: int = -1
    last_window: int = -2
    run: int = 0  # consecutive step windows up to last_window
    elide_window: int = -2  # the window in which this site's calls are being elided

    @property
    def in_loop(self) -> bool:
        return self.windows >= 2

    @property
    def every_step(self) -> bool:
        return self.run >= 2

    def to_dict(self, steps: int) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "site": self.site,
            "calls": self.calls,
            "elided": self.elided,
            "per_step": (self.calls + self.elided) / steps if steps else float(self.calls + self.elided),
            "mean_ms": (self.total_ns / self.calls / 1e6) if self.calls else 0.0,
            "in_loop": self.in_loop,
            "redundant": self.kind == "barrier" and self.every_step,
        }


@dataclasses.dataclass(frozen=True)
class AuditOptions:
    count: bool = True  # audit mode: patch and count (barriers, synchronize, host syncs)
    host_syncs: bool = True  # include host syncs of device tensors (and CUDA sync debug mode on GPU)
    cpu_as_device: bool = False  # dry run on a CPU machine: count CPU tensors' host syncs as a GPU's
    elide_barriers: bool = False  # opt-in: skip per-step barriers inside the loop
    elide_after: int = 2  # a site must have run in this many consecutive steps before it is elided
    keep_steps: int = 100_000  # per-step counts kept (oldest dropped)

    def __post_init__(self) -> None:
        if not isinstance(self.elide_after, int) or self.elide_after < 1:
            raise ValueError(f"sync_audit.elide_after must be >= 1 (got {self.elide_after!r})")
        if not isinstance(self.keep_steps, int) or self.keep_steps < 1:
            raise ValueError(f"sync_audit.keep_steps must be >= 1 (got {self.keep_steps!r})")


class SyncAudit:
    """Patches while open; ``advance(step)`` closes the current step window. One audit per process."""

    _active: SyncAudit | None = None

    def __init__(self, opts: AuditOptions) -> None:
        self.opts = opts
        self.sites: dict[tuple[str, str], SyncSite] = {}
        self.per_step: dict[int, dict[str, int]] = {}
        self._current: dict[str, int] = {}
        self._window = -1  # -1: before the first step() call (set-up and the first step)
        self._steps = 0
        self._patches: list[tuple[Any, str, Any, bool]] = []
        self._main = threading.main_thread()
        self._debug_mode_prev: int | None = None
        self._showwarning_prev: Callable | None = None
        self._inside = False  # the training thread is inside a patched host sync (debug mode: no double count)
        self._saw_device = False  # a device tensor reached a patched call
        self._closed = False

    # -- patching
    def _patch(self, owner: Any, name: str, wrapper: Callable) -> None:
        had = name in vars(owner)
        original = getattr(owner, name)
        setattr(owner, name, wrapper(original))
        self._patches.append((owner, name, original, had))

    def start(self) -> None:
        if SyncAudit._active is not None:
            raise RuntimeError("a sync audit is already open in this process; close it first")
        import torch
        import torch.distributed as dist

        SyncAudit._active = self
        if self.opts.count or self.opts.elide_barriers:
            barrier = self._wrap_barrier
            self._patch(dist, "barrier", barrier)
            c10d = getattr(dist, "distributed_c10d", None)
            if c10d is not None and getattr(c10d, "barrier", None) is not None:
                self._patch(c10d, "barrier", barrier)
        if not self.opts.count:
            return
        self._patch(torch.cuda, "synchronize", lambda f: self._wrap_timed(f, "cuda_synchronize"))
        accel = getattr(torch, "accelerator", None)
        if accel is not None and hasattr(accel, "synchronize"):
            self._patch(accel, "synchronize", lambda f: self._wrap_timed(f, "cuda_synchronize"))
        self._patch(torch.cuda.Stream, "synchronize", lambda f: self._wrap_timed(f, "stream_synchronize"))
        self._patch(torch.cuda.Event, "synchronize", lambda f: self._wrap_timed(f, "event_synchronize"))
        if self.opts.host_syncs:
            for name in HOST_SYNC_METHODS:
                self._patch(torch.Tensor, name, self._wrap_host)
            self._patch(torch.Tensor, "cpu", self._wrap_cpu)
            self._patch(torch.Tensor, "to", self._wrap_to)
            self._patch(torch.Tensor, "numpy", self._wrap_numpy)
            self._start_cuda_debug_mode(torch)

    def _start_cuda_debug_mode(self, torch: Any) -> None:
        # On GPU, CUDA's sync debug mode reports the implicit syncs no Python patch sees (nonzero,
        # masked indexing, copies to the host inside torch). It raises AssertionError on CPU builds.
        if self._debug_mode_prev is not None:
            return
        try:
            if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
                return
            self._debug_mode_prev = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        except (AssertionError, RuntimeError):
            self._debug_mode_prev = None
            return
        warnings.filterwarnings("always", message=".*called a synchronizing CUDA operation.*")
        self._showwarning_prev = warnings.showwarning

        def showwarning(message, category, filename, lineno, file=None, line=None):
            if "synchronizing CUDA operation" in str(message):
                if not self._inside and threading.current_thread() is self._main:
                    self._count("host_sync", caller_site(), 0)  # attributed to the user's frame
                return
            self._showwarning_prev(message, category, filename, lineno, file, line)

        warnings.showwarning = showwarning

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for owner, name, original, had in reversed(self._patches):
            if had:
                setattr(owner, name, original)
            else:
                try:
                    delattr(owner, name)
                except AttributeError:
                    setattr(owner, name, original)
        self._patches.clear()
        if self._debug_mode_prev is not None:
            import torch

            try:
                torch.cuda.set_sync_debug_mode(self._debug_mode_prev)
            except (AssertionError, RuntimeError):
                pass
        if self._showwarning_prev is not None:
            warnings.showwarning = self._showwarning_prev
        if SyncAudit._active is self:
            SyncAudit._active = None

    # -- counting
    def _site(self, kind: str, site: str) -> SyncSite:
        key = (kind, site)
        s = self.sites.get(key)
        if s is None:
            s = self.sites[key] = SyncSite(kind, site)
        return s

    def _touch(self, s: SyncSite) -> None:
        w = self._window
        if w < 0 or w == s.last_window:
            return
        s.run = s.run + 1 if w == s.last_window + 1 else 1
        s.windows += 1
        if s.first_window < 0:
            s.first_window = w
        s.last_window = w

    def _count(self, kind: str, site: str, ns: int) -> None:
        s = self._site(kind, site)
        self._touch(s)
        s.calls += 1
        s.total_ns += ns
        self._current[kind] = self._current.get(kind, 0) + 1

    def _wrap_barrier(self, original: Callable) -> Callable:
        audit = self

        def barrier(*args: Any, **kwargs: Any) -> Any:
            if audit._closed:
                return original(*args, **kwargs)
            site = caller_site()
            s = audit._site("barrier", site)
            w = audit._window
            # Elide only where this site ran in each of the previous `elide_after` step windows.
            if (
                audit.opts.elide_barriers
                and w >= 0
                and not kwargs.get("async_op", False)
                and (s.elide_window == w or (s.last_window == w - 1 and s.run >= audit.opts.elide_after))
            ):
                audit._touch(s)
                s.elide_window = w
                s.elided += 1
                audit._current["barrier_elided"] = audit._current.get("barrier_elided", 0) + 1
                return None
            t0 = time.perf_counter_ns()
            out = original(*args, **kwargs)
            audit._count("barrier", site, time.perf_counter_ns() - t0)
            return out

        return barrier

    def _wrap_timed(self, original: Callable, kind: str) -> Callable:
        audit = self

        def synchronize(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter_ns()
            out = original(*args, **kwargs)
            if not audit._closed:
                audit._count(kind, caller_site(), time.perf_counter_ns() - t0)
            return out

        return synchronize

    def _syncs(self, tensor: Any) -> bool:
        """Would reading this tensor on the host wait for a device?"""
        kind = tensor.device.type
        if kind == "cpu":
            return self.opts.cpu_as_device
        if kind == "meta":
            return False
        self._saw_device = True
        return True

    def _count_host(self, tensor: Any) -> bool:
        """Count a host sync of ``tensor`` made directly by user code on the training thread."""
        if self._closed or threading.current_thread() is not self._main or not self._syncs(tensor):
            return False
        site = user_caller(3)
        if site is None:
            return False  # torch's (or a library's) own call, e.g. an optimizer's step counter
        self._count("host_sync", site, 0)
        return True

    def _guarded_call(self, original: Callable, self_: Any, args: Any, kwargs: Any) -> Any:
        self._inside = True
        try:
            return original(self_, *args, **kwargs)
        finally:
            self._inside = False

    def _wrap_host(self, original: Callable) -> Callable:
        audit = self

        def host_sync(self_: Any, *args: Any, **kwargs: Any) -> Any:
            if audit._count_host(self_):
                return audit._guarded_call(original, self_, args, kwargs)
            return original(self_, *args, **kwargs)

        host_sync.__name__ = getattr(original, "__name__", "host_sync")
        return host_sync

    def _wrap_cpu(self, original: Callable) -> Callable:
        audit = self

        def cpu(self_: Any, *args: Any, **kwargs: Any) -> Any:
            if self_.device.type != "cpu" and audit._count_host(self_):
                return audit._guarded_call(original, self_, args, kwargs)
            return original(self_, *args, **kwargs)

        return cpu

    def _wrap_numpy(self, original: Callable) -> Callable:
        audit = self

        def numpy(self_: Any, *args: Any, **kwargs: Any) -> Any:
            # Only numpy(force=True) copies a device tensor to the host; otherwise a CPU tensor's view.
            force = kwargs.get("force", args[0] if args else False)
            if force and self_.device.type != "cpu" and audit._count_host(self_):
                return audit._guarded_call(original, self_, args, kwargs)
            return original(self_, *args, **kwargs)

        return numpy

    def _wrap_to(self, original: Callable) -> Callable:
        audit = self

        def to(self_: Any, *args: Any, **kwargs: Any) -> Any:
            if self_.device.type != "cpu" and _to_host_blocking(args, kwargs) and audit._count_host(self_):
                return audit._guarded_call(original, self_, args, kwargs)
            return original(self_, *args, **kwargs)

        return to

    def advance(self, step: int) -> None:
        """Close the window of ``step`` (called after the step's optimizer step)."""
        if self._current or self.opts.count:
            self.per_step[step] = self._current
            if len(self.per_step) > self.opts.keep_steps:
                self.per_step.pop(next(iter(self.per_step)))
        self._current = {}
        self._window += 1
        self._steps += 1
        if self.opts.count and self.opts.host_syncs and self._debug_mode_prev is None and "torch" in sys.modules:
            self._start_cuda_debug_mode(sys.modules["torch"])  # CUDA may have started after the audit

    # -- results
    def report(self) -> dict[str, Any]:
        steps = max(1, self._steps)
        sites = sorted(self.sites.values(), key=lambda s: (-(s.calls + s.elided), s.kind, s.site))
        rows = [s.to_dict(steps) for s in sites]
        return {
            "steps": self._steps,
            "sites": rows,
            "redundant_barriers": [r["site"] for r in rows if r["redundant"]],
            "elided": sum(s.elided for s in sites),
            "visibility": self.visibility(),
        }

    def visibility(self) -> str:
        """What this audit could and could not see in this process."""
        if not (self.opts.count and self.opts.host_syncs):
            return "barriers only (host syncs not audited)"
        if self._debug_mode_prev is not None:
            return ("CUDA run: host syncs of device tensors counted at user frames; implicit syncs "
                    "(nonzero, masked indexing, copies inside torch) from CUDA's sync debug mode")  # fmt: skip
        if self.opts.cpu_as_device:
            return ("dry run (cpu_as_device): CPU tensors counted as device tensors, so the host-sync "
                    "sites are those a GPU run would have; implicit syncs inside torch are not seen")  # fmt: skip
        if not self._saw_device:
            return ("CPU-only run: barriers and synchronize calls are counted; host syncs (.item(), "
                    ".tolist(), bool/float/int, .cpu(), .to('cpu')) count only on device tensors and "
                    "there were none, and implicit syncs need CUDA's sync debug mode on a GPU; "
                    "sync_audit={'cpu_as_device': true} lists the sites a GPU run would have")  # fmt: skip
        return ("device tensors seen without CUDA's sync debug mode: host syncs counted at user "
                "frames; implicit syncs inside torch are not seen")  # fmt: skip

    def format_report(self) -> str:
        rep = self.report()
        lines = [f"sync audit over {rep['steps']} steps ({rep['visibility']})"]
        for r in rep["sites"]:
            flag = "  REDUNDANT (inside the step loop)" if r["redundant"] else ""
            elided = f" elided={r['elided']}" if r["elided"] else ""
            lines.append(
                f"  {r['kind']:<18} {r['per_step']:6.2f}/step calls={r['calls']}{elided} "
                f"mean={r['mean_ms']:.3f}ms  {r['site']}{flag}"
            )
        return "\n".join(lines)


def _to_host_blocking(args: tuple, kwargs: dict) -> bool:
    """Does ``Tensor.to(*args, **kwargs)`` copy to the CPU without ``non_blocking``?"""
    import torch

    device = kwargs.get("device")
    non_blocking = kwargs.get("non_blocking", False)
    for a in args:
        if isinstance(a, str | torch.device):
            device = a
        elif isinstance(a, torch.Tensor):
            device = a.device
        elif isinstance(a, bool):
            non_blocking = a  # to(device, dtype, non_blocking, copy): the first bool is non_blocking
            break
    if device is None or non_blocking:
        return False
    return torch.device(device).type == "cpu"

"""Seeded, reproducible fault injection into a running training job.

Configured from Python (``Chaos(config)``) or, for a script that was not written for hyperacc, from the
environment variable ``HYPERACC_CHAOS`` holding the same JSON (``install_from_env()``, which
``python -m hyperacc.bootstrap`` calls). Example::

    {"seed": 1, "faults": [
        {"kind": "slowdown",    "ranks": [2],   "factor": 0.15},
        {"kind": "spike",       "ranks": "all", "rate": 0.01, "ms": 40, "dist": "exp"},
        {"kind": "data_stall",  "ranks": [1],   "rate": 0.03, "ms": 60},
        {"kind": "gc_pressure", "ranks": [3],   "live": 300000, "garbage": 20000},
        {"kind": "cold_read",   "ranks": [0],   "rate": 0.05, "mb": 8},
        {"kind": "competitor",  "ranks": [1],   "cpu": 1},
        {"kind": "launch",      "ranks": [3],   "ms": 0.02},
        {"kind": "page_churn",  "ranks": [2],   "kb": 64}]}

What each kind does:

- ``slowdown``: the rank's compute takes ``factor`` longer. It really burns CPU (``work``: ``spin``, a
  busy loop holding the GIL, or ``matmul``, real torch matrix products, a heavier forward), so it
  competes for cores as a slow host would. Explicit mode burns ``factor`` x the compute time measured
  between ``compute_begin`` and ``compute_end``; automatic mode burns at the start of every backward,
  ``factor`` x that micro-step's forward time x ``(1 + backward_ratio)`` (backward ~ 2 x forward),
  before the gradient collective as a slow device would.
- ``spike``: with probability ``rate`` per step, an extra ``ms`` of burnt CPU (``dist``: ``fixed``,
  ``exp`` (mean ``ms``) or ``lognormal`` (median ``ms``, ``sigma``)), inside the compute.
- ``data_stall``: with probability ``rate`` per step, the next batch is ``ms`` late (a sleep in the
  loader path, as a blocked read would be; in automatic mode without a DataLoader, just before the
  step's first forward, where such a script reads its batch).
- ``gc_pressure``: builds ``live`` long-lived container objects once, then each step creates ``garbage``
  objects in reference cycles that survive a few steps, so automatic generation-2 collections fire and
  pause for a time proportional to the live set. Every collection of 1 ms or more is recorded.
- ``cold_read``: with probability ``rate`` per step, evicts a private ``mb`` MB file from the page cache
  (``posix_fadvise(DONTNEED)``) and reads it back from storage.
- ``competitor``: another process competes for the rank's cores, as a noisy neighbour on a shared host
  does: a busy-looping child process (``procs`` of them) pinned to the rank's CPUs. With ``cpu`` >= 0
  the rank and the competitor are both pinned to that one CPU, so the competition falls on this rank
  alone. The rank's work is unchanged: it loses wall time, not CPU time.
- ``launch``: every torch operator the rank calls from Python first burns ``ms`` on the host (a
  ``TorchFunctionMode``), as a slow launch path (driver, contended host) does; the tracer's
  launch-latency probe shows it.
- ``page_churn``: the rank's C allocator maps every block of ``kb`` KiB or more afresh and unmaps it when
  freed (glibc's ``mallopt``: mmap threshold ``kb`` KiB, trim threshold as low; the heap's free chunks
  of that size, which glibc would serve first, are held for good), so the kernel faults in
  and zeroes new pages for each such tensor, at every step: the same work at a higher CPU time, all of it
  in the kernel. glibc's default, self-adjusting thresholds leave some processes in this state by
  chance for their whole life (docs/detection.md, "Kind"). Only where the process runs on glibc; elsewhere
  one log line says it was not applied.

Randomness is counter-based (seed, rank, fault index, step), so the same configuration injects exactly
the same faults whatever else the job does. Every injection is appended to the ground-truth file
``RUN_DIR/chaos/rank-XXXXX.jsonl`` (one JSON object per line: rank, node, step, kind, magnitude_ms,
detail), which detection benchmarks score against.

Why this module is over 500 lines: a seventh of it is the description above, which is the fault
catalogue users read; the code is one ``Chaos`` class whose hooks share the per-step state of every
fault kind.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import tempfile
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from hyperacc import process
from hyperacc.options import OptionsError, check, env_text, invalid, load, parse_json, refuse_unknown
from hyperacc.schema import chaos_path

log = logging.getLogger(__name__)

ENV = "HYPERACC_CHAOS"
KINDS = ("slowdown", "spike", "data_stall", "gc_pressure", "cold_read", "competitor", "launch", "page_churn")
_DISTS = ("fixed", "exp", "lognormal")


ChaosConfigError = OptionsError  # the name before the one options error; public, kept as an alias


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    ranks: tuple[int, ...] | None  # None: every rank
    rate: float = 1.0
    ms: float = 0.0
    factor: float = 0.0
    dist: str = "fixed"
    sigma: float = 0.5
    live: int = 0
    garbage: int = 0
    mb: float = 8.0
    backward_ratio: float = 2.0
    cpu: int = -1  # competitor: the CPU to pin the rank and the competitor to (-1: the rank's own CPUs)
    procs: int = 1  # competitor: busy processes
    work: str = "spin"  # slowdown: "spin" (a busy loop) or "matmul" (torch matrix products)
    kb: float = 64.0  # page_churn: blocks of this many KiB and more are mapped afresh at every use

    def applies_to(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks


def parse_config(config: Mapping[str, Any] | str) -> tuple[int, list[Fault], str | None]:
    """Validate a chaos configuration; returns (seed, faults, run_dir)."""
    if isinstance(config, str):
        config = parse_json(config, ENV, '{"seed": 1, "faults": [{"kind": "spike", "rate": 0.01, "ms": 40}]}')
    if not isinstance(config, Mapping):
        raise OptionsError("chaos configuration must be a JSON object with 'seed' and 'faults'")
    refuse_unknown("chaos", config, ("seed", "faults", "run_dir"))
    seed = config.get("seed", 0)
    check("chaos", "seed", seed, isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0,
          "an integer >= 0")  # fmt: skip
    run_dir = config.get("run_dir")
    check("chaos", "run_dir", run_dir, run_dir is None or isinstance(run_dir, str), "a path or null")
    raws = config.get("faults", [])
    check("chaos", "faults", raws, isinstance(raws, (list, tuple)), "a list of faults")
    faults = []
    for i, raw in enumerate(raws):
        where = f"faults[{i}]"
        if not isinstance(raw, Mapping) or raw.get("kind") not in KINDS:
            kind = raw.get("kind") if isinstance(raw, Mapping) else raw
            raise invalid("chaos", f"{where}.kind", kind, f"one of {', '.join(KINDS)}")
        ranks = raw.get("ranks", "all")
        if ranks == "all":
            ranks = None
        elif isinstance(ranks, int) and not isinstance(ranks, bool):
            ranks = (ranks,)
        elif not isinstance(ranks, (list, tuple)):
            raise invalid("chaos", f"{where}.ranks", ranks, "'all', a rank or a list of ranks")
        fault = load(Fault, {**raw, "ranks": ranks}, "chaos", prefix=f"{where}.")
        for name, ok, allowed in (
            ("rate", 0.0 <= fault.rate <= 1.0, "in [0, 1]"),
            ("procs", fault.procs >= 1, ">= 1"),
            ("cpu", fault.cpu >= -1, ">= -1 (-1: the rank's own CPUs)"),
            ("ms", fault.ms >= 0, ">= 0"),
            ("factor", fault.factor >= 0, ">= 0"),
            ("mb", fault.mb > 0, "> 0"),
            ("kb", 4 <= fault.kb <= 32 * 1024, "in [4, 32768] KiB"),
            ("live", fault.live >= 0, ">= 0"),
            ("garbage", fault.garbage >= 0, ">= 0"),
            ("work", fault.work in ("spin", "matmul"), "'spin' or 'matmul'"),
            ("dist", fault.dist in _DISTS, f"one of {', '.join(_DISTS)}"),
        ):
            check("chaos", f"{where}.{name}", getattr(fault, name), ok, allowed)
        faults.append(fault)
    return seed, faults, run_dir


def _churn_pages(threshold: int) -> bool:
    """glibc maps blocks of ``threshold`` bytes and more afresh and trims its heap above as much; False
    (one log line) where the process's allocator is not glibc."""
    from hyperacc.stabilize import memory  # only for this fault: the rest of chaos does without it

    alloc = memory.detect_host_allocator()
    if memory.glibc_thresholds(alloc, threshold, threshold):
        _hold_free_heap(alloc.lib, threshold)
        return True
    log.warning("hyperacc.chaos: page_churn needs glibc's mallopt; not applied")
    return False


def _hold_free_heap(libc: Any, size: int, most: int = 4096) -> int:
    """Take the heap's free chunks of ``size`` bytes and more for good, so that blocks of that size are
    mapped afresh from now on: glibc serves a block from a free chunk of its heap before it maps one,
    whatever its mmap threshold, and a process whose start left such chunks (numpy's modules compiled
    at import, where their bytecode was not written) never paged at all. Blocks of ``size`` are taken
    until one is mapped (outside ``[heap]``), at most ``most``, untouched (the kernel gives them no page
    until written); the number held."""
    import ctypes

    try:
        heap = next(line.split()[0] for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith("[heap]"))
    except (OSError, StopIteration):
        return 0
    lo, hi = (int(x, 16) for x in heap.split("-"))
    malloc, free = libc.malloc, libc.free
    malloc.argtypes, malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    free.argtypes, free.restype = [ctypes.c_void_p], None
    held = 0
    while held < most:
        block = malloc(size)
        if not block or not lo <= block < hi:
            free(block)  # mapped: the heap has no free chunk of this size left
            break
        held += 1
    return held


def burn_ns(duration_ns: int) -> None:
    """Busy-wait holding the GIL: real CPU work, as a slow host or a compute spike would be."""
    end = time.perf_counter_ns() + int(duration_ns)
    x = 0
    while time.perf_counter_ns() < end:
        x += 1


_MATMUL: list[Any] = []


def matmul_ns(duration_ns: int) -> None:
    """Real tensor work for about ``duration_ns``: 128 x 128 float32 matrix products, back to back."""
    import torch

    if not _MATMUL:
        g = torch.Generator().manual_seed(0)
        _MATMUL.extend([torch.randn(128, 128, generator=g), torch.randn(128, 128, generator=g),
                        torch.empty(128, 128)])  # fmt: skip
    a, b, out = _MATMUL
    end = time.perf_counter_ns() + int(duration_ns)
    with torch.no_grad():
        while time.perf_counter_ns() < end:
            torch.mm(a, b, out=out)


class _Garbage:
    __slots__ = ("ref", "payload")

    def __init__(self) -> None:
        self.ref: Any = None
        self.payload = None


class Chaos:
    """Injects the configured faults into one rank. Explicit calls or ``install()`` for automatic hooks."""

    def __init__(
        self,
        config: Mapping[str, Any] | str,
        *,
        rank: int | None = None,
        node: int | None = None,
        run_dir: str | os.PathLike | None = None,
    ) -> None:
        self.seed, faults, cfg_run_dir = parse_config(config)
        place = process.place()
        self.rank = place.rank if rank is None else rank
        self.node = place.node if node is None else node
        self.faults = [(i, f) for i, f in enumerate(faults) if f.applies_to(self.rank)]
        run_dir = run_dir or cfg_run_dir or env_text("HYPERACC_RUN_DIR") or None
        self.truth_path = chaos_path(run_dir, self.rank) if run_dir else None
        self._pending: list[str] = []
        self._step = 0
        self._compute_t0 = time.perf_counter_ns()
        self._garbage: deque[list[_Garbage]] = deque(maxlen=3)
        self._live: list[list[int]] = []
        self._cold_file: Path | None = None
        self._hooks: list[Any] = []
        self._orig_next: Any = None
        self._orig_backward: Any = None
        self._orig_scaler_step: Any = None
        self._gc_t0 = 0
        self._in_gc = False
        self._closed = False
        for _i, f in self.faults:
            if f.kind == "slowdown":
                self._record(0, "slowdown", 0.0, {"factor": f.factor})
            if f.kind == "gc_pressure" and f.live:
                self._live = [[j] for j in range(f.live)]  # tracked containers: gen-2 pauses scale with them
        if any(f.kind == "gc_pressure" for _, f in self.faults):
            gc.callbacks.append(self._on_gc)
        self._competitors: list[Any] = []
        self._dispatch_mode: Any = None
        for _i, f in self.faults:
            if f.kind == "competitor":
                self._start_competitor(f)
            elif f.kind == "launch" and f.ms > 0 and self._dispatch_mode is None:
                self._dispatch_mode = _slow_dispatch(int(f.ms * 1e6))
                self._record(0, "launch", f.ms)
            elif f.kind == "page_churn":
                self._record(0, "page_churn", 0.0, {"kb": f.kb, "applied": _churn_pages(int(f.kb * 1024))})
        process.at_exit(self.close)

    def _start_competitor(self, fault: Fault) -> None:
        """Busy child processes on the rank's CPUs (the rank itself pinned to ``fault.cpu`` when given)."""
        import subprocess
        import sys

        try:
            if fault.cpu >= 0:
                os.sched_setaffinity(0, {fault.cpu})
            cpus = sorted(os.sched_getaffinity(0))
        except OSError as exc:
            log.warning("chaos: cannot pin rank %d to CPU %d (%s); competitor not started", self.rank, fault.cpu, exc)
            return

        def child_setup() -> None:
            os.sched_setaffinity(0, cpus)
            try:  # die with the rank (PR_SET_PDEATHSIG = 1)
                import ctypes
                import signal

                ctypes.CDLL(None).prctl(1, signal.SIGKILL)
            except (OSError, AttributeError):
                pass

        for _ in range(fault.procs):
            self._competitors.append(
                subprocess.Popen([sys.executable, "-S", "-c", "while True: pass"], preexec_fn=child_setup,
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )  # fmt: skip
        self._record(0, "competitor", 0.0, {"cpus": cpus, "procs": fault.procs})

    # ------------------------------------------------------------ randomness and ground truth

    def _rng(self, index: int, step: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.rank, index, step])

    def _magnitude_ms(self, fault: Fault, rng: np.random.Generator) -> float:
        if fault.dist == "exp":
            return float(rng.exponential(fault.ms))
        if fault.dist == "lognormal":
            return float(fault.ms * np.exp(fault.sigma * rng.standard_normal()))
        return fault.ms

    def _record(self, step: int, kind: str, magnitude_ms: float, detail: Mapping[str, Any] | None = None) -> None:
        if self.truth_path is None:
            return
        row = {"rank": self.rank, "node": self.node, "step": step, "kind": kind, "magnitude_ms": round(magnitude_ms, 4)}
        if detail:
            row["detail"] = dict(detail)
        self._pending.append(json.dumps(row))
        if len(self._pending) >= 64 and not self._in_gc:
            self.flush()

    def flush(self) -> None:
        if self.truth_path is None or not self._pending:
            return
        # Take the lines first: a GC callback may record (never flush) while this writes.
        lines, self._pending = self._pending, []
        try:
            self.truth_path.parent.mkdir(parents=True, exist_ok=True)
            with self.truth_path.open("a") as fh:
                fh.write("\n".join(lines) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            log.warning("chaos: cannot write ground truth to %s (%s); recording switched off", self.truth_path, exc)
            self.truth_path = None

    def _on_gc(self, phase: str, info: Mapping[str, Any]) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter_ns()
            return
        pause_ms = (time.perf_counter_ns() - self._gc_t0) / 1e6
        if pause_ms >= 1.0:
            self._in_gc = True
            try:
                self._record(self._step, "gc_pause", pause_ms, {"generation": info.get("generation")})
            finally:
                self._in_gc = False

    # ------------------------------------------------------------ explicit API

    def step_begin(self, step: int) -> None:
        """Call at the start of each step (before loading its batch)."""
        self._step = step
        for i, f in self.faults:
            if f.kind == "gc_pressure" and f.garbage:
                batch = [_Garbage() for _ in range(f.garbage)]
                for a, b in zip(batch, batch[1:] + batch[:1], strict=False):
                    a.ref = b  # a cycle: only the cyclic collector can free it
                self._garbage.append(batch)
                self._record(step, "gc_pressure", 0.0, {"objects": f.garbage})
            elif f.kind == "cold_read" and self._rng(i, step).random() < f.rate:
                t0 = time.perf_counter_ns()
                self._cold_read(f)
                self._record(step, "cold_read", (time.perf_counter_ns() - t0) / 1e6, {"mb": f.mb})
        self._compute_t0 = time.perf_counter_ns()

    def data(self, step: int | None = None) -> None:
        """Call in the loader path (``__getitem__`` or the iterator): injects data stalls."""
        step = self._step if step is None else step
        for i, f in self.faults:
            if f.kind == "data_stall" and self._rng(i, step).random() < f.rate:
                ms = self._magnitude_ms(f, self._rng(i + 1000, step))
                time.sleep(ms / 1e3)
                self._record(step, "data_stall", ms)

    def compute_begin(self) -> None:
        self._compute_t0 = time.perf_counter_ns()

    def compute_end(self, step: int | None = None, compute_ns: int | None = None) -> None:
        """Call after the step's compute (explicit mode): burns the slowdown share and any spike."""
        step = self._step if step is None else step
        if compute_ns is None:
            compute_ns = time.perf_counter_ns() - self._compute_t0
        self._burn(step, compute_ns, spike=True)

    def _burn(self, step: int, compute_ns: int, *, spike: bool) -> None:
        for i, f in self.faults:
            if f.kind == "slowdown" and f.factor > 0:
                if f.work == "matmul":
                    matmul_ns(int(f.factor * compute_ns))
                else:
                    burn_ns(int(f.factor * compute_ns))
            elif spike and f.kind == "spike" and self._rng(i, step).random() < f.rate:
                ms = self._magnitude_ms(f, self._rng(i + 1000, step))
                burn_ns(int(ms * 1e6))
                self._record(step, "spike", ms)

    def _cold_read(self, fault: Fault) -> None:
        nbytes = int(fault.mb * 2**20)
        if self._cold_file is None:
            base = self.truth_path.parent if self.truth_path else Path(tempfile.gettempdir())
            base.mkdir(parents=True, exist_ok=True)
            self._cold_file = base / f"cold-read-rank{self.rank}.bin"
            with self._cold_file.open("wb") as fh:
                fh.write(np.random.default_rng(self.rank).bytes(nbytes))
                fh.flush()
                os.fsync(fh.fileno())
        fd = os.open(self._cold_file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            while os.read(fd, 1 << 20):
                pass
        finally:
            os.close(fd)

    # ------------------------------------------------------------ automatic mode

    def install(self) -> Chaos:
        """Inject through global hooks, for a script that was not written for hyperacc.

        Step boundaries come from the optimizer's global step hooks. Compute faults (slowdown, spike)
        burn at the start of every backward (``torch.autograd.backward`` is wrapped), ``factor`` x that
        micro-step's forward time x ``(1 + backward_ratio)``, so they happen where a slow device would
        be slow: before the gradient collective, inside the backward. Data stalls happen in the
        ``DataLoader`` iterator, or, in a step that fetched nothing from a DataLoader (a script that
        reads its own batches, as nanoGPT does), just before the step's first forward: where the input
        of that step was read.
        """
        import threading

        import torch
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook
        from torch.utils.data import dataloader

        ratio = max((f.backward_ratio for _, f in self.faults if f.kind == "slowdown"), default=2.0)
        stalls = any(f.kind == "data_stall" for _, f in self.faults)
        main = threading.get_ident()
        # per step: forward time not yet burnt for, whether the input was read, whether a spike fired
        state = {"depth": 0, "t0": 0, "forward_ns": 0, "fetched": False, "stalled": False,
                 "spiked": False, "optimizer": None, "stepped": False}  # fmt: skip

        def pre(module: torch.nn.Module, args: Any) -> None:
            if threading.get_ident() != main:
                return
            if state["depth"] == 0 and torch.is_grad_enabled():
                if stalls and not state["fetched"] and not state["stalled"]:
                    state["stalled"] = True
                    self.data(self._step)
                state["t0"] = time.perf_counter_ns()
            state["depth"] += 1

        def post(module: torch.nn.Module, args: Any, output: Any) -> None:
            if threading.get_ident() != main:
                return
            state["depth"] = max(state["depth"] - 1, 0)
            if state["depth"] == 0 and torch.is_grad_enabled():
                state["forward_ns"] += time.perf_counter_ns() - state["t0"]

        orig_backward = torch.autograd.backward

        def backward(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == main:
                compute_ns = int(state["forward_ns"] * (1 + ratio))
                state["forward_ns"] = 0
                self._burn(self._step, compute_ns, spike=not state["spiked"])
                state["spiked"] = True
            return orig_backward(*args, **kwargs)

        def next_step() -> None:
            state.update(fetched=False, stalled=False, spiked=False, forward_ns=0)
            self.step_begin(self._step + 1)

        def step_post(optimizer: Any, args: Any, kwargs: Any) -> None:
            if state["optimizer"] is None:
                state["optimizer"] = id(optimizer)
            if state["optimizer"] == id(optimizer):  # several optimizers: count steps of the first
                state["stepped"] = True
                next_step()

        from torch.amp.grad_scaler import GradScaler

        orig_scaler_step = GradScaler.step

        def scaler_step(scaler: Any, *args: Any, **kwargs: Any) -> Any:
            # A skipped update (inf/NaN gradients) still ends the iteration, as the tracer counts steps.
            state["stepped"] = False
            try:
                return orig_scaler_step(scaler, *args, **kwargs)
            finally:
                if not state["stepped"]:
                    next_step()

        self._hooks = [
            register_module_forward_pre_hook(pre),
            register_module_forward_hook(post, always_call=True),
            register_optimizer_step_post_hook(step_post),
        ]
        self._orig_backward = orig_backward
        torch.autograd.backward = backward
        self._orig_scaler_step = orig_scaler_step
        GradScaler.step = scaler_step
        if stalls:
            orig = dataloader._BaseDataLoaderIter.__next__
            chaos = self

            def __next__(it: Any) -> Any:
                if threading.get_ident() == main:
                    state["fetched"] = True
                    chaos.data()
                return orig(it)

            self._orig_next = orig
            dataloader._BaseDataLoaderIter.__next__ = __next__
        self.step_begin(0)
        return self

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for proc in self._competitors:
            proc.kill()
            proc.wait()
        self._competitors = []
        if self._dispatch_mode is not None:
            try:
                self._dispatch_mode.__exit__(None, None, None)
            except RuntimeError:  # closed from another thread than the one that entered it
                pass
            self._dispatch_mode = None
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._orig_next is not None:
            from torch.utils.data import dataloader

            dataloader._BaseDataLoaderIter.__next__ = self._orig_next
            self._orig_next = None
        if self._orig_backward is not None:
            import torch
            from torch.amp.grad_scaler import GradScaler

            torch.autograd.backward = self._orig_backward
            GradScaler.step = self._orig_scaler_step
            self._orig_backward = None
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        self._garbage.clear()
        self.flush()
        if self._cold_file is not None:
            self._cold_file.unlink(missing_ok=True)


def _slow_dispatch(ns: int) -> Any:
    """A TorchFunctionMode, entered on this thread, that burns ``ns`` before every torch operator."""
    from torch.overrides import TorchFunctionMode

    class SlowDispatch(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            burn_ns(ns)
            return func(*args, **(kwargs or {}))

    mode = SlowDispatch()
    mode.__enter__()
    return mode


_installed: Chaos | None = None


def from_env(**kwargs: Any) -> Chaos | None:
    """The Chaos configured by ``HYPERACC_CHAOS``, or None when it is unset or empty."""
    raw = env_text(ENV)
    return Chaos(raw, **kwargs) if raw else None


def install_from_env(**kwargs: Any) -> Chaos | None:
    """Install the environment's chaos once per process (a second call returns the first one)."""
    global _installed
    if _installed is None:
        chaos = from_env(**kwargs)
        _installed = chaos.install() if chaos else None
    return _installed


def read_ground_truth(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every injection recorded under ``RUN_DIR/chaos``, in file order (rank by rank)."""
    rows = []
    for path in sorted((Path(run_dir) / "chaos").glob("rank-*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    log.warning("skipping a truncated ground-truth line in %s", path)
    return rows

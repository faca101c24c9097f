"""Prefetch batches to the device through a fixed pool of pinned host buffers.

Why: torch's DataLoader pin-memory thread pins a fresh host tensor for every batch (page-locking is a
slow, variable-latency syscall path), and a plain ``.to(device, non_blocking=True)`` on the training
thread serialises the copy with the step. Here one copy thread stages each batch into one of ``slots``
(default 3) pinned buffers that are allocated once and reused (grown only when a batch is larger than
any before), issues one host-to-device copy per batch on a side CUDA stream, runs an optional device
``transform`` on that stream (e.g. YUV -> RGB, so only raw YUV crosses PCIe), and records an event.
The consumer's stream waits on that event (``wait_event``: never a host synchronisation) and the output
tensors are ``record_stream``-ed so the caching allocator cannot hand their memory out while the
consumer still reads it. A slot's pinned memory is rewritten only after the copy thread has seen its
event complete, i.e. after the device finished reading it (the pitfall of timm's PrefetchLoader, which
has no such guard; FFCV uses the same event-guarded slot idea).

Without CUDA (or for a non-CUDA device) it degrades to a bounded prefetch queue with the same
semantics: order kept, at most ``slots`` batches ahead, producer exceptions re-raised in the consumer
with their original traceback, ``close()``/early ``break`` stop the thread.

The consumer's wait for each batch is its data time: while a hyper-trace tracer runs in the process
(``hyperacc.trace.current()``), ``__next__`` adds it to the step's ``data`` phase (0 when the batch was
ready), so a tracer that counts DataLoader fetches only on the training thread still sees the wait
behind the prefetcher. Rules and defaults: docs/data.md.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["DevicePrefetcher", "PrefetchIterator"]

log = logging.getLogger(__name__)


def _no_tracer() -> None:
    return None


def _tracer_lookup() -> Callable[[], Any]:
    """``hyperacc.trace.current`` when the trace layer is importable, else a function returning None."""
    try:
        from hyperacc.trace import current
    except Exception:  # noqa: BLE001 - the prefetcher works without the trace layer
        return _no_tracer
    return current

_ALIGN = 256  # byte alignment of each tensor inside a slot (any dtype's element size divides it)
_POLL_S = 0.05  # how often a blocked producer re-checks the stop flag


class _End:
    pass


_END = _End()


class _Failure:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


# ----------------------------------------------------------------------------- batch structure


def _leaves(obj: Any, out: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, Mapping):
        for v in obj.values():
            _leaves(v, out)
    elif isinstance(obj, tuple | list):
        for v in obj:
            _leaves(v, out)


def _rebuild(obj: Any, it: Iterator[torch.Tensor]) -> Any:
    """Same structure as ``obj`` with its tensors replaced, in order, by the items of ``it``."""
    if isinstance(obj, torch.Tensor):
        return next(it)
    if isinstance(obj, Mapping):
        items = {k: _rebuild(v, it) for k, v in obj.items()}
        if type(obj) is dict:
            return items
        try:
            return type(obj)(items)
        except TypeError:
            return items
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_rebuild(v, it) for v in obj))
    if isinstance(obj, tuple | list):
        return type(obj)(_rebuild(v, it) for v in obj)
    return obj


# ----------------------------------------------------------------------------- CUDA staging


class _Slot:
    """One pinned host buffer plus the event that says when the device has finished reading it."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.host: torch.Tensor | None = None
        self.event: torch.cuda.Event | None = None
        self.recorded = False
        self.grows = 0


class _CudaStager:
    """Runs in the copy thread: pinned staging, one H2D copy per batch, transform, event."""

    def __init__(self, device: torch.device, transform: Callable[[Any], Any] | None) -> None:
        self.device = device
        self.transform = transform
        self.stream = torch.cuda.Stream(device=device)

    @torch.no_grad()
    def stage(self, slot: _Slot, batch: Any) -> tuple[Any, list[torch.Tensor]]:
        leaves: list[torch.Tensor] = []
        _leaves(batch, leaves)
        layout: list[tuple[int, int] | None] = []  # (offset, nbytes) for host tensors, None otherwise
        total = 0
        for t in leaves:
            if t.device.type != "cpu":
                layout.append(None)
                continue
            nbytes = t.numel() * t.element_size()
            layout.append((total, nbytes))
            total += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        if slot.recorded:
            # The device may still be reading this slot's pinned memory: wait here, in the copy thread.
            slot.event.synchronize()
        if total and (slot.host is None or slot.host.numel() < total):
            # Grow rarely: only when a batch is larger than any staged in this slot before.
            capacity = max(total, int(slot.host.numel() * 1.25) if slot.host is not None else 0)
            capacity = (capacity + (1 << 20) - 1) >> 20 << 20
            slot.host = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
            slot.grows += 1
        for t, where in zip(leaves, layout, strict=True):
            if where is not None and where[1]:
                off, nbytes = where
                slot.host[off : off + nbytes].view(t.dtype).view(t.shape).copy_(t)
        keep: list[torch.Tensor] = []
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            outs: list[torch.Tensor] = []
            dev_buf = None
            if total:
                dev_buf = torch.empty(total, dtype=torch.uint8, device=self.device)
                dev_buf.copy_(slot.host[:total], non_blocking=True)
                keep.append(dev_buf)
            for t, where in zip(leaves, layout, strict=True):
                if where is None:
                    moved = t.to(self.device, non_blocking=True)
                    outs.append(moved)
                    if moved is not t:
                        keep.append(moved)
                elif where[1] == 0:
                    outs.append(torch.empty(t.shape, dtype=t.dtype, device=self.device))
                else:
                    off, nbytes = where
                    outs.append(dev_buf[off : off + nbytes].view(t.dtype).view(t.shape))
            result = _rebuild(batch, iter(outs))
            if self.transform is not None:
                result = self.transform(result)
                extra: list[torch.Tensor] = []
                _leaves(result, extra)
                keep.extend(x for x in extra if x.device.type == "cuda")
            if slot.event is None:
                slot.event = torch.cuda.Event()
            slot.event.record(self.stream)
            slot.recorded = True
        return result, keep


# ----------------------------------------------------------------------------- the pipe


class _Pipe:
    """State shared by the consumer and the copy thread. The thread never references the iterator
    object itself, so an abandoned iterator is collected and its finaliser stops the thread."""

    def __init__(self, slots: int, cuda: bool) -> None:
        self.ready: queue.Queue = queue.Queue(maxsize=slots)
        self.free: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        if cuda:
            for i in range(slots):
                self.free.put(_Slot(i))

    def put(self, item: Any) -> bool:
        while not self.stop.is_set():
            try:
                self.ready.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def take_slot(self) -> _Slot | None:
        while not self.stop.is_set():
            try:
                return self.free.get(timeout=_POLL_S)
            except queue.Empty:
                continue
        return None


def _produce(
    pipe: _Pipe,
    source: Iterable[Any],
    stager: _CudaStager | None,
    device: torch.device,
    transform: Callable[[Any], Any] | None,
) -> None:
    it = None
    try:
        if stager is not None:
            torch.cuda.set_device(device)
        it = iter(source)
        while not pipe.stop.is_set():
            try:
                batch = next(it)
            except StopIteration:
                pipe.put(_END)
                return
            if pipe.stop.is_set():
                return
            if stager is not None:
                slot = pipe.take_slot()
                if slot is None:
                    return
                result, keep = stager.stage(slot, batch)
                if not pipe.put((slot, result, keep)):
                    return
            else:
                if device.type != "cpu":
                    out: list[torch.Tensor] = []
                    _leaves(batch, out)
                    batch = _rebuild(batch, iter([t.to(device) for t in out]))
                if transform is not None:
                    batch = transform(batch)
                if not pipe.put((None, batch, None)):
                    return
    except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
        pipe.put(_Failure(exc))
    finally:
        # Close the source here, in its own thread (a DataLoader iterator shuts its workers down).
        close = getattr(it, "close", None)
        if callable(close):
            try:
                close()
            except Exception:  # noqa: BLE001
                log.debug("closing the prefetch source failed", exc_info=True)
        del it


class PrefetchIterator:
    """One pass over the source. Use it in a ``for`` loop; ``close()`` (or leaving a ``with`` block,
    or dropping the last reference after an early ``break``) stops the copy thread."""

    def __init__(
        self,
        source: Iterable[Any],
        device: torch.device,
        slots: int,
        transform: Callable[[Any], Any] | None,
        join_timeout: float,
    ) -> None:
        self.device = device
        cuda = device.type == "cuda"
        self._pipe = _Pipe(slots, cuda)
        stager = _CudaStager(device, transform) if cuda else None
        self._join_timeout = join_timeout
        self._done = False
        self.batches = 0
        self.waits = 0
        self.wait_ns = 0
        self._current_tracer = _tracer_lookup()
        self._thread = threading.Thread(
            target=_produce,
            args=(self._pipe, source, stager, device, transform),
            name="hyperacc-prefetch",
            daemon=True,
        )
        self._thread.start()

    def __iter__(self) -> PrefetchIterator:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        ready = self._pipe.ready
        waited = 0
        try:
            item = ready.get_nowait()
        except queue.Empty:
            # The producer is behind: this wait is the data time the step sees.
            t0 = time.perf_counter_ns()
            item = self._wait(ready)
            waited = time.perf_counter_ns() - t0
            self.waits += 1
            self.wait_ns += waited
        tracer = self._current_tracer()
        if tracer is not None:
            self._report_wait(tracer, waited)
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.exc
        slot, batch, keep = item
        if slot is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(slot.event)
            for t in keep:
                t.record_stream(stream)
            self._pipe.free.put_nowait(slot)
        self.batches += 1
        return batch

    def _report_wait(self, tracer: Any, waited: int) -> None:
        try:
            tracer.add_phase("data", waited)
        except Exception as exc:  # noqa: BLE001 - reporting must never break the data path
            self._current_tracer = _no_tracer
            log.warning("hyperacc prefetch: reporting data waits to the tracer switched off: %r", exc)

    def _wait(self, ready: queue.Queue) -> Any:
        while True:
            try:
                return ready.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive():
                    # The thread ended without a sentinel (it was stopped): nothing more will come.
                    try:
                        return ready.get_nowait()
                    except queue.Empty:
                        return _END

    def close(self) -> None:
        """Stop the copy thread and release the source. Safe to call more than once."""
        if self._done:
            return
        self._done = True
        self._pipe.stop.set()
        _drain(self._pipe.ready)
        if self._thread is not threading.current_thread():
            self._thread.join(self._join_timeout)
            if self._thread.is_alive():
                log.warning(
                    "hyperacc prefetch: the copy thread is still inside the source after %.1fs; "
                    "it will exit when the source returns",
                    self._join_timeout,
                )
        _drain(self._pipe.ready)

    def __enter__(self) -> PrefetchIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass


def _drain(q: queue.Queue) -> None:
    while True:
        try:
            q.get_nowait()
        except queue.Empty:
            return


class DevicePrefetcher:
    """Wrap any iterable of batches (tensors, tuples, lists, dicts, namedtuples) so that iterating it
    yields the same batches already on ``device``, up to ``slots`` batches ahead.

    ``device``: ``None`` picks the current CUDA device when there is one, else CPU (bounded prefetch
    queue only). ``transform`` runs on the device after the copy, on the copy stream (e.g. YUV -> RGB).
    Consumers on a non-default stream should make that stream current before calling ``next``.
    """

    def __init__(
        self,
        loader: Iterable[Any],
        device: str | torch.device | None = None,
        *,
        slots: int = 3,
        transform: Callable[[Any], Any] | None = None,
        join_timeout: float = 10.0,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.loader = loader
        self.device = _resolve_device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"DevicePrefetcher: device {self.device} requested but CUDA is not available")
        self.slots = slots
        self.transform = transform
        self.join_timeout = join_timeout
        # Weak, so that an iterator abandoned after an early ``break`` is collected and stops its thread.
        self._current: weakref.ref[PrefetchIterator] | None = None

    def __iter__(self) -> PrefetchIterator:
        self.close()
        it = PrefetchIterator(self.loader, self.device, self.slots, self.transform, self.join_timeout)
        self._current = weakref.ref(it)
        return it

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def close(self) -> None:
        """Stop the iteration in progress, if any."""
        it = self._current() if self._current is not None else None
        if it is not None:
            it.close()
        self._current = None

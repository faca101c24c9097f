"""Device-clock columns on CUDA: a fixed budget of events per step, read back without waiting.

Each traced step gets a slot of ``events`` preallocated ``torch.cuda.Event`` objects, whatever the
model's bucket count: the step's start and end, the outermost forward and backward of each micro-step,
the gradient collective of each DDP model (its last bucket's launch and completion: two events per
model, not per bucket) and each synchronous explicit collective; forward and backward pairs only with
the ``device_phases`` option (each event record costs a few microseconds of host time). A pair that finds the budget spent
makes its column "not measured" (null) for that step; a device column is never filled with a host
value. ``resolve`` runs at the start of later steps and reads a slot only once every one of its
events reports ``query() == True``, so the host never waits for the device; rows stay unflushed until
then. A step that finds every slot pending (the device more than ``steps`` steps behind) gets no device
values. Only ``resolve(wait=True)`` at close synchronises. docs/tracing.md, "Clocks".
"""

from __future__ import annotations

from hyperacc.trace.columns import (
    DEV_BACKWARD_NS,
    DEV_COMM_WAIT_NS,
    DEV_FORWARD_NS,
    DEV_SELF_NS,
    DEV_STEP_NS,
)
from hyperacc.trace.step_clock import BACKWARD, COMM, FORWARD

DDP_COMM = 7  # a gradient collective inside backward: device wait, taken out of the backward
_KINDS = 8


def _event_calls() -> tuple:
    """``(current_stream, record, query, elapsed)``: the current CUDA stream and the event calls, without
    torch's Python wrappers where this torch has their C base. ``torch.cuda.current_stream()`` spends
    most of an event record's host time (measured on an H200: record() 6.7-10.7 us, of which
    current_stream() 4.6-7.5 us, against 0.6 us for the C lookup): it re-checks CUDA availability and an
    environment variable at every call. The Stream objects are cached by (id, device, type), the tuple
    torch itself builds them from; stream ids come from torch's fixed pools, and the cache is cleared
    past 256 entries all the same."""
    import torch

    public = (torch.cuda.current_stream, torch.cuda.Event.record, torch.cuda.Event.query,
              torch.cuda.Event.elapsed_time)  # fmt: skip
    try:
        base = torch._C._CudaEventBase
        get_device, get_stream = torch._C._cuda_getDevice, torch._C._cuda_getCurrentStream
        make = torch.cuda.Stream
        cache: dict = {}

        def current_stream() -> object:
            data = get_stream(get_device())
            stream = cache.get(data)
            if stream is None:
                if len(cache) >= 256:
                    cache.clear()
                stream = cache[data] = make(stream_id=data[0], device_index=data[1], device_type=data[2])
            return stream

        if current_stream() != torch.cuda.current_stream():
            return public
        return current_stream, base.record, base.query, base.elapsed_time
    except Exception:  # noqa: BLE001 - a torch without these private calls: the public ones
        return public


class DeviceTimer:
    def __init__(self, steps: int = 32, events: int = 24) -> None:
        import torch

        self.steps, self.budget = steps, events
        self.events = [[torch.cuda.Event(enable_timing=True) for _ in range(events)] for _ in range(steps)]
        self._stream, self._record, self._query, self._elapsed = _event_calls()
        pairs = events // 2
        self.n_events = [0] * steps
        self.n_pairs = [0] * steps
        self.pair_kind = [[0] * pairs for _ in range(steps)]
        self.pair_a = [[0] * pairs for _ in range(steps)]
        self.pair_b = [[0] * pairs for _ in range(steps)]
        self.incomplete = [0] * steps  # bit per kind whose pairs did not all fit
        self.row = [-1] * steps
        self.end_event = [-1] * steps
        self.head = 0  # slots opened
        self.tail = 0  # slots resolved
        self.cur = -1  # slot of the step in progress, -1 when it has none
        self._sums = [0.0] * _KINDS

    def begin_step(self) -> bool:
        """Open a slot and record the step's start; False when every slot is still pending."""
        if self.head - self.tail >= self.steps:
            self.cur = -1
            return False
        k = self.head % self.steps
        self.cur = k
        self.n_events[k] = 0
        self.n_pairs[k] = 0
        self.incomplete[k] = 0
        self.end_event[k] = -1
        self.mark()
        return True

    def mark(self) -> int:
        """Record an event on the current stream; its index in the slot, or -1 (no slot, budget spent)."""
        k = self.cur
        if k < 0:
            return -1
        n = self.n_events[k]
        if n >= self.budget - 1:  # the last event is kept for the step's end
            return -1
        self._record(self.events[k][n], self._stream())
        self.n_events[k] = n + 1
        return n

    def pair(self, kind: int, a: int, b: int) -> None:
        k = self.cur
        if k < 0:
            return
        n = self.n_pairs[k]
        if a < 0 or b < 0 or n >= len(self.pair_a[k]):
            self.incomplete[k] |= 1 << kind
            return
        self.pair_kind[k][n] = kind
        self.pair_a[k][n] = a
        self.pair_b[k][n] = b
        self.n_pairs[k] = n + 1

    def end_step(self, row: int) -> bool:
        """Close the step's slot; False when the step had none."""
        k = self.cur
        if k < 0:
            return False
        n = self.n_events[k]
        self._record(self.events[k][n], self._stream())
        self.n_events[k] = n + 1
        self.end_event[k] = n
        self.row[k] = row
        self.head += 1
        self.cur = -1
        return True

    def oldest_pending_row(self) -> int | None:
        return self.row[self.tail % self.steps] if self.tail < self.head else None

    def resolve(self, buf: list[list[int]], capacity: int, *, wait: bool = False) -> None:
        """Write the device times of completed slots into their rows of ``buf`` (oldest first)."""
        query = self._query
        while self.tail < self.head:
            k = self.tail % self.steps
            events = self.events[k]
            end = self.end_event[k]
            if wait:
                for i in range(self.n_events[k]):
                    events[i].synchronize()
            elif not query(events[end]) or not all(query(events[i]) for i in range(self.n_events[k])):
                return  # the end is recorded last; the others may sit on another stream
            self._write(k, buf[self.row[k] % capacity])
            self.tail += 1

    def _write(self, k: int, row: list[int]) -> None:
        events = self.events[k]
        sums = self._sums
        for i in range(_KINDS):
            sums[i] = 0.0
        kinds, a, b = self.pair_kind[k], self.pair_a[k], self.pair_b[k]
        elapsed = self._elapsed
        for i in range(self.n_pairs[k]):
            sums[kinds[i]] += elapsed(events[a[i]], events[b[i]])  # milliseconds
        bad = self.incomplete[k]
        step = elapsed(events[0], events[self.end_event[k]])
        row[DEV_STEP_NS] = max(int(step * 1e6), 0)
        if not bad & (1 << FORWARD):
            if self._had(k, FORWARD):
                row[DEV_FORWARD_NS] = max(int(sums[FORWARD] * 1e6), 0)
        comm_ok = not bad & ((1 << COMM) | (1 << DDP_COMM))
        if comm_ok:
            comm = sums[COMM] + sums[DDP_COMM]
            row[DEV_COMM_WAIT_NS] = max(int(comm * 1e6), 0)
            row[DEV_SELF_NS] = max(int((step - comm) * 1e6), 0)
        if comm_ok and not bad & (1 << BACKWARD) and self._had(k, BACKWARD):
            row[DEV_BACKWARD_NS] = max(int((sums[BACKWARD] - sums[DDP_COMM]) * 1e6), 0)

    def _had(self, k: int, kind: int) -> bool:
        kinds = self.pair_kind[k]
        return any(kinds[i] == kind for i in range(self.n_pairs[k]))

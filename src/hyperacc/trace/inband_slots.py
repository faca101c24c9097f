"""The in-band exchange proper: the slots one rank sends on the last gradient bucket (its arrival and
wait, in milliseconds), everyone's values decoded after the SUM, the listeners and the pacer, and the
one-time agreement of all ranks on whether the slots ride along (``agree``). The DDP hook that
carries them is ``inband.GradientRounds``; docs/tracing.md, "In-band exchange"."""

from __future__ import annotations

import datetime
import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from hyperacc.trace.failsafe import switch_off

_FP16_MAX_MS = 65000.0  # float16 tops out at 65504
_agreements: dict[str, int] = {}  # agreements made so far per group: every rank makes them in the same order

Listener = Callable[[int, np.ndarray, np.ndarray], None]

_SMALL_WORLD = 64
_HISTORY = 16
_RECV_RING = 4


def agree(group: Any, proposal: bool, timeout_s: float) -> bool:
    """One decision for every rank of ``group``: True only if all of them proposed True in time.

    Each rank adds its proposal to counters in the job's store; once all have arrived (or after
    ``timeout_s``) it proposes the decision with ``compare_set`` on one key, and every rank adopts
    whatever that key holds: the first proposal wins, so all ranks end with the same answer even when
    some timed out. No store, no agreement: False.
    """
    base = _job_store()
    if base is None:
        return False
    world = group.size()
    tag = "-".join(str(r) for r in dist.get_process_group_ranks(group)) if world <= 16 else f"{world}"
    run = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    index = _agreements.get(tag, 0)
    _agreements[tag] = index + 1
    store = dist.PrefixStore(f"hyperacc/inband/{run}/{restart}/{tag}/{index}/", base)
    if proposal:
        store.add("yes", 1)
    if store.add("arrived", 1) == world:
        store.set("all", "1")
    arrived = True
    try:
        store.wait(["all"], datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistError):
        arrived = False
    mine = arrived and store.add("yes", 0) == world
    return store.compare_set("decision", "", "1" if mine else "0") == b"1"


def _job_store() -> Any:
    try:
        return c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no default group, or a torch without this helper
        return None


class InBand:
    """The in-band exchange of one rank: slots to send, values received, listeners and the pacer."""

    def __init__(self, world: int, rank: int, lag: int) -> None:
        self.world, self.rank, self.lag = world, rank, lag
        self.decoding = True
        self.listeners: list[Listener] = []
        self.min_wait_rank = -1
        self.spread = -1
        self._hist_round = [-1] * _HISTORY
        self._hist_arrival = [-1] * _HISTORY
        self._hist_wait = [-1] * _HISTORY
        self._hist_row = [-1] * _HISTORY
        # CUDA: (arrival, wait) of a ring row from its device columns once resolved, else (-1, -1)
        self.device_values: Callable[[int], tuple[int, int]] | None = None
        self.arrivals_ns = np.full(world, -1, np.int64)
        self.waits_ns = np.full(world, -1, np.int64)
        self._tmp = np.zeros(world, np.float64)
        self._valid = np.zeros(world, bool)
        self._invalid = np.zeros(world, bool)
        self._ext: torch.Tensor | None = None
        self._ext_key: tuple[int, Any, Any] | None = None
        self._head: torch.Tensor | None = None
        self._tail: torch.Tensor | None = None
        self._mine: tuple[torch.Tensor, torch.Tensor] | None = None
        self._recv: list[torch.Tensor] = []
        self._recv_np: list[np.ndarray] = []
        self._recv_events: list[Any] = []
        self._recv_round = [-1] * _RECV_RING
        self._recv_next = 0
        self._recv_read = 0
        self._decode_np: np.ndarray | None = None

    def remember(self, rnd: int, arrival: int, wait: int, row: int) -> None:
        """This rank's host-clock values of round ``rnd``, and the ring row its step will take."""
        h = rnd % _HISTORY
        self._hist_round[h], self._hist_arrival[h], self._hist_wait[h] = rnd, arrival, wait
        self._hist_row[h] = row

    def values_of(self, rnd: int) -> tuple[int, int]:
        """(arrival, wait) of round ``rnd`` in ns, -1 where unknown; device clock when there is one."""
        h = rnd % _HISTORY
        if rnd < 0 or self._hist_round[h] != rnd:
            return -1, -1
        if self.device_values is not None:
            return self.device_values(self._hist_row[h])  # NaN until that row's events are read back
        return self._hist_arrival[h], self._hist_wait[h]

    @property
    def slots(self) -> torch.Tensor:
        """The slot part of the extended bucket (after ``extended``)."""
        assert self._tail is not None
        return self._tail

    @property
    def gradients(self) -> torch.Tensor:
        """The gradient part of the extended bucket (after ``extended``)."""
        assert self._head is not None
        return self._head

    def extended(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(bucket + slots, its gradient view, its slot view), allocated once per bucket size."""
        n = buf.numel()
        key = (n, buf.dtype, buf.device)
        if self._ext_key != key:
            ext = torch.empty(n + 2 * self.world, dtype=buf.dtype, device=buf.device)
            self._ext, self._ext_key = ext, key
            self._head, self._tail = ext[:n], ext[n:]  # views made once: slicing costs microseconds
            self._mine = (self._tail[self.rank : self.rank + 1], self._tail[self.world + self.rank :][:1])
            if buf.is_cuda and not self._recv:
                self._recv = [torch.empty(2 * self.world, dtype=buf.dtype, pin_memory=True) for _ in range(_RECV_RING)]
                self._recv_np = [r.float().numpy() if r.dtype == torch.bfloat16 else r.numpy() for r in self._recv]
                self._recv_events = [torch.cuda.Event() for _ in range(_RECV_RING)]
        return self._ext, self._head, self._tail  # type: ignore[return-value]

    def fill(self, rnd: int, tail: torch.Tensor) -> None:
        """This rank's values of round ``rnd - lag`` into its two slots, zeros elsewhere (no host buffer)."""
        tail.zero_()
        arrival, wait = self.values_of(rnd - self.lag)
        fp16 = tail.dtype == torch.float16
        mine = self._mine
        assert mine is not None
        mine[0].fill_(_ms(arrival, fp16))
        mine[1].fill_(_ms(wait, fp16))

    def receive(self, rnd: int, tail: torch.Tensor) -> None:
        """The summed slots of round ``rnd`` (carrying round ``rnd - lag``): decode now (CPU) or later."""
        if not self.decoding:
            return
        if not tail.is_cuda:
            vals = tail.numpy() if tail.dtype in (torch.float32, torch.float64) else tail.float().numpy()
            self._decode(vals, rnd - self.lag)
            return
        i = self._recv_next % _RECV_RING
        self._recv[i].copy_(tail, non_blocking=True)
        self._recv_events[i].record()
        self._recv_round[i] = rnd - self.lag
        self._recv_next += 1

    def poll(self) -> None:
        """Decode the copies that reached the host (CUDA); never waits."""
        while self._recv_read < self._recv_next:
            if self._recv_next - self._recv_read > _RECV_RING:
                self._recv_read = self._recv_next - _RECV_RING  # overwritten before being read
            i = self._recv_read % _RECV_RING
            if not self._recv_events[i].query():
                return
            vals = self._recv_np[i]
            if self._recv[i].dtype == torch.bfloat16:
                vals = self._recv[i].float().numpy()
            self._decode(vals, self._recv_round[i])
            self._recv_read += 1

    def _decode(self, vals: np.ndarray, step: int) -> None:
        w = self.world
        if w <= _SMALL_WORLD:
            lo, hi, culprit = math.inf, -math.inf, -1
            for r, v in enumerate(vals[w:].tolist()):
                if v >= 0.0:  # NaN compares False
                    if v < lo:
                        lo, culprit = v, r
                    if v > hi:
                        hi = v
            self.min_wait_rank = culprit
            self.spread = int(round((hi - lo) * 1e6)) if culprit >= 0 else -1
        else:
            self._to_ns(vals[w:], self.waits_ns)
            valid = self.waits_ns >= 0
            if valid.any():
                masked = np.where(valid, self.waits_ns, np.iinfo(np.int64).max)
                self.min_wait_rank = int(masked.argmin())
                self.spread = int(self.waits_ns[valid].max() - masked[self.min_wait_rank])
            else:
                self.min_wait_rank = self.spread = -1
        if step < 0 or not self.listeners:
            return
        self._to_ns(vals[w:], self.waits_ns)
        self._to_ns(vals[:w], self.arrivals_ns)
        for fn in self.listeners:
            try:
                fn(step, self.arrivals_ns, self.waits_ns)
            except Exception as exc:  # noqa: BLE001
                self.listeners = [f for f in self.listeners if f is not fn]
                switch_off(f"in-band listener {getattr(fn, '__qualname__', fn)!s}", exc)

    def _to_ns(self, ms: np.ndarray, out: np.ndarray) -> None:
        tmp = self._tmp
        np.multiply(ms, 1e6, out=tmp)
        np.greater_equal(tmp, 0.0, out=self._valid)
        np.logical_not(self._valid, out=self._invalid)
        np.copyto(tmp, -1.0, where=self._invalid)
        np.rint(tmp, out=tmp)
        np.copyto(out, tmp, casting="unsafe")


def _ms(ns: int, fp16: bool) -> float:
    if ns < 0:
        return math.nan
    ms = ns / 1e6
    return min(ms, _FP16_MAX_MS) if fp16 else ms

"""Deterministic garbage collection: the same collection at the same step on every rank.

Python's automatic collector runs when allocation counters cross thresholds, at a different moment on
each rank; under a synchronous all-reduce every such pause stalls the whole job. Here automatic
collection is off, collections run every ``interval`` steps (at step indices that are multiples of
``interval``, identical on every rank), and a safety valve collects early, at a step all ranks agreed
on, when memory grows past a bound in between. The agreement goes through the job's c10d store from a
background thread (no collective, nothing on the training thread). Rules and defaults:
docs/stabilizers.md, "Deterministic GC".
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from hyperacc.stabilize.memory import rss_bytes

log = logging.getLogger(__name__)

NEVER = 1 << 62  # "no step": larger than any real step index
WORKER_POLICIES = ("enable", "inherit")


@dataclasses.dataclass
class GCOptions:
    interval: int = 400  # collect every N steps (the seed's value)
    generation: int = 2  # gc.collect(generation) on the schedule
    freeze: bool = True  # collect once and gc.freeze() at the first step (set-up objects leave the GC)
    workers: str = "enable"  # forked children / DataLoader workers: "enable" automatic GC, or "inherit"
    valve: bool = True  # early collection at an agreed step when memory grows past a bound
    valve_rss_mb: float | None = 2048.0  # RSS growth since the last collection that triggers the valve
    valve_objects: int | None = 1_000_000  # GC-tracked objects allocated (net) since the last collection
    valve_lead_steps: int = 10  # the agreed step is at least this many steps after the proposal ...
    valve_lead_s: float = 1.0  # ... and at least this much wall time later, at the measured step rate
    valve_poll_s: float = 0.2  # how often the background thread looks at memory and at the store

    def validate(self) -> None:
        if self.interval < 1:
            raise ValueError(f"gc.interval must be >= 1 step (got {self.interval})")
        if self.generation not in (0, 1, 2):
            raise ValueError(f"gc.generation must be 0, 1 or 2 (got {self.generation})")
        if self.workers not in WORKER_POLICIES:
            raise ValueError(f"gc.workers must be one of {WORKER_POLICIES} (got {self.workers!r})")
        if self.valve_poll_s <= 0 or self.valve_lead_s < 0 or self.valve_lead_steps < 1:
            raise ValueError("gc.valve_poll_s must be > 0, gc.valve_lead_s >= 0, gc.valve_lead_steps >= 1")


# ------------------------------------------------------------------ forked children (DataLoader workers)

_worker_policy: str | None = None  # set while a schedule is active in this process
_fork_hook_installed = False


def _after_fork_in_child() -> None:
    # A forked DataLoader worker would otherwise inherit "automatic GC off" and never collect.
    if _worker_policy == "enable" and not gc.isenabled():
        gc.enable()


def _install_fork_hook() -> None:
    global _fork_hook_installed
    if not _fork_hook_installed and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _fork_hook_installed = True


def apply_worker_policy(policy: str) -> None:
    """What a DataLoader ``worker_init_fn`` does with GC (also works for spawned workers)."""
    if policy == "enable" and not gc.isenabled():
        gc.enable()


# ------------------------------------------------------------------ the schedule


class GCSchedule:
    """Owns the GC state of the process while active. The training thread calls :meth:`collect`,
    :meth:`freeze` and :meth:`valve_done`; the valve thread only writes ``valve_at``."""

    _instances = 0  # per process; the same count on every rank keys the store rounds

    def __init__(
        self,
        opts: GCOptions,
        *,
        rank: int,
        world_size: int,
        get_step: Callable[[], int],
        get_store: Callable[[], Any],
        record: Callable[[str, int, int, float, str], None],
    ) -> None:
        opts.validate()
        self.opts = opts
        self.rank = rank
        self.world_size = world_size
        self._get_step = get_step
        self._get_store = get_store
        self._record = record
        self.valve_at = NEVER  # read by the training thread on every step
        self.valve_proposals = 0
        self.valve_proposer = -1  # rank whose proposal won the current round
        self._baseline_rss = -1
        self._was_enabled = True
        self._froze = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        GCSchedule._instances += 1
        self._key_prefix = f"hyperacc/gc_valve/{GCSchedule._instances}/"
        self._valve_round = 0  # rounds the training thread has executed

    # -- life cycle
    def start(self) -> None:
        global _worker_policy
        self._was_enabled = gc.isenabled()
        gc.disable()
        _worker_policy = self.opts.workers
        _install_fork_hook()
        self._baseline_rss = rss_bytes()
        if self.opts.valve and (self.opts.valve_rss_mb is not None or self.opts.valve_objects is not None):
            self._thread = threading.Thread(target=self._valve_loop, name="hyperacc-gc-valve", daemon=True)
            self._thread.start()

    def close(self) -> None:
        global _worker_policy
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.opts.valve_poll_s + 1.0)
        _worker_policy = None
        if self._froze:
            gc.unfreeze()
            self._froze = False
        if self._was_enabled:
            gc.enable()

    # -- actions on the training thread (only on steps where something is due)
    def next_due(self, step: int) -> int:
        """The first multiple of ``interval`` after ``step``: identical on every rank."""
        return (step // self.opts.interval + 1) * self.opts.interval

    def freeze(self, step: int) -> None:
        t0 = time.perf_counter_ns()
        collected = gc.collect()
        gc.freeze()
        self._froze = True
        self._baseline_rss = rss_bytes()
        self._record("gc_freeze", step, time.perf_counter_ns() - t0, float(gc.get_freeze_count()),
                     f"collected={collected}")  # fmt: skip

    def collect(self, step: int, reason: str) -> int:
        gen = self.opts.generation
        t0 = time.perf_counter_ns()
        collected = gc.collect(gen)
        duration = time.perf_counter_ns() - t0
        self._baseline_rss = rss_bytes()
        self._record("gc_collect", step, duration, float(collected), f"{reason} gen={gen}")
        return duration

    def valve_done(self) -> None:
        self.valve_at = NEVER
        self._valve_round += 1

    # -- the valve thread
    def _over_bound(self) -> str | None:
        o = self.opts
        if o.valve_objects is not None:
            pending = gc.get_count()[0]
            if pending > o.valve_objects:
                return f"objects={pending}>{o.valve_objects}"
        if o.valve_rss_mb is not None and self._baseline_rss > 0:
            rss = rss_bytes()
            if rss > 0 and rss - self._baseline_rss > o.valve_rss_mb * 2**20:
                return f"rss_growth_mb={(rss - self._baseline_rss) / 2**20:.0f}>{o.valve_rss_mb:g}"
        return None

    def _valve_loop(self) -> None:
        o = self.opts
        store = None
        warned_no_store = False
        rate = 0.0  # steps per second, smoothed
        last_step, last_t = self._get_step(), time.monotonic()
        round_ = 0  # next round this thread will look for
        try:
            while not self._stop.wait(o.valve_poll_s):
                step, now = self._get_step(), time.monotonic()
                if step > last_step and now > last_t:
                    inst = (step - last_step) / (now - last_t)
                    rate = inst if rate == 0.0 else 0.7 * rate + 0.3 * inst
                    last_step, last_t = step, now
                if self.valve_at != NEVER or self._valve_round < round_:
                    continue  # a round is agreed and not yet executed
                if self.world_size > 1 and store is None:
                    store = self._get_store()
                key = f"{self._key_prefix}{round_}"
                if store is not None and store.check([key]):
                    self._adopt(store.get(key), round_)
                    round_ += 1
                    continue
                # Before the first step the set-up's objects still count (the first step freezes them).
                why = self._over_bound() if step >= 0 else None
                if why is None:
                    continue
                lead = max(o.valve_lead_steps, math.ceil(o.valve_lead_s * rate))
                proposal = f"{step + lead}:{self.rank}"
                if store is not None:
                    agreed = store.compare_set(key, "", proposal)  # first proposal wins, atomically
                else:
                    if self.world_size > 1 and not warned_no_store:
                        log.warning(
                            "hyperacc.stabilize: GC safety valve has no c10d store to agree through; "
                            "this rank collects early on its own"
                        )
                        warned_no_store = True
                    agreed = proposal
                self.valve_proposals += 1
                self._record("gc_valve_proposed", step, 0, float(proposal.split(":")[0]), why)
                self._adopt(agreed, round_)
                round_ += 1
        except Exception as exc:  # the valve is optional: never let it disturb training
            if not self._stop.is_set():
                log.warning(
                    "hyperacc.stabilize: GC safety valve switched off after an internal error: %r", exc
                )

    def _adopt(self, value: bytes | str, round_: int) -> None:
        text = value.decode() if isinstance(value, bytes) else value
        at, _, proposer = text.partition(":")
        self.valve_proposer = int(proposer) if proposer else -1
        self.valve_at = int(at)

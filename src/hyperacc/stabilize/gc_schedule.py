"""Deterministic garbage collection: the same collection at the same step on every rank, at a cost no
larger than the automatic collector's.

Python's automatic collector runs when allocation counters cross thresholds, at a different moment on
each rank; under a synchronous all-reduce every such pause stalls the whole job. The expensive ones are
the full collections, which walk every long-lived object; the young ones are bounded by CPython's
thresholds and free each cycle while it is still in cache. So by default young collections stay with
CPython and full collections run only at step indices every rank shares (``young="scheduled"`` moves
every collection to the schedule). The cost model (``pause = fixed + per_unit x what accumulated``,
fitted to the collections themselves), the pause budget and the cost budget decide the interval when
``interval="auto"``; a safety valve collects early, at a step all ranks agreed on, when memory would
grow past a bound before the next scheduled collection. Agreement goes through the job's c10d store
from a background thread (no collective, nothing on the training thread). Rules and defaults:
docs/stabilizers.md, "Deterministic GC".

Why this module is over 500 lines: ``GCSchedule`` holds the state that the training thread and the
background agreement thread share (plans, the valve's step, the cost samples); its pure parts (the cost
model and the plan arithmetic) are the next to move out.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from hyperacc.stabilize.memory import rss_bytes
from hyperacc.stats import median

log = logging.getLogger(__name__)

NEVER = 1 << 62  # "no step": larger than any real step index
WORKER_POLICIES = ("enable", "inherit")
YOUNG_POLICIES = ("automatic", "scheduled")
AUTO = "auto"
NO_FULL = 1 << 30  # gen-2 threshold that CPython never reaches: full collections only on the schedule
SAMPLES = 32  # collections kept for the cost model
RECENT = 4  # latest collections that give the garbage rate
SHRINK_AT = 1.5  # an agreed auto interval is re-agreed when a pause exceeds this x the budget
MAX_ROUNDS = 8  # auto agreements per run (the first one and at most 7 shrinks)


@dataclasses.dataclass(frozen=True)
class GCOptions:
    """docs/stabilizers.md, "Deterministic GC"."""

    interval: int | str = AUTO  # collect every N steps, or "auto": from the cost model and the budget
    young: str = "automatic"  # young collections: "automatic" (CPython's thresholds) or "scheduled" too
    generation: int = 2  # gc.collect(generation) on the schedule
    freeze: bool = True  # collect once and gc.freeze() at the first step (set-up objects leave the GC)
    workers: str = "enable"  # forked children / DataLoader workers: "enable" automatic GC, or "inherit"
    pause_budget_ms: float | None = None  # largest predicted pause of one collection ...
    pause_budget_frac: float = 0.05  # ... by default this fraction of the median step time
    cost_budget_frac: float = 0.01  # auto: the fixed part of a collection, spread over the interval, at most this
    max_interval: int = 400  # auto never collects less often than this
    calibration_steps: int = 20  # auto: steps collected one by one (after the freeze) to fit the model
    valve: bool = True  # early collection at an agreed step when memory would pass a bound
    valve_rss_mb: float | None = 2048.0  # RSS growth since the last collection that triggers the valve
    valve_objects: int | None = 1_000_000  # GC-tracked objects allocated (net) since the last collection
    valve_lead_steps: int = 2  # the agreed step is at least this many steps after the proposal ...
    valve_lead_s: float | None = None  # ... and this much wall time later (None: 2.5 x valve_poll_s)
    valve_poll_s: float = 0.1  # how often the background thread looks at memory and at the store

    def __post_init__(self) -> None:
        if isinstance(self.interval, bool) or not (
            self.interval == AUTO or (isinstance(self.interval, int) and self.interval >= 1)
        ):
            raise ValueError(f"gc.interval must be a whole number of steps >= 1 or 'auto' (got {self.interval!r})")
        if self.generation not in (0, 1, 2):
            raise ValueError(f"gc.generation must be 0, 1 or 2 (got {self.generation!r})")
        if self.young not in YOUNG_POLICIES:
            raise ValueError(f"gc.young must be one of {YOUNG_POLICIES} (got {self.young!r})")
        if self.young == "automatic" and self.generation != 2:
            raise ValueError(
                f"gc.generation {self.generation} needs gc.young 'scheduled': with young collections automatic "
                "the schedule runs the full (generation 2) collections"
            )
        if not 0 < self.cost_budget_frac <= 1:
            raise ValueError(f"gc.cost_budget_frac must be in (0, 1] (got {self.cost_budget_frac!r})")
        if self.workers not in WORKER_POLICIES:
            raise ValueError(f"gc.workers must be one of {WORKER_POLICIES} (got {self.workers!r})")
        if self.pause_budget_ms is not None and not self.pause_budget_ms > 0:
            raise ValueError(f"gc.pause_budget_ms must be > 0 or null (got {self.pause_budget_ms!r})")
        if not 0 < self.pause_budget_frac <= 10:
            raise ValueError(f"gc.pause_budget_frac must be in (0, 10] (got {self.pause_budget_frac!r})")
        if not (isinstance(self.max_interval, int) and self.max_interval >= 1):
            raise ValueError(f"gc.max_interval must be a whole number >= 1 (got {self.max_interval!r})")
        if not (isinstance(self.calibration_steps, int) and self.calibration_steps >= 2):
            raise ValueError(f"gc.calibration_steps must be a whole number >= 2 (got {self.calibration_steps!r})")
        if not self.valve_poll_s > 0 or (self.valve_lead_s is not None and self.valve_lead_s < 0):
            raise ValueError("gc.valve_poll_s must be > 0 and gc.valve_lead_s >= 0 (or null)")
        if not (isinstance(self.valve_lead_steps, int) and self.valve_lead_steps >= 1):
            raise ValueError(f"gc.valve_lead_steps must be a whole number >= 1 (got {self.valve_lead_steps!r})")

    @property
    def auto(self) -> bool:
        return self.interval == AUTO

    @property
    def young_automatic(self) -> bool:
        return self.young == "automatic"

    @property
    def lead_s(self) -> float:
        return 2.5 * self.valve_poll_s if self.valve_lead_s is None else self.valve_lead_s

    @property
    def longest_interval(self) -> int:
        """The interval a memory release follows by default: the fixed one, or auto's ceiling."""
        return self.max_interval if self.auto else int(self.interval)


# ------------------------------------------------------------------ the cost model (pure)


@dataclasses.dataclass(frozen=True)
class CostModel:
    """``pause_ns = fixed_ns + per_object_ns x young objects``; ``objects_per_step`` young objects a step
    leaves for the collector (net GC-tracked allocations); ``step_ns`` a step without collection."""

    fixed_ns: float
    per_object_ns: float
    objects_per_step: float
    step_ns: float
    samples: int

    def pause_ns(self, interval: int) -> float:
        return self.fixed_ns + self.per_object_ns * self.objects_per_step * interval

    def cost_per_step_ns(self, interval: int) -> float:
        return self.pause_ns(interval) / interval


def fit_cost_model(samples: Sequence[tuple[int, int, int, int]], *, flat: str = "proportional") -> CostModel | None:
    """Fit the model to collections ``(t_start_ns, young_objects, pause_ns, steps_since_previous)``.

    ``per_object_ns`` and ``fixed_ns`` come from a least-squares line through (objects, pause) when the
    object counts differ enough (largest >= 1.5 x smallest), else ``fixed_ns = 0`` and
    ``per_object_ns`` = median of pause / objects (which over-predicts pauses at longer intervals when
    there is a fixed cost: the safe side when collections walk young garbage). With ``flat="fixed"`` a
    line that does not rise, or object counts that do not differ enough, give ``fixed_ns`` = median
    pause and ``per_object_ns`` = 0, and a line with a negative fixed part keeps its slope with
    ``fixed_ns`` = the smallest pause (the safe side when young collections are automatic and a short
    interval only repeats the fixed part: never the proportional model, whose zero fixed part would
    let the cost rule collect at every step). ``objects_per_step`` is the rate of the latest 4 collections;
    ``step_ns`` the median time between the latest 5 collections less the pause, per step."""
    rows = [s for s in samples if s[3] >= 1]
    if len(rows) < 2:
        return None
    objects = [float(n) for _, n, _, _ in rows]
    pauses = [float(d) for _, _, d, _ in rows]
    recent = rows[-RECENT:]  # the garbage rate now, not averaged over a calibration long past
    per_step = sum(n for _, n, _, _ in recent) / sum(k for *_, k in recent)
    fixed, slope = 0.0, math.nan
    lo, hi = min(objects), max(objects)
    spread = hi > 0 and (lo == 0 or hi >= 1.5 * lo)  # enough different counts to draw a line through
    if spread:
        mx, my = sum(objects) / len(rows), sum(pauses) / len(rows)
        sxx = sum((x - mx) ** 2 for x in objects)
        slope = sum((x - mx) * (y - my) for x, y in zip(objects, pauses, strict=True)) / sxx
        fixed = my - slope * mx
        if slope <= 0 and flat == "fixed":  # nothing accumulates between collections: a fixed cost
            fixed, slope = median(pauses), 0.0
        elif fixed < 0 and flat == "fixed":  # a steep line through few objects: keep the smallest pause fixed
            fixed = min(pauses)
        elif slope <= 0 or fixed < 0:  # noise hides the line: fall back to the proportional model
            fixed, slope = 0.0, math.nan
    if math.isnan(slope) and flat == "fixed" and not spread:
        fixed, slope = median(pauses), 0.0  # one object count only: no growth to see, keep the interval
    if math.isnan(slope):
        ratios = sorted(d / n for n, d in zip(objects, pauses, strict=True) if n > 0)
        slope = ratios[len(ratios) // 2] if ratios else 0.0
        fixed = 0.0 if ratios else median(pauses)
    gaps = []  # the step time now: from the latest collections, as the rate
    tail = rows[-RECENT - 1 :]
    for prev, cur in zip(tail, tail[1:], strict=False):
        gap = cur[0] - prev[0] - prev[2]
        if gap > 0:
            gaps.append(gap / cur[3])
    step_ns = median(gaps) if gaps else math.nan
    return CostModel(fixed, slope, per_step, step_ns, len(rows))


def choose_interval(model: CostModel, budget_ns: float, max_interval: int, cost_frac: float | None = None) -> int:
    """The longest interval whose predicted pause fits the budget, in ``[1, max_interval]``.

    When even the fixed cost exceeds the budget no interval meets it: then the interval at which the
    per-object part equals the fixed part (a pause of about twice the fixed cost, and a cost per step
    within 2x of the cheapest). With ``cost_frac``, never shorter than the interval that spreads the fixed
    part to at most ``cost_frac`` of a step (``ceil(fixed / (cost_frac x step))``): a collection the pause
    budget would repeat every few steps must not cost the job more time than the collector it replaces."""
    growth = model.per_object_ns * model.objects_per_step  # pause added per step of interval
    floor_interval = 1
    if cost_frac is not None and math.isfinite(model.step_ns) and model.step_ns > 0 and model.fixed_ns > 0:
        floor_interval = math.ceil(model.fixed_ns / (cost_frac * model.step_ns))
    if growth <= 0:
        return max_interval
    if model.fixed_ns >= budget_ns:
        interval = math.ceil(model.fixed_ns / growth)
    else:
        interval = math.floor((budget_ns - model.fixed_ns) / growth)
    return max(1, min(max_interval, max(interval, floor_interval)))


def _group_started() -> bool:
    """The default process group exists (so a missing store will not appear later)."""
    try:
        import torch.distributed as dist

        return bool(dist.is_available() and dist.is_initialized())
    except Exception:  # noqa: BLE001
        return True


# ------------------------------------------------------------------ forked children (DataLoader workers)

_worker_policy: str | None = None  # set while a schedule is active in this process
_worker_thresholds: tuple[int, ...] | None = None  # CPython's thresholds before the schedule changed them
_fork_hook_installed = False


def _after_fork_in_child() -> None:
    # A forked DataLoader worker would otherwise inherit "automatic GC off" (or "no full collections")
    # and never collect (in full).
    if _worker_policy == "enable":
        if _worker_thresholds is not None:
            gc.set_threshold(*_worker_thresholds)
        if not gc.isenabled():
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
    """Owns the GC state of the process while active.

    The training thread calls :meth:`due`, :meth:`collect`, :meth:`freeze` and :meth:`valve_done`; the
    background thread only writes ``valve_at`` (the agreed valve step), ``plan`` (the agreed auto
    interval and the step it starts at) and ``plan_version``, each one attribute assignment.

    States of ``interval="auto"``: *calibrating* (a collection every step for ``calibration_steps``
    steps after the freeze), *agreeing* (still every step, until the agreed plan arrives from the
    store), *planned* (collections at ``start + k x interval``); a pause above 1.5 x the budget opens a
    new agreement that can only shorten the interval (at most 8 agreements)."""

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
        self.opts = opts
        self.rank = rank
        self.world_size = world_size
        self._get_step = get_step
        self._get_store = get_store
        self._record = record
        self.valve_at = NEVER  # read by the training thread on every step
        self.valve_proposals = 0
        self.valve_proposer = -1  # rank whose proposal won the current round
        # (start step, interval) segments; auto has none until the first agreement (every step)
        self.plans: tuple[tuple[int, int], ...] = () if opts.auto else ((0, int(opts.interval)),)
        self.plan_version = 0
        self.agreements = 0
        self.model: CostModel | None = None
        self.first_step: int | None = None  # the freeze step (auto calibrates after it)
        self._samples: list[tuple[int, int, int, int] | None] = [None] * SAMPLES
        self._n_samples = 0
        self._last_collect_step: int | None = None
        self._over_budget = 0  # pauses above SHRINK_AT x budget since the last agreement
        self._warned_budget = False
        self.collections = 0  # all collections (scheduled and valve) and their pause time
        self.total_ns = 0
        self.max_ns = 0
        self.scheduled = 0
        self.scheduled_ns = 0
        self.scheduled_max_ns = 0
        self.valve_steps: collections.deque[int] = collections.deque(maxlen=1000)
        self._baseline_rss = -1
        self._was_enabled = True
        self._thresholds: tuple[int, ...] = gc.get_threshold()
        self._froze = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        GCSchedule._instances += 1
        self._key_prefix = f"hyperacc/gc/{GCSchedule._instances}/"
        self._valve_round = 0  # rounds the training thread has executed

    # -- life cycle
    def start(self) -> None:
        global _worker_policy, _worker_thresholds
        self._was_enabled = gc.isenabled()
        self._thresholds = gc.get_threshold()
        if self.opts.young_automatic:
            # CPython keeps its young collections (each cycle freed within its thresholds' allocations);
            # the full ones, which walk every long-lived object, run only on the schedule.
            gc.set_threshold(self._thresholds[0], self._thresholds[1], NO_FULL)
            gc.enable()
            _worker_thresholds = self._thresholds
        else:
            gc.disable()
        _worker_policy = self.opts.workers
        _install_fork_hook()
        self._baseline_rss = rss_bytes()
        o = self.opts
        valve = o.valve and (o.valve_rss_mb is not None or o.valve_objects is not None)
        if valve or o.auto:
            self._thread = threading.Thread(target=self._loop, name="hyperacc-gc", daemon=True)
            self._thread.start()

    def close(self) -> None:
        global _worker_policy, _worker_thresholds
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.opts.valve_poll_s + 1.0)
        _worker_policy = None
        _worker_thresholds = None
        if self._froze:
            gc.unfreeze()
            self._froze = False
        gc.set_threshold(*self._thresholds)
        if self._was_enabled:
            gc.enable()
        else:
            gc.disable()

    # -- the schedule (training thread, only on steps where something is due)
    @property
    def interval(self) -> int:
        """The interval of the latest plan (1 while auto calibrates)."""
        return self.plans[-1][1] if self.plans else 1

    def next_due(self, step: int) -> int:
        """The first scheduled step after ``step``: identical on every rank that holds the same plans.

        Plans are ``(start, interval)`` segments with increasing starts; each holds from its start to
        the next one's. Before the first (auto, calibrating or agreeing) every step is due, or, with young
        collections automatic, the steps ``first + 1, 2, 4, 8, ...``: the full collection's pause is
        measured at intervals that differ, so that its fixed part and its growth per step separate."""
        plans = self.plans
        nxt = step + 1
        if not plans or nxt < plans[0][0]:
            first = self.first_step
            if not self.opts.young_automatic or first is None or nxt <= first + 1:
                return nxt
            offset = 1 << (nxt - first - 1).bit_length()  # the next power of two at or after nxt - first
            return first + offset if not plans else min(first + offset, plans[0][0])
        for i, (start, interval) in enumerate(plans):
            end = plans[i + 1][0] if i + 1 < len(plans) else NEVER
            if nxt >= end:
                continue
            lo = max(nxt, start)
            first = start + -(-(lo - start) // interval) * interval
            if first < end:
                return first
        return NEVER

    def begin(self, step: int) -> None:
        """The first step of the run (auto calibrates from here; the freeze, when on, set it already)."""
        if self.first_step is None:
            self.first_step = step
            self._last_collect_step = step

    def freeze(self, step: int) -> None:
        t0 = time.perf_counter_ns()
        collected = gc.collect()
        gc.freeze()
        self._froze = True
        self._baseline_rss = rss_bytes()
        self.first_step = step
        self._last_collect_step = step
        self._record("gc_freeze", step, time.perf_counter_ns() - t0, float(gc.get_freeze_count()),
                     f"collected={collected}")  # fmt: skip

    def collect(self, step: int, reason: str) -> int:
        gen = self.opts.generation
        young = gc.get_count()[0]
        t0 = time.perf_counter_ns()
        collected = gc.collect(gen)
        duration = time.perf_counter_ns() - t0
        self._baseline_rss = rss_bytes()
        since = step - self._last_collect_step if self._last_collect_step is not None else 0
        self._last_collect_step = step
        # What accumulates between two collections: young objects when they wait for the schedule; the
        # garbage that reached the full collection (what it freed) when CPython collects young objects.
        load = collected if self.opts.young_automatic else young
        self._samples[self._n_samples % SAMPLES] = (t0, load, duration, since)
        self._n_samples += 1
        self.collections += 1
        self.total_ns += duration
        self.max_ns = max(self.max_ns, duration)
        scheduled = reason.startswith("scheduled")
        if scheduled:
            self.scheduled += 1
            self.scheduled_ns += duration
            self.scheduled_max_ns = max(self.scheduled_max_ns, duration)
        else:
            self.valve_steps.append(step)
        self._record("gc_collect", step, duration, float(collected), f"{reason} gen={gen} young={young}")
        self.note_pause(duration, scheduled)
        return duration

    def valve_done(self) -> None:
        self.valve_at = NEVER
        self._valve_round += 1

    # -- cost model
    def samples(self) -> list[tuple[int, int, int, int]]:
        n = min(self._n_samples, SAMPLES)
        start = self._n_samples - n
        return [s for i in range(start, self._n_samples) if (s := self._samples[i % SAMPLES]) is not None]

    def budget_ns(self, model: CostModel | None) -> float:
        if self.opts.pause_budget_ms is not None:
            return self.opts.pause_budget_ms * 1e6
        if model is None or not math.isfinite(model.step_ns) or model.step_ns <= 0:
            return math.nan
        return self.opts.pause_budget_frac * model.step_ns

    def fit(self) -> CostModel | None:
        return fit_cost_model(self.samples(), flat="fixed" if self.opts.young_automatic else "proportional")

    def choose(self, model: CostModel, budget_ns: float) -> int:
        return choose_interval(model, budget_ns, self.opts.max_interval, self.opts.cost_budget_frac)

    def candidate(self) -> tuple[int, CostModel | None, float]:
        model = self.fit()
        budget = self.budget_ns(model)
        if model is None or not math.isfinite(budget):
            return self.interval, model, budget
        return self.choose(model, budget), model, budget

    # -- the background thread: valve and auto agreement
    def _loop(self) -> None:
        o = self.opts
        store = None
        warned_no_store = False
        rate = 0.0  # steps per second, smoothed
        obj_rate = 0.0  # young objects per step, smoothed
        last_step, last_t, last_count = self._get_step(), time.monotonic(), gc.get_count()[0]
        valve_round = 0  # next valve round this thread will look for
        auto_round = 0  # next auto agreement round
        auto_posted = -1  # the round this rank posted its candidate for
        valve = o.valve and (o.valve_rss_mb is not None or o.valve_objects is not None)
        try:
            while not self._stop.wait(o.valve_poll_s):
                step, now, count = self._get_step(), time.monotonic(), gc.get_count()[0]
                if step > last_step and now > last_t:
                    inst = (step - last_step) / (now - last_t)
                    rate = inst if rate == 0.0 else 0.7 * rate + 0.3 * inst
                    if count >= last_count:  # no collection in between
                        grow = (count - last_count) / (step - last_step)
                        obj_rate = grow if obj_rate == 0.0 else 0.7 * obj_rate + 0.3 * grow
                    last_step, last_t = step, now
                last_count = count
                if self.world_size > 1 and store is None:
                    store = self._get_store()
                    # (before the script's init_process_group there is no store yet: not a reason to warn)
                    if store is None and not warned_no_store and _group_started():
                        log.warning(
                            "hyperacc.stabilize: GC has no c10d store to agree through; each rank decides "
                            "its valve collections and auto interval on its own"
                        )
                        warned_no_store = True
                lead = max(o.valve_lead_steps, math.ceil(o.lead_s * rate))
                if o.auto and auto_round < MAX_ROUNDS:
                    auto_round, auto_posted = self._auto_step(store, step, lead, auto_round, auto_posted)
                if valve:
                    valve_round = self._valve_step(store, step, lead, obj_rate, valve_round)
        except Exception as exc:  # the valve and auto are optional: never let them disturb training
            if not self._stop.is_set():
                log.warning("hyperacc.stabilize: GC background thread switched off after an internal error: %r", exc)

    def _valve_step(self, store: Any, step: int, lead: int, obj_rate: float, round_: int) -> int:
        if self.valve_at != NEVER or self._valve_round < round_:
            return round_  # a round is agreed and not yet executed
        key = f"{self._key_prefix}valve/{round_}"
        if store is not None and store.check([key]):
            self._adopt_valve(store.get(key))
            return round_ + 1
        # Before the first step the set-up's objects still count (the first step freezes them).
        why = self._over_bound(lead * max(obj_rate, 0.0)) if step >= 0 else None
        if why is None:
            return round_
        proposal = f"{step + lead}:{self.rank}"
        agreed = store.compare_set(key, "", proposal) if store is not None else proposal  # first wins
        self.valve_proposals += 1
        self._record("gc_valve_proposed", step, 0, float(step + lead), why)
        self._adopt_valve(agreed)
        return round_ + 1

    def _over_bound(self, objects_ahead: float) -> str | None:
        """Would memory pass a bound by the time the agreed step comes? (objects: the young count now
        plus the growth expected over the lead; RSS: growth since the last collection now)."""
        o = self.opts
        if o.valve_objects is not None and not o.young_automatic:  # else CPython collects young objects
            pending = gc.get_count()[0]
            if pending + objects_ahead > o.valve_objects:
                return f"objects={pending}+{objects_ahead:.0f} ahead>{o.valve_objects}"
        if o.valve_rss_mb is not None and self._baseline_rss > 0:
            rss = rss_bytes()
            if rss > 0 and rss - self._baseline_rss > o.valve_rss_mb * 2**20:
                return f"rss_growth_mb={(rss - self._baseline_rss) / 2**20:.0f}>{o.valve_rss_mb:g}"
        return None

    def _adopt_valve(self, value: bytes | str) -> None:
        text = value.decode() if isinstance(value, bytes) else value
        at, _, proposer = text.partition(":")
        self.valve_proposer = int(proposer) if proposer else -1
        self.valve_at = int(at)

    def _auto_step(self, store: Any, step: int, lead: int, round_: int, posted: int) -> tuple[int, int]:
        """One look at the auto agreement of round ``round_``; returns (round, round posted)."""
        first = self.first_step
        if first is None or step < first + self.opts.calibration_steps:
            return round_, posted
        base = f"{self._key_prefix}auto/{round_}/"
        if round_ > 0 and posted < round_:
            # A later round opens when some rank's pause went over the budget.
            if self._over_budget == 0 and (store is None or not store.check([base + "open"])):
                return round_, posted
            if store is not None:
                store.set(base + "open", str(self.rank))
        if posted < round_:
            interval, model, budget = self.candidate()
            if round_ > 0:
                interval = min(interval, self.interval)  # a later round only shortens it
            self.model = model
            if store is None or self.world_size == 1:
                start = max(step + 1, self.plans[-1][0] + 1 if self.plans else 0)
                self._adopt_plan(interval, start, round_, model, budget, agreed_by=self.rank)
                return round_ + 1, round_
            store.set(f"{base}c/{self.rank}", str(interval))
            self._record("gc_auto_candidate", step, int(budget) if math.isfinite(budget) else 0,
                         float(interval), _describe(model, budget))  # fmt: skip
            posted = round_
        agreed_key = base + "agreed"
        if store.check([agreed_key]):
            text = store.get(agreed_key).decode()
            interval_s, _, start_s = text.partition(":")
            self._adopt_plan(int(interval_s), int(start_s), round_, self.model, self.budget_ns(self.model), 0)
            return round_ + 1, posted
        if self.rank == 0:
            keys = [f"{base}c/{r}" for r in range(self.world_size)]
            if store.check(keys):
                values = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(k) for k in keys]
                interval = min(int(v.decode() if isinstance(v, bytes) else v) for v in values)
                start = max(step + lead, self.plans[-1][0] + 1 if self.plans else 0)  # starts increase
                store.compare_set(agreed_key, "", f"{interval}:{start}")
        return round_, posted

    def _adopt_plan(
        self, interval: int, start: int, round_: int, model: CostModel | None, budget: float, agreed_by: int
    ) -> None:
        self.plans = (*self.plans, (start, interval))
        self.plan_version += 1  # one assignment: the training thread sees a consistent plan
        self.agreements = round_ + 1
        self._over_budget = 0
        self._record("gc_auto_interval", start, int(budget) if math.isfinite(budget) else 0, float(interval),
                     f"round={round_} {_describe(model, budget)}")  # fmt: skip

    def note_pause(self, duration_ns: int, scheduled: bool) -> None:
        """After a collection (training thread): count pauses over the budget, warn once for a fixed
        interval whose pauses exceed it."""
        if not scheduled:
            return
        model = self.model if self.opts.auto else None
        budget = self.opts.pause_budget_ms * 1e6 if self.opts.pause_budget_ms is not None else math.nan
        if self.opts.auto:
            if self.plan_version > 0 and self.interval > 1:  # an interval of 1 cannot shrink
                # over what the plan allowed: the budget, or the pause the model predicted for an
                # interval the cost floor made longer than the budget's
                allowed = self.budget_ns(model)
                if model is not None and math.isfinite(allowed):
                    allowed = max(allowed, model.pause_ns(self.interval))
                if math.isfinite(allowed) and duration_ns > SHRINK_AT * allowed:
                    self._over_budget += 1
            return
        if self._warned_budget or self.collections < 3:
            return
        fitted = self.fit()
        if fitted is None:
            return
        budget = self.budget_ns(fitted)
        if math.isfinite(budget) and duration_ns > SHRINK_AT * budget:
            best = self.choose(fitted, budget)
            if best >= self.interval:  # auto would not collect more often: the cost rule keeps this pause
                return
            self._warned_budget = True
            log.warning(
                "hyperacc.stabilize: scheduled GC pauses take %.1f ms, over the pause budget of %.1f ms "
                "(%g of a %.1f ms step); gc interval 'auto' would collect every %d steps",
                duration_ns / 1e6, budget / 1e6, self.opts.pause_budget_frac, fitted.step_ns / 1e6, best,
            )  # fmt: skip


def _describe(model: CostModel | None, budget: float) -> str:
    if model is None:
        return "model=none"
    return (
        f"fixed_ms={model.fixed_ns / 1e6:.3f} per_object_ns={model.per_object_ns:.1f} "
        f"objects_per_step={model.objects_per_step:.0f} step_ms={model.step_ns / 1e6:.2f} "
        f"budget_ms={budget / 1e6:.2f}"
    )

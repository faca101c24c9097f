"""The stabilizer handle: starts each configured part, runs what is due at each step boundary, records
what it did, and undoes everything at ``close()``.

The training thread calls ``step(step)`` once per step (the tracer's step hook does it under
``hyperacc run``); on steps where nothing is due that is a few integer comparisons. Each part is guarded:
an internal error switches that part off with one log line and training goes on. The parts that act at
the same steps on every rank (GC schedule, memory release) are then switched off on every rank: the
failing rank sets a key in the job's c10d store, and a thread of every other rank, looking once a second,
switches the part off there at its next step boundary. docs/stabilizers.md.
"""

from __future__ import annotations

import atexit
import collections
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from hyperacc.process import env_int
from hyperacc.stabilize import affinity as _affinity
from hyperacc.stabilize import allocator as _allocator
from hyperacc.stabilize import memory as _memory
from hyperacc.stabilize.config import PARTS, AffinityOptions, MemoryOptions, StabilizeConfig
from hyperacc.stabilize.gc_schedule import NEVER, GCSchedule
from hyperacc.stabilize.sync_audit import SyncAudit
from hyperacc.stabilize.workers import WorkerInit
from hyperacc.trace.failsafe import OffOnEveryRank

log = logging.getLogger("hyperacc.stabilize")

RECORDS_KEPT = 100_000  # newest records kept in memory (a collection every step would grow forever)
ALIGNED = ("gc", "memory")  # parts that act at the same steps on every rank: switched off on all alike


class Stabilizer:
    """What :func:`hyperacc.stabilize.stabilize` returns. Call ``step(step)`` once after each optimizer
    step with the global step (the same number on every rank), ``close()`` at the end."""

    def __init__(self, config: StabilizeConfig, *, store: Any = None, rank: int | None = None) -> None:
        self.config = config
        self._store = store
        self.rank, self.world_size = self._rank_world(rank)
        # What it did, as EVENT_SCHEMA rows (the newest RECORDS_KEPT).
        self._records: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECORDS_KEPT)
        # Rows no tracer took; close() writes them to run_dir.
        self._unforwarded: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECORDS_KEPT)
        self._trace_current: Callable[[], Any] | None = None
        self.current_step = -1  # read by the GC thread
        self.binding: _affinity.RankBinding | None = None
        self.host_allocator: _memory.HostAllocator | None = None
        self.allocator_setting: dict[str, Any] | None = None
        self.disabled: dict[str, str] = {}  # part -> why it was switched off
        self._gc: GCSchedule | None = None
        self._memory: MemoryOptions | None = None
        self._audit: SyncAudit | None = None
        self._first = True
        self._frozen = False
        self._due = -NEVER  # the first step() always looks
        self._gc_due = NEVER
        self._mem_due = NEVER
        self._plan_seen = 0  # the GC plan version the due steps were computed from
        self._releases = 0
        self._release_ns = 0
        self._released_bytes = 0
        self._closed = False
        Stabilizer._instances += 1  # the same number on every rank: stabilizers are made in the same order
        self._everywhere = OffOnEveryRank(f"hyperacc/stabilize/{Stabilizer._instances}/off/", self.rank,
                                          self._get_store)  # fmt: skip

    _instances = 0

    @staticmethod
    def _rank_world(rank: int | None) -> tuple[int, int]:
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                return (dist.get_rank() if rank is None else rank), dist.get_world_size()
        except Exception:  # no process group means a single rank
            pass
        return (env_int("RANK", 0) if rank is None else rank), env_int("WORLD_SIZE", 1)

    # -- records
    def _record(self, kind: str, step: int, duration_ns: int, value: float, detail: str) -> None:
        row = {"rank": self.rank, "step": step, "t_ns": time.time_ns(), "kind": kind,
               "duration_ns": int(duration_ns), "value": float(value), "detail": detail}  # fmt: skip
        self._records.append(row)
        tracer = self._tracer()
        if tracer is not None:
            try:  # the tracer's run directory gets the event beside the step records
                tracer.record_event(kind, step, int(duration_ns), float(value), detail)
                return
            except Exception:
                pass
        self._unforwarded.append(row)

    @property
    def records(self) -> list[dict[str, Any]]:
        """What it did, as EVENT_SCHEMA rows (the newest 100,000)."""
        return list(self._records)

    def _tracer(self) -> Any:
        if self._trace_current is None:
            try:
                from hyperacc.trace.tracer import current
            except Exception:
                current = None
            self._trace_current = current or (lambda: None)
        return self._trace_current()

    def _disable(self, part: str, exc: BaseException, *, elsewhere: str | None = None) -> None:
        """Switch ``part`` off on this rank after an internal error; a part of ``ALIGNED`` also on every
        other rank (``elsewhere``: it already was, on the rank this says)."""
        if part in self.disabled:
            return
        self.disabled[part] = elsewhere or repr(exc)
        if elsewhere is None:
            log.warning("hyperacc.stabilize: %s switched off after an internal error: %r", part, exc)
            self._record("stabilizer_off", self.current_step, 0, 0.0, f"{part}: {exc!r}")
            if part in ALIGNED and self.world_size > 1:
                self._everywhere.publish(part, exc)
        else:
            log.warning("hyperacc.stabilize: %s switched off: it failed on %s", part, elsewhere)
            self._record("stabilizer_off", self.current_step, 0, 0.0, f"{part}: switched off on {elsewhere}")
        if part == "gc" and self._gc is not None:
            gcs, self._gc = self._gc, None
            try:
                gcs.close()
            except Exception:  # already failing; restoring GC is best effort
                pass
            self._gc_due = NEVER
        elif part == "memory":
            self._memory = None
            self._mem_due = NEVER
        elif part == "sync_audit" and self._audit is not None:
            audit, self._audit = self._audit, None
            try:
                audit.close()
            except Exception:
                pass
        self._due = min(self._gc_due, self._mem_due)

    def _get_store(self) -> Any:
        if self._store is not None:
            return self._store
        try:
            import torch.distributed as dist
            from torch.distributed.distributed_c10d import _get_default_store

            if dist.is_initialized():
                self._store = _get_default_store()
        except Exception:  # no store: GC decisions stay local
            return None
        return self._store

    # -- start-up (side effects, each part guarded)
    def start(self) -> Stabilizer:
        cfg = self.config
        if cfg.allocator is not None:
            try:
                self.allocator_setting = _allocator.configure(
                    expandable_segments=cfg.allocator.expandable_segments
                )
                self._record("allocator_conf", -1, 0, float(bool(self.allocator_setting["too_late"])),
                             str(self.allocator_setting["value"]))  # fmt: skip
            except ValueError:
                raise  # the user's PYTORCH_ALLOC_CONF is malformed: say so
            except Exception as exc:
                self._disable("allocator", exc)
        if cfg.memory is not None:
            try:
                self.host_allocator = _memory.detect_host_allocator()
                held = _memory.hold_freed_memory(self.host_allocator) if cfg.memory.hold else "not held"
                self._memory = cfg.memory
                self._record("memory_hold", -1, 0, 0.0, f"{self.host_allocator.name}: {held}")
            except Exception as exc:
                self._disable("memory", exc)
        if cfg.affinity is not None:
            try:
                self._start_affinity(cfg.affinity)
            except Exception as exc:
                self._disable("affinity", exc)
        if cfg.gc is not None:
            try:
                self._gc = GCSchedule(
                    cfg.gc, rank=self.rank, world_size=self.world_size, get_step=self._get_step,
                    get_store=self._get_store, record=self._record,
                )  # fmt: skip
                self._gc.start()
            except Exception as exc:
                self._disable("gc", exc)
        if cfg.sync_audit is not None:
            try:
                self._audit = SyncAudit(cfg.sync_audit)
                self._audit.start()
            except Exception as exc:
                self._disable("sync_audit", exc)
        watched = tuple(p for p in ALIGNED if getattr(cfg, p) is not None and p not in self.disabled)
        if watched and self.world_size > 1:
            self._everywhere.watch(watched)
        atexit.register(self._at_exit)
        return self

    def _start_affinity(self, opts: AffinityOptions) -> None:
        nproc = opts.nproc if opts.nproc is not None else env_int("LOCAL_WORLD_SIZE", 1)
        local = opts.local_rank if opts.local_rank is not None else env_int("LOCAL_RANK", 0)
        binding, plan = _affinity.binding_for_rank(
            local, nproc, opts.workers_per_rank, sysfs_root=opts.sysfs_root, main_cores=opts.main_cores
        )
        done = _affinity.apply_binding(binding, set_threads=opts.set_threads, memory=opts.memory)
        self.binding = binding
        for w in plan.warnings:
            log.info("hyperacc.stabilize affinity: %s", w)
        self._record("affinity", -1, 0, float(len(binding.main_cpus)),
                     f"main={done['main_cpus']} workers={[_affinity.format_cpulist(w) for w in binding.worker_cpus]} "
                     f"{done.get('memory', '')} source={binding.source}")  # fmt: skip

    def _get_step(self) -> int:
        return self.current_step

    # -- the per-step call (hot path: a few comparisons unless something is due)
    def step(self, step: int) -> None:
        """Call once after each optimizer step with the global step index (a repeated call for the
        same step, e.g. from both the script and the tracer's step hook, does nothing)."""
        if step == self.current_step:
            return
        self.current_step = step
        if self._everywhere.elsewhere:
            for part, text in self._everywhere.take():
                self._disable(part, RuntimeError(text), elsewhere=text)
        gcs = self._gc
        if step >= self._due or (
            gcs is not None and (step >= gcs.valve_at or gcs.plan_version != self._plan_seen)
        ):
            self._act(step)
        if self._audit is not None:
            try:
                self._audit.advance(step)
            except Exception as exc:
                self._disable("sync_audit", exc)

    def _act(self, step: int) -> None:
        gcs = self._gc
        if self._first:
            self._first = False
            if gcs is not None:
                if gcs.opts.freeze and not self._frozen:
                    self._guarded("gc", self._freeze_now, step)
                gcs.begin(step)
                self._gc_due = gcs.next_due(step)
            if self._memory is not None:
                interval = self.config.release_interval()
                self._mem_due = (step // interval + 1) * interval
            self._due = min(self._gc_due, self._mem_due)
            return
        if gcs is not None and gcs.plan_version != self._plan_seen:
            # A new agreed plan (interval "auto"): the next due step follows it from here.
            self._plan_seen = gcs.plan_version
            self._gc_due = gcs.next_due(step - 1)
        valve = gcs is not None and step >= gcs.valve_at
        if gcs is not None and (step >= self._gc_due or valve):
            scheduled = step >= self._gc_due
            reason = "scheduled" if scheduled else f"valve proposer={gcs.valve_proposer}"
            if valve and gcs.valve_at < step:
                reason += f" late(agreed={gcs.valve_at})"
            self._guarded("gc", gcs.collect, step, reason)
            if valve and self._gc is not None:
                gcs.valve_done()
            if scheduled:
                self._gc_due = gcs.next_due(step)
        mem = self._memory
        if mem is not None and (step >= self._mem_due or (valve and mem.release_on_valve)):
            self._guarded("memory", self._release, step, "valve" if step < self._mem_due else "scheduled")
            if step >= self._mem_due:
                interval = self.config.release_interval()
                self._mem_due = (step // interval + 1) * interval
        self._due = min(self._gc_due, self._mem_due)

    def _guarded(self, part: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            out = fn(*args)
            return True if out is None else out
        except Exception as exc:  # a stabilizer never stops training
            self._disable(part, exc)
            return None

    def _freeze_now(self, step: int) -> None:
        if self._gc is not None and not self._frozen:
            self._gc.freeze(step)
            self._frozen = True

    def _release(self, step: int, reason: str) -> None:
        alloc = self.host_allocator
        if alloc is None or not alloc.can_release:
            return
        before = _memory.rss_bytes()
        ns = _memory.release(alloc)
        after = _memory.rss_bytes()
        self._releases += 1
        self._release_ns += ns
        self._released_bytes += max(0, before - after)
        self._record("memory_release", step, ns, float(max(0, before - after)), f"{reason} {alloc.name}")

    # -- user-facing helpers
    def freeze(self) -> None:
        """Collect and ``gc.freeze()`` now: call it after set-up, right before the DataLoader iterator
        forks its workers (they then share the frozen pages copy-on-write)."""
        self._guarded("gc", self._freeze_now, self.current_step)

    def worker_init_fn(self, user_fn: Callable[[int], Any] | None = None) -> WorkerInit:
        """A ``worker_init_fn`` composing the GC policy and worker cores with ``user_fn``."""
        policy = self._gc.opts.workers if self._gc is not None else None
        cpus = self.binding.worker_cpus if self.binding is not None else ()
        return WorkerInit(policy, cpus, user_fn)

    def attach(self, loader: Any) -> Any:
        """Install :meth:`worker_init_fn` on a DataLoader (before its iterator is created)."""
        workers = getattr(loader, "num_workers", 0)
        if workers > 0:
            planned = len(self.binding.worker_cpus) if self.binding is not None else None
            if planned is not None and planned < workers:
                log.warning(
                    "hyperacc.stabilize: the DataLoader has %d workers but the binding plans cores for %d; "
                    "set affinity={'workers_per_rank': %d} so each worker gets its own cores",
                    workers, planned, workers,
                )  # fmt: skip
            current = loader.worker_init_fn
            if not isinstance(current, WorkerInit):
                loader.worker_init_fn = self.worker_init_fn(current)
        return loader

    def stall_counters(self) -> dict[str, int]:
        """CUDA allocator stall counters (cumulative; empty on CPU)."""
        return _allocator.stall_counters()

    def audit_report(self) -> dict[str, Any] | None:
        return self._audit.report() if self._audit is not None else None

    def summary(self) -> dict[str, Any]:
        """What the stabilizer did, per part."""
        gcs = self._gc
        gc_part: dict[str, Any] = {"collections": 0, "scheduled": 0, "scheduled_ms_mean": 0.0,
                                   "scheduled_ms_max": 0.0, "total_ms": 0.0, "valve": 0, "valve_steps": []}  # fmt: skip
        if gcs is not None:
            model = gcs.model
            gc_part = {
                "collections": gcs.collections,
                "scheduled": gcs.scheduled,
                "scheduled_ms_mean": gcs.scheduled_ns / gcs.scheduled / 1e6 if gcs.scheduled else 0.0,
                "scheduled_ms_max": gcs.scheduled_max_ns / 1e6,
                "total_ms": gcs.total_ns / 1e6,
                "valve": len(gcs.valve_steps),
                "valve_steps": list(gcs.valve_steps),
                "interval": gcs.interval,
                "plan_start": gcs.plans[-1][0] if gcs.opts.auto and gcs.plans else None,
                "agreements": gcs.agreements,
                "cost_model": None if model is None else {
                    "fixed_ms": model.fixed_ns / 1e6, "per_object_ns": model.per_object_ns,
                    "objects_per_step": model.objects_per_step, "step_ms": model.step_ns / 1e6,
                },
            }  # fmt: skip
        out: dict[str, Any] = {
            "rank": self.rank,
            "parts": {p: getattr(self.config, p) is not None and p not in self.disabled for p in PARTS},
            "disabled": dict(self.disabled),
            "gc": gc_part,
            "memory": {
                "allocator": self.host_allocator.name if self.host_allocator else None,
                "releases": self._releases,
                "release_ms_mean": self._release_ns / self._releases / 1e6 if self._releases else 0.0,
                "released_mb": self._released_bytes / 2**20,
            },
            "allocator": self.allocator_setting,
            "affinity": self.binding.to_dict() if self.binding is not None else None,
        }
        if self._audit is not None:
            out["sync_audit"] = self._audit.report()
        return out

    def close(self) -> dict[str, Any]:
        """Stop threads, undo patches, restore GC; write the records to ``run_dir`` when set.
        Returns :meth:`summary`."""
        if self._closed:
            return self.summary()
        self._closed = True
        self._everywhere.close()
        try:
            atexit.unregister(self._at_exit)
        except Exception:
            pass
        audit_summary = self.summary()
        if self._audit is not None:
            self._audit.close()
            self._report_audit(audit_summary.get("sync_audit") or {})
        if self._gc is not None:
            self._gc.close()
        if self.config.run_dir:
            try:
                self._write_events(self.config.run_dir)
            except Exception as exc:  # losing the record must not fail the job
                log.warning("hyperacc.stabilize: could not write events to %s: %r", self.config.run_dir, exc)
        return audit_summary

    def _report_audit(self, report: Mapping[str, Any]) -> None:
        """One event per sync site; rank 0 also names each redundant barrier in one log line."""
        for site in report.get("sites", []):
            self._record(
                "sync_site", self.current_step, int(site["mean_ms"] * 1e6), float(site["per_step"]),
                f"{site['kind']} {site['site']} calls={site['calls']} elided={site['elided']} "
                f"redundant={site['redundant']}",
            )  # fmt: skip
            if site["redundant"] and self.rank == 0:
                log.warning(
                    "hyperacc.stabilize: dist.barrier() at %s runs every step (%d calls, %d elided): redundant "
                    "under DDP, whose gradient all-reduce already synchronises the ranks",
                    site["site"], site["calls"], site["elided"],
                )  # fmt: skip
        if report.get("visibility") and self.rank == 0:
            log.info("hyperacc.stabilize sync audit: %s", report["visibility"])

    def _write_events(self, run_dir: str) -> None:
        import pyarrow as pa

        from hyperacc.schema import EVENT_SCHEMA
        from hyperacc.store import event_writer

        if self._unforwarded:
            rows = list(self._unforwarded)
            event_writer(run_dir, self.rank).write(pa.Table.from_pylist(rows, schema=EVENT_SCHEMA))
            self._unforwarded.clear()

    def _at_exit(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self) -> Stabilizer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

"""Stabilizers: turn random per-rank disturbances into bounded costs paid at the same step on every rank.

Under a synchronous all-reduce a pause on any one rank stalls all of them, so a per-rank pause of
probability p becomes a cluster spike of probability 1-(1-p)^N. Each part here removes one source of
such pauses or moves it to a step every rank shares:

- ``gc``: automatic GC off, collections every N steps at the same step index, a safety valve agreed
  through the c10d store (:mod:`hyperacc.stabilize.gc_schedule`);
- ``memory``: the host allocator holds freed memory and releases it on the same schedule
  (:mod:`hyperacc.stabilize.memory`);
- ``allocator``: ``expandable_segments:True`` for the CUDA caching allocator
  (:mod:`hyperacc.stabilize.allocator`);
- ``affinity``: NUMA/CPU binding of the rank and its DataLoader workers
  (:mod:`hyperacc.stabilize.affinity`);
- ``sync_audit``: counts barriers and host syncs per step, opt-in elision of per-step barriers
  (:mod:`hyperacc.stabilize.sync_audit`).

Use::

    stab = hyperacc.stabilize.stabilize(gc={"interval": 400}, affinity={"workers_per_rank": 4})
    loader = stab.attach(loader)          # workers: GC policy + their own cores
    for step, batch in enumerate(loader):
        ...; optimizer.step()
        stab.step(step)                    # the global step: the same number on every rank
    stab.close()

``from_env()`` builds the same from ``HYPERACC_STABILIZE`` (JSON of these keyword arguments, ``1`` for
the defaults, or the path of a TOML/JSON file). Every rule and default: docs/stabilizers.md.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hyperacc.process import env_int
from hyperacc.stabilize import affinity as _affinity
from hyperacc.stabilize import allocator as _allocator
from hyperacc.stabilize import memory as _memory
from hyperacc.stabilize.gc_schedule import NEVER, GCOptions, GCSchedule, apply_worker_policy
from hyperacc.stabilize.sync_audit import AuditOptions, SyncAudit

log = logging.getLogger(__name__)

ENV_VAR = "HYPERACC_STABILIZE"

__all__ = [
    "ENV_VAR",
    "AffinityOptions",
    "AllocatorOptions",
    "AuditOptions",
    "GCOptions",
    "MemoryOptions",
    "StabilizeConfig",
    "Stabilizer",
    "WorkerInit",
    "config_from_dict",
    "from_env",
    "launch_env",
    "load_config",
    "stabilize",
]


# ------------------------------------------------------------------ configuration


@dataclasses.dataclass
class MemoryOptions:
    interval: int | None = None  # release every N steps; None: the GC interval (or 400 without GC)
    hold: bool = True  # stop the allocator from releasing on its own (glibc mallopt, tcmalloc rate 0)
    release_on_valve: bool = True  # also release when the GC safety valve fires

    def validate(self) -> None:
        if self.interval is not None and self.interval < 1:
            raise ValueError(f"memory.interval must be >= 1 step (got {self.interval})")


@dataclasses.dataclass
class AllocatorOptions:
    expandable_segments: bool = True

    def validate(self) -> None:
        pass


@dataclasses.dataclass
class AffinityOptions:
    workers_per_rank: int = 0  # DataLoader workers per rank that get their own cores
    main_cores: int | None = None  # cores kept for the main process; None: all but one per worker
    set_threads: bool = True  # torch.set_num_threads(physical cores of the main share)
    memory: bool = True  # prefer the rank's NUMA node for memory (libnuma)
    sysfs_root: str = "/sys"
    nproc: int | None = None  # local ranks on this node; None: LOCAL_WORLD_SIZE
    local_rank: int | None = None  # None: LOCAL_RANK

    def validate(self) -> None:
        if self.workers_per_rank < 0:
            raise ValueError(f"affinity.workers_per_rank must be >= 0 (got {self.workers_per_rank})")


PARTS: dict[str, type] = {
    "gc": GCOptions,
    "memory": MemoryOptions,
    "allocator": AllocatorOptions,
    "affinity": AffinityOptions,
    "sync_audit": AuditOptions,
}
ON_BY_DEFAULT = {"gc": True, "memory": True, "allocator": True, "affinity": False, "sync_audit": False}


@dataclasses.dataclass
class StabilizeConfig:
    """Each part is its options, or None when off."""

    gc: GCOptions | None = dataclasses.field(default_factory=GCOptions)
    memory: MemoryOptions | None = dataclasses.field(default_factory=MemoryOptions)
    allocator: AllocatorOptions | None = dataclasses.field(default_factory=AllocatorOptions)
    affinity: AffinityOptions | None = None
    sync_audit: AuditOptions | None = None
    run_dir: str | None = None  # where close() writes the records as events (EVENT_SCHEMA)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for part in PARTS:
            opts = getattr(self, part)
            out[part] = False if opts is None else dataclasses.asdict(opts)
        if self.run_dir:
            out["run_dir"] = self.run_dir
        return out


def _part_options(part: str, value: Any, source: str) -> Any:
    cls = PARTS[part]
    if value is None or value is False:
        return None
    if value is True:
        opts = cls()
    elif isinstance(value, cls):
        opts = value
    elif isinstance(value, Mapping):
        value = dict(value)
        if value.pop("enabled", True) is False:
            return None
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(
                f"{source}: unknown {part} option(s) {unknown}; valid: {sorted(names | {'enabled'})}"
            )
        opts = cls(**value)
    else:
        raise ValueError(f"{source}: {part} must be true, false or a table of options (got {value!r})")
    try:
        opts.validate()
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    return opts


def config_from_dict(values: Mapping[str, Any], source: str = "stabilize()") -> StabilizeConfig:
    """Build a config from keyword arguments / a parsed file: each part is true, false or a table."""
    values = dict(values)
    if "stabilize" in values and isinstance(values["stabilize"], Mapping) and len(values) == 1:
        values = dict(values["stabilize"])
    unknown = sorted(set(values) - set(PARTS) - {"run_dir"})
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {unknown}; valid: {sorted([*PARTS, 'run_dir'])}")
    kwargs: dict[str, Any] = {}
    for part in PARTS:
        kwargs[part] = _part_options(part, values.get(part, ON_BY_DEFAULT[part]), source)
    run_dir = values.get("run_dir")
    return StabilizeConfig(**kwargs, run_dir=str(run_dir) if run_dir else None)


def load_config(path: str | os.PathLike) -> dict[str, Any]:
    """Read a TOML or JSON file (a top-level ``[stabilize]`` table or the parts at top level)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ValueError(
            f"cannot read stabilizer config {p}: {exc.strerror}; pass an existing file"
        ) from None
    if p.suffix.lower() == ".json":
        try:
            return json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{p} is not valid JSON ({exc}); fix the file") from None
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            raise ValueError(
                f"{p}: reading TOML needs Python >= 3.11 or `pip install tomli`; or use JSON"
            ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{p} is not valid TOML ({exc}); fix the file") from None


def _resolve(
    config: str | os.PathLike | Mapping | StabilizeConfig | None, kwargs: Mapping[str, Any]
) -> StabilizeConfig:
    if isinstance(config, StabilizeConfig):
        if kwargs:
            merged = config.to_dict()
            merged.update(kwargs)
            return config_from_dict(merged)
        return config
    values: dict[str, Any] = {}
    source = "stabilize()"
    if isinstance(config, Mapping):
        values.update(config)
    elif config is not None:
        values.update(load_config(config))
        if list(values) == ["stabilize"]:
            values = dict(values["stabilize"])
        source = str(config)
    values.update(kwargs)
    return config_from_dict(values, source)


# ------------------------------------------------------------------ DataLoader workers


class WorkerInit:
    """A DataLoader ``worker_init_fn`` that applies the GC policy and the worker's own cores, then
    calls the user's function. Picklable, so it also works with the spawn start method."""

    def __init__(
        self,
        gc_policy: str | None,
        worker_cpus: tuple[tuple[int, ...], ...] = (),
        user_fn: Callable[[int], Any] | None = None,
    ) -> None:
        self.gc_policy = gc_policy
        self.worker_cpus = worker_cpus
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        if self.gc_policy is not None:
            apply_worker_policy(self.gc_policy)
        if self.worker_cpus:
            try:
                _affinity.set_process_affinity(self.worker_cpus[worker_id % len(self.worker_cpus)])
            except OSError as exc:
                log.warning("hyperacc.stabilize: could not bind DataLoader worker %d: %s", worker_id, exc)
        if self.user_fn is not None:
            self.user_fn(worker_id)


# ------------------------------------------------------------------ the handle


class Stabilizer:
    """What :func:`stabilize` returns. Call ``step(step)`` once after each optimizer step with the
    global step (the same number on every rank), ``close()`` at the end."""

    def __init__(self, config: StabilizeConfig, *, store: Any = None, rank: int | None = None) -> None:
        self.config = config
        self._store = store
        self.rank, self.world_size = self._rank_world(rank)
        self.records: list[dict[str, Any]] = []  # what it did, as EVENT_SCHEMA rows
        self._unforwarded: list[dict[str, Any]] = []  # rows no tracer took; close() writes them to run_dir
        self._trace_current: Callable[[], Any] | None = None
        self.current_step = -1  # read by the valve thread
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
        self._closed = False

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
        self.records.append(row)
        tracer = self._tracer()
        if tracer is not None:
            try:  # the tracer's run directory gets the event beside the step records
                tracer.record_event(kind, step, int(duration_ns), float(value), detail)
                return
            except Exception:
                pass
        self._unforwarded.append(row)

    def _tracer(self) -> Any:
        if self._trace_current is None:
            try:
                from hyperacc.trace.tracer import current
            except Exception:
                current = None
            self._trace_current = current or (lambda: None)
        return self._trace_current()

    def _disable(self, part: str, exc: BaseException) -> None:
        if part in self.disabled:
            return
        self.disabled[part] = repr(exc)
        log.warning("hyperacc.stabilize: %s switched off after an internal error: %r", part, exc)
        self._record("stabilizer_off", self.current_step, 0, 0.0, f"{part}: {exc!r}")
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
        except Exception:  # no store: the valve falls back to local collections
            return None
        return self._store

    # -- start-up (side effects, each part guarded)
    def _start(self) -> Stabilizer:
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

    # -- the per-step call (hot path: a couple of comparisons unless something is due)
    def step(self, step: int) -> None:
        """Call once after each optimizer step with the global step index (a repeated call for the
        same step, e.g. from both the script and the tracer's step hook, does nothing)."""
        if step == self.current_step:
            return
        self.current_step = step
        gcs = self._gc
        if step >= self._due or (gcs is not None and step >= gcs.valve_at):
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
                self._gc_due = gcs.next_due(step)
                if gcs.opts.freeze and not self._frozen:
                    self._guarded("gc", self._freeze_now, step)
            if self._memory is not None:
                interval = self._memory_interval()
                self._mem_due = (step // interval + 1) * interval
            self._due = min(self._gc_due, self._mem_due)
            return
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
                interval = self._memory_interval()
                self._mem_due = (step // interval + 1) * interval
        self._due = min(self._gc_due, self._mem_due)

    def _memory_interval(self) -> int:
        mem = self._memory
        if mem is not None and mem.interval is not None:
            return mem.interval
        gc_opts = self.config.gc
        return gc_opts.interval if gc_opts is not None else 400

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
        collections = [r for r in self.records if r["kind"] == "gc_collect"]
        scheduled = [r["duration_ns"] for r in collections if r["detail"].startswith("scheduled")]
        valve = [r for r in collections if r["detail"].startswith("valve")]
        releases = [r for r in self.records if r["kind"] == "memory_release"]
        out: dict[str, Any] = {
            "rank": self.rank,
            "parts": {p: getattr(self.config, p) is not None and p not in self.disabled for p in PARTS},
            "disabled": dict(self.disabled),
            "gc": {
                "collections": len(collections),
                "scheduled": len(scheduled),
                "scheduled_ms_mean": (sum(scheduled) / len(scheduled) / 1e6) if scheduled else 0.0,
                "scheduled_ms_max": (max(scheduled) / 1e6) if scheduled else 0.0,
                "valve": len(valve),
                "valve_steps": [r["step"] for r in valve],
            },
            "memory": {
                "allocator": self.host_allocator.name if self.host_allocator else None,
                "releases": len(releases),
                "release_ms_mean": (sum(r["duration_ns"] for r in releases) / len(releases) / 1e6)
                if releases
                else 0.0,
                "released_mb": sum(r["value"] for r in releases) / 2**20,
            },  # fmt: skip
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

    def _write_events(self, run_dir: str) -> None:
        import pyarrow as pa

        from hyperacc.schema import EVENT_SCHEMA
        from hyperacc.store import event_writer

        if self._unforwarded:
            event_writer(run_dir, self.rank).write(
                pa.Table.from_pylist(self._unforwarded, schema=EVENT_SCHEMA)
            )
            self._unforwarded = []

    def _at_exit(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self) -> Stabilizer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ------------------------------------------------------------------ entry points


def stabilize(
    config: str | os.PathLike | Mapping[str, Any] | StabilizeConfig | None = None,
    *,
    store: Any = None,
    rank: int | None = None,
    **kwargs: Any,
) -> Stabilizer:
    """Start the stabilizers and return the handle.

    ``config`` is a TOML/JSON file, a mapping or a :class:`StabilizeConfig`; ``kwargs`` override it.
    Each part (``gc``, ``memory``, ``allocator``, ``affinity``, ``sync_audit``) is ``True``, ``False``
    or a mapping of its options; ``gc``, ``memory`` and ``allocator`` are on by default. ``store`` is
    the c10d store the GC safety valve agrees through (default: the default process group's)."""
    cfg = _resolve(config, kwargs)
    return Stabilizer(cfg, store=store, rank=rank)._start()


def from_env(environ: Mapping[str, str] | None = None) -> Stabilizer | None:
    """Start from ``HYPERACC_STABILIZE`` or return None when it is unset/empty/``0``.

    The value is JSON of :func:`stabilize`'s keyword arguments, ``1``/``true`` for the defaults, or
    the path of a TOML/JSON config file."""
    global _from_env, _from_env_raw
    env = os.environ if environ is None else environ
    raw = env.get(ENV_VAR, "").strip()
    if not raw or raw.lower() in ("0", "false", "off", "no"):
        return None
    if _from_env is not None and not _from_env._closed and _from_env_raw == raw:
        return _from_env  # `hyperacc run` started it already; the script's own call gets the same one
    _from_env, _from_env_raw = _start_from_env(raw), raw
    return _from_env


_from_env: Stabilizer | None = None  # the stabilizer from_env() started in this process
_from_env_raw: str | None = None


def _start_from_env(raw: str) -> Stabilizer:
    if raw.lower() in ("1", "true", "on", "yes"):
        return stabilize()
    if raw.startswith("{"):
        try:
            values = json.loads(raw)
        except ValueError as exc:
            raise ValueError(
                f'{ENV_VAR} is not valid JSON ({exc}); set it to e.g. \'{{"gc": {{"interval": 400}}}}\', '
                "1 for the defaults, or a config file path"
            ) from None
        return stabilize(config_from_dict(values, ENV_VAR))
    if not Path(raw).is_file():
        raise ValueError(f"{ENV_VAR}={raw!r} is neither JSON, 1/0, nor an existing config file")
    return stabilize(raw)


def launch_env(
    config: str | os.PathLike | Mapping[str, Any] | StabilizeConfig | None = None, **kwargs: Any
) -> dict[str, str]:
    """Environment a launcher (``hyperacc run``) adds for the ranks it starts: the config itself, the
    allocator settings (before CUDA initialises) and tcmalloc's background release off."""
    cfg = _resolve(config, kwargs)
    env = {ENV_VAR: json.dumps(cfg.to_dict(), sort_keys=True)}
    if cfg.memory is not None and cfg.memory.hold:
        env.update(_memory.launch_env())
    if cfg.allocator is not None:
        scratch = dict(os.environ)
        value = _allocator.configure(scratch, expandable_segments=cfg.allocator.expandable_segments)["value"]
        if value:
            for name in _allocator.ENV_NAMES:
                env[name] = str(value)
    return env

"""Stabilizer configuration: one frozen dataclass per part, validated on construction, and the readers
that build them from keyword arguments, a TOML/JSON file or a parsed mapping.

Each part is on (its options), or off (None). Unknown keys and mistyped or impossible values raise
``hyperacc.options.OptionsError`` (a ``ValueError``) naming the key (``memory.interval``) and what is
allowed. Defaults: docs/stabilizers.md.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from hyperacc import options
from hyperacc.options import OptionsError, check, check_fields, invalid
from hyperacc.stabilize.gc_schedule import GCOptions
from hyperacc.stabilize.sync_audit import AuditOptions

SECTION = "stabilize"

DEFAULT_RELEASE_INTERVAL = 400  # memory release every N steps when there is no GC schedule to follow


@dataclasses.dataclass(frozen=True)
class MemoryOptions:
    interval: int | None = None  # release every N steps; None: the GC interval (auto: its max_interval)
    hold: bool = True  # stop the allocator from releasing on its own (glibc mallopt, tcmalloc rate 0)
    release_on_valve: bool = True  # also release when the GC safety valve fires

    def __post_init__(self) -> None:
        check_fields(self, SECTION, "memory.")
        interval = self.interval
        check(SECTION, "memory.interval", interval, interval is None or interval >= 1,
              "a whole number of steps >= 1 or null")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class AllocatorOptions:
    expandable_segments: bool = True

    def __post_init__(self) -> None:
        check_fields(self, SECTION, "allocator.")


@dataclasses.dataclass(frozen=True)
class AffinityOptions:
    workers_per_rank: int = 0  # DataLoader workers per rank that get their own cores
    main_cores: int | None = None  # cores kept for the main process; None: the rule of docs/stabilizers.md
    set_threads: bool = True  # torch.set_num_threads(physical cores of the main share)
    memory: bool = True  # prefer the rank's NUMA node for memory (libnuma)
    sysfs_root: str = "/sys"
    nproc: int | None = None  # local ranks on this node; None: LOCAL_WORLD_SIZE
    local_rank: int | None = None  # None: LOCAL_RANK

    def __post_init__(self) -> None:
        check_fields(self, SECTION, "affinity.")
        check(SECTION, "affinity.workers_per_rank", self.workers_per_rank, self.workers_per_rank >= 0, ">= 0")
        main = self.main_cores
        check(SECTION, "affinity.main_cores", main, main is None or main >= 1, ">= 1 or null")


PARTS: dict[str, type] = {
    "gc": GCOptions,
    "memory": MemoryOptions,
    "allocator": AllocatorOptions,
    "affinity": AffinityOptions,
    "sync_audit": AuditOptions,
}
ON_BY_DEFAULT = {"gc": True, "memory": True, "allocator": True, "affinity": False, "sync_audit": False}


@dataclasses.dataclass(frozen=True)
class StabilizeConfig:
    """Each part is its options, or None when off."""

    gc: GCOptions | None = dataclasses.field(default_factory=GCOptions)
    memory: MemoryOptions | None = dataclasses.field(default_factory=MemoryOptions)
    allocator: AllocatorOptions | None = dataclasses.field(default_factory=AllocatorOptions)
    affinity: AffinityOptions | None = None
    sync_audit: AuditOptions | None = None
    run_dir: str | None = None  # where close() writes the records as events (EVENT_SCHEMA)

    def __post_init__(self) -> None:
        check_fields(self, SECTION)  # each part its options class or None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for part in PARTS:
            opts = getattr(self, part)
            out[part] = False if opts is None else dataclasses.asdict(opts)
        if self.run_dir:
            out["run_dir"] = self.run_dir
        return out

    def release_interval(self) -> int:
        """Steps between memory releases: memory.interval, else the GC's, else 400."""
        if self.memory is not None and self.memory.interval is not None:
            return self.memory.interval
        return self.gc.longest_interval if self.gc is not None else DEFAULT_RELEASE_INTERVAL


def _part_options(part: str, value: Any, source: str) -> Any:
    cls = PARTS[part]
    if value is None or value is False:
        return None
    if value is True:
        return cls()
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise OptionsError(f"{source}: {invalid(SECTION, part, value, 'true, false or a table of options')}")
    value = dict(value)
    if value.pop("enabled", True) is False:
        return None
    try:
        options.refuse_unknown(part, value, [*(f.name for f in dataclasses.fields(cls)), "enabled"])
    except OptionsError as exc:
        raise OptionsError(f"{source}: {exc}") from None
    return options.load(cls, value, SECTION, source=source, prefix=f"{part}.")


def config_from_dict(values: Mapping[str, Any], source: str = "stabilize()") -> StabilizeConfig:
    """Build a config from keyword arguments / a parsed file: each part is true, false or a table."""
    values = dict(values)
    if "stabilize" in values and isinstance(values["stabilize"], Mapping) and len(values) == 1:
        values = dict(values["stabilize"])
    try:
        options.refuse_unknown(None, values, [*PARTS, "run_dir"], what="key")
    except OptionsError as exc:
        raise OptionsError(f"{source}: {exc}") from None
    kwargs = {part: _part_options(part, values.get(part, ON_BY_DEFAULT[part]), source) for part in PARTS}
    run_dir = values.get("run_dir")
    return StabilizeConfig(**kwargs, run_dir=str(run_dir) if run_dir else None)


def load_config(path: str | os.PathLike, what: str = "stabilizer config") -> dict[str, Any]:
    """Read a TOML or JSON file (a top-level ``[stabilize]`` table or the parts at top level); ``what``
    names the file in errors."""
    return options.read_file(path, what)


def resolve_config(
    config: str | os.PathLike | Mapping | StabilizeConfig | None, kwargs: Mapping[str, Any]
) -> StabilizeConfig:
    """A config from a file path, a mapping or a config, with keyword arguments overriding it."""
    if isinstance(config, StabilizeConfig):
        if kwargs:
            return config_from_dict({**config.to_dict(), **kwargs})
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

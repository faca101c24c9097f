"""Stabilizer configuration: one frozen dataclass per part, validated on construction, and the readers
that build them from keyword arguments, a TOML/JSON file or a parsed mapping.

Each part is on (its options), or off (None). Unknown keys and impossible values raise ``ValueError``
naming the key and the valid ones. Defaults: docs/stabilizers.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hyperacc.stabilize.gc_schedule import GCOptions
from hyperacc.stabilize.sync_audit import AuditOptions

DEFAULT_RELEASE_INTERVAL = 400  # memory release every N steps when there is no GC schedule to follow


@dataclasses.dataclass(frozen=True)
class MemoryOptions:
    interval: int | None = None  # release every N steps; None: the GC interval (auto: its max_interval)
    hold: bool = True  # stop the allocator from releasing on its own (glibc mallopt, tcmalloc rate 0)
    release_on_valve: bool = True  # also release when the GC safety valve fires

    def __post_init__(self) -> None:
        if self.interval is not None and (isinstance(self.interval, bool) or not isinstance(self.interval, int)
                                          or self.interval < 1):  # fmt: skip
            raise ValueError(f"memory.interval must be a whole number of steps >= 1 (got {self.interval!r})")


@dataclasses.dataclass(frozen=True)
class AllocatorOptions:
    expandable_segments: bool = True


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
        if not isinstance(self.workers_per_rank, int) or self.workers_per_rank < 0:
            raise ValueError(f"affinity.workers_per_rank must be >= 0 (got {self.workers_per_rank!r})")
        if self.main_cores is not None and (not isinstance(self.main_cores, int) or self.main_cores < 1):
            raise ValueError(f"affinity.main_cores must be >= 1 or null (got {self.main_cores!r})")


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
        for part, cls in PARTS.items():
            value = getattr(self, part)
            if value is not None and not isinstance(value, cls):
                raise ValueError(f"{part} must be {cls.__name__} or None (got {type(value).__name__})")

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
        raise ValueError(f"{source}: {part} must be true, false or a table of options (got {value!r})")
    value = dict(value)
    if value.pop("enabled", True) is False:
        return None
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise ValueError(f"{source}: unknown {part} option(s) {unknown}; valid: {sorted(names | {'enabled'})}")
    try:
        return cls(**value)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{source}: {exc}") from None


def config_from_dict(values: Mapping[str, Any], source: str = "stabilize()") -> StabilizeConfig:
    """Build a config from keyword arguments / a parsed file: each part is true, false or a table."""
    values = dict(values)
    if "stabilize" in values and isinstance(values["stabilize"], Mapping) and len(values) == 1:
        values = dict(values["stabilize"])
    unknown = sorted(set(values) - set(PARTS) - {"run_dir"})
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {unknown}; valid: {sorted([*PARTS, 'run_dir'])}")
    kwargs = {part: _part_options(part, values.get(part, ON_BY_DEFAULT[part]), source) for part in PARTS}
    run_dir = values.get("run_dir")
    return StabilizeConfig(**kwargs, run_dir=str(run_dir) if run_dir else None)


def load_config(path: str | os.PathLike, what: str = "stabilizer config") -> dict[str, Any]:
    """Read a TOML or JSON file (a top-level ``[stabilize]`` table or the parts at top level); ``what``
    names the file in errors."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {p}: {exc.strerror}; pass an existing file") from None
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
            raise ValueError(f"{p}: reading TOML needs Python >= 3.11 or `pip install tomli`; or use JSON") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{p} is not valid TOML ({exc}); fix the file") from None


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

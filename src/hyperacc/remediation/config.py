"""Remediation settings: the mode, the bounds of every action and where the loop keeps its files.

One frozen dataclass, validated on construction, read by the pure policy (``policy.decide``), by the
executor that applies its decisions, and by the ranks of an elastic job (``HYPERACC_REMEDIATE`` holds
it as JSON, or just the mode). Each field is documented in docs/remediation.md with its default.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hyperacc import options
from hyperacc.options import OptionsError, check, check_fields

ENV = "HYPERACC_REMEDIATE"
MODES = ("off", "dry-run", "auto")
EXCLUDE_FILE = "hosts.exclude"  # default name of the exclusion file in the run directory
SECTION = "remediation"

RemediationConfigError = OptionsError  # the name before the one options error; public, kept as an alias


@dataclasses.dataclass(frozen=True)
class RemediationConfig:
    mode: str = "off"  # off | dry-run (decide and log, act on nothing) | auto
    run_dir: str | None = None  # events, drain requests, membership (default: HYPERACC_RUN_DIR)
    exclude_file: str | None = None  # default RUN_DIR/hosts.exclude
    # -- drain a persistent straggler node (rule "drain-slow-node")
    min_nodes: int | None = None  # MIN of --nnodes MIN:MAX; None: never drain
    max_drains: int = 1  # drains per run (K)
    drain_min_slowdown: float = 0.10  # the node's ranks at least 10 % slower than the median rank
    drain_hold_windows: int = 2  # still confirmed this many windows after it was first confirmed
    drain_cooldown_steps: int = 0  # steps after a drain before another one (0: one checkpoint interval)
    drain_kinds: tuple[str, ...] = ("compute", "host", "launch")  # rank kinds of a node verdict that drain
    signal_timeout_s: float = 60.0  # a draining rank waits this long for its agent to stop it
    # -- live switches (rules "gc-schedule", "memory-release")
    gc_min_share: float = 0.10  # GC explains at least 10 % of the time lost to spikes ...
    gc_min_spikes: int = 3  # ... over at least this many spikes, or a confirmed GC straggler
    gc_lead_steps: int = 20  # the agreed step is this far ahead, so every rank reaches it in time ...
    switch_lead_s: float = 2.0  # ... and at least this much training time ahead at the measured step rate
    memory_min_share: float = 0.10  # the same for allocator (memory-release) spikes
    memory_min_spikes: int = 3

    def __post_init__(self) -> None:
        check_fields(self, SECTION)
        for name, ok, allowed in (
            ("mode", self.mode in MODES, f"one of {', '.join(MODES)}"),
            ("min_nodes", self.min_nodes is None or self.min_nodes >= 1, ">= 1 or null"),
            ("max_drains", self.max_drains >= 0, ">= 0"),
            ("drain_min_slowdown", self.drain_min_slowdown >= 0, ">= 0"),
            ("drain_hold_windows", self.drain_hold_windows >= 0, ">= 0"),
            ("drain_cooldown_steps", self.drain_cooldown_steps >= 0, ">= 0"),
            ("signal_timeout_s", self.signal_timeout_s > 0, "> 0"),
            ("gc_min_share", 0 <= self.gc_min_share <= 1, "a share in [0, 1]"),
            ("gc_min_spikes", self.gc_min_spikes >= 0, ">= 0"),
            ("gc_lead_steps", self.gc_lead_steps >= 1, ">= 1"),
            ("switch_lead_s", self.switch_lead_s >= 0, ">= 0"),
            ("memory_min_share", 0 <= self.memory_min_share <= 1, "a share in [0, 1]"),
            ("memory_min_spikes", self.memory_min_spikes >= 0, ">= 0"),
        ):
            check(SECTION, name, getattr(self, name), ok, allowed)

    @property
    def acting(self) -> bool:
        return self.mode == "auto"

    def resolved_run_dir(self) -> Path | None:
        root = self.run_dir or os.environ.get("HYPERACC_RUN_DIR", "").strip()
        return Path(root) if root else None

    def resolved_exclude_file(self) -> Path | None:
        if self.exclude_file:
            return Path(self.exclude_file)
        root = self.resolved_run_dir()
        return root / EXCLUDE_FILE if root else None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], source: str | None = None) -> RemediationConfig:
        return options.load(cls, values, SECTION, source=source)

    @classmethod
    def parse(cls, text: str) -> RemediationConfig:
        """A mode (``off``, ``dry-run``, ``auto``), a JSON object, or the path of a JSON or TOML file (its
        settings at top level or in a ``[remediate]`` table)."""
        text = text.strip()
        if text in MODES:
            return cls(mode=text)
        if not text.startswith("{") and Path(text).suffix.lower() == ".toml":
            values = options.read_file(text, what="remediation policy")
            return cls.from_mapping(options.table(values, "remediate"), source=text)
        source = None
        if not text.startswith("{") and Path(text).is_file():
            source, text = text, Path(text).read_text()
        try:
            values = json.loads(text)
        except ValueError as exc:
            raise OptionsError(
                f"remediation must be off, dry-run, auto, a JSON object, or a JSON or TOML file (not valid JSON: {exc})"
            ) from None
        if not isinstance(values, dict):
            raise OptionsError("remediation settings must be a JSON object")
        return cls.from_mapping(values, source=source)

    @classmethod
    def from_env(cls) -> RemediationConfig | None:
        raw = os.environ.get(ENV, "").strip()
        return cls.parse(raw) if raw else None


@dataclasses.dataclass(frozen=True)
class LaunchSettings:
    """What ``hyperacc run --remediate`` adds to the launch (docs/remediation.md, "hyperacc run --remediate")."""

    config: RemediationConfig
    env: dict[str, str]  # for torchrun and the ranks
    max_restarts: str | None  # torchrun's --max-restarts to use (None: as given)
    notes: tuple[str, ...]  # what was changed, and why (printed by --dry-run)


def launch_settings(text: str, *, nnodes: str | None = None, max_restarts: str | None = None) -> LaunchSettings:
    """``--remediate`` as the ranks will read it, and what the launch needs for it.

    * ``min_nodes`` (when not given) is the MIN of ``--nnodes MIN:MAX``;
    * an elastic job (MIN < MAX) gets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (restarted workers need
      torchrun's own store, pytorch#135712);
    * in ``auto`` mode an elastic job's ``--max-restarts`` is raised to ``max_drains`` when lower (each
      drain restarts the other nodes once).
    Raises ``OptionsError`` with one line naming the problem."""
    try:
        config = RemediationConfig.parse(text)
    except OptionsError:
        raise
    except (ValueError, TypeError, OSError, RecursionError) as exc:  # unreadable file, odd bytes, deep JSON
        raise OptionsError(f"cannot read the remediation settings ({type(exc).__name__}: {exc})") from None
    if config.mode == "off":
        return LaunchSettings(config, {}, None, ())
    notes: list[str] = []
    low, high = _node_range(nnodes)
    elastic = low is not None and high is not None and low < high
    if config.min_nodes is None and elastic:
        config = dataclasses.replace(config, min_nodes=low)
        notes.append(f"min_nodes={low} (the MIN of --nnodes {nnodes})")
    env = {ENV: config.to_json()}
    restarts = None
    if elastic:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        notes.append("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: the workers get torchrun's own store, so that the "
                     "nodes left after a drain can restart (pytorch#135712)")  # fmt: skip
        given = int(max_restarts) if max_restarts is not None else 0  # torchrun's default is 0
        if config.acting and config.max_drains > given:
            restarts = str(config.max_drains)
            notes.append(f"--max-restarts {restarts} (was {given}): each of the max_drains={config.max_drains} "
                         "drain(s) restarts the other nodes once; add what failures need on top")  # fmt: skip
    elif config.min_nodes is None:
        notes.append("not an elastic job (--nnodes MIN:MAX with MIN < MAX): nodes are never drained")
    return LaunchSettings(config, env, restarts, tuple(notes))


def _node_range(nnodes: str | None) -> tuple[int | None, int | None]:
    if not nnodes:
        return None, None
    parts = nnodes.split(":")
    try:
        low, high = int(parts[0]), int(parts[-1])
    except ValueError:
        return None, None
    return low, high

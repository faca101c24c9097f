"""Starting the stabilizers: from arguments (:func:`stabilize`), from the environment a launcher set
(:func:`from_env`), and the environment a launcher sets for the ranks it starts (:func:`launch_env`).

``HYPERACC_STABILIZE`` holds JSON of :func:`stabilize`'s keyword arguments, ``1`` for the defaults, or
the path of a TOML/JSON config file. docs/stabilizers.md, "Using it".
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hyperacc.options import OptionsError, parse_json
from hyperacc.stabilize import allocator as _allocator
from hyperacc.stabilize import memory as _memory
from hyperacc.stabilize.config import StabilizeConfig, config_from_dict, resolve_config
from hyperacc.stabilize.stabilizer import Stabilizer

ENV_VAR = "HYPERACC_STABILIZE"

ConfigSource = str | os.PathLike | Mapping[str, Any] | StabilizeConfig | None


def stabilize(config: ConfigSource = None, *, store: Any = None, rank: int | None = None, **kwargs: Any) -> Stabilizer:
    """Start the stabilizers and return the handle.

    ``config`` is a TOML/JSON file, a mapping or a :class:`StabilizeConfig`; ``kwargs`` override it.
    Each part (``gc``, ``memory``, ``allocator``, ``affinity``, ``sync_audit``) is ``True``, ``False``
    or a mapping of its options; ``gc``, ``memory`` and ``allocator`` are on by default. ``store`` is
    the c10d store the GC agrees through (default: the default process group's)."""
    return Stabilizer(resolve_config(config, kwargs), store=store, rank=rank).start()


_from_env: Stabilizer | None = None  # the stabilizer from_env() started in this process
_from_env_raw: str | None = None


def from_env(environ: Mapping[str, str] | None = None) -> Stabilizer | None:
    """Start from ``HYPERACC_STABILIZE`` or return None when it is unset/empty/``0``.

    A second call with the same value returns the stabilizer the first one started (``hyperacc run``
    starts one; a script that calls this itself gets that one)."""
    global _from_env, _from_env_raw
    env = os.environ if environ is None else environ
    raw = env.get(ENV_VAR, "").strip()
    if not raw or raw.lower() in ("0", "false", "off", "no"):
        return None
    if _from_env is not None and not _from_env._closed and _from_env_raw == raw:
        return _from_env
    _from_env, _from_env_raw = _start_from_env(raw), raw
    return _from_env


def _start_from_env(raw: str) -> Stabilizer:
    if raw.lower() in ("1", "true", "on", "yes"):
        return stabilize()
    if raw.startswith("{"):
        example = '{"gc": {"interval": 400}} (1 for the defaults, or a config file path)'
        return stabilize(config_from_dict(parse_json(raw, ENV_VAR, example), ENV_VAR))
    if not Path(raw).is_file():
        raise OptionsError(f"{ENV_VAR}={raw!r} is neither JSON, 1/0, nor an existing config file")
    return stabilize(raw)


def launch_env(config: ConfigSource = None, **kwargs: Any) -> dict[str, str]:
    """Environment a launcher (``hyperacc run``) adds for the ranks it starts: the config itself, the
    allocator settings (before CUDA initialises) and tcmalloc's background release off."""
    cfg = resolve_config(config, kwargs)
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

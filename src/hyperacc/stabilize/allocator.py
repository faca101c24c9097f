"""CUDA caching-allocator settings and stall counters.

``expandable_segments:True`` lets the caching allocator grow a segment instead of searching, splitting
and, when that fails, freeing every cached block and retrying (``num_alloc_retries``): the retry path
synchronises all streams and is a classic per-rank spike. The setting is read once, when CUDA
initialises, from ``PYTORCH_ALLOC_CONF`` or ``PYTORCH_CUDA_ALLOC_CONF``; which of the two wins differs
between torch versions, so the merged value is written to both. Rules and defaults:
docs/stabilizers.md, "Allocator settings".
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, MutableMapping

log = logging.getLogger(__name__)

ENV_NAMES: tuple[str, ...] = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")

# torch.cuda.memory_stats() counters that reveal allocator stalls (cumulative since CUDA init).
STALL_COUNTERS: tuple[str, ...] = (
    "num_alloc_retries",
    "num_sync_all_streams",
    "num_device_alloc",
    "num_device_free",
    "num_ooms",
)


def parse_alloc_conf(text: str) -> dict[str, str]:
    """``"a:1,roundup_power2_divisions:[256:1,512:2],b:True"`` -> ordered dict; commas inside ``[]``
    belong to the value."""
    out: dict[str, str] = {}
    depth = 0
    item = []
    items = []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth = max(0, depth - 1)
        if ch == "," and depth == 0:
            items.append("".join(item))
            item = []
        else:
            item.append(ch)
    items.append("".join(item))
    for raw in items:
        raw = raw.strip()
        if not raw:
            continue
        key, sep, value = raw.partition(":")
        if not sep:
            raise ValueError(
                f"allocator setting {raw!r} has no ':' (expected key:value pairs separated by commas, "
                "e.g. 'expandable_segments:True,max_split_size_mb:256')"
            )
        out[key.strip()] = value.strip()
    return out


def format_alloc_conf(settings: Mapping[str, str]) -> str:
    return ",".join(f"{k}:{v}" for k, v in settings.items())


def merged_alloc_conf(env: Mapping[str, str], wanted: Mapping[str, str]) -> tuple[str, list[str]]:
    """The value to put in both variables: the user's settings (``PYTORCH_CUDA_ALLOC_CONF`` overlaid by
    ``PYTORCH_ALLOC_CONF``) plus each ``wanted`` key the user did not set. A user's explicit value
    always wins. Returns the value and notes worth logging."""
    notes: list[str] = []
    user: dict[str, str] = {}
    values = {name: env.get(name) for name in ENV_NAMES}
    if values["PYTORCH_ALLOC_CONF"] and values["PYTORCH_CUDA_ALLOC_CONF"]:
        if values["PYTORCH_ALLOC_CONF"] != values["PYTORCH_CUDA_ALLOC_CONF"]:
            notes.append(
                "PYTORCH_ALLOC_CONF and PYTORCH_CUDA_ALLOC_CONF differ; merged them "
                "(PYTORCH_ALLOC_CONF wins on a shared key)"
            )
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if values[name]:
            try:
                user.update(parse_alloc_conf(values[name]))
            except ValueError as exc:
                raise ValueError(f"{name}={values[name]!r}: {exc}") from None
    merged = dict(user)
    for key, value in wanted.items():
        if key in user and user[key] != value:
            notes.append(f"kept the user's {key}:{user[key]} (hyperacc would set {key}:{value})")
        merged.setdefault(key, value)
    return format_alloc_conf(merged), notes


def cuda_initialized() -> bool:
    """True when this process has already initialised CUDA (never initialises it itself)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:  # a broken CUDA stack means "not initialised by us"
        return False


def configure(
    env: MutableMapping[str, str] | None = None, *, expandable_segments: bool = True
) -> dict[str, object]:
    """Write the merged allocator settings into ``env`` (default ``os.environ``).

    Returns what was done: ``value``, ``notes`` and ``too_late`` (CUDA was already initialised in this
    process, so the setting only reaches processes started from here on; a warning says so)."""
    target = os.environ if env is None else env
    wanted = {"expandable_segments": "True"} if expandable_segments else {}
    value, notes = merged_alloc_conf(target, wanted)
    changed = any(target.get(name) != value for name in ENV_NAMES)
    if value:
        for name in ENV_NAMES:
            target[name] = value
    too_late = env is None and changed and cuda_initialized()
    if too_late:
        log.warning(
            "hyperacc.stabilize: CUDA is already initialised, so %s=%s reaches only processes started "
            "from now on; set it in the launcher's environment (`hyperacc run` does) or call "
            "hyperacc.stabilize.stabilize() before the first CUDA call",
            ENV_NAMES[0],
            value,
        )
    for note in notes:
        log.info("hyperacc.stabilize: %s", note)
    return {"value": value, "notes": notes, "too_late": too_late}


def stall_counters(device: int | None = None) -> dict[str, int]:
    """Cumulative allocator stall counters of ``device`` (default: current). Empty when CUDA is not
    initialised (CPU build, CPU job): this never initialises CUDA and never synchronises a device."""
    if not cuda_initialized():
        return {}
    import torch

    try:
        stats = torch.cuda.memory_stats(device)
    except Exception:  # counters are a signal, not a reason to fail
        return {}
    return {name: int(stats.get(name, 0)) for name in STALL_COUNTERS}


class StallCounterDeltas:
    """Per-step deltas of :func:`stall_counters` for a tracer: ``delta()`` returns the change since
    the previous call (empty on CPU)."""

    def __init__(self, device: int | None = None) -> None:
        self.device = device
        self._last = stall_counters(device)

    def delta(self) -> dict[str, int]:
        now = stall_counters(self.device)
        if not now:
            return {}
        out = {k: v - self._last.get(k, 0) for k, v in now.items()}
        self._last = now
        return out

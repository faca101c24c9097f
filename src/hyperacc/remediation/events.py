"""The remediation event log: one JSON object per line in ``RUN_DIR/remediation/events.jsonl``.

Every decision of the policy (taken, refused or only printed in dry-run) and every step of its
execution (a drain requested, executed, a checkpoint saved, a job resumed) is one event, appended under
a lock and fsynced, so a crash loses at most the event being written and several processes (the
analyzer rank, the ranks of a draining job) can append to the same file. The policy reads the log back
as its history (how many drains were done, what is already switched on).

Fields (docs/remediation.md, "Events"): ``time`` (UTC ISO 8601), ``kind`` (``decision``, ``drain``,
``checkpoint``, ``resume``), ``action``, ``status``, ``step``, ``target``, ``rule``, ``mode``,
``reason`` and ``detail`` (a JSON object); absent fields are omitted.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

EVENTS_FILE = "events.jsonl"


def remediation_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "remediation"


def events_path(run_dir: str | os.PathLike) -> Path:
    return remediation_dir(run_dir) / EVENTS_FILE


def append_event(run_dir: str | os.PathLike, event: Mapping[str, Any]) -> dict[str, Any]:
    """Append one event (a ``time`` is added when missing); returns what was written."""
    row = {"time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds"), **event}
    row = {k: v for k, v in row.items() if v is not None}
    line = json.dumps(row, sort_keys=True, default=str)
    path = events_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            end = fh.seek(0, os.SEEK_END)
            if end:
                fh.seek(end - 1)
                if fh.read(1) != "\n":  # a writer died mid-line: keep this event on a line of its own
                    line = "\n" + line
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
    return row


def read_events(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every event in file order; a truncated last line (a crash while writing) is skipped."""
    path = events_path(run_dir)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            log.warning("skipping an unreadable remediation event line in %s", path)
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows

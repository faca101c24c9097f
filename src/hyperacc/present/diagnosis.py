"""The diagnosis document (``hyperacc.analysis.diagnose(...).to_dict()``) as the presenters use it."""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)


def diagnosis_of(run_dir: str | os.PathLike, **options: Any) -> dict[str, Any] | None:
    """``diagnose(run_dir).to_dict()``, or None when this installation has no analysis module.

    Errors about the run directory itself (``RunDirError``) propagate: the caller reports them.
    """
    try:
        from hyperacc.analysis import diagnose
    except ImportError as exc:
        log.warning("analysis not available (%s); presenting the step records only", exc)
        return None
    return diagnose(run_dir, **options).to_dict()


def remediation_of(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every remediation event of a run, in time order (docs/remediation.md, "Events"): the event log
    ``RUN_DIR/remediation/events.jsonl`` (decisions, drains, checkpoints, resumes) and the ranks' own
    ``remediation`` events (a live switch started), one row per switch with the ranks that started it.
    Each row has ``line``, the one-line text ``analyze``, the report and the live line show."""
    import datetime as _dt

    from hyperacc.remediation.events import read_events

    rows = [dict(e) for e in read_events(run_dir)]
    try:
        from hyperacc import store

        table = store.read_events(run_dir)
    except Exception as exc:  # noqa: BLE001 - no step events is no reason to hide the log
        log.debug("no rank events in %s (%s)", run_dir, exc)
        table = None
    if table is not None and table.num_rows:
        switches: dict[tuple[int, str], dict[str, Any]] = {}
        for r in table.to_pylist():
            if r.get("kind") != "remediation":
                continue
            row = switches.setdefault((r.get("step"), r.get("detail") or ""), {
                "kind": "switch", "step": r.get("step"), "detail": r.get("detail"), "ranks": [],
                "time": _dt.datetime.fromtimestamp((r.get("t_ns") or 0) / 1e9, _dt.timezone.utc)
                .isoformat(timespec="milliseconds"),
            })  # fmt: skip
            row["ranks"].append(int(r["rank"]))
        rows += list(switches.values())
    rows.sort(key=lambda e: str(e.get("time", "")))
    for e in rows:
        e["line"] = remediation_line(e)
    return rows


def remediation_line(e: dict[str, Any]) -> str:
    """One remediation event as one line of text."""
    if e.get("kind") == "switch":
        ranks = sorted(e.get("ranks") or [])
        return f"step {e.get('step')}: ranks {','.join(map(str, ranks))}: {e.get('detail')}"
    step = f"step {e['step']}: " if e.get("step") is not None else ""
    what = e.get("rule") or e.get("kind")
    target = f" {e['target']}" if e.get("target") else ""
    at = f" at {e['at']}" if e.get("at") not in (None, "-") else ""
    reason = f": {e['reason']}" if e.get("reason") else ""
    settings = (e.get("detail") or {}).get("settings") if isinstance(e.get("detail"), dict) else None
    knobs = f" [{'; '.join(settings)}]" if settings else ""
    return f"{step}{e.get('kind')} {what} {e.get('status', '')}{target}{at}{reason}{knobs}"


def print_verdict(con: Any, title: str, verdict: str, alarm: bool, evidence: list[str], next_step: list[str]) -> None:
    """The head every verdict command prints (analyze, doctor): a panel with the verdict, red when it
    calls for action, then the evidence and the next steps, one line each."""
    from rich.panel import Panel

    con.print(Panel(verdict, title=title, border_style="red" if alarm else "green"))
    con.print("[bold]Evidence[/bold]")
    for line in evidence:
        con.print(f"  - {line}", highlight=False)
    con.print("[bold]Next step[/bold]")
    for line in next_step:
        con.print(f"  - {line}", highlight=False)

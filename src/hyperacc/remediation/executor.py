"""Carrying out the policy's decisions: the side effects, in one place.

``RemediationExecutor.step(findings, job)`` is what the live path calls (each time the detector has new
verdicts): it reads the history from the event log, asks the pure policy (``policy.decide``) and applies
each decision according to the mode:

* ``off``: nothing is decided or written;
* ``dry-run``: every decision is written to the event log as ``would`` and printed, nothing is done;
* ``auto``: a drain becomes a drain request (``drain.request_drain``) that the job's ranks carry out at
  their next checkpoint boundary; a live switch (``gc_schedule``, ``memory_release``) goes to the handler
  registered for it (``handlers``: a callable taking the ``Decision``, returning a short note or raising);
  without one it is logged as ``unavailable``; advice is logged and printed.

Every outcome is one event (docs/remediation.md, "Events").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from hyperacc.remediation import events
from hyperacc.remediation.config import RemediationConfig, RemediationConfigError
from hyperacc.remediation.drain import request_drain
from hyperacc.remediation.policy import Decision, Finding, JobState, decide

log = logging.getLogger(__name__)

Handler = Callable[[Decision], "str | None"]


class RemediationExecutor:
    def __init__(
        self,
        config: RemediationConfig,
        *,
        handlers: Mapping[str, Handler] | None = None,
        echo: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.run_dir = config.resolved_run_dir()
        if config.mode != "off" and self.run_dir is None:
            raise RemediationConfigError(
                "remediation needs a run directory for its event log: set run_dir or HYPERACC_RUN_DIR"
            )
        self.handlers = dict(handlers or {})
        self.echo = echo or (lambda line: log.warning("%s", line))

    def history(self) -> list[dict[str, Any]]:
        return events.read_events(self.run_dir) if self.run_dir is not None else []

    def step(self, findings: Iterable[Finding], job: JobState) -> list[dict[str, Any]]:
        """Decide with the current findings and the recorded history, then apply; returns the events."""
        if self.config.mode == "off":
            return []
        return self.apply(decide(list(findings), self.history(), job, self.config), job)

    def apply(self, decisions: Iterable[Decision], job: JobState | None = None) -> list[dict[str, Any]]:
        written = []
        for d in decisions:
            event = self._apply_one(d, job)
            if event is not None and self.run_dir is not None:
                written.append(events.append_event(self.run_dir, event))
        return written

    def _apply_one(self, d: Decision, job: JobState | None) -> dict[str, Any] | None:
        mode = self.config.mode
        if mode == "off":
            return None
        settings = f" [{'; '.join(d.settings)}]" if d.settings else ""
        if d.status == "refused":
            self.echo(f"hyperacc remediation: {d.rule}: not acting on {d.target}: {d.reason}")
            return d.to_event(mode)
        if d.status == "advise":
            self.echo(f"hyperacc remediation: {d.rule}: {d.target}: {d.reason}{settings}")
            return d.to_event(mode, "advised")
        if mode == "dry-run":
            self.echo(f"hyperacc remediation (dry-run): would {d.action} {d.target} at {d.at}: {d.reason}")
            return d.to_event(mode, "would")
        if d.action == "drain":
            assert self.run_dir is not None
            request_drain(self.run_dir, d.target, reason=d.reason, rule=d.rule, step=job.step if job else None,
                          finding=d.finding)  # fmt: skip
            self.echo(f"hyperacc remediation: draining {d.target} at its next checkpoint: {d.reason}")
            return d.to_event(mode, "requested")
        handler = self.handlers.get(d.action)
        if handler is None:
            self.echo(f"hyperacc remediation: {d.rule}: no live handler for {d.action}; not done: {d.reason}")
            return d.to_event(mode, "unavailable")
        try:
            note = handler(d)
        except Exception as exc:  # noqa: BLE001 - a failing action is logged, never raised into training
            self.echo(f"hyperacc remediation: {d.rule}: {d.action} failed: {exc}")
            event = d.to_event(mode, "failed")
            event["detail"]["error"] = f"{type(exc).__name__}: {exc}"
            return event
        self.echo(f"hyperacc remediation: {d.action} for {d.target} at {d.at}: {d.reason}")
        event = d.to_event(mode, "done")
        if note:
            event["detail"]["note"] = note
        return event

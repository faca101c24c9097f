"""Automated remediation: a pure policy (findings + history in, bounded decisions out) and its executors.

* ``policy.decide`` - the rules of docs/remediation.md, pure;
* ``executor.RemediationExecutor`` - applies decisions: event log, drain requests, live switches, dry-run;
* ``drain.NodeDrain`` - inside an elastic job's ranks, drains a node at a checkpoint boundary
  (``hyperacc.elastic.Checkpointer`` runs it);
* ``exclusion`` - the exclusion file launchers read; ``events`` - the event log.
"""

from __future__ import annotations

from hyperacc.remediation.config import RemediationConfig, RemediationConfigError
from hyperacc.remediation.events import append_event, read_events
from hyperacc.remediation.exclusion import add_exclusions, node_name, read_exclusions
from hyperacc.remediation.policy import Decision, Finding, JobState, decide, drain_refusal

__all__ = [
    "Decision",
    "Finding",
    "JobState",
    "RemediationConfig",
    "RemediationConfigError",
    "add_exclusions",
    "append_event",
    "decide",
    "drain_refusal",
    "node_name",
    "read_events",
    "read_exclusions",
]

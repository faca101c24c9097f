"""Remediation while the job runs (``hyperacc run --remediate``): rank 0 decides from the live verdicts,
every rank applies a live switch at the step rank 0 agreed.

- Rank 0 (its window-aggregation thread, never the training thread): after each window the live
  detector judged, ``decide`` turns its active stragglers and the recent windows' spike tallies by cause
  into ``Finding``s and hands them to the ``RemediationExecutor`` (the documented policy of
  docs/remediation.md decides; the executor logs every decision to ``RUN_DIR/remediation/events.jsonl``).
  A live switch (deterministic GC, scheduled memory release) is published in the job's c10d store with
  its agreed step; a drain becomes a drain request that the ranks carry out at their next checkpoint.
- Every rank: a background thread polls the store for published switches; the training thread, at
  each step boundary (a step callback of the automatic tracer), starts the switch once it reaches the
  agreed step: a ``hyperacc.stabilize`` stabilizer with just that part, whose ``step()`` is then called at
  every boundary like any other stabilizer. The switch is recorded as a ``remediation`` event of the rank.

Nothing here runs when remediation is off; a failure switches remediation off with one log line.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from hyperacc.remediation.config import RemediationConfig
from hyperacc.remediation.drain import read_membership
from hyperacc.remediation.executor import RemediationExecutor
from hyperacc.remediation.policy import Decision, Finding, JobState
from hyperacc.trace.failsafe import switch_off

log = logging.getLogger("hyperacc.remediation")

# The stabilizer parts a live switch starts (the others stay off).
SWITCH_PARTS: dict[str, dict[str, Any]] = {
    "gc_schedule": {"gc": {}, "memory": None, "allocator": None},
    "memory_release": {"gc": None, "memory": {}, "allocator": None},
}


def _prefix() -> str:
    run = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"hyperacc/remediate/{run}/{restart}/"


def findings_from_live(
    stragglers: Sequence[Any], windows: Mapping[str, np.ndarray], node_names: Mapping[int, str] | None = None
) -> list[Finding]:
    """Findings from the live detector: its active stragglers, and the spike causes of its recent windows
    (``spikes_<cause>`` and ``lost_ns_<cause>`` tallies of the window summaries)."""
    out = [Finding.from_straggler(s, node_names) for s in stragglers]
    lost = {k[len("lost_ns_"):]: float(np.nansum(v)) for k, v in windows.items() if k.startswith("lost_ns_")}
    total = sum(lost.values())
    step = int(np.nanmax(windows["last_step"])) if "last_step" in windows and len(windows["last_step"]) else None
    for cause, ns in lost.items():
        spikes = int(np.nansum(windows.get(f"spikes_{cause}", np.zeros(0))))
        if spikes and total > 0:
            out.append(Finding.from_cause({"cause": cause, "share": ns / total, "spikes": spikes}, step))
    return out


class LiveRemediation:
    """One rank's part of live remediation (see the module's docstring)."""

    def __init__(
        self,
        config: RemediationConfig,
        *,
        rank: int,
        record: Callable[[str, int, str], None] | None = None,
        poll_s: float = 1.0,
    ) -> None:
        self.config = config
        self.rank = rank
        self.record = record  # (kind, step, detail) -> an event of the rank's trace
        self.poll_s = poll_s
        self.executor = (
            RemediationExecutor(config, handlers={a: self._publish for a in SWITCH_PARTS}) if rank == 0 else None
        )
        self.stabilizers: list[Any] = []
        self._pending: dict[str, int] = {}  # action -> agreed step (written by the poll thread)
        self._applied: set[str] = set()
        self._store: Any = None
        self._on = config.mode != "off"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="hyperacc-remediation", daemon=True)
        if self._on:
            self._thread.start()

    # ------------------------------------------------------------------ rank 0: deciding

    def decide(self, stragglers: Sequence[Any], windows: Mapping[str, np.ndarray], step: int,
               window_steps: int) -> list[dict[str, Any]]:  # fmt: skip
        """After a live window: the policy's decisions on the current verdicts (rank 0, off the training
        thread); returns the events written."""
        if self.executor is None or not self._on:
            return []
        try:
            membership = read_membership(self.config.resolved_run_dir()) if self.config.resolved_run_dir() else None
            if membership:
                job = JobState.from_membership(membership, step, window_steps)
                names = {n["group_rank"]: n["name"] for n in membership.get("nodes", []) if "group_rank" in n}
            else:
                nodes = sorted({int(getattr(s, "node", 0)) for s in stragglers} | {0})
                job = JobState(step=step, nodes=tuple(f"node{n}" for n in nodes), window_steps=window_steps)
                names = None
            return self.executor.step(findings_from_live(stragglers, windows, names), job)
        except Exception as exc:  # noqa: BLE001 - remediation never stops training
            self._on = False
            switch_off("remediation", exc)
            return []

    def _publish(self, decision: Decision) -> str:
        """Handler of a live switch: every rank learns the agreed step through the store."""
        store = self._connect()
        store.set(f"switch/{decision.action}", json.dumps({"step": decision.step, "rule": decision.rule}))
        return f"published for step {decision.step}"

    # ------------------------------------------------------------------ every rank: applying

    def _connect(self) -> Any:
        if self._store is None:
            import torch.distributed as dist

            from hyperacc.trace.aggregate import connect_store

            base = connect_store()
            if base is None:
                base = dist.HashStore()  # a single process: rank 0 is every rank
            self._store = dist.PrefixStore(_prefix(), base)
        return self._store

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                store = self._connect()
                for action in SWITCH_PARTS:
                    if action in self._pending or action in self._applied:
                        continue
                    if store.check([f"switch/{action}"]):
                        spec = json.loads(store.get(f"switch/{action}").decode())
                        self._pending[action] = int(spec["step"])
            except Exception as exc:  # noqa: BLE001 - a dead store stops remediation, never training
                self._on = False
                switch_off("remediation (store)", exc)
                return

    def step(self, step: int) -> None:
        """At every step boundary (training thread): start a published switch at its agreed step, and
        drive the stabilizers started so far."""
        if self._pending:
            for action, at in list(self._pending.items()):
                if step + 1 >= at:
                    del self._pending[action]
                    self._apply(action, step)
        for stabilizer in self.stabilizers:
            stabilizer.step(step)

    def _apply(self, action: str, step: int) -> None:
        self._applied.add(action)
        try:
            from hyperacc.stabilize import stabilize

            self.stabilizers.append(stabilize(SWITCH_PARTS[action]))
            detail = f"{action} switched on at step {step + 1}"
        except Exception as exc:  # noqa: BLE001
            detail = f"{action} could not be switched on: {type(exc).__name__}: {exc}"
            switch_off(f"remediation {action}", exc)
        log.warning("hyperacc remediation: rank %d: %s", self.rank, detail)
        if self.record is not None:
            self.record("remediation", step + 1, detail)

    def close(self) -> None:
        self._stop.set()
        for stabilizer in self.stabilizers:
            try:
                stabilizer.close()
            except Exception as exc:  # noqa: BLE001
                switch_off("remediation stabilizer", exc)

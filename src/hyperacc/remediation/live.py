"""Remediation while the job runs (``hyperacc run --remediate``): rank 0 decides from the live verdicts,
every rank applies a live switch at the step rank 0 agreed.

- Rank 0 (its window-aggregation thread, never the training thread): after each window the live
  detector judged, ``decide`` turns its active stragglers and the recent windows' spike tallies by cause
  into ``Finding``s and hands them to the ``RemediationExecutor`` (the documented policy of
  docs/remediation.md decides; the executor logs every decision to ``RUN_DIR/remediation/events.jsonl``).
  A live switch (deterministic GC, scheduled memory release) is proposed in the job's c10d store with
  the step it proposes and its lead; a drain becomes a drain request that the ranks carry out at their
  next checkpoint.
- Every rank: a background thread polls one counter of the store; when it moves, the thread acknowledges
  a new proposal with the rank's current step, and the last rank to acknowledge agrees the step for all:
  the proposed step, or the newest acknowledged step plus the lead when that is later (the decider's
  guess of the ranks' step can lag). The training thread, at each step boundary (a step callback of the
  automatic tracer), starts the switch once it reaches the agreed step: a ``hyperacc.stabilize``
  stabilizer with just that part, whose ``step()`` is then called at every boundary like any other
  stabilizer. The switch is recorded as a ``remediation`` event of the rank.

Nothing here runs when remediation is off; a failure switches remediation off with one log line.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from hyperacc.remediation.config import RemediationConfig
from hyperacc.remediation.drain import read_membership
from hyperacc.remediation.events import append_event
from hyperacc.remediation.executor import RemediationExecutor
from hyperacc.remediation.policy import Decision, Finding, JobState
from hyperacc.trace.failsafe import switch_off
from hyperacc.trace.options import ENV_NODE_AGENT

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
        current_step: Callable[[], int] | None = None,
        poll_s: float = 0.25,
        decides: bool | None = None,
        applies: bool = True,
        store_address: str | None = None,
        prefix: str | None = None,
        world_size: int = 1,
        resumed: Callable[[], tuple[int, int] | None] | None = None,
    ) -> None:
        self.config = config
        # the tracer's (steps counted before, step resumed at) once the job resumed from a checkpoint
        self.resumed = resumed
        self.rank = rank
        self.record = record  # (kind, step, detail) -> an event of the rank's trace
        self.current_step = current_step  # rank 0: the training thread's step (read, never waited on)
        self.poll_s = poll_s
        # who decides: rank 0, or the node agent that holds it (``hyperacc.agent.LiveNode``: ``applies``
        # False, the job's store at ``store_address`` "host:port" under the ranks' ``prefix``)
        self.store_address = store_address
        self.prefix = prefix
        decides = rank == 0 if decides is None else decides
        self.executor = (
            RemediationExecutor(config, handlers={a: self._publish for a in SWITCH_PARTS}) if decides else None
        )
        self.world_size = max(int(world_size), 1)  # the ranks that acknowledge a proposed switch
        self.stabilizers: list[Any] = []
        self._pending: dict[str, tuple[int, str]] = {}  # action -> (agreed step, rule), set by the poll thread
        self._acked: set[str] = set()  # proposals this rank acknowledged, not agreed yet
        self._applied: set[str] = set()
        self._published: dict[str, str] = {}  # the decider: action -> rule of every switch it proposed
        self._lead = config.gc_lead_steps  # the decider's lead of its latest decision
        self._seen: deque[tuple[float, int]] = deque(maxlen=16)  # rank 0: (monotonic time, step), polled
        self._store: Any = None
        self._on = config.mode != "off"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="hyperacc-remediation", daemon=True)
        if self._on and applies:
            self._thread.start()

    @property
    def on(self) -> bool:
        return self._on

    @property
    def agreed(self) -> dict[str, int]:
        """The switches agreed and not started yet on this rank: action -> agreed step."""
        return {action: at for action, (at, _) in list(self._pending.items())}

    # ------------------------------------------------------------------ rank 0: deciding

    def on_judged(self, detector: Any, window: Mapping[str, np.ndarray], first_step: int) -> None:
        """``WindowGatherer``'s hook after each judged window (the aggregation thread), with the window's
        columns (``windows.rows_columns``): decide on the detector's active stragglers and its recent
        windows. Never raises."""
        if self.executor is None or not self._on:
            return
        try:
            last_steps = window.get("last_step")
            last = int(np.max(last_steps)) if last_steps is not None and len(last_steps) else first_step
            now = last if self.current_step is None else max(int(self.current_step()), last)
            rate = self._rate(now, window)
            self.decide(detector.active_stragglers, detector.history, now, int(detector.opts.window_steps),
                        nodes=int(getattr(detector, "nodes", 1)), steps_per_s=rate)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - remediation never stops training nor the aggregation
            self._off_everywhere(exc)

    def retarget(self, prefix: str, store_address: str | None = None) -> None:
        """Publish under ``prefix`` from now on (the node agent, after an elastic restart of the ranks),
        in the store at ``store_address`` when given: where the agents do not share their rendezvous
        store with the workers (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which a drain needs), each
        attempt of the ranks has a store of its own, and the earlier one is gone.

        The restarted ranks start with none of the switches the earlier ones started (or never agreed,
        when they were halted): every switch this decider proposed is proposed again under the new prefix,
        from step 0, so that the new ranks agree it at their newest step plus the lead. The policy decides
        a switch once per run; this keeps it on for the run. One ``carry`` event per switch and restart."""
        moved = store_address is not None and store_address != self.store_address
        if prefix == self.prefix and not moved:
            return
        if moved:
            self.store_address = store_address
        self.prefix = prefix
        self._store = None
        if not self._on or not self._published:
            return
        try:
            for action, rule in list(self._published.items()):
                self._propose(action, rule, 0)
                if self.executor is not None and self.executor.run_dir is not None:
                    append_event(self.executor.run_dir, {
                        "kind": "carry", "rule": rule, "action": action, "status": "proposed",
                        "target": "all ranks", "at": f"prefix {prefix}", "mode": self.config.mode,
                        "reason": "the ranks restarted without it: proposed again from their newest step",
                    })  # fmt: skip
                log.warning("hyperacc remediation: %s proposed again to the restarted ranks (%s)", action, prefix)
        except Exception as exc:  # noqa: BLE001 - remediation never stops training nor the aggregation
            self._off_everywhere(exc)

    def observe(self, step: int, at_s: float | None = None) -> None:
        """A sample of the training step at ``at_s`` seconds (default: now, monotonic), for the rate of
        steps per second; one source of samples keeps to one clock."""
        self._seen.append((time.monotonic() if at_s is None else at_s, step))

    def _rate(self, now: int, window: Mapping[str, np.ndarray]) -> float:
        """Training steps per wall-clock second, pauses and all: the step counter sampled by the poll
        thread over the last few seconds; without such samples, the windows' median step time (an upper
        bound of the rate, so the lead is never too short)."""
        seen = list(self._seen)
        if len(seen) >= 2:
            (t0, s0), (t1, s1) = seen[0], seen[-1]
            if t1 - t0 >= 1.0 and s1 > s0:
                return (s1 - s0) / (t1 - t0)
        medians = np.asarray(window.get("step_ns_median", ()), dtype=np.float64)
        medians = medians[np.isfinite(medians) & (medians != 0)]
        return 1e9 / float(np.median(medians)) if medians.size and np.median(medians) > 0 else 0.0

    def lead_steps(self, steps_per_s: float) -> int:
        """How far ahead a live switch's agreed step is: ``gc_lead_steps``, and at least ``switch_lead_s``
        of training at the measured rate, so that every rank's poll thread learns it in time."""
        return max(self.config.gc_lead_steps, math.ceil(self.config.switch_lead_s * max(steps_per_s, 0.0)))

    def decide(self, stragglers: Sequence[Any], windows: Mapping[str, np.ndarray], step: int,
               window_steps: int, *, nodes: int = 1, steps_per_s: float = 0.0) -> list[dict[str, Any]]:  # fmt: skip
        """The policy's decisions on the current verdicts (rank 0, off the training thread); returns the
        events written."""
        if self.executor is None or not self._on:
            return []
        run_dir = self.config.resolved_run_dir()
        membership = read_membership(run_dir) if run_dir else None
        if membership:
            job = JobState.from_membership(membership, step, window_steps)
            names = {n["group_rank"]: n["name"] for n in membership.get("nodes", []) if "group_rank" in n}
        else:
            seen = {int(getattr(s, "node", 0)) for s in stragglers}
            job = JobState(step=step, nodes=tuple(f"node{n}" for n in sorted(seen | set(range(nodes)))),
                           window_steps=window_steps)  # fmt: skip
            names = None
        lead = self._lead = self.lead_steps(steps_per_s)
        if lead != self.config.gc_lead_steps:
            self.executor.config = dataclasses.replace(self.config, gc_lead_steps=lead)
        return self.executor.step(findings_from_live(stragglers, windows, names), job)

    def _publish(self, decision: Decision) -> str:
        """Handler of a live switch: proposed to every rank through the store (``_acknowledge`` agrees it)."""
        self._published[decision.action] = decision.rule
        self._propose(decision.action, decision.rule, int(decision.step or 0))
        return f"proposed for step {decision.step} (lead {self._lead} steps)"

    def _propose(self, action: str, rule: str, step: int) -> None:
        store = self.connect()
        store.set(f"switch/{action}", json.dumps({"step": step, "rule": rule, "lead": self._lead}))
        if not self._on:  # switched off meanwhile: the ranks must drop it too
            store.set("off", "switched off")
        store.add("news", 1)

    # ------------------------------------------------------------------ every rank: applying

    def connect(self) -> Any:
        """The job's store under this job's prefix (connected once)."""
        if self._store is None:
            import torch.distributed as dist

            from hyperacc.analysis.window_store import connect_store

            base = connect_store(self.store_address)
            if base is None:
                base = dist.HashStore()  # a single process: rank 0 is every rank
            self._store = dist.PrefixStore(self.prefix or _prefix(), base)
        return self._store

    def _poll(self) -> None:
        """Every rank's poll thread: one request per ``poll_s`` (the ``news`` counter every writer moves);
        the keys are read only when it moved."""
        news = 0
        while not self._stop.wait(self.poll_s):
            try:
                if self.executor is not None and self.current_step is not None:  # rank 0 decides: its rate
                    self.observe(int(self.current_step()))
                store = self.connect()
                now = store.add("news", 0)
                if now == news:
                    continue
                news = now
                if store.check(["off"]):
                    self._on = False
                    self._pending.clear()
                    log.warning("hyperacc remediation: rank %d: switched off (%s)", self.rank,
                                store.get("off").decode()[:200])  # fmt: skip
                    return
                for action in SWITCH_PARTS:
                    if action in self._pending or action in self._applied:
                        continue
                    if action not in self._acked and store.check([f"switch/{action}"]):
                        self._acknowledge(store, action)
                    if action in self._acked and store.check([f"agreed/{action}"]):
                        spec = json.loads(store.get(f"agreed/{action}").decode())
                        self._pending[action] = (int(spec["step"]), str(spec.get("rule", "")))
                        self._acked.discard(action)
            except Exception as exc:  # noqa: BLE001 - a dead store stops remediation, never training
                self._off_everywhere(exc, "remediation (store)")
                return

    def _acknowledge(self, store: Any, action: str) -> None:
        """This rank learnt of a proposed switch: it sets ``ack/<action>/<rank>`` to its current step; the
        last of the ``world_size`` ranks to do so agrees the step for all, ``max(proposed, newest
        acknowledged + lead)``, in ``agreed/<action>``. A rank that never acknowledges (dead, hung) leaves
        the switch unagreed, so no rank starts it."""
        proposal = json.loads(store.get(f"switch/{action}").decode())
        step = int(self.current_step()) if self.current_step is not None else 0
        self._acked.add(action)
        store.set(f"ack/{action}/{self.rank}", str(step))
        if store.add(f"acks/{action}", 1) != self.world_size:
            return
        keys = [f"ack/{action}/{r}" for r in range(self.world_size)]
        steps = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(k) for k in keys]
        newest = max(int(s) for s in steps)
        at = max(int(proposal["step"]), newest + int(proposal.get("lead", self.config.gc_lead_steps)))
        store.set(f"agreed/{action}", json.dumps({"step": at, "rule": proposal.get("rule", "")}))
        store.add("news", 1)

    def _off_everywhere(self, exc: BaseException, part: str = "remediation") -> None:
        """An internal error: remediation off on this rank, and on every rank through the store (a
        switch not started yet is dropped everywhere)."""
        self._on = False
        self._pending.clear()
        switch_off(part, exc)
        try:
            store = self.connect()
            store.set("off", f"rank {self.rank}: {type(exc).__name__}: {exc}")
            store.add("news", 1)
        except Exception:  # noqa: BLE001 - the store itself failed: the others keep polling a silent store
            pass

    def step(self, step: int) -> None:
        """At every step boundary (training thread; ``step`` just ended): start a published switch before
        its agreed step, and drive the stabilizers started so far."""
        if self._pending:
            for action, (agreed, rule) in list(self._pending.items()):
                at = self._renumbered(agreed)
                if step + 1 >= at:
                    del self._pending[action]
                    self._apply(action, at, rule, step + 1)
        for stabilizer in self.stabilizers:
            stabilizer.step(step)

    def _renumbered(self, at: int) -> int:
        """An agreed step in this rank's numbering. Ranks that acknowledged a switch before their
        checkpoint's load (an elastic restart: the node agent proposes its switches again at once) agreed a
        step of their own count from 0; the tracer then numbered the steps from the one resumed at, on every
        rank alike (``Tracer.resume_at``), so such a step moves by as much. A step agreed at or after it is
        already in that numbering."""
        resumed = self.resumed() if self.resumed is not None else None
        if resumed is not None and at < resumed[1]:
            return at + resumed[1] - resumed[0]
        return at

    def _apply(self, action: str, at: int, rule: str, start: int) -> None:
        self._applied.add(action)
        late = "" if start == at else f"; LATE: the agreed step was {at}"
        try:
            from hyperacc.stabilize import stabilize

            self.stabilizers.append(stabilize(SWITCH_PARTS[action]))
            detail = f"{action} switched on at step {start} ({rule}, agreed step {at}){late}"
        except Exception as exc:  # noqa: BLE001
            detail = f"{action} could not be switched on at step {start}: {type(exc).__name__}: {exc}"
            switch_off(f"remediation {action}", exc)
        log.warning("hyperacc remediation: rank %d: %s", self.rank, detail)
        if self.record is not None:
            self.record("remediation", start, detail)

    def close(self) -> None:
        self._stop.set()
        for stabilizer in self.stabilizers:
            try:
                stabilizer.close()
            except Exception as exc:  # noqa: BLE001
                switch_off("remediation stabilizer", exc)


def install(auto: Any) -> LiveRemediation | None:
    """``hyperacc.bootstrap``: live remediation from ``HYPERACC_REMEDIATE`` on a traced rank (``auto`` is
    the automatic tracer). Rank 0 decides after each window its aggregator judged; every rank applies
    switches from a step callback. None when remediation is off (then nothing is added anywhere)."""
    try:
        config = RemediationConfig.from_env()
    except ValueError as exc:
        switch_off("remediation (HYPERACC_REMEDIATE)", exc)
        return None
    if config is None or config.mode == "off":
        return None
    tracer = getattr(auto, "tracer", None)
    if tracer is None:
        log.warning("hyperacc: remediation needs the tracer (HYPERACC_RUN_DIR); remediation is off")
        return None
    agent = bool(os.environ.get(ENV_NODE_AGENT))  # hyperacc run's node agent decides, not rank 0
    try:
        live = LiveRemediation(
            config, rank=tracer.rank, current_step=lambda: tracer.current_step, resumed=lambda: tracer.resumed,
            record=lambda kind, step, detail: tracer.record_event(kind, step, detail=detail),
            decides=tracer.rank == 0 and not agent, world_size=tracer.world_size,
        )  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - e.g. no run directory for the event log
        switch_off("remediation", exc)
        return None
    auto.add_step_callback(live.step)
    if tracer.rank == 0 and not agent:
        if tracer.aggregator is None:
            log.warning("hyperacc: remediation decides from the live windows (--trace window > 0); "
                        "this job has none, so nothing will be decided")  # fmt: skip
        else:
            tracer.aggregator.on_judged = live.on_judged
    return live

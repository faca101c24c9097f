"""The remediation policy: confirmed findings and the history of past actions in, bounded decisions out.

Pure: no files, no clocks, no processes. ``decide(findings, history, job, config)`` returns what to do
now; the executor (``hyperacc.remediation.executor``) records and carries it out, and an elastic job's
ranks (``hyperacc.remediation.drain``) check a drain's bounds again before acting. Every rule, its
trigger and its bounds: docs/remediation.md. In short:

* ``drain-slow-node``: a node verdict (more than half of a node's ranks confirmed stragglers) of a
  hardware kind (``drain_kinds``), still active ``drain_hold_windows`` windows after it was confirmed,
  at least ``drain_min_slowdown`` slower, drains that node at the next checkpoint boundary; never below
  ``min_nodes``, at most ``max_drains`` per run, one at a time, never the node hosting the rendezvous;
* ``gc-schedule``: a confirmed GC straggler, or GC explaining ``gc_min_share`` of the time lost to
  spikes, switches deterministic GC on for all ranks at one agreed step, once per run;
* ``memory-release``: the same for allocator spikes and scheduled memory release, plus the settings that
  need a restart, as advice;
* ``advise-*``: every other confirmed finding gets its exact knob, once per target.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from hyperacc.remediation.config import RemediationConfig

# Advice for findings the loop does not act on (straggler kind -> (knob, why)). No straggler rule names
# a communication straggler (the collective's own spikes belong to the cluster: analysis.spikes), so
# there is no entry for one.
ADVICE: dict[str, tuple[str, str]] = {
    "data": (
        "DataLoader(num_workers=N, persistent_workers=True, prefetch_factor=4) or "
        "hyperacc.data.pipeline.make_loader(..., prefetch_to='cuda')",
        "the input path stalls this rank (docs/data.md)",
    ),
    "launch": (
        "hyperacc run --stabilize '{\"affinity\": true}' (bind ranks to cores; `hyperacc affinity` shows the plan)",
        "the host is slow to launch work",
    ),
    "host": (
        "keep other processes off the training cores; bind ranks with `hyperacc affinity`",
        "another process takes this rank's cores",
    ),
    "compute": (
        "run `hyperacc doctor` on that node; drain it if its other ranks turn slow too",
        "one rank computes slowly; one slow rank is not a slow node",
    ),
}
MEMORY_RESTART_SETTINGS = (
    "PYTORCH_ALLOC_CONF=expandable_segments:True (set before CUDA starts: needs a restart)",
    "TCMALLOC_RELEASE_RATE=0 with hyperacc's scheduled release (read at start: needs a restart)",
)


@dataclasses.dataclass(frozen=True)
class Finding:
    """A verdict the policy may act on. Stragglers come from ``hyperacc.analysis`` (live or offline),
    spike causes from the diagnosis' ``causes``; only ``confirmed`` ones are ever acted on."""

    kind: str  # straggler kind (compute, page_faults, data, launch, gc, host, node) or spike cause (gc, allocator, ...)
    source: str = "straggler"  # straggler | spikes
    rank: int | None = None
    node: str | None = None  # the node's name (the exclusion file's word for it)
    rank_kind: str | None = None  # a node verdict: the kind its ranks were slow in
    slowdown: float | None = None
    confirmed_step: int | None = None
    last_step: int | None = None  # last step at which it was still seen
    active: bool = True
    confirmed: bool = True
    share: float | None = None  # spike causes: share of the time lost to spikes
    spikes: int | None = None

    @classmethod
    def from_straggler(cls, s: Any, node_names: Mapping[int, str] | None = None) -> Finding:
        """From ``hyperacc.analysis.stragglers.Straggler`` (or its ``to_dict()``); ``node_names`` maps
        torchrun's node index (GROUP_RANK) to the node's name (``drain.read_membership``)."""
        d = s if isinstance(s, Mapping) else s.to_dict()
        node = d.get("node")
        name = (node_names or {}).get(node, None if node is None else f"node{node}")
        return cls(
            kind=str(d["kind"]), source="straggler", rank=d.get("rank"), node=name,
            rank_kind=d.get("rank_kind"), slowdown=d.get("slowdown"), confirmed_step=d.get("confirmed_step"),
            last_step=d.get("until_step"), active=bool(d.get("active", True)), confirmed=True,
        )  # fmt: skip

    @classmethod
    def from_cause(cls, cause: Mapping[str, Any], step: int | None = None) -> Finding:
        """From one row of the diagnosis' ``causes`` (cause, spikes, time_lost_ns, share)."""
        return cls(
            kind=str(cause["cause"]), source="spikes", share=cause.get("share"), spikes=cause.get("spikes"),
            last_step=step, confirmed=True,
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class JobState:
    step: int  # the step the live path has seen
    nodes: tuple[str, ...]  # names of the job's nodes in this round
    window_steps: int = 50
    undrainable: Mapping[str, str] = dataclasses.field(default_factory=dict)  # node name -> why not
    restarts_left: int | None = None  # torchrun restarts left (None: unknown)

    @classmethod
    def from_membership(cls, membership: Mapping[str, Any], step: int, window_steps: int = 50) -> JobState:
        """From ``drain.read_membership(run_dir)``, what the job's rank 0 wrote at its start."""
        nodes = membership.get("nodes", [])
        return cls(
            step=step, nodes=tuple(n["name"] for n in nodes), window_steps=window_steps,
            undrainable={n["name"]: n["why_not"] for n in nodes if n.get("why_not")},
            restarts_left=membership.get("restarts_left"),
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Decision:
    rule: str  # drain-slow-node | gc-schedule | memory-release | advise-<kind>
    action: str  # drain | gc_schedule | memory_release | advise
    status: str  # act | refused | advise
    target: str  # a node name, "all ranks", or the rank
    at: str  # when: "next checkpoint", "step N", "next restart", "-"
    reason: str  # the finding and the trigger, in one line
    step: int | None = None  # the agreed step of a live switch
    settings: tuple[str, ...] = ()  # exact knobs (advice)
    finding: dict[str, Any] | None = None

    def to_event(self, mode: str, status: str | None = None) -> dict[str, Any]:
        return {
            "kind": "decision", "rule": self.rule, "action": self.action, "status": status or self.status,
            "target": self.target, "at": self.at, "step": self.step, "mode": mode, "reason": self.reason,
            "detail": {"settings": list(self.settings), "finding": self.finding},
        }  # fmt: skip


def drain_refusal(
    config: RemediationConfig, *, nodes: int, drains_done: int, restarts_left: int | None, why_not: str | None
) -> str | None:
    """Why a drain may not happen now (the bounds of ``drain-slow-node``), or None when it may."""
    if config.min_nodes is None:
        return "min_nodes is not set (the MIN of --nnodes MIN:MAX): the loop never drains without it"
    if nodes - 1 < config.min_nodes:
        return f"the job has {nodes} nodes and may not go below min_nodes={config.min_nodes}"
    if drains_done >= config.max_drains:
        return f"{drains_done} drain(s) already done; max_drains={config.max_drains}"
    if restarts_left is not None and restarts_left < 1:
        return "no torchrun restart left for the other nodes (raise --max-restarts)"
    if why_not:
        return f"this node cannot be drained: {why_not}"
    return None


def _events(history: Iterable[Mapping[str, Any]], **match: Any) -> list[Mapping[str, Any]]:
    return [e for e in history if all(e.get(k) == v for k, v in match.items())]


def _drains_done(history: Sequence[Mapping[str, Any]]) -> int:
    return len(_events(history, kind="drain", status="executed"))


def _drain_pending(history: Sequence[Mapping[str, Any]]) -> bool:
    """A drain was requested and the job has not acted on it (nor refused it) yet."""
    last_request = max((i for i, e in enumerate(history) if e.get("kind") == "decision"
                        and e.get("action") == "drain" and e.get("status") == "requested"), default=-1)  # fmt: skip
    if last_request < 0:
        return False
    return not any(e.get("kind") == "drain" for e in history[last_request + 1 :])


def decide(
    findings: Iterable[Finding],
    history: Sequence[Mapping[str, Any]],
    job: JobState,
    config: RemediationConfig,
) -> list[Decision]:
    """What to do now. Never acts on an unconfirmed or inactive finding; every decision is bounded and
    decided at most once (the history holds what was decided before). ``config.mode`` is the executor's
    business: the same decisions come out in dry-run, and the executor only prints them."""
    if config.mode == "off":
        return []
    found = [f for f in findings if f.confirmed and f.active]
    out: list[Decision] = []
    out += _drain_rule(found, history, job, config)
    out += _switch_rule(found, history, job, config, "gc")
    out += _switch_rule(found, history, job, config, "allocator")
    out += _advice(found, history)
    return out


def _drain_rule(found: list[Finding], history: Sequence[Mapping[str, Any]], job: JobState,
                config: RemediationConfig) -> list[Decision]:  # fmt: skip
    candidates: dict[str, list[Finding]] = {}
    for f in found:
        if f.source != "straggler" or f.kind != "node" or f.node is None:
            continue
        if (f.rank_kind or "compute") not in config.drain_kinds:
            continue
        if f.confirmed_step is None or f.last_step is None:
            continue
        if f.last_step - f.confirmed_step < config.drain_hold_windows * job.window_steps:
            continue  # confirmed, but not for long enough yet
        if f.slowdown is None or f.slowdown < 1.0 + config.drain_min_slowdown:
            continue
        if _events(history, kind="decision", action="drain", status="would", target=f.node):
            continue  # dry-run: said once
        candidates.setdefault(f.node, []).append(f)
    if not candidates or _drain_pending(history):
        return []
    last_drain = max((int(e.get("step") or 0) for e in _events(history, kind="drain", status="executed")), default=None)
    if last_drain is not None and job.step - last_drain < config.drain_cooldown_steps:
        return []
    # the slowest node first; one drain at a time
    node, fs = max(candidates.items(), key=lambda kv: max(f.slowdown or 0.0 for f in kv[1]))
    worst = max(fs, key=lambda f: f.slowdown or 0.0)
    reason = (
        f"node {node}: {len(fs)} rank(s) confirmed {worst.rank_kind or 'compute'} stragglers, "
        f"{worst.slowdown:.2f}x the median since step {worst.confirmed_step}, still at step {worst.last_step}"
    )
    why = drain_refusal(
        config,
        nodes=len(job.nodes),
        drains_done=_drains_done(history),
        restarts_left=job.restarts_left,
        why_not=job.undrainable.get(node) if node in job.nodes else f"{node} is not in this round of the job",
    )
    finding = dataclasses.asdict(worst)
    if why is not None:
        if any(e.get("rule") == "drain-slow-node" and e.get("target") == node and e.get("status") == "refused"
               and ((e.get("detail") or {}).get("finding") or {}).get("why") == why for e in history):  # fmt: skip
            return []  # refused for this reason already; say it once
        return [Decision("drain-slow-node", "drain", "refused", node, "-", f"{reason}; refused: {why}",
                         finding={**finding, "why": why})]  # fmt: skip
    return [Decision("drain-slow-node", "drain", "act", node, "next checkpoint", reason, finding=finding)]


def _switch_rule(found: list[Finding], history: Sequence[Mapping[str, Any]], job: JobState,
                 config: RemediationConfig, cause: str) -> list[Decision]:  # fmt: skip
    rule, action = ("gc-schedule", "gc_schedule") if cause == "gc" else ("memory-release", "memory_release")
    if any(e.get("kind") == "decision" and e.get("rule") == rule and e.get("action") == action
           for e in history):  # fmt: skip
        return []  # once per run, whatever came of it
    share_min = config.gc_min_share if cause == "gc" else config.memory_min_share
    spikes_min = config.gc_min_spikes if cause == "gc" else config.memory_min_spikes
    trigger, paging = None, False
    for f in found:
        if f.source == "straggler" and cause == "gc" and (f.kind == "gc" or f.rank_kind == "gc"):
            trigger = f"rank {f.rank} is a confirmed GC straggler ({_x(f.slowdown)} the median GC time)"
            break
        if f.source == "straggler" and cause == "allocator" and f.kind == "page_faults":
            # its allocator returns and maps memory again at every step: holding freed memory ends it, and
            # the settings read at start (the CUDA allocator's, tcmalloc's) have nothing to do with it
            trigger = f"rank {f.rank} is a confirmed page-fault straggler ({_x(f.slowdown)} the median CPU time)"
            paging = True
            break
        often = f.source == "spikes" and (f.share or 0) >= share_min and (f.spikes or 0) >= spikes_min
        if often and (f.kind == cause or (cause == "allocator" and f.kind == "page_faults")):
            # page-fault spikes: memory faulted in again at some steps, which holding freed memory ends
            paging = f.kind == "page_faults"
            trigger = f"{f.kind} explains {100 * (f.share or 0):.0f} % of the time lost to spikes ({f.spikes} spikes)"
            break
    if trigger is None:
        return []
    at = job.step + config.gc_lead_steps
    what = "deterministic GC (gc.freeze, full collections every N steps on all ranks)" if cause == "gc" else \
        "scheduled memory release on all ranks"  # fmt: skip
    out = [Decision(rule, action, "act", "all ranks", f"step {at}", f"{trigger}: switch on {what}", step=at)]
    if cause == "allocator" and not paging:
        out.append(Decision("memory-release", "advise", "advise", "all ranks", "next restart",
                            "allocator settings that only take effect at start", settings=MEMORY_RESTART_SETTINGS))
    return out


def _advice(found: list[Finding], history: Sequence[Mapping[str, Any]]) -> list[Decision]:
    out = []
    for f in found:
        kind = f.rank_kind if f.kind == "node" else f.kind
        if f.source != "straggler" or kind not in ADVICE or (f.kind == "node" and kind in ("compute", "host", "launch")):
            continue  # a slow node of a hardware kind is the drain rule's
        target = f"rank {f.rank}" if f.rank is not None else str(f.node)
        rule = f"advise-{kind}"
        if any(e.get("rule") == rule and e.get("target") == target for e in history) or any(
            d.rule == rule and d.target == target for d in out
        ):
            continue
        knob, why = ADVICE[kind]
        out.append(Decision(rule, "advise", "advise", target, "-",
                            f"{target} ({f.node}): {why} ({_x(f.slowdown)} the median)", settings=(knob,),
                            finding=dataclasses.asdict(f)))  # fmt: skip
    return out


def _x(v: float | None) -> str:
    return "far above" if v is None else f"{v:.2f}x"

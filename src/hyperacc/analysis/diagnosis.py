"""The diagnosis document: verdict, evidence, next step, and the findings behind them.

``Diagnosis.to_dict()`` is what ``hyperacc analyze --json`` prints; its schema is documented in
docs/detection.md ("The diagnosis document") and shared with the presentation layer (report, export).
Keys are only ever added, never renamed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from hyperacc.analysis.projection import headline, percent

SCHEMA_VERSION = 1

# What to do about each kind of straggler and each spike cause (docs/detection.md, "Next steps").
ADVICE: dict[str, str] = {
    "compute": "check that rank's device and host (clocks, thermals, other processes); drain it if it stays slow",
    "data": "make the input path steady: more loader workers, prefetch, readahead for the storage "
    "(docs/data.md)",
    "launch": "the host is slow to launch work: bind ranks to cores (`hyperacc affinity`), check CPU "
    "frequency and other load on that node",
    "gc": "make garbage collection deterministic: gc.freeze() after set-up and collect every N steps on "
    "all ranks at once (hyperacc stabilizers)",
    "host": "another process takes that rank's cores: bind ranks to cores (`hyperacc affinity`) and keep "
    "other work off the node",
    "node": "the whole node is slow: run a pre-flight check on it and drain it from the job",
    "allocator": "the CUDA caching allocator stalls: set PYTORCH_ALLOC_CONF=expandable_segments:True and "
    "release memory at a fixed step (hyperacc stabilizers)",
    "communication": "the collective itself was slow: check the network (links, NCCL settings); pacing "
    "can reduce arrival spread (docs/pacing.md)",
    "compute_spike": "compute spikes with no coinciding signal: sample a window with torch.profiler on that "
    "rank to see which kernels grew",
    "unknown": "no recorded signal explains these spikes: trace a window with torch.profiler on the worst "
    "rank, and check for host-wide events at those steps",
}


@dataclasses.dataclass
class Diagnosis:
    run_dir: str
    world_size: int
    nodes: int
    steps: int
    missing_ranks: list[int]
    stragglers: list[dict[str, Any]]
    spikes: dict[str, Any]
    causes: list[dict[str, Any]]
    projection: dict[str, Any]
    verdict: str = ""
    evidence: list[str] = dataclasses.field(default_factory=list)
    next_step: list[str] = dataclasses.field(default_factory=list)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    ranks_analyzed: int = 0
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        """The document ``analyze --json`` prints: plain JSON types, no NaN (unknown values are None)."""
        return _plain(
            {
                "schema_version": self.schema_version,
                "run_dir": self.run_dir,
                "world_size": self.world_size,
                "nodes": self.nodes,
                "steps": self.steps,
                "ranks_analyzed": self.ranks_analyzed,
                "missing_ranks": list(self.missing_ranks),
                "verdict": self.verdict,
                "evidence": list(self.evidence),
                "next_step": list(self.next_step),
                "stragglers": [dict(s) for s in self.stragglers],
                "spikes": self.spikes,
                "causes": [dict(c) for c in self.causes],
                "projection": self.projection,
                "options": dict(self.options),
                "docs": "docs/detection.md",
            }
        )


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    return value


def explain(d: Diagnosis, spike_verdict_rate: float = 0.01) -> None:
    """Fill ``verdict``, ``evidence`` and ``next_step`` from the findings (pure; rules in the docs)."""
    evidence: list[str] = []
    steps: list[str] = []
    cluster = d.spikes.get("cluster", {})
    rate = float(cluster.get("rate", 0.0))
    top_cause = d.causes[0]["cause"] if d.causes else None

    nodes_bad = sorted({s["node"] for s in d.stragglers if s["kind"] == "node"})
    ranks_bad = [s for s in d.stragglers if s["kind"] != "node"]
    if d.stragglers:
        parts = []
        for node in nodes_bad:
            members = [s for s in d.stragglers if s["node"] == node]
            size = sum(1 for r in d.spikes.get("per_rank", []) if r["node"] == node) or len(members)
            parts.append(
                f"node {node} is slow ({len(members)} of its {size} ranks are stragglers, "
                f"{_ratio(_median([m['self_slowdown'] or m['slowdown'] for m in members]))} since step "
                f"{min(m['since_step'] for m in members)})"
            )
        for s in ranks_bad[:3]:
            if s["active"]:
                parts.append(
                    f"rank {s['rank']} (node {s['node']}) is a persistent {s['kind']} straggler "
                    f"({_metric(s['metric'])} {_ratio(s['slowdown'])} since step {s['since_step']})"
                )
            else:
                parts.append(
                    f"rank {s['rank']} (node {s['node']}) was a {s['kind']} straggler from step "
                    f"{s['since_step']} to {s['until_step']} ({_metric(s['metric'])} {_ratio(s['slowdown'])})"
                )
        if len(ranks_bad) > 3:
            parts.append(f"{len(ranks_bad) - 3} more ranks are stragglers")
        active = [s for s in d.stragglers if s["active"]]
        verdict = _sentence("; ".join(parts))
        if active:
            verdict += (
                " The other ranks wait for " + ("it" if len(active) == 1 else "them") + " in every step."
            )
        if rate >= spike_verdict_rate and top_cause:
            verdict += f" Separately, {percent(rate)} of steps spiked, mostly from {top_cause}."
    elif rate >= spike_verdict_rate and cluster.get("spike_steps", 0):
        verdict = f"No straggler, but {percent(rate)} of steps spiked on at least one rank" + (
            f", mostly from {top_cause} ({percent(d.causes[0]['share'])} of the time lost)."
            if top_cause
            else "."
        )
    elif cluster.get("spike_steps", 0):
        verdict = f"Steady: no straggler, and only {percent(rate)} of steps spiked."
    elif not cluster.get("steps"):
        verdict = "Nothing to judge yet: every recorded step falls in the warm-up."
    else:
        verdict = f"Steady: no straggler and no spike in {cluster.get('steps', d.steps)} steps."
    if d.ranks_analyzed < d.options.get("min_ranks", 4) and verdict.startswith("Steady"):
        spiked = f"{percent(rate)} of steps spiked" if cluster.get("spike_steps") else "no spike"
        verdict = (
            f"Steady: {spiked} in {cluster['steps']} steps "
            f"(stragglers are not judged with {d.ranks_analyzed} rank(s))."
        )

    for s in d.stragglers[:10]:
        until = "" if s["active"] else f", last seen at step {s['until_step']}"
        line = (
            f"rank {s['rank']} (node {s['node']}): {_metric(s['metric'])} {_ratio(s['slowdown'])} the cluster "
            f"median in {s['windows_flagged']} of {s['windows_seen']} windows, since step {s['since_step']} "
            f"(confirmed at step {s['confirmed_step']}{until})"
        )
        if _culprit(s):
            line += (
                f"; it waits {_ms(s['comm_wait_ns'])} in the collective against {_ms(s['cluster_comm_wait_ns'])} "
                "for the median rank: it is the culprit, the others are victims"
            )
        evidence.append(line)
    for node in nodes_bad:
        members = [s["rank"] for s in d.stragglers if s["node"] == node]
        evidence.append(
            f"node {node}: ranks {members} are all slow, so the node is the problem, not one device"
        )
    if cluster:
        evidence.append(
            f"{cluster.get('spike_steps', 0)} of {cluster.get('steps', 0)} steps ({percent(rate)}) had a spike "
            "on at least one rank"
        )
    per_rank = sorted(d.spikes.get("per_rank", []), key=lambda r: -r["rate"])
    for r in [r for r in per_rank if r["spikes"]][:3]:
        line = (
            f"rank {r['rank']} (node {r['node']}): {r['spikes']} spikes in {r['steps']} steps, {percent(r['rate'])} "
            f"(95 % interval {percent(r['ci_low'])}-{percent(r['ci_high'])})"
        )
        main = (r.get("by_cause") or {}).get(r.get("cause") or "")
        if main:
            line += (
                f"; {r['cause']} spikes {percent(main['rate'])} "
                f"({percent(main['ci_low'])}-{percent(main['ci_high'])}), the most time lost"
            )
        evidence.append(line)
    if d.causes:
        evidence.append(
            "time lost to spikes: "
            + ", ".join(
                f"{c['cause']} {percent(c['share'])} ({_ms(c['time_lost_ns'])})" for c in d.causes[:4]
            )
        )
    min_ranks = d.options.get("min_ranks", 4)
    if d.ranks_analyzed < min_ranks:
        evidence.append(
            f"stragglers were not judged: {d.ranks_analyzed} rank(s) with records, and a robust comparison "
            f"needs at least {min_ranks}"
        )
    if cluster and not cluster.get("steps"):
        evidence.append(
            f"every recorded step falls in the warm-up (the first {d.options.get('warmup_steps', 10)} steps of "
            "each rank): nothing was judged"
        )
    line = headline(d.projection)
    if line and cluster.get("spike_steps", 0):
        evidence.append(line)
    if d.missing_ranks:
        evidence.append(
            f"ranks {_ranks(d.missing_ranks)} wrote no step records (world size {d.world_size}); they are not "
            "judged, and missing data never counts as a fast rank"
        )

    seen: set[str] = set()
    for node in nodes_bad:
        steps.append(f"node {node}: {ADVICE['node']}")
        seen.add("node")
    for s in ranks_bad[:5]:
        steps.append(f"rank {s['rank']}: {ADVICE[s['kind']]}")
    if not d.stragglers or rate >= spike_verdict_rate:
        for c in d.causes[:2]:
            if c["share"] < 0.2 and steps:
                continue
            key = "compute_spike" if c["cause"] == "compute" else c["cause"]
            if key not in seen:
                steps.append(f"{c['cause']} spikes: {ADVICE[key]}")
                seen.add(key)
    if not steps:
        steps.append("nothing to fix; keep tracing to catch regressions")
    d.verdict, d.evidence, d.next_step = verdict, evidence, steps


def _culprit(s: dict[str, Any]) -> bool:
    """The straggler waits less in the collective than the median rank: the others wait for it."""
    mine, median = s.get("comm_wait_ns"), s.get("cluster_comm_wait_ns")
    return mine is not None and median is not None and mine < median


def _sentence(text: str) -> str:
    return (text[:1].upper() + text[1:] + ".") if text else text


def _metric(metric: str) -> str:
    return {
        "self_ns": "self-time",
        "data_ns": "data wait",
        "launch_ns": "launch latency",
        "gc_ns": "GC time",
    }.get(metric, metric)


def _ratio(x: float | None) -> str:
    return "far above" if x is None else f"{x:.2f}x"


def _median(values: list[float | None]) -> float | None:
    vals = sorted(v for v in values if v is not None)
    return vals[len(vals) // 2] if vals else None


def _ms(ns: float) -> str:
    ms = ns / 1e6
    return f"{ms:.3g} ms" if ms < 1000 else f"{ms / 1000:.3g} s"


def _ranks(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 12 else f"{ranks[:12]} and {len(ranks) - 12} more"

"""The diagnosis document: verdict, evidence, next step, and the findings behind them.

``Diagnosis.to_dict()`` is what ``hyperacc analyze --json`` prints; its schema is documented in
docs/detection.md ("The diagnosis document") and shared with the presentation layer (report, export).
Keys are only ever added, never renamed.

Why this module is over 500 lines: the words of every finding (stragglers, episodes, causes, spikes,
projection) are here and nowhere else, so that a kind is worded once for the text, the JSON and the
report.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from hyperacc.analysis.options import METRIC_WORD, DetectionOptions
from hyperacc.analysis.projection import headline, percent
from hyperacc.stats import median

SCHEMA_VERSION = 1

# Where the input gap of a loop without a DataLoader lies: the time outside the timed phases before the
# step's last backward began (trace/step_clock.py), so also the time between a forward and its backward,
# where a nanoGPT-style loop reads its next batch (docs/detection.md, "The work between steps").
GAP_WHERE = (
    "outside its forward, backward and optimizer step (between `optimizer.step()` and the next forward, "
    "or between a forward and its backward)"
)

# What to do about each kind of straggler and each spike cause (docs/detection.md, "Next steps").
ADVICE: dict[str, str] = {
    "compute": "that rank does more work per step, or the same work runs slower on its cores: look for uneven "
    "work (larger inputs, a code path only it takes), then check its host for other processes sharing its "
    "cores (`top`, `hyperacc affinity`) and its device and host clocks and thermals; drain it if it stays slow",
    "compute_or_host": "check that rank's host for other processes taking its cores (`top`, `hyperacc affinity`) "
    "and its device (clocks, thermals); drain it if it stays slow",
    "data": "make the input path steady: more loader workers, prefetch, readahead for the storage "
    "(docs/data.md)",
    "data_between": f"that rank waits off its CPU for its next batch (no DataLoader) {GAP_WHERE}: sample its "
    "stacks while it is slow (`py-spy dump --pid PID`) to see the read or lock, and fetch the next batch "
    "ahead (a background thread, or a DataLoader with workers; readahead for the storage, docs/data.md)",
    "launch": "the host is slow to launch work: bind ranks to cores (`hyperacc affinity`), check CPU "
    "frequency and other load on that node",
    "gc": "make garbage collection deterministic: gc.freeze() after set-up and collect every N steps on "
    "all ranks at once (hyperacc stabilizers)",
    "host": "another process takes that rank's cores: bind ranks to cores (`hyperacc affinity`) and keep "
    "other work off the node",
    "host_work": f"that rank does CPU work of its own between steps, {GAP_WHERE}: profile that code on that "
    "rank (py-spy, torch.profiler), and move or spread what it does there (logging, metrics, Python objects "
    "built per step)",
    "blocked": "that rank waited off its CPU (a read, a lock, a sleep): sample its stacks while it is slow "
    "(`py-spy dump --pid PID`) to see what it waits on, and check its storage and network",
    "page_faults": "its allocator hands memory back to the kernel and takes it again, so the kernel faults "
    "in and zeroes fresh pages at every step (glibc does this by default to some blocks, depending on "
    "where they lie): hold freed memory (`hyperacc run --stabilize 1`, docs/stabilizers.md \"Deterministic "
    "memory release\"), or set MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_, or preload tcmalloc (a memory-mapped "
    "dataset read for the first time faults too: check whether that rank reads more of it)",
    # spikes of that kind (attribution._paging): at some steps, not every step
    "page_faults_spike": "the kernel faulted in and zeroed fresh memory pages at those steps: a large buffer made "
    "anew each time (a new tensor or array where one could be kept and reused), or memory its allocator handed "
    "back and takes again: reuse the buffer, hold freed memory (`hyperacc run --stabilize 1`, docs/stabilizers.md "
    "\"Deterministic memory release\"), or preload tcmalloc",
    "node": "the whole node is slow: run a pre-flight check on it and drain it from the job",
    "allocator": "the CUDA caching allocator stalls: set PYTORCH_ALLOC_CONF=expandable_segments:True and "
    "release memory at a fixed step (hyperacc stabilizers)",
    "communication": "the collective itself was slow: check the network (links, NCCL settings); pacing "
    "can reduce arrival spread (docs/pacing.md)",
    # the same cause where every rank is on one node: no network between them
    "communication_one_node": "the collective itself was slow, and every rank is on one node, so no network "
    "link was involved: the ranks' transfers go through the host (shared memory, NVLink, PCIe), and on a "
    "busy host the collective's own threads wait for a CPU (gloo); keep other work off the node, and "
    "`hyperacc doctor` measures its transfers between ranks",
    "compute_spike": "compute spikes with no coinciding signal: sample a window with torch.profiler on that "
    "rank to see which kernels grew",
    "unknown": "no recorded signal explains these spikes: trace a window with torch.profiler on the worst "
    "rank, and check for host-wide events at those steps",
    # spikes that recur every N steps (analysis.periods): work the loop does on a fixed period
    "periodic": "they recur on a fixed period of steps, so they are work the loop does every so many steps "
    "on that rank (a checkpoint save, an evaluation, logging, a metric gathered or printed): make it "
    "asynchronous (torch.distributed.checkpoint's async_save, logging from a background thread), spread it "
    "over the ranks, or do it less often",
    # the same for input waits: a DataLoader's workers hand out batches in turn
    "periodic_data": "the input stalls on a fixed period of steps: a DataLoader's workers hand out the batches "
    "in turn, so one slow worker (its files, its disk, its CPU) stalls every N-th step where N is num_workers; "
    "otherwise a new file or shard is opened every so many batches, or the loop's own periodic work runs before "
    "the next batch (an evaluation over its own DataLoader, whose workers start again at each evaluation unless "
    "persistent_workers=True): compare the period with num_workers and with the evaluation interval, and "
    "prefetch across the boundary",
    # a slowdown of the whole job (analysis.slowdowns), by what its ranks did more
    "slow_preempted": "another process took those ranks' CPUs over those steps (they were ready to run and "
    "waited for a core): find what ran then (other jobs on the node, a log shipper, a checkpoint upload, "
    "`top`), bind ranks to cores (`hyperacc affinity`) and keep other work off the node",
    "slow_communication": "every rank waited longer in the collective with no slower rank to wait for: the "
    "collective itself slowed (the network, or other jobs sharing its links; on one node, the host's "
    "transfers and the collective's threads); `hyperacc doctor` measures the links between ranks",
    "slow_in_turn": "the ranks took turns to be the last to arrive, each slow at some steps only: something on "
    "the node slowed one rank at a time (other processes moving between cores, interrupts, a loader's workers "
    "waking): keep other work off the node and bind ranks to cores (`hyperacc affinity`)",
    "slow_compute": "the work per step grew (longer inputs, a new phase of training) or the same work ran "
    "slower (CPU or device clocks, thermals): compare the inputs of those steps, and the node's clocks",
    "periodic_job": "work the whole job does on a fixed period of steps, on every rank alike (an evaluation, a "
    "checkpoint, logging, a metric gathered from all ranks): do it less often or asynchronously, or count it "
    "as the price of that work; it is not a rank's fault",
    # one spike that lost most of the time spikes lost (analysis.run_dir._stalls)
    "stall": "one stall of that rank, not a rate: find what its training thread did at that moment (its own "
    "logs and the node's at that time: a blocking read on a shared file system, a lock, a checkpoint or a log "
    "flush, a sleep); `py-spy dump` of a rank caught in the next one shows where it waits",
    # the same when the ranks waited for their input at those steps
    "periodic_job_data": "every rank waits for its input at once on a fixed period of steps: a DataLoader whose "
    "iterator is made again at each pass over it (persistent_workers=False: the training loader each epoch, an "
    "evaluation's loader each evaluation) starts its worker processes again and fills its prefetch from nothing: "
    "compare the period with the epoch's length and the evaluation interval in steps, and keep the workers "
    "(persistent_workers=True; Hugging Face's dataloader_persistent_workers); otherwise every rank opens a new "
    "file or shard every so many batches: prefetch across that boundary",
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
    rank_causes: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # analysis.excess
    episodes: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # stragglers that recovered
    slowdowns: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # analysis.slowdowns: the job's
    windows_judged: int = 0  # windows in which the straggler rules could compare enough ranks
    steps_per_rank: int = 0  # the most steps any rank recorded (warm-up included)
    coordination: dict[str, Any] = dataclasses.field(default_factory=dict)  # analysis.coordination
    resources: dict[str, Any] = dataclasses.field(default_factory=dict)  # analysis.resources
    what_if: dict[str, Any] | None = None  # analysis.whatif: the job time each culprit cost
    stalls: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # one spike that lost most time

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
                "rank_causes": [dict(e) for e in self.rank_causes],
                "episodes": [dict(e) for e in self.episodes],
                "slowdowns": [dict(s) for s in self.slowdowns],
                "stalls": [dict(s) for s in self.stalls],
                "windows_judged": self.windows_judged,
                "steps_per_rank": self.steps_per_rank,
                "coordination": self.coordination,
                "resources": self.resources,
                "what_if": self.what_if,
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
    opts = d.options or {}
    min_ranks = opts.get("min_ranks", DetectionOptions().min_ranks)
    job_period = cluster.get("period")

    nodes_bad = sorted({s["node"] for s in d.stragglers if s["kind"] == "node"})
    ranks_bad = [s for s in d.stragglers if s["kind"] != "node"]
    sentences: list[str] = []
    if d.stragglers:
        parts = []
        for node in nodes_bad:
            members = [s for s in d.stragglers if s["node"] == node]
            size = sum(1 for r in d.spikes.get("per_rank", []) if r["node"] == node) or len(members)
            word = _metric(members[0]["metric"])
            versus = (
                f"{_ratio(members[0]['node_ratio'])} the other nodes'"
                if members[0].get("node_ratio") is not None
                else f"{_ratio(median([m['self_slowdown'] or m['slowdown'] for m in members]))} the cluster median"
            )
            parts.append(
                f"node {node} is slow ({len(members)} of its {size} ranks, {word} {versus} "
                f"since step {min(m['since_step'] for m in members)})"
            )
        for s in ranks_bad[:3]:
            parts.append(_straggler_phrase(s))
        if len(ranks_bad) > 3:
            more = len(ranks_bad) - 3
            parts.append(f"{more} more rank{'s are stragglers' if more > 1 else ' is a straggler'}")
        sentences.append(_sentence("; ".join(parts)))
        waited = [s for s in d.stragglers if s["active"] and _culprit_share(s) is not None]
        if waited and len(waited) == len([s for s in d.stragglers if s["active"]]):
            share = median([_culprit_share(s) for s in waited])
            chance = median([s.get("culprit_expected") for s in waited])
            who = "it" if len(waited) == 1 else "one of them"
            sentences.append(
                f"The other ranks waited for {who} in {percent(share)} of the flagged steps "
                f"({percent(chance)} by chance)."
            )
    if d.episodes:
        width = opts.get("window_steps", DetectionOptions().window_steps)
        sentences.append(_sentence("; ".join(episode_phrase(e, width) for e in costliest(d.episodes, 3))))
        if len(d.episodes) > 3:
            more = len(d.episodes) - 3
            sentences.append(f"{more} more episode{'s are' if more > 1 else ' is'} in the evidence.")
    too_short = (
        not d.stragglers and not d.episodes and d.ranks_analyzed >= min_ranks
        and d.windows_judged < opts.get("persist_k", 3)
    )
    if too_short:
        sentences.append(_too_short(d))
    slowdowns = [s for s in d.slowdowns if s.get("job_time_lost_ns")]
    if slowdowns:
        sentences.append(_sentence("; ".join(slowdown_phrase(s) for s in costliest(slowdowns, 2))))
    excess = d.rank_causes or []
    if excess:
        sentences.append(_sentence("; ".join(excess_phrase(e) for e in excess[:3])))
    for stall in d.stalls:  # its cost is the what-if's sentence below, where there is one
        sentences.append(_sentence(stall_phrase(stall, cost=not d.what_if)))
    if not cluster.get("steps") and not d.stragglers:
        verdict = "Nothing to judge yet: " + _nothing_judged(d) + "." + (" " + _too_short(d) if too_short else "")
    elif d.stragglers or excess or too_short or d.episodes or slowdowns or d.stalls:
        if not d.stragglers and not too_short and d.ranks_analyzed >= min_ranks:
            # "at the end" only where a rank was slow for a while before (an episode): said of a rank's
            # own excess or a slowdown of the whole job, it read as if some straggler had recovered
            sentences.insert(0, "No straggler at the end of the run." if d.episodes else "No straggler.")
        if rate >= spike_verdict_rate and top_cause:
            sentences.append(f"Separately, {percent(rate)} of steps spiked on some rank, mostly from {top_cause}.")
        sentences += what_if_sentences(d.what_if)
        verdict = " ".join(sentences)
    elif rate >= spike_verdict_rate and cluster.get("spike_steps", 0):
        verdict = f"No straggler, but {percent(rate)} of steps spiked on at least one rank" + (
            f", mostly from {top_cause} ({percent(d.causes[0]['share'])} of the time lost), "
            # with the job's period below, not all of it is a random floor
            + ("shared by the ranks (no rank stands out)." if job_period else "a floor the ranks share (no rank stands out).")
            if top_cause
            else "."
        )
    elif cluster.get("spike_steps", 0):
        verdict = f"Steady: no straggler, and only {percent(rate)} of steps spiked."
    else:
        verdict = f"Steady: no straggler and no spike in {cluster.get('steps', d.steps)} steps."
    if d.ranks_analyzed < min_ranks and verdict.startswith("Steady"):
        spiked = f"{percent(rate)} of steps spiked" if cluster.get("spike_steps") else "no spike"
        verdict = (
            f"Steady: {spiked} in {cluster['steps']} steps "
            f"(stragglers are not judged with {d.ranks_analyzed} rank(s))."
        )

    if job_period and cluster.get("spike_steps", 0):
        verdict += " " + _sentence(_job_period_phrase(job_period))
    for e in d.episodes[:10]:
        if e.get("rule") == "change_point":
            evidence.append(_episode_evidence(e))
    evidence += [_slowdown_evidence(s) for s in slowdowns[:5]]
    evidence += [f"{stall_phrase(s)}; {percent(s['spike_share'])} of the time all spikes lost" for s in d.stalls]
    for s in (d.stragglers + [e for e in d.episodes if e.get("rule") != "change_point"])[:10]:
        until = "" if s["active"] else f", last seen at step {s['until_step']}"
        line = (
            f"rank {s['rank']} (node {s['node']}): {metric_phrase(s)} {_ratio(s['slowdown'])} the cluster "
            f"median in {s['windows_flagged']} of {s['windows_seen']} windows, since step {s['since_step']} "
            f"(confirmed at step {s['confirmed_step']} by {_RULE.get(s.get('rule', 'outlier'), 'the outlier rule')}"
            f"{until})"
        )
        share = _culprit_share(s)
        if share is not None:
            line += (
                f"; it waited least in the collective in {s['culprit_steps']} of {s['culprit_known']} steps of those "
                f"windows ({percent(share)}, {percent(s['culprit_expected'])} by chance)"
            )
        elif _culprit(s):
            line += (
                f"; it waits {_ms(s['comm_wait_ns'])} in the collective against {_ms(s['cluster_comm_wait_ns'])} "
                "for the median rank: it is the culprit, the others are victims"
            )
        basis = basis_phrase(s)
        if basis:
            line += f"; {basis}"
        evidence.append(line)
    for node in nodes_bad:
        members = [s for s in d.stragglers if s["node"] == node]
        line = (
            f"node {node}: ranks {[s['rank'] for s in members]} are all slower than every other rank, by more than "
            "the spread within nodes, so the node is the problem, not one device"
        )
        now, base = members[0].get("node_ratio"), members[0].get("node_baseline_ratio")
        if now is not None and base is not None:
            line += (
                f"; its {_metric(members[0]['metric'])} is {now:.2f}x the other nodes', and was {base:.2f}x in "
                "its first windows"
            )
            if base >= 1.0 + opts.get("min_slowdown", 0.05):
                line += " (slow from the start: a slower machine, or a fault present from the start)"
            else:
                line += f" (it became slow at step {min(s['since_step'] for s in members)})"
        evidence.append(line)
    for e in excess[:5]:
        evidence.append(
            f"rank {e['rank']} (node {e['node']}): {e['spikes']} {e['cause']} spikes in {e['steps']} steps "
            f"({percent(e['rate'])}) against {percent(e['others_rate'])} on the other ranks, "
            f"{_ms(e['mean_excess_ns'])} each, {_ms(e['time_lost_ns'])} lost (p = {e['p_value']:.1g})"
            + (f"; {period_phrase(e['period'])}" if e.get("period") else "")
            + ("; the collector's own cadence, where the loop allocates alike every step" if e.get("period") and e["cause"] == "gc" else "")
        )
    if cluster:
        evidence.append(
            f"{cluster.get('spike_steps', 0)} of {cluster.get('steps', 0)} steps ({percent(rate)}) had a spike "
            "on at least one rank"
        )
    if job_period:
        evidence.append(_job_period_phrase(job_period))
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
    if d.ranks_analyzed < min_ranks:
        evidence.append(
            f"stragglers were not judged: {d.ranks_analyzed} rank(s) with records, and a robust comparison "
            f"needs at least {min_ranks}"
        )
    elif too_short:
        evidence.append(_too_short(d, detail=True))
    if cluster and not cluster.get("steps"):
        evidence.append(_nothing_judged(d) + ": nothing was judged")
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
        key = _advice_key(s)
        steps.append(f"rank {s['rank']}: {ADVICE[key]}")
        if key == "host_work" and _gc_excess(s) >= opts.get("floor_ns", 200_000):
            steps.append(f"rank {s['rank']}: its GC between steps: {ADVICE['gc']}")
    for e in costliest(d.episodes, 3):
        key = _advice_key(e)
        if not any(s["rank"] == e["rank"] for s in ranks_bad[:5]):
            steps.append(f"rank {e['rank']}, steps {e['since_step']}-{e['until_step']}: {ADVICE[key]}")
    for s in costliest(slowdowns, 2):
        key = _SLOW_ADVICE.get(s["kind"], s["kind"])
        steps.append(f"the job's steps {s['since_step']}-{s['until_step']}: {ADVICE[key]}")
    for s in d.stalls:
        steps.append(f"rank {s['rank']}, step {s['step']}: {ADVICE['stall']}")
    for e in excess[:3]:
        key = _SPIKE_ADVICE.get(e["cause"], e["cause"])
        if e.get("period") and e["cause"] != "gc":  # a collector's cadence is not the loop's work: GC's advice
            periodic = ADVICE["periodic_data" if e["cause"] == "data" else "periodic"]
            steps.append(f"rank {e['rank']}, {e['cause']} spikes every {e['period']['every']} steps: {periodic}")
        if any(s["rank"] == e["rank"] and s["kind"] == key for s in ranks_bad[:5]):
            continue  # the straggler's advice already says it
        steps.append(f"rank {e['rank']}, {e['cause']} spikes: {ADVICE[key]}")
        seen.add(key)
    if job_period:
        # every rank's collector on one cadence: GC's advice; every rank's input at once: the input's
        advice = ADVICE[_JOB_PERIOD_ADVICE.get(tuple(job_period.get("causes") or ()), "periodic_job")]
        steps.append(f"spikes every {job_period['every']} steps on most ranks at once: {advice}")
    if too_short:
        steps.append(_too_short_advice(d))
    if not d.stragglers or rate >= spike_verdict_rate:
        stalled = {s["cause"]: s["excess_ns"] for s in d.stalls}
        for c in d.causes[:2]:
            if c["share"] < 0.2 and steps:
                continue
            if stalled.get(c["cause"], 0) >= opts.get("explain_share", 0.5) * c["time_lost_ns"]:
                continue  # the stall is most of that cause's time: its own advice above says what to do
            key = _SPIKE_ADVICE.get(c["cause"], c["cause"])
            if key == "communication" and d.nodes == 1:
                key = "communication_one_node"
            if key not in seen:
                steps.append(f"{c['cause']} spikes: {ADVICE[key]}")
                seen.add(key)
    if not steps:
        steps.append("nothing to fix; keep tracing to catch regressions")
    d.verdict, d.evidence, d.next_step = verdict, evidence, steps


def what_if_sentences(w: dict[str, Any] | None, most: int = 3) -> list[str]:
    """"Without rank 2's steps 120-179 the job would have taken 9.45 s instead of 10.5 s (-10 %)", for
    the culprits that cost most, and all of them together (docs/detection.md, "What-if")."""
    rows = sorted((c for c in (w or {}).get("culprits", []) if c["saved_ns"] > 0), key=lambda c: -c["saved_ns"])
    if not rows:
        return []
    job = w["job_ns"] / 1e9

    def cost(saved: dict[str, Any]) -> str:
        without, share = f"{saved['job_ns_without'] / 1e9:.3g}", percent(saved["saved_frac"])
        if without == f"{job:.3g}":  # a saving under the figures' last digit: say the saving itself
            return f"{_ms(saved['saved_ns'])} less than its {job:.3g} s (-{share})"
        return f"{without} s instead of {job:.3g} s (-{share})"

    out = [f"Without {_culprit_words(c)} the job would have taken {cost(c)}." for c in rows[:most]]
    if len(w["culprits"]) > 1:
        n = len(w["culprits"])
        out.append(f"Without {'both' if n == 2 else f'all {n}'} culprits together: {cost(w['all'])}.")
    return out


def _culprit_words(c: dict[str, Any]) -> str:
    if c["what"] == "stall":
        return f"rank {c['rank']}'s stall at step {c['since_step']}"
    if c["what"] == "spikes":
        return f"rank {c['rank']}'s {c['cause']} spikes"
    if c["what"] == "straggler":
        return f"rank {c['rank']}'s slowness since step {c['since_step']}"
    return f"rank {c['rank']}'s steps {c['since_step']}-{c['until_step']}"


def costliest(episodes: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """The ``n`` episodes that cost the job most (``job_time_lost_ns``), costliest first: the verdict and
    the next steps name these, so a short one the host made never pushes out a fault that cost seconds."""
    return sorted(episodes, key=lambda e: -(e.get("job_time_lost_ns") or 0.0))[:n]


def episode_phrase(e: dict[str, Any], window_steps: int | None = None) -> str:
    """"Rank 2 (node 0) was slow from step 120 to 179 (...), then recovered" (docs/detection.md, "Episodes").
    A straggler of the window rules that recovered (``windows_flagged``) and was flagged in fewer of the
    ``window_steps`` windows over its range than they hold was slow on and off, and is said so."""
    kind = _KIND_WORD.get(e["kind"], e["kind"])
    ratio, versus = _ratio(e["slowdown"]), "the cluster median"
    if e["kind"] == "node" and e.get("node_ratio") is not None:  # half the ranks slow move the median itself
        ratio, versus = _ratio(e["node_ratio"]), "the other nodes'"
    what = f"{_metric(e['metric']) if e['metric'] != 'cpu_ns' else 'self-time'} {ratio} {versus}"
    lost = e.get("job_time_lost_ns")
    cost = f", {lost / 1e9:.3g} s of job time lost" if lost else ""
    if e.get("gc_ns") is not None:
        what += f", {_ms(e['gc_ns'])} of GC per step"
    who = f"rank {e['rank']} (node {e['node']})"
    if e["active"]:
        return f"{who} is slow since step {e['since_step']} ({kind}: {what}{cost}), still at the end"
    flagged = e.get("windows_flagged")
    if window_steps and flagged is not None:
        held = -(-(e["until_step"] - e["since_step"] + 1) // window_steps)  # the windows over its range
        if flagged < held:
            return (f"{who} was slow on and off over steps {e['since_step']}-{e['until_step']} (in {flagged} of its "
                    f"{held} windows; {kind}: {what}{cost}), and not in most of its last ones")  # fmt: skip
    return f"{who} was slow from step {e['since_step']} to {e['until_step']} ({kind}: {what}{cost}), then recovered"


# a slowdown's kind (analysis.slowdowns) and the advice that says what to do about it
_SLOW_ADVICE = {"preempted": "slow_preempted", "communication": "slow_communication", "compute": "slow_compute",
                "host": "blocked", "compute_or_host": "compute_or_host", "unknown": "unknown",
                "in_turn": "slow_in_turn"}  # fmt: skip
_SLOW_WORDS = {
    "preempted": ("waited for a CPU", "run-queue delay"),
    "compute": ("computed more", "CPU time"),
    "data": ("waited for input", "input wait"),
    "gc": ("collected garbage", "GC time"),
    "host": ("waited off the CPU", ""),
    "compute_or_host": ("computed more and waited for a CPU", ""),
    "unknown": ("slowed, with no recorded signal to say why", ""),
}


_TURN_WORDS = {"preempted": "waiting for a CPU", "compute": "computing more", "data": "waiting for input",
               "gc": "collecting garbage"}  # what ranks slow by turns did (``Slowdown.turns_of``)


def slowdown_who(s: dict[str, Any]) -> str:
    """Whom the job waited for over a slowdown, and what they did more: "ranks [1, 3] waited for a CPU
    (run-queue delay +24 ms a step)"."""
    if s["kind"] == "communication":
        return "every rank waited longer in the collective, with no slower rank to wait for"
    if s["kind"] == "in_turn" and s.get("turns_of") in _TURN_WORDS and s.get("cause_rise_ns") is not None:
        what, column = _TURN_WORDS[s["turns_of"]], _SLOW_WORDS[s["turns_of"]][1]
        return (f"the ranks took turns to be the slow one, {what} ({column} +{_ms(s['cause_rise_ns'])} a step on the "
                "median rank; none slowed throughout, and the collective itself did not)")  # fmt: skip
    if s["kind"] == "in_turn":
        return "the ranks took turns to be the slow one (none slowed throughout, and the collective itself did not)"
    if not s["ranks"]:
        return "no recorded signal says which rank or why"
    who = "every rank" if s["shared"] else f"ranks {_ranks(s['ranks'])}" if len(s["ranks"]) > 1 else f"rank {s['ranks'][0]}"
    if s.get("nodes"):  # every rank of those nodes and no other: the node's, not one device's
        nodes = s["nodes"]
        who = (f"node {nodes[0]}'s ranks" if len(nodes) == 1 else f"the ranks of nodes {_ranks(nodes)}") + f" ({_ranks(s['ranks'])})"
    what, column = _SLOW_WORDS.get(s["kind"], (s["kind"], ""))
    rise = f"self-time +{_ms(s['self_rise_ns'])} a step"
    if column and s.get("cause_rise_ns") is not None:
        rise = f"{column} +{_ms(s['cause_rise_ns'])} a step"
    elif s["kind"] == "compute_or_host":
        rise = f"CPU time +{_ms(s['cpu_rise_ns'] or 0.0)} and run-queue delay +{_ms(s['delay_rise_ns'] or 0.0)} a step"
    return f"{who} {what} ({rise})"


def slowdown_phrase(s: dict[str, Any]) -> str:
    """"The job's step time rose 1.60x over steps 90-149 (2.06 s lost): ranks [1, 3] waited for a CPU
    (run-queue delay +24 ms a step)" (docs/detection.md, "Slowdowns of the job")."""
    lost = f"{s['job_time_lost_ns'] / 1e9:.3g} s lost"
    if s.get("from_start"):  # no level before it: slow against the level after
        return (f"the job's step time was {_ratio(s['slowdown'])} its later level from the start (steps "
                f"{s['since_step']}-{s['until_step']}; {lost}): {slowdown_who(s)}")
    when = f"from step {s['since_step']}, still at the end" if s["active"] else f"over steps {s['since_step']}-{s['until_step']}"
    return f"the job's step time rose {_ratio(s['slowdown'])} {when} ({lost}): {slowdown_who(s)}"


def _slowdown_evidence(s: dict[str, Any]) -> str:
    went = (f"was {_ms(s['step_ns'])} from the start, against {_ms(s['baseline_ns'])} after,"
            if s.get("from_start") else f"went from {_ms(s['baseline_ns'])} to {_ms(s['step_ns'])}")
    line = (
        f"the job: its step time (the slowest rank's) {went} over "
        f"steps {s['since_step']}-{s['until_step']} ({s['steps']} steps; noise {s['noise']:.3f} per block), confirmed "
        f"at step {s['confirmed_step']} by the change-point rule on the job's own step time; "
    )
    if not s["ranks"]:
        return line + slowdown_who(s)
    return line + f"{slowdown_who(s)}, their self-time +{_ms(s['self_rise_ns'])} a step (the job's rose {_ms(s['step_ns'] - s['baseline_ns'])})"


def _episode_evidence(e: dict[str, Any]) -> str:
    channel = "CPU time" if e["metric"] == "cpu_ns" else "self-time"
    line = (
        f"rank {e['rank']} (node {e['node']}): an episode of steps {e['since_step']}-{e['until_step']} "
        f"({e['steps']} steps): its {channel} against the cluster median shifted {e['shift']:.2f}x over its own "
        f"typical ratio (noise {e['noise']:.3f} per block), confirmed at step {e['confirmed_step']} by the "
        f"change-point rule; {_ms(e['excess_ns'])} over the median per step, {_ms(e['job_time_lost_ns'])} of job time"
    )
    basis = basis_phrase(e)
    if e.get("gc_ns") is not None:  # the collector ran more over it: named (docs/detection.md, "Episodes")
        basis += f"{'; ' if basis else ''}{_ms(e['gc_ns'])} of GC per step against {_ms(e['cluster_gc_ns'])} on the median rank"
    return line + (f"; {basis}" if basis else "")


# the advice of a spike cause where it differs from the straggler kind of the same name
_SPIKE_ADVICE = {"compute": "compute_spike", "compute/host": "compute_or_host", "page_faults": "page_faults_spike"}


_RULE = {
    "outlier": "the outlier rule",
    "rank_order": "rank order",
    "culprit": "the per-step culprit record",
    "node": "the slow-node rule",
}
_EXCESS_WORDS = {
    "data": "stalls in data loading",
    "gc": "pauses in garbage collection",
    "allocator": "stalls in the CUDA allocator",
    "page_faults": "spends extra time in the kernel faulting in fresh memory pages",
    "host": "loses its CPU (preempted or blocked)",
    "compute": "has compute spikes",
    "host_work": "does CPU work of its own between steps (after `optimizer.step()`, before the next forward)",
    "unknown": "spikes with no recorded cause",
    "compute/host": "has spikes in its own work (compute or preemption: CPU time was not measured)",
}


def _straggler_phrase(s: dict[str, Any]) -> str:
    """"Persistent" only when the rank was slow in nearly every window since it started (80 %)."""
    what = f"{metric_phrase(s)} {_ratio(s['slowdown'])}"
    since = s.get("windows_since") or s["windows_seen"]
    kind = kind_word(s["kind"])
    if s["active"] and s["windows_flagged"] >= 0.8 * since:
        text = f"rank {s['rank']} (node {s['node']}) is a persistent {kind} straggler ({what} since step {s['since_step']})"
    elif s["active"]:
        text = (
            f"rank {s['rank']} (node {s['node']}) is an intermittent {kind} straggler ({what} in "
            f"{s['windows_flagged']} of {since} windows since step {s['since_step']})"
        )
    else:
        text = (
            f"rank {s['rank']} (node {s['node']}) was a {kind} straggler from step {s['since_step']} to "
            f"{s['until_step']} ({what})"
        )
    between = _between_phrase(s)
    return f"{text}: {between}" if between else text


_KIND_WORD = {"host_work": "host-work", "page_faults": "page-fault", "unknown": "unexplained"}


def kind_word(kind: str) -> str:
    """A straggler's kind as the texts print it (``host_work`` -> ``host-work``)."""
    return _KIND_WORD.get(kind, kind)


def _gc_excess(s: dict[str, Any]) -> float:
    gc, med = s.get("gc_ns"), s.get("cluster_gc_ns")
    return gc - med if gc is not None and med is not None else 0.0


def metric_phrase(s: dict[str, Any]) -> str:
    """The judged metric in words; the data wait of a loop without a DataLoader is the time between steps."""
    return "time between steps" if s.get("between_steps") and s["metric"] == "data_ns" else _metric(s["metric"])


def _between_phrase(s: dict[str, Any]) -> str:
    """Where the time between steps went (docs/detection.md, "The work between steps"), GC named."""
    if not s.get("between_steps"):
        return ""
    gc, gc_med = s.get("gc_ns"), s.get("cluster_gc_ns")
    gc_text = f"{_ms(gc)} of GC per step against {_ms(gc_med)} on the median rank" if gc is not None and gc_med is not None else ""
    if s["kind"] == "host_work" and not _gc_excess(s) > 0:
        gc_text = ""  # no more GC than the median rank's to name ("0 ms of GC per step against 0 ms")
    if s["kind"] in ("gc", "host_work"):
        what = "garbage collection" if s["kind"] == "gc" else "its own CPU work"
        text = f"{what} {GAP_WHERE}"
        return f"{text} ({gc_text})" if gc_text else text
    if s["kind"] == "unknown":
        return ("its CPU time grew by half the gap or more, but within the other ranks' spread: neither its "
                "own work nor a wait for input is shown")  # fmt: skip
    return "it waits off the CPU for its input (no DataLoader; its CPU time did not grow with the gap)"


# the same causes as nouns, for the live line that says a rank's cause is over
_EXCESS_NOUNS = {"data": "data-loading stalls", "gc": "garbage-collection pauses", "allocator": "allocator stalls",
                 "page_faults": "page-fault spikes",
                 "host": "preemptions", "compute": "compute spikes", "host_work": "spikes of its own work between steps",
                 "unknown": "unexplained spikes", "compute/host": "spikes in its own work"}  # fmt: skip


def excess_noun(cause: str) -> str:
    """"data-loading stalls": a rank-specific cause as a noun (``_EXCESS_WORDS`` says it as a verb)."""
    return _EXCESS_NOUNS.get(cause, f"{cause} spikes")


def excess_phrase(e: dict[str, Any]) -> str:
    period = e.get("period")
    return (
        f"rank {e['rank']} (node {e['node']}) {_EXCESS_WORDS.get(e['cause'], e['cause'] + ' spikes')} on "
        f"{percent(e['rate'])} of its steps ({percent(e['others_rate'])} on the other ranks), "
        f"{_ms(e['mean_excess_ns'])} each, {_ms(e['time_lost_ns'])} lost"
        + (f", every {period['every']} steps" if period else "")
    )


_PHASE_WHERE = {"data_ns": "waiting for its input", "h2d_ns": "copying its input to the device",
                "forward_ns": "in its forward", "backward_ns": "in its backward", "optimizer_ns": "in its optimizer step",
                "gc_ns": "in garbage collection", "other_ns": "outside its timed phases"}  # fmt: skip


_STALL_CAUSE = {"host": "off its CPU (preempted or blocked)", "gc": "garbage collection", "compute": "computing",
                "host_work": "its own CPU work", "allocator": "the CUDA allocator", "unknown": "no recorded cause",
                "page_faults": "the kernel faulting in fresh memory pages",
                "compute/host": "computing or preempted (CPU time was not measured)"}  # fmt: skip


def stall_phrase(s: dict[str, Any], cost: bool = True) -> str:
    """"rank 1 (node 0) stalled 8 s at step 150, outside its timed phases, off its CPU (...): the job lost
    7.97 s to it, 52 % of its 15.2 s"."""
    where = _PHASE_WHERE.get(s["phase"], s["phase"])
    cause = _STALL_CAUSE.get(s["cause"])
    lost = s.get("job_time_lost_ns")
    priced = (f"the job lost {_ms(lost)} to it, {percent(s['job_share'])} of its {_ms(s['job_ns'])}" if lost is not None
            else f"{percent(s['job_share'])} of the job's {_ms(s['job_ns'])} in one step")  # fmt: skip
    text = f"rank {s['rank']} (node {s['node']}) stalled {_ms(s['excess_ns'])} at step {s['step']}, {where}"
    return text + (f", {cause}" if cause else "") + (f": {priced}" if cost else "")


def period_phrase(p: dict[str, Any]) -> str:
    """"15 of them every 25 steps, on 15 of the 15 judged steps of that period (26, 51, ..., 376)" (analysis.periods)."""
    return (
        f"{p['repeats']} of them every {p['every']} steps, on {p['repeats']} of the {p['expected']} judged steps "
        f"of that period ({_steps_on(p)})"
    )


def _steps_on(p: dict[str, Any]) -> str:
    first, every, last = p["first"], p["every"], p["last"]
    if last - first <= 2 * every:
        return ", ".join(str(x) for x in range(first, last + 1, every))
    return f"{first}, {first + every}, ..., {last}"


def _job_period_phrase(p: dict[str, Any]) -> str:
    lost, job = p.get("lost_ns"), p.get("job_ns")
    cost = f", {_ms(lost)} of the job's {_ms(job)} ({percent(lost / job)})" if lost and job else ""
    what = _JOB_PERIOD_WORDS.get(tuple(p.get("causes") or ()), "work the job does on a fixed period of steps")
    return (
        f"more than half of the ranks spiked at once every {p['every']} steps ({_steps_on(p)}: {p['repeats']} of "
        f"the {p['expected']} judged steps of that period){cost}: {what}"
    )


# What a job's period is, by the causes its spikes recur with on most ranks (``spikes.cluster.period``).
_JOB_PERIOD_WORDS = {
    ("gc",): "GC pauses, every rank's collector on one cadence (the loop allocates alike every step)",
    ("data",): "every rank waited for its input at those steps",
}
_JOB_PERIOD_ADVICE = {("gc",): "gc", ("data",): "periodic_job_data"}


def basis_phrase(s: dict[str, Any]) -> str:
    basis, share = s.get("kind_basis"), s.get("cpu_share")
    if s.get("between_steps"):
        if basis == "off_cpu":
            return "its CPU time did not grow with the gap: it waits for input"
        if share is not None:
            return (f"its CPU time grew by {percent(max(share, 0.0))} of the excess of its time outside the timed "
                    "phases: it works, it does not wait for input")  # fmt: skip
        return ""
    if basis == "off_cpu" and s.get("rank_kind", s["kind"]) == "host":
        return ("its CPU time did not grow, nor the time it waited for a CPU, while its time outside the timed "
                "phases did: it waited off its CPU there (a read, a lock, a sleep), it was not preempted")
    if basis == "cpu_time" and share is not None:
        blocked = s.get("blocked_per_step")
        if s.get("rank_kind", s["kind"]) == "host" and blocked is not None:
            return (
                f"its CPU time grew by only {percent(max(share, 0.0))} of its extra wall time, and it blocked off "
                f"its CPU {blocked:.2g} more time(s) per step (voluntary context switches): it waited (a read, "
                "a lock, a sleep), it was not preempted"
            )
        if s.get("rank_kind", s["kind"]) == "host":
            return (
                f"its CPU time grew by only {percent(max(share, 0.0))} of its extra wall time: it was preempted "
                "or blocked, not computing more"
            )
        return "its CPU time grew with it: it computes more (or computes slower, on cores it shares)"
    if basis == "cpu_time":
        return "its CPU time per step stands out: it computes more (or computes slower, on cores it shares)"
    if basis == "input_fetch" and share is not None:
        return ("it grew in its DataLoader's fetch, and its CPU time with it: it loads or preprocesses its input on "
                "the training thread (a DataLoader with num_workers=0, or a transform or collate in the main "
                "process), more than the other ranks")  # fmt: skip
    if basis == "input_fetch":
        return "it grew in its DataLoader's fetch: its input path (loading, preprocessing) is slower"
    if basis == "not_preempted":
        grew = f"its CPU time grew by only {percent(max(share, 0.0))} of its extra wall time" if share is not None else (
            "its CPU time did not grow with it")
        return (f"{grew}, yet it neither waited for a CPU nor blocked more than the other ranks: it computes more, "
                "and the CPU time it spends inside its collectives (different on each rank, as a pipeline's stages' "
                "are) hides it")  # fmt: skip
    if basis == "device_clock":
        return "judged on the device clock"
    if basis == "wall_time_only":
        return "CPU time was not measured, so more work cannot be told from preemption"
    if basis == "major_faults":
        return "its major page faults stand out: the host pages from storage"
    if basis == "sys_cpu_time":
        sys_t, sys_med = s.get("sys_cpu_ns"), s.get("cluster_sys_cpu_ns")
        faults, faults_med = s.get("minor_faults"), s.get("cluster_minor_faults")
        if None in (sys_t, sys_med, faults, faults_med):
            return "its extra CPU time is the kernel's, faulting in memory pages: the same work at a higher cost"
        return (
            f"its extra CPU time is the kernel's ({_ms(sys_t)} of system time per step against {_ms(sys_med)} on "
            f"the median rank) faulting in memory pages ({faults:.0f} page faults per step against "
            f"{faults_med:.0f}): the same work at a higher cost"
        )
    return ""


def _advice_key(f: dict[str, Any]) -> str:
    """The ``ADVICE`` entry of a straggler or an episode: its kind, refined by the evidence behind it."""
    kind = f["kind"]
    if kind == "compute" and f.get("kind_basis") == "wall_time_only":
        return "compute_or_host"
    if kind == "host" and (f.get("blocked_per_step") is not None or f.get("kind_basis") == "off_cpu"):
        return "blocked"
    if kind == "data" and f.get("between_steps"):
        return "data_between"
    return kind


def _too_short(d: Diagnosis, detail: bool = False) -> str:
    o = d.options or {}
    k, w, warm = o.get("persist_k", 3), o.get("window_steps", 50), o.get("warmup_steps", 10)
    need = warm + k * w
    text = (
        f"Stragglers not judged: {d.steps_per_rank} steps per rank, and confirming one needs {need} "
        f"({k} windows of {w} steps after {warm} steps of warm-up)"
    )
    if detail:
        return text[:1].lower() + text[1:] + f"; {d.windows_judged} window(s) could be judged"
    return text + "."


def _too_short_advice(d: Diagnosis) -> str:
    o = d.options or {}
    k, warm, least = o.get("persist_k", 3), o.get("warmup_steps", 10), o.get("min_window_samples", 10)
    fit = (d.steps_per_rank - warm) // k
    if fit >= least:
        return (
            f"record more steps, or judge shorter windows: --window-steps {fit} (at least {least} steps each) "
            "gives the rules the windows they need"
        )
    return f"record at least {warm + k * least} steps per rank ({k} windows of at least {least} steps after warm-up)"


def _nothing_judged(d: Diagnosis) -> str:
    warm = (d.options or {}).get("warmup_steps", 10)
    if d.steps_per_rank <= warm:
        return f"every recorded step falls in the warm-up (the first {warm} steps of each rank)"
    return (
        f"{d.steps_per_rank} steps per rank, {d.steps_per_rank - warm} after the warm-up, and a spike needs a "
        "baseline of at least 3 steps"
    )


def _culprit_share(s: dict[str, Any]) -> float | None:
    n, c = s.get("culprit_known"), s.get("culprit_steps")
    return c / n if n and c is not None else None


def _culprit(s: dict[str, Any]) -> bool:
    """The straggler waits less in the collective than the median rank: the others wait for it."""
    mine, median = s.get("comm_wait_ns"), s.get("cluster_comm_wait_ns")
    return mine is not None and median is not None and mine < median


def _sentence(text: str) -> str:
    return (text[:1].upper() + text[1:] + ".") if text else text


def _metric(metric: str) -> str:
    return METRIC_WORD.get(metric, metric)


def _ratio(x: float | None) -> str:
    return "far above" if x is None or math.isnan(x) else f"{x:.2f}x"


def _ms(ns: float) -> str:
    ms = ns / 1e6
    return f"{ms:.3g} ms" if ms < 1000 else f"{ms / 1000:.3g} s"


def _ranks(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 12 else f"{ranks[:12]} and {len(ranks) - 12} more"

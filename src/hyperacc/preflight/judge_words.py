"""The doctor's words: the verdict, the findings and the next steps written from the judged document
(the rules are in ``judge.py``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from hyperacc.preflight.figures import RANK_FIGURES, RESOURCES
from hyperacc.preflight.findings import Finding, Flag


def _fmt(v: float | None) -> str:
    if v is None or not math.isfinite(v):
        return "-"
    return f"{v:.3g}"


def _flag_text(fl: Flag) -> str:
    f = RANK_FIGURES.get(fl.figure)
    label = f.label if f else fl.figure
    unit = f.unit if f else ""
    return (
        f"{label} {fl.slowdown:.2f}x slower than the median ({_fmt(fl.value)} vs {_fmt(fl.median)} {unit}, "
        f"{fl.rounds_flagged} of {fl.rounds_seen} rounds{'' if fl.material else ', below the bar but consistent'})"
    )


def _subject(f: Finding) -> str:
    if f.scope == "rank":
        return f"rank {f.rank} (node {f.node}, host {f.host})"
    if f.scope == "node":
        return f"node {f.node} (host {f.host})"
    return f"the link between nodes {f.nodes[0]} and {f.nodes[1]} ({f.host})"


def _words(doc: Mapping[str, Any], findings: list[Finding]) -> tuple[str, list[str], list[str]]:
    evidence: list[str] = []
    nxt: list[str] = []
    for f in findings:
        what = " and ".join(RESOURCES[r][0] for r in f.resources)
        evidence.append(f"{_subject(f)} is slow: {what}: " + "; ".join(_flag_text(fl) for fl in f.flags))
        for r in f.resources:
            nxt.append(f"{_subject(f)}: {RESOURCES[r][1]}")
    world, nodes = doc["world_size"], doc["nodes"]
    if not doc["judged"]["ranks"]:
        evidence.append(
            f"{world} rank{'s' if world != 1 else ''}: fewer than {doc['options']['min_ranks']} ranks, so no robust "
            "comparison between ranks (the figures are listed, not judged)"
        )
    if nodes > 1 and not doc["judged"]["nodes"]:
        evidence.append(
            f"{nodes} nodes: nodes are compared through their ranks only; a node-level comparison "
            f"(and telling a slow node from a slow link) needs {doc['options']['min_ranks']} nodes or more"
        )
    share = doc.get("cpu_share")
    if share and share["median"] < 0.8:
        evidence.append(
            f"the ranks ran {100 * share['median']:.0f} % of the wall time on a core (min "
            f"{100 * share['min']:.0f} %): more ranks than free cores or other load; host figures are "
            "timed in CPU time, so this contention does not make a rank look slow"
        )
    ar = doc.get("allreduce")
    if ar:
        evidence.append(
            f"all-reduce over {world} ranks: {ar['latency_us']:.3g} us for 8 bytes, {ar['time_ms']:.3g} ms for "
            f"{ar['bytes'] / 2**20:.0f} MiB (bus bandwidth {ar['busbw_gbps']:.3g} GB/s)"
        )
    reads = doc["figures"].get("read_p50"), doc["figures"].get("read_p99")
    if reads[0] and reads[1]:
        evidence.append(
            f"data reads of {doc['options']['read_bytes'] // 1024} KiB, page cache evicted first (median rank): "
            f"p50 {_fmt(reads[0]['median'])} ms, p99 {_fmt(reads[1]['median'])} ms"
        )
    slow_links = [lk for lk in doc.get("links", []) if lk["slow"]]
    if doc.get("links") and not slow_links:
        bws = [lk["bandwidth_gbps"] for lk in doc["links"] if lk["bandwidth_gbps"]]
        if bws:
            spread = f"{min(bws):.3g}" if len(bws) == 1 else f"{min(bws):.3g} to {max(bws):.3g}"
            pairs = f"{len(doc['links'])} node pair{'s' if len(doc['links']) > 1 else ''}"
            evidence.append(f"{pairs} exchanged {spread} GB/s per rank; no slow link")
    for name, reason in doc.get("skipped", {}).items():
        if name in ("h2d", "read_p50"):
            evidence.append(f"not measured: {reason}")
    for where, err in doc.get("errors", {}).items():
        evidence.append(f"benchmark failed on {where}: {err}")
    hosts = doc["exclude_hosts"]
    if findings:
        if len(findings) == 1:
            f = findings[0]
            verdict = f"{_subject(f).capitalize()} is slow: {' and '.join(RESOURCES[r][0] for r in f.resources)}"
        else:
            verdict = f"{len(findings)} findings: " + "; ".join(
                f"{_subject(f)}: {' and '.join(RESOURCES[r][0].split(' (')[0] for r in f.resources)}"
                for f in findings
            )
        if hosts:
            verdict += f". Leave out: {', '.join(hosts)}."
            nxt.append(
                "start the job without those hosts: pass the exclusion file to the launcher (Slurm: "
                "--exclude=$PWD/FILE; a list: $(paste -sd, FILE)) or run `hyperacc doctor` on a fresh "
                "allocation"
            )
    elif doc["judged"]["ranks"]:
        verdict = (
            f"Healthy: no slow rank, node or link among {world} ranks on {nodes} node{'s' if nodes != 1 else ''} "
            f"(every figure within the rules of docs/doctor.md)"
        )
        nxt.append("start the job")
    else:
        verdict = f"Measured {world} rank{'s' if world != 1 else ''}; too few to compare (see evidence)"
        nxt.append("run the doctor with at least 4 ranks to compare them")
    return verdict, evidence, nxt

"""The pre-flight verdict: pure functions from the gathered measurements to findings and a document.

Each figure is a (rank x round) matrix of costs. A rank is slow on a figure when it is a slow outlier
in at least ``persist_k`` rounds by the rule of ``hyperacc analyze`` (``hyperacc.analysis.outliers.
outlier_flags``: modified z-score AND the leave-one-out Tukey fence AND a material excess), one round
playing the part of one window. The rest is specific to a pre-flight check (docs/doctor.md, "Rules"):

* which resource is slow follows from which figures are: two or more of the CPU-bound figures (matmul
  on a CPU, memory bandwidth, dispatch) name the host's CPU; otherwise each figure names its own;
* a node is slow when more than ``node_fraction`` of its ranks are (as in analyze), or when its
  medians are outliers among the nodes (with ``min_ranks`` nodes or more);
* network: for node pairs ``(i, j)`` with exchange cost ``c_ij``, node ``i``'s best partner cost
  ``b_i = min_j c_ij`` judged across nodes names a slow node (every exchange with it is slow); the
  ratio ``c_ij / max(b_i, b_j)`` judged across pairs names a slow link (only that exchange is slow,
  both ends are fine elsewhere).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hyperacc.analysis.options import DetectionOptions
from hyperacc.analysis.outliers import confirmation, outlier_flags
from hyperacc.analysis.robust import nan_median
from hyperacc.preflight.figures import CPU_FIGURES, RANK_FIGURES, Figure
from hyperacc.preflight.findings import Finding, Flag, _plain
from hyperacc.preflight.judge_words import _words
from hyperacc.preflight.options import DoctorOptions

SCHEMA_VERSION = 1
CONTENTION = Figure("contention", "wall time per CPU second", "contention", "x", False, "none", "wall")


# ---------------------------------------------------------------- matrices from the gathered document


def _figure_matrix(ranks: Sequence[Mapping[str, Any]], name: str, rounds: int) -> tuple[np.ndarray, np.ndarray]:
    cost = np.full((len(ranks), rounds), np.nan)
    work = np.full((len(ranks), rounds), np.nan)
    for i, r in enumerate(ranks):
        row = r.get("figures", {}).get(name)
        if not row:
            continue
        c = np.asarray(row["cost_ns"], dtype=np.float64)[:rounds]
        w = np.asarray(row["work"], dtype=np.float64)[:rounds]
        cost[i, : c.size] = c
        work[i, : w.size] = w
    cost[~(cost > 0)] = np.nan  # a zero or negative cost was not measured
    return cost, work


def _p2p_matrix(ranks: Sequence[Mapping[str, Any]], rounds: int) -> tuple[np.ndarray, np.ndarray]:
    """Each rank's best exchange (lowest cost over its partner nodes) per round."""
    cost = np.full((len(ranks), rounds), np.nan)
    work = np.full((len(ranks), rounds), np.nan)
    for i, r in enumerate(ranks):
        ex = r.get("exchanges") or {}
        if not ex or not r.get("exchange_bytes"):
            continue
        per_partner = np.full((len(ex), rounds), np.nan)
        for j, vals in enumerate(ex.values()):
            v = np.asarray(vals["large_ns"], dtype=np.float64)[:rounds]
            per_partner[j, : v.size] = v
        with np.errstate(all="ignore"):
            cost[i] = np.nanmin(np.where(np.isnan(per_partner), np.inf, per_partner), axis=0)
        cost[i][~np.isfinite(cost[i])] = np.nan
        work[i] = 2.0 * r["exchange_bytes"]  # a round trip carries the message twice
    return cost, work


def pair_costs(ranks: Sequence[Mapping[str, Any]], rounds: int) -> dict[tuple[int, int], np.ndarray]:
    """Node pair -> per-round exchange cost: the median over both ends and all local ranks."""
    samples: dict[tuple[int, int], list[np.ndarray]] = {}
    for r in ranks:
        for partner, vals in (r.get("exchanges") or {}).items():
            a, b = sorted((int(r["node"]), int(partner)))
            v = np.full(rounds, np.nan)
            x = np.asarray(vals["large_ns"], dtype=np.float64)[:rounds]
            v[: x.size] = x
            samples.setdefault((a, b), []).append(v)
    return {pair: nan_median(np.vstack(vs), axis=0) for pair, vs in sorted(samples.items())}


# ---------------------------------------------------------------- the rules


def _floor(fig: Figure, det: DetectionOptions) -> float:
    return {"none": 0.0, "floor_ns": float(det.floor_ns), "launch_floor_ns": float(det.launch_floor_ns)}[fig.floor]


def confirmed_slow(
    cost: np.ndarray, det: DetectionOptions, floor: float
) -> list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
    """Rows of a (subject x round) cost matrix confirmed slow: [(row, flags, judged, median per round)]."""
    flags, judged, med = outlier_flags(cost, det, floor)
    out = []
    for i in range(cost.shape[0]):
        if confirmation(flags[i], judged[i], det.persist_k, det.persist_n) is not None:
            out.append((i, flags[i], judged[i], med))
    return out


def _flag(fig: Figure, cost: np.ndarray, work: np.ndarray, i: int, flags: np.ndarray, judged: np.ndarray,
          med: np.ndarray) -> Flag:  # fmt: skip
    with np.errstate(all="ignore"):
        slowdown = float(nan_median(cost[i, flags] / med[flags]))
        value = fig.display(float(nan_median(cost[i])), float(nan_median(work[i])))
        median = fig.display(float(nan_median(med)), float(nan_median(work)))
    return Flag(fig.name, slowdown, value, median, int(flags.sum()), int(judged.sum()))


def resources_of(figures: Sequence[str], cuda: bool) -> list[str]:
    """Which resources a set of slow figures points at (docs/doctor.md, "Naming the resource")."""
    cpu_bound = [f for f in CPU_FIGURES if f in figures and not (cuda and f == "matmul")]
    out: list[str] = []
    if len(cpu_bound) >= 2:
        out.append("cpu")
    for f in figures:
        if "cpu" in out and f in cpu_bound:
            continue
        res = RANK_FIGURES[f].resource
        if res not in out:
            out.append(res)
    return out


def judge(doc: Mapping[str, Any], opts: DoctorOptions | None = None) -> dict[str, Any]:
    """The doctor's document (verdict, evidence, next step, findings, hosts to leave out) from the
    measurements the ranks gathered (``hyperacc.preflight.worker``)."""
    opts = opts or DoctorOptions.from_mapping(doc.get("options", {}))
    det = opts.detection()
    ranks = sorted(doc["ranks"], key=lambda r: r["rank"])
    rounds = opts.rounds
    node_of = np.asarray([int(r["node"]) for r in ranks])
    host_of_node: dict[int, str] = {}
    for r in ranks:
        host_of_node.setdefault(int(r["node"]), str(r["host"]))
    nodes = sorted(host_of_node)
    cuda = any(r.get("device", "cpu") != "cpu" for r in ranks)

    matrices: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name in RANK_FIGURES:
        cost, work = _p2p_matrix(ranks, rounds) if name == "p2p" else _figure_matrix(ranks, name, rounds)
        if name == "memory":
            cost = _unshared(cost, ranks, rounds, det)
        if not np.isnan(cost).all():
            matrices[name] = (cost, work)

    rank_findings = _rank_findings(matrices, ranks, det, cuda)
    node_findings: dict[int, Finding] = {}
    grouped = _grouped_nodes(rank_findings, node_of, nodes, det)
    for i, f in sorted(rank_findings.items()):  # most of a node's ranks slow: the node, told once
        if f.node in grouped:
            _merge(node_findings, dataclasses.replace(f, scope="node", rank=None), cuda)
            del rank_findings[i]
    node_judged = len(nodes) >= det.min_ranks
    if node_judged:
        for f in _node_outliers(matrices, ranks, node_of, nodes, host_of_node, det):
            _merge(node_findings, f, cuda)
    pairs = pair_costs(ranks, rounds)
    links_doc, link_findings, net_nodes = _judge_pairs(pairs, nodes, host_of_node, det, ranks)
    for n, fl in net_nodes.items():
        _merge(node_findings, Finding("node", ["network"], [fl], node=n, host=host_of_node[n],
                                      hosts=[host_of_node[n]]), cuda)  # fmt: skip
    for i, f in sorted(rank_findings.items()):  # a rank slow on what its node is slow on: part of it
        node = node_findings.get(f.node)
        if node is not None and all(r in node.resources for r in f.resources):
            _merge(node_findings, dataclasses.replace(f, scope="node", rank=None), cuda)
            del rank_findings[i]
    findings = [node_findings[n] for n in sorted(node_findings)]
    findings += [rank_findings[i] for i in sorted(rank_findings)]
    findings += link_findings
    exclude: list[str] = []
    for f in findings:
        exclude += [h for h in f.hosts if h not in exclude]

    figures_doc = _figures_doc(matrices, ranks)
    skipped: dict[str, str] = {}
    errors: dict[str, str] = {}
    for r in ranks:
        for k, v in (r.get("skipped") or {}).items():
            skipped.setdefault(k, v)
        for k, v in (r.get("errors") or {}).items():
            errors.setdefault(f"rank {r['rank']}: {k}", v)
    allreduce = _allreduce_doc(ranks)
    out = {
        "schema_version": SCHEMA_VERSION,
        "kind": "doctor",
        "world_size": len(ranks),
        "nodes": len(nodes),
        "hosts": [host_of_node[n] for n in nodes],
        "device": "cuda" if cuda else "cpu",
        "rounds": rounds,
        "seconds": opts.seconds,
        "wall_s": doc.get("wall_s"),
        "judged": {"ranks": len(ranks) >= det.min_ranks, "nodes": node_judged,
                   "links": len(pairs) >= det.min_ranks},  # fmt: skip
        "findings": [f.to_dict() for f in findings],
        "exclude_hosts": exclude,
        "figures": figures_doc,
        "allreduce": allreduce,
        "links": links_doc,
        "cpu_share": _cpu_share_doc(ranks),
        "skipped": skipped,
        "errors": errors,
        "options": dataclasses.asdict(opts),
        "docs": "docs/doctor.md",
    }
    out["verdict"], out["evidence"], out["next_step"] = _words(out, findings)
    return _plain(out)


def _rank_findings(
    matrices: dict[str, tuple[np.ndarray, np.ndarray]], ranks: Sequence[Mapping[str, Any]],
    det: DetectionOptions, cuda: bool,
) -> dict[int, Finding]:  # fmt: skip
    per_rank: dict[int, list[Flag]] = {}
    for name, (cost, work) in matrices.items():
        fig = RANK_FIGURES[name]
        for i, flags, judged, med in confirmed_slow(cost, det, _floor(fig, det)):
            per_rank.setdefault(i, []).append(_flag(fig, cost, work, i, flags, judged, med))
    # A rank slow on one CPU-bound figure: are its other CPU-bound figures slow too, if less? Then the
    # host's CPU is named, not the one figure that crossed the bar (docs/doctor.md, "Naming the resource").
    half = dataclasses.replace(det, min_slowdown=det.min_slowdown / 2)
    cpu_bound = [f for f in CPU_FIGURES if f in matrices and not (cuda and f == "matmul")]
    for name in cpu_bound:
        cost, work = matrices[name]
        fig = RANK_FIGURES[name]
        for i, flags, judged, med in confirmed_slow(cost, half, _floor(fig, half)):
            have = [fl.figure for fl in per_rank.get(i, [])]
            if name not in have and any(f in cpu_bound for f in have):
                per_rank[i].append(dataclasses.replace(_flag(fig, cost, work, i, flags, judged, med), material=False))
    out = {}
    for i, flags in sorted(per_rank.items()):
        r = ranks[i]
        out[i] = Finding(
            "rank", resources_of([fl.figure for fl in flags], cuda), flags, node=int(r["node"]),
            host=str(r["host"]), rank=int(r["rank"]), hosts=[str(r["host"])], ranks=[int(r["rank"])],
        )  # fmt: skip
    return out


def _grouped_nodes(
    rank_findings: dict[int, Finding], node_of: np.ndarray, nodes: list[int], det: DetectionOptions
) -> set[int]:
    """More than ``node_fraction`` of a node's ranks slow (and at least two): the node (analyze's rule)."""
    out = set()
    for n in nodes:
        members = np.flatnonzero(node_of == n)
        slow = [int(i) for i in members if int(i) in rank_findings]
        if members.size >= 2 and len(slow) >= 2 and len(slow) / members.size > det.node_fraction:
            out.add(n)
    return out


def _node_outliers(
    matrices: dict[str, tuple[np.ndarray, np.ndarray]], ranks: Sequence[Mapping[str, Any]], node_of: np.ndarray,
    nodes: list[int], host_of_node: dict[int, str], det: DetectionOptions,
) -> list[Finding]:  # fmt: skip
    """Each node's best rank on every figure (and on the contention figure), judged across nodes: a node
    whose fastest rank is slow is slow as a whole. (A median would be moved by one slow rank of a
    two-rank node, which the rank rules already name.)"""
    rows = {n: np.flatnonzero(node_of == n) for n in nodes}
    candidates = dict(matrices)
    extra = _contention_matrix(ranks, next(iter(matrices.values()))[0].shape[1]) if matrices else None
    if extra is not None:
        candidates["contention"] = extra
    out = []
    for name, (cost, work) in candidates.items():
        ncost = np.vstack([_nan_min(cost[rows[n]]) for n in nodes])
        nwork = np.vstack([nan_median(work[rows[n]], axis=0) for n in nodes])
        fig = RANK_FIGURES.get(name) or CONTENTION
        for k, flags, judged, med in confirmed_slow(ncost, det, _floor(fig, det)):
            n = nodes[k]
            fl = _flag(fig, ncost, nwork, k, flags, judged, med)
            out.append(Finding("node", [fig.resource], [fl], node=n, host=host_of_node[n], hosts=[host_of_node[n]]))
    return out


def _nan_min(values: np.ndarray) -> np.ndarray:
    """Column minimum ignoring NaN; NaN where a column has no value."""
    with np.errstate(all="ignore"):
        out = np.min(np.where(np.isnan(values), np.inf, values), axis=0)
    return np.where(np.isfinite(out), out, np.nan)


def _merge(node_findings: dict[int, Finding], new: Finding, cuda: bool) -> None:
    """Add ``new`` (about one node) to that node's finding: one flag per figure, the resources they name,
    its ranks and hosts."""
    found = node_findings.setdefault(new.node, Finding("node", [], [], node=new.node, host=new.host,
                                                       hosts=list(new.hosts)))  # fmt: skip
    for fl in new.flags:
        old = next((x for x in found.flags if x.figure == fl.figure), None)
        if old is None:
            found.flags.append(fl)
        elif fl.slowdown < old.slowdown:  # the node is at least this slow on every slow rank
            found.flags[found.flags.index(old)] = fl
    found.ranks = sorted(set(found.ranks) | set(new.ranks))
    for h in new.hosts:
        if h not in found.hosts:
            found.hosts.append(h)
    names = [fl.figure for fl in found.flags]
    found.resources = resources_of([n for n in names if n in RANK_FIGURES], cuda)
    if "contention" in names:
        found.resources.append("contention")


def _unshared(cost: np.ndarray, ranks: Sequence[Mapping[str, Any]], rounds: int, det: DetectionOptions) -> np.ndarray:
    """The memory figure of the rounds in which the rank had a core to itself: not more than the
    materiality bar (``min_slowdown``) of its wall time spent waiting for one (CPU share at least
    ``1 / (1 + min_slowdown)``). Where ranks take turns on shared cores, the bandwidth a rank gets in
    CPU time depends on whether the rank beside it copied too or ran something else (a clean 2-node job
    beside a busy process: one rank 1.27x slower in 3 of 5 rounds, 41 % CPU share): those rounds are
    not judged (docs/doctor.md, "Why CPU time")."""
    shared = _cpu_shares(ranks, rounds) < 1.0 / (1.0 + det.min_slowdown)  # NaN (not measured) is not shared
    return np.where(shared, np.nan, cost)


def _cpu_shares(ranks: Sequence[Mapping[str, Any]], rounds: int) -> np.ndarray:
    """(rank x round) share of wall time each rank's host benchmarks ran on a core; NaN: not measured."""
    m = np.full((len(ranks), rounds), np.nan)
    for i, r in enumerate(ranks):
        share = np.asarray((r.get("extra") or {}).get("cpu_share", []), dtype=np.float64)[:rounds]
        m[i, : share.size] = share
    return m


def _contention_matrix(ranks: Sequence[Mapping[str, Any]], rounds: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Wall time per CPU second of the host benchmarks (1 / CPU share): > 1 where the rank waited for a core."""
    with np.errstate(all="ignore"):
        m = 1.0 / _cpu_shares(ranks, rounds)
    m[~np.isfinite(m)] = np.nan
    return None if np.isnan(m).all() else (m, np.ones_like(m))


def _judge_pairs(
    pairs: dict[tuple[int, int], np.ndarray],
    nodes: list[int],
    host_of_node: dict[int, str],
    det: DetectionOptions,
    ranks: Sequence[Mapping[str, Any]],
) -> tuple[list[dict[str, Any]], list[Finding], dict[int, Flag]]:
    """Slow nodes (every exchange with them slow) and slow links (one exchange slow) from pair costs."""
    if not pairs:
        return [], [], {}
    nbytes = next((r["exchange_bytes"] for r in ranks if r.get("exchange_bytes")), 0)
    work = 2.0 * nbytes
    fig = RANK_FIGURES["p2p"]
    index = {n: k for k, n in enumerate(nodes)}
    rounds = next(iter(pairs.values())).size
    best = np.full((len(nodes), rounds), np.inf)
    for (a, b), c in pairs.items():
        for n in (a, b):
            best[index[n]] = np.fmin(best[index[n]], np.where(np.isnan(c), np.inf, c))
    best[~np.isfinite(best)] = np.nan
    net_nodes: dict[int, Flag] = {}
    if len(nodes) >= det.min_ranks:
        for k, flags, judged, med in confirmed_slow(best, det, 0.0):
            net_nodes[nodes[k]] = _flag(fig, best, np.full_like(best, work), k, flags, judged, med)
    keys = list(pairs)
    cost = np.vstack([pairs[p] for p in keys])
    with np.errstate(all="ignore"):
        ratio = np.vstack([pairs[(a, b)] / np.fmax(best[index[a]], best[index[b]]) for a, b in keys])
    link_findings = []
    flagged_links: set[tuple[int, int]] = set()
    if len(keys) >= det.min_ranks:
        for k, flags, judged, _med in confirmed_slow(ratio, det, 0.0):
            a, b = keys[k]
            if a in net_nodes or b in net_nodes:
                continue  # explained by a slow node
            fl = Flag(
                "p2p", float(nan_median(ratio[k, flags])), fig.display(float(nan_median(cost[k])), work),
                fig.display(float(nan_median(cost)), work), int(flags.sum()), int(judged.sum()),
            )  # fmt: skip
            flagged_links.add((a, b))
            link_findings.append(Finding("link", ["link"], [fl], nodes=(a, b),
                                         host=f"{host_of_node[a]} <-> {host_of_node[b]}"))  # fmt: skip
    links_doc = []
    for k, (a, b) in enumerate(keys):
        small = [
            v
            for r in ranks
            for partner, vals in (r.get("exchanges") or {}).items()
            if sorted((int(r["node"]), int(partner))) == [a, b]
            for v in vals["small_ns"]
        ]
        links_doc.append({
            "nodes": [a, b],
            "hosts": [host_of_node[a], host_of_node[b]],
            "bandwidth_gbps": fig.display(float(nan_median(cost[k])), work) if work else None,
            "latency_us": float(nan_median(np.asarray(small))) / 2e3 if small else None,  # one way
            "ratio_to_best": float(nan_median(ratio[k])),
            "slow": (a, b) in flagged_links,
        })  # fmt: skip
    return links_doc, link_findings, net_nodes


def _figures_doc(matrices: dict[str, tuple[np.ndarray, np.ndarray]], ranks: Sequence[Mapping[str, Any]]) -> dict:
    out = {}
    for name, (cost, work) in matrices.items():
        fig = RANK_FIGURES[name]
        med_cost = nan_median(nan_median(cost, axis=1))
        rows = []
        for i, r in enumerate(ranks):
            c = float(nan_median(cost[i]))
            rows.append({
                "rank": int(r["rank"]), "node": int(r["node"]), "host": str(r["host"]),
                "value": fig.display(c, float(nan_median(work[i]))) if math.isfinite(c) else None,
                "slowdown": c / float(med_cost) if math.isfinite(c) and med_cost > 0 else None,
            })  # fmt: skip
        out[name] = {
            "label": fig.label, "unit": fig.unit, "resource": fig.resource,
            "median": fig.display(float(med_cost), float(nan_median(work))) if math.isfinite(med_cost) else None,
            "per_rank": rows,
        }  # fmt: skip
    return out


def _allreduce_doc(ranks: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    rows = [r["allreduce"] for r in ranks if r.get("allreduce")]
    if not rows:
        return None
    small = nan_median(np.asarray([v for r in rows for v in r["small_ns"]], dtype=np.float64))
    large = nan_median(np.asarray([v for r in rows for v in r["large_ns"]], dtype=np.float64))
    n = int(rows[0]["world_size"])
    nbytes = float(rows[0]["large_bytes"])
    algbw = nbytes / large if large > 0 else float("nan")
    return {
        "latency_us": float(small) / 1e3,
        "bytes": int(nbytes),
        "time_ms": float(large) / 1e6,
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * 2 * (n - 1) / n if n > 1 else algbw,  # nccl-tests' bus bandwidth
    }


def _cpu_share_doc(ranks: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    shares = [nan_median(np.asarray((r.get("extra") or {}).get("cpu_share", [np.nan]), dtype=np.float64))
              for r in ranks]  # fmt: skip
    arr = np.asarray(shares, dtype=np.float64)
    if np.isnan(arr).all():
        return None
    return {"median": float(nan_median(arr)), "min": float(np.nanmin(arr)), "max": float(np.nanmax(arr))}



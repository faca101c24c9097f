"""Rank-specific causes: a rank whose spikes of one cause are far above the host-wide noise floor.

On a busy host every rank spikes now and then (a scheduler slice lost, another job's burst); those
spikes are the floor that all ranks share. An intermittent culprit (a rank that stalls in data loading
on 2 % of its steps) hides among them when spikes are only counted per cluster. This rule compares each
rank's rate of each cause with the other ranks' pooled rate of the same cause (docs/detection.md,
"Rank-specific causes"):

    P(Binomial(n_r, q) >= k_r) < top_alpha / tests   with q = (m k~ + 1) / (m n~ + 2)
    AND k_r / n_r >= excess_ratio x q   AND k_r >= excess_min_spikes
    AND, for the unspecific causes (compute, host, unknown) with min_ranks ranks or more, the rank's
        rate is an outlier among the ranks' rates (the straggler rule of one window: modified z, the
        other ranks' Tukey fence, min_slowdown)

The binomial counts each spike as an independent draw. Spikes that come in bursts (a loaded host
starving a rank's loader workers for a stretch, then another rank's) are fewer independent events
than spikes, so the test is made on ``k / phi`` spikes of ``n / phi`` steps, where ``phi`` >= 1 is the
cause's dispersion: Pearson's chi-square of each rank's spike counts per window around that rank's own
rate, pooled over the other ranks (the null: this rank spikes as they do; a culprit's own fault, a
stretch of GC pauses, is bursty by nature and must not hide itself), over its degrees of freedom (the
quasi-binomial correction). Spikes drawn independently give ``phi`` about 1 and the test as it was.
A rank whose spikes of the cause all fell in one window is one burst, however many spikes: no finding
(the live detector's first window after a start-up, offline a stretch that the episodes judge).

For a cause whose time the window summaries measure (input waits, GC pauses), the spikes must also
be time the rank lost that the typical rank did not: its total of that time (the windows' typical value
over their judged steps, plus what its spikes lost) exceeds the other ranks' median total by at least
half of what its spikes lost. On a loaded host every rank waits for its starved loader workers; a rank
whose usual wait is shorter counts more of the same waiting as spikes, without waiting longer in all.

``tests`` is the number of (rank, cause) pairs with at least ``excess_min_spikes`` spikes (a pair with
fewer is never a finding, so it is no test). ``k_r`` of ``n_r`` judged steps of the rank spiked with
that cause; ``k~`` and ``n~`` are the medians of
the ``m`` other ranks' counts and judged steps (the typical rank's rate, with one pseudo-spike over all
their steps so that a cause no other rank shows still needs several spikes to stand out; the median, so
that two culprits do not hide each other). The last condition is there because a shared host's spikes are burstier than a
binomial: on clean jobs here the ranks' rates of unspecific spikes ranged 6-18 % in one run, a spread
no binomial floor allows for; data, GC and allocator spikes come from a signal of their own, and the
healthy ranks' floor of them is near zero. Pure: counts in, findings out; offline and live use it alike.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from hyperacc.analysis.options import DetectionOptions
from hyperacc.analysis.outliers import cross_rank_outliers
from hyperacc.analysis.robust import binom_sf, loo_median

# Spikes of a rank's own work that no phase or signal names specifically. Without CPU time the line
# between them is noise (a preempted step and a longer computation look alike), so they are counted
# as one cause, "compute/host"; with CPU time, compute (CPU time grew) and host (it did not) are told
# apart and tested each on its own.
UNSPECIFIC: tuple[str, ...] = ("compute", "host", "unknown")
MERGED = "compute/host"


def cause_groups(causes: Sequence[str], cpu_measured: bool) -> dict[str, tuple[str, ...]]:
    """The causes tested for rank-specific excess, each with the spike causes it counts."""
    groups: dict[str, tuple[str, ...]] = {}
    for c in causes:
        if c in UNSPECIFIC and not cpu_measured:
            groups.setdefault(MERGED, ())
            groups[MERGED] += (c,)
        else:
            groups[c] = (c,)
    if cpu_measured and "unknown" in groups:  # no phase grew and CPU time did not tell: still unspecific
        groups["host"] = groups.get("host", ()) + groups.pop("unknown")
    return groups


@dataclasses.dataclass
class RankExcess:
    rank: int
    node: int
    cause: str
    spikes: int  # spikes of this cause on the rank
    steps: int  # the rank's judged steps
    rate: float  # spikes / steps
    others_rate: float  # the other ranks' pooled rate of the same cause
    mean_excess_ns: float  # the average time one of these spikes lost
    time_lost_ns: float  # all of them together
    p_value: float
    dispersion: float = 1.0  # the cause's phi: how bursty its spikes were (1: independent draws)
    # where its spikes of the cause recur every N steps (analysis.periods, ``Period.to_dict``): offline only,
    # the live windows keep no spike's step
    period: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# The causes whose time a rank's window summaries measure, and the summary column that holds it (a
# median over the window's typical steps, or a sum over them).
CAUSE_TIME: dict[str, tuple[str, bool]] = {"data": ("data_ns_median", False), "gc": ("gc_ns_sum", True)}


def cause_times(windows: Mapping[str, np.ndarray], ri: np.ndarray, n_ranks: int) -> dict[str, np.ndarray]:
    """Each rank's total time of each cause in ``CAUSE_TIME`` from window summaries (row ``j`` is rank
    ``ri[j]``'s): typical value x judged steps (or the typical steps' sum), plus what its spikes of the
    cause lost. NaN where the rank's windows did not measure it. One pass per cause, for every rank."""
    if "judged_steps" not in windows:
        return {}
    judged = np.nan_to_num(np.asarray(windows["judged_steps"], dtype=np.float64))
    out = {}
    for cause, (column, is_sum) in CAUSE_TIME.items():
        if column not in windows:
            continue
        v = np.asarray(windows[column], dtype=np.float64)
        measured = np.bincount(ri, weights=np.isfinite(v).astype(np.float64), minlength=n_ranks)
        v = np.nan_to_num(v)
        total = np.bincount(ri, weights=v if is_sum else v * judged, minlength=n_ranks)
        lost = windows.get(f"lost_ns_{cause}")
        if lost is not None:
            total += np.bincount(ri, weights=np.nan_to_num(np.asarray(lost, dtype=np.float64)), minlength=n_ranks)
        out[cause] = np.where(measured > 0, total, np.nan)
    return out


def cause_time(windows: Mapping[str, np.ndarray]) -> dict[str, float]:
    """``cause_times`` of one rank's window summaries."""
    n = len(windows["judged_steps"]) if "judged_steps" in windows else 0
    return {c: float(v[0]) for c, v in cause_times(windows, np.zeros(n, dtype=np.int64), 1).items()}


def dispersions(spikes: np.ndarray, judged: np.ndarray, ri: np.ndarray, n_ranks: int) -> np.ndarray:
    """(ranks x 3): per rank, Pearson's chi-square of its spike counts per window (row ``j``: ``spikes[j]``
    of ``judged[j]`` judged steps, rank ``ri[j]``) around the rank's own rate, its degrees of freedom
    (windows - 1), and the number of windows with a spike. Chi-square and degrees of freedom are 0 where
    the rank had no spike of it, or spiked at every step, or was judged in one window only."""
    k = np.nan_to_num(np.asarray(spikes, dtype=np.float64))
    n = np.nan_to_num(np.asarray(judged, dtype=np.float64))
    ok = n > 0
    k, n, ri = k[ok], n[ok], ri[ok]
    total_k = np.bincount(ri, weights=k, minlength=n_ranks)
    total_n = np.bincount(ri, weights=n, minlength=n_ranks)
    windows = np.bincount(ri, minlength=n_ranks).astype(np.float64)
    spiked = np.bincount(ri, weights=(k > 0).astype(np.float64), minlength=n_ranks)
    valid = (windows >= 2) & (total_k > 0) & (total_k < total_n)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.where(valid, total_k / total_n, 0.5)[ri]
        terms = np.square(k - n * p) / (n * p * (1.0 - p))
    chi2 = np.bincount(ri, weights=np.where(valid[ri], terms, 0.0), minlength=n_ranks)
    return np.stack([np.where(valid, chi2, 0.0), np.where(valid, windows - 1, 0.0), spiked], axis=1)


def window_dispersion(spikes: np.ndarray, judged: np.ndarray) -> tuple[float, float, float]:
    """``dispersions`` of one rank: (chi-square, degrees of freedom, windows with a spike)."""
    row = dispersions(spikes, judged, np.zeros(len(spikes), dtype=np.int64), 1)[0]
    return float(row[0]), float(row[1]), float(row[2])


def member_dispersion(windows: Mapping[str, np.ndarray], causes: Sequence[str]) -> dict[tuple[str, ...], tuple[float, ...]]:
    """One rank's ``window_dispersion`` for every set of causes ``cause_groups`` can test together (each
    cause alone, and the merged unspecific ones with and without CPU time), from its window summaries
    (``spikes_<cause>``, ``judged_steps``): a few numbers kept per rank instead of its window tallies."""
    if "judged_steps" not in windows:
        return {}
    sets = {members for cpu in (True, False) for members in cause_groups(causes, cpu).values()}
    sets |= {(c,) for c in causes}
    out = {}
    for members in sets:
        parts = [windows[f"spikes_{c}"] for c in members if f"spikes_{c}" in windows]
        if parts:
            out[members] = window_dispersion(np.sum(parts, axis=0), windows["judged_steps"])
    return out


def group_dispersion(
    per_rank: Sequence[Mapping[tuple[str, ...], tuple[float, ...]]], groups: Mapping[str, tuple[str, ...]]
) -> dict[str, np.ndarray]:
    """Per cause group, each rank's (chi-square, degrees of freedom, windows with a spike) from its
    ``member_dispersion`` (a set a rank lacks is the sum of its members' own), as a (ranks x 3) array."""
    out = {}
    for name, members in groups.items():
        rows = np.zeros((len(per_rank), 3))
        for i, d in enumerate(per_rank):
            if members in d:
                rows[i] = d[members]
            else:
                for c in members:
                    if (c,) in d:
                        rows[i] += d[(c,)]
        out[name] = rows
    return out


def pooled_dispersion(parts: Iterable[Sequence[float]]) -> float:
    """``phi`` of a cause: the chi-squares over their degrees of freedom (the first two of each part),
    at least 1."""
    chi2 = df = 0.0
    for part in parts:
        chi2 += part[0]
        df += part[1]
    return max(1.0, chi2 / df) if df > 0 else 1.0


def rank_excess(
    ranks: Sequence[int],
    nodes: Sequence[int],
    steps: Sequence[float],
    counts: Mapping[str, Sequence[float]],
    lost: Mapping[str, Sequence[float]],
    opts: DetectionOptions,
    dispersion: Mapping[str, np.ndarray] | None = None,
    times: Mapping[str, Sequence[float]] | None = None,
) -> list[RankExcess]:
    """Per rank and cause, the spikes that stand out from the other ranks' floor (module docstring).

    ``steps[i]`` are rank ``ranks[i]``'s judged steps; ``counts[cause][i]`` its spikes of that cause and
    ``lost[cause][i]`` the time they lost; ``dispersion[cause][i]`` its (chi-square, degrees of
    freedom, windows with a spike) of the cause's spikes per window (``dispersions``; where not given,
    ``phi`` is 1 and one window's spikes count);
    ``times[cause][i]`` its total time of the cause (``cause_time``; not tested where not given or NaN).
    Needs two ranks or more; sorted by time lost."""
    if opts.top_alpha <= 0:
        return []
    n = np.asarray(steps, dtype=np.float64)
    if n.size < 2:
        return []
    # Bonferroni over the (rank, cause) pairs that could be reported at all (at least
    # excess_min_spikes spikes): a pair with fewer is never a finding, so it is no test.
    tests = max(sum(int((np.nan_to_num(np.asarray(v, dtype=np.float64)) >= opts.excess_min_spikes).sum())
                    for v in counts.values()), 1)  # fmt: skip
    out: list[RankExcess] = []
    for cause, raw in counts.items():
        k = np.nan_to_num(np.asarray(raw, dtype=np.float64))
        lost_c = np.nan_to_num(np.asarray(lost.get(cause, np.zeros(n.size)), dtype=np.float64))
        k_all, n_all = k.sum(), n.sum()
        with np.errstate(invalid="ignore", divide="ignore"):
            rates = np.where(n > 0, k / n, np.nan)
        outlier, _, _, judged = cross_rank_outliers(rates, opts, 0.0)
        if cause not in (MERGED, *UNSPECIFIC, "host_work"):
            judged = np.zeros(n.size, dtype=bool)  # a specific signal: the binomial floor holds
        candidates = np.flatnonzero((n > 0) & (k >= opts.excess_min_spikes) & ~(judged & ~outlier))
        if candidates.size == 0:
            continue
        # the median of the other ranks, for every rank at once (at thousands of ranks with many
        # candidates, one median per rank would cost ranks squared)
        med_k, med_n = loo_median(np.stack([k, n], axis=1)).T
        m = float(n.size - 1)
        given = (dispersion or {}).get(cause)
        chi = np.zeros((n.size, 3)) if given is None else np.asarray(given, dtype=np.float64)
        one_burst = chi[:, 2] < 2 if given is not None and chi.shape[1] > 2 else np.zeros(n.size, dtype=bool)
        chi_all = chi.sum(axis=0)
        total = np.asarray((times or {}).get(cause, np.full(n.size, np.nan)), dtype=np.float64)
        typical_total = loo_median(total[:, None])[:, 0] if np.isfinite(total).sum() >= 2 else np.full(n.size, np.nan)
        for i in candidates:
            others_k, others_n = k_all - k[i], n_all - n[i]
            q = (m * float(med_k[i]) + 1.0) / (m * float(med_n[i]) + 2.0)
            rate = k[i] / n[i]
            if rate < opts.excess_ratio * q:
                continue
            # all of its spikes in one window: one burst, however many spikes (module docstring)
            if one_burst[i]:
                continue
            # the same waiting spread differently is no time of its own (module docstring)
            if np.isfinite(total[i]) and np.isfinite(typical_total[i]) and total[i] - typical_total[i] < 0.5 * lost_c[i]:
                continue
            # bursts: the independent events are fewer than the spikes, by the other ranks' dispersion
            phi = pooled_dispersion([chi_all - chi[i]])
            p = float(binom_sf(k[i], n[i], q)) if phi == 1.0 else float(binom_sf(math.floor(k[i] / phi), n[i] / phi, q))
            if p >= opts.top_alpha / tests:
                continue
            out.append(
                RankExcess(
                    rank=int(ranks[i]), node=int(nodes[i]), cause=str(cause), spikes=int(k[i]), steps=int(n[i]),
                    rate=float(rate), others_rate=float(others_k / others_n) if others_n > 0 else 0.0,
                    mean_excess_ns=float(lost_c[i] / k[i]), time_lost_ns=float(lost_c[i]), p_value=p,
                    dispersion=phi,
                )  # fmt: skip
            )
    return sorted(out, key=lambda e: (-e.time_lost_ns, e.rank))


def working_gap_ranks(stragglers: Sequence[Mapping[str, Any]]) -> set[int]:
    """Ranks found working in their input gap: stragglers (or episodes) of the time between steps of
    kind gc or host_work. Their gap spikes that neither CPU nor GC time explains are that work preempted
    on a busy host, not waiting for input, so the diagnosis counts them as ``host_work``, not ``data``
    (docs/detection.md, "The work between steps"). Not a rank whose work lies outside the timed phases of
    a loop with a DataLoader (``kind_basis`` ``outside_phases``): its data spikes are its loader's fetch."""
    return {int(s["rank"]) for s in stragglers if s.get("between_steps") and s["kind"] in ("gc", "host_work")
            and s.get("kind_basis") != "outside_phases"}  # fmt: skip


def grouped(counts: Mapping[str, Sequence[float]], groups: Mapping[str, tuple[str, ...]]) -> dict[str, np.ndarray]:
    """Per-rank counts (or times) of each cause group."""
    out = {}
    for name, members in groups.items():
        parts = [np.nan_to_num(np.asarray(counts[c], dtype=np.float64)) for c in members if c in counts]
        if parts:
            out[name] = np.sum(parts, axis=0)
    return out


def excess_from_windows(
    windows: Mapping[str, np.ndarray], causes: Sequence[str], opts: DetectionOptions
) -> list[RankExcess]:
    """``rank_excess`` over window summaries (``judged_steps``, ``spikes_<cause>``, ``lost_ns_<cause>``
    summed per rank): the live detector's history and the offline summaries alike."""
    if "judged_steps" not in windows or len(windows["rank"]) == 0:
        return []
    rank = np.asarray(windows["rank"], dtype=np.int64)
    ranks, ri = np.unique(rank, return_inverse=True)
    nodes = np.zeros(ranks.size, dtype=np.int64)
    nodes[ri] = np.asarray(windows["node"], dtype=np.int64)

    def per_rank(name: str) -> np.ndarray:
        v = np.nan_to_num(np.asarray(windows[name], dtype=np.float64))
        return np.bincount(ri, weights=v, minlength=ranks.size)

    judged = np.asarray(windows["judged_steps"], dtype=np.float64)
    if np.isnan(judged).all():
        return []
    counts = {c: per_rank(f"spikes_{c}") for c in causes if f"spikes_{c}" in windows}
    lost = {c: per_rank(f"lost_ns_{c}") for c in causes if f"lost_ns_{c}" in windows}
    cpu = windows.get("cpu_ns_median")
    groups = cause_groups(list(counts), cpu is not None and bool(np.isfinite(np.asarray(cpu, dtype=float)).any()))
    per_window = grouped({c: windows[f"spikes_{c}"] for c in counts}, groups)
    chi = {name: dispersions(k, judged, ri, ranks.size) for name, k in per_window.items()}
    times = {c: t for c, t in cause_times(windows, ri, ranks.size).items() if groups.get(c) == (c,)}
    return rank_excess(ranks, nodes, per_rank("judged_steps"), grouped(counts, groups), grouped(lost, groups), opts,
                       dispersion=chi, times=times)  # fmt: skip

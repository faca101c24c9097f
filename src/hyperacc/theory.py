"""Spike theory: why a rare per-rank hiccup becomes a frequent cluster-wide stall.

Under a synchronous all-reduce the cluster's step is the slowest rank's step, so a step spikes for the
whole cluster when any rank spikes. With ``n`` nodes of ``r`` ranks each, a per-rank spike rate
``p_rank`` (a GC pause in one process) and a per-node rate ``p_node`` (a host-wide event that hits all
ranks of a node), independent across ranks and nodes::

    P(cluster step spikes) = 1 - (1 - p_rank)^(n*r) * (1 - p_node)^n

and the rate that keeps it under a target ``P`` is ``p_rank = 1 - ((1-P) / (1-p_node)^n)^(1/(n*r))``.
Step-time distributions are exact order statistics: with each rank's step ``X = base + noise + B*S``
(``noise ~ N(0, sigma)``, ``B ~ Bernoulli(p_rank)``, ``S`` a spike magnitude), the cluster step has
CDF ``F_node(x)^n`` with ``F_node(x) = (1-p_node) F_X(x)^r + p_node E_S[F_X(x-S)^r]``; its mean,
variance and quantiles are integrated numerically from that CDF (no Monte Carlo).

Reliability is a serial system: the job stops when any node fails, so
``MTBF_cluster = 1 / sum(1/MTBF_i)`` (``MTBF_node / n`` for identical nodes) and a job of length ``T``
survives with probability ``exp(-T / MTBF_cluster)``.

See docs/theory.md for the derivations and the seed's numbers reproduced.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

# The cluster spike probability the seed's "0.5 % at 64 nodes, 0.1-0.3 % at 256 nodes" corresponds to:
# a quarter of steps. docs/theory.md shows the arithmetic.
DEFAULT_TARGET = 0.25


def _scipy_special():  # noqa: ANN202
    """scipy is imported where a distribution is computed, not at import: a training rank imports this
    module (through the analysis options) but never computes one."""
    from scipy import special

    return special


def _scipy_stats():  # noqa: ANN202
    from scipy import stats

    return stats


class TheoryError(ValueError):
    """Impossible input; the message names the parameter and the valid range."""


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def _check_prob(name: str, p: float) -> float:
    if not (_is_number(p) and 0.0 <= p <= 1.0):  # NaN fails the comparison
        raise TheoryError(f"{name} must be a probability in [0, 1] (got {p})")
    return float(p)


def _check_count(name: str, n: int) -> int:
    if not _is_number(n) or not math.isfinite(n) or int(n) != n or n < 1:
        raise TheoryError(f"{name} must be a whole number >= 1 (got {n})")
    return int(n)


# Step times and spike sizes beyond this (in the caller's unit: 1e12 ms is 31 years) would overflow
# the second moment the order statistics integrate (x**2 over the grid).
MAX_TIME = 1e12


def _check_finite(
    name: str, x: float, low: float | None = None, low_open: bool = False, high: float | None = None
) -> float:
    """A finite number, at least (or above, ``low_open``) ``low`` and at most ``high``."""
    ok = _is_number(x) and math.isfinite(x)
    if ok and low is not None:
        ok = x > low if low_open else x >= low
    if ok and high is not None:
        ok = x <= high
    if not ok:
        bound = "" if low is None else f" {'>' if low_open else '>='} {low:g}"
        bound += "" if high is None else f"{' and' if bound else ''} <= {high:g}"
        raise TheoryError(f"{name} must be a finite number{bound} (got {x})")
    return float(x)


def cluster_spike_probability(
    p_rank: float, ranks_per_node: int = 1, nodes: int = 1, p_node: float = 0.0
) -> float:
    """Probability that at least one rank of the cluster spikes in a step."""
    p_rank, p_node = _check_prob("p_rank", p_rank), _check_prob("p_node", p_node)
    ranks_per_node, nodes = _check_count("ranks_per_node", ranks_per_node), _check_count("nodes", nodes)
    # log1p keeps precision for tiny rates at thousands of ranks
    log_clear = nodes * ranks_per_node * _log1m(p_rank) + nodes * _log1m(p_node)
    return float(-math.expm1(log_clear))


def _log1m(p: float) -> float:
    return -math.inf if p >= 1.0 else math.log1p(-p)


def required_rate(
    target: float, nodes: int, ranks_per_node: int = 1, p_node: float = 0.0, per: str = "rank"
) -> float:
    """The largest per-rank (``per="rank"``) or per-node (``per="node"``) spike rate that keeps the
    cluster spike probability at or under ``target``.

    With ``per="node"`` the node rate is a host-wide rate and ``p_node`` is ignored; with
    ``per="rank"`` an existing ``p_node`` uses up part of the budget and the target may be out of reach.
    """
    target = _check_prob("target", target)
    nodes, ranks_per_node = _check_count("nodes", nodes), _check_count("ranks_per_node", ranks_per_node)
    p_node = _check_prob("p_node", p_node)
    if per == "node":
        return float(-math.expm1(math.log1p(-target) / nodes)) if target < 1 else 1.0
    if per != "rank":
        raise TheoryError(f"per must be 'rank' or 'node' (got {per!r})")
    if target >= 1.0:
        return 1.0
    budget = math.log1p(-target) - nodes * _log1m(p_node)  # log of what ranks may still spend
    if budget > 0 or math.isnan(budget):
        floor = cluster_spike_probability(0.0, ranks_per_node, nodes, p_node)
        raise TheoryError(
            f"target {target:.4g} cannot be met at {nodes} nodes: node-level spikes alone give "
            f"{floor:.4g}; lower p_node or raise the target"
        )
    return float(-math.expm1(budget / (nodes * ranks_per_node)))


def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals] (exact, by integration)."""
    dist = ClusterStepModel(base=0.0, noise=1.0, p_rank=0.0)
    return dist.stats(nodes=_check_count("n", n)).mean


# ---------------------------------------------------------------- step-time order statistics


@dataclasses.dataclass(frozen=True)
class StepStats:
    nodes: int
    ranks: int
    mean: float
    std: float
    p50: float
    p99: float
    p_spike: float

    @property
    def cv(self) -> float:
        return self.std / self.mean if self.mean else float("nan")


@dataclasses.dataclass(frozen=True)
class ClusterStepModel:
    """Each rank's step = ``base + N(0, noise) + Bernoulli(p_rank) * S_rank``; each node additionally
    gets ``Bernoulli(p_node) * S_node`` on all its ranks. ``spike`` is the magnitude's distribution:
    ``fixed`` (exactly ``spike_size``), ``exp`` (mean ``spike_size``) or ``lognormal`` (median
    ``spike_size``, shape ``spike_sigma``). Units are whatever ``base`` is in (ms in the CLI)."""

    base: float = 100.0
    noise: float = 5.0
    p_rank: float = 0.0
    spike_size: float = 200.0
    spike: str = "fixed"
    spike_sigma: float = 0.5
    ranks_per_node: int = 1
    p_node: float = 0.0
    grid_points: int = 20001

    def __post_init__(self) -> None:
        _check_prob("p_rank", self.p_rank)
        _check_prob("p_node", self.p_node)
        _check_count("ranks_per_node", self.ranks_per_node)
        _check_finite("base", self.base, -MAX_TIME, high=MAX_TIME)
        _check_finite("noise", self.noise, 0.0, high=MAX_TIME)
        _check_finite("spike_size", self.spike_size, 0.0, high=MAX_TIME)
        _check_finite("spike_sigma", self.spike_sigma, 0.0, high=5.0)  # exp(7.5 sigma) bounds the grid
        if not (_is_number(self.grid_points) and 2 <= self.grid_points <= 10_000_000):
            raise TheoryError(f"grid_points must be a whole number in [2, 10,000,000] (got {self.grid_points})")
        if self.spike not in ("fixed", "exp", "lognormal"):
            raise TheoryError(f"spike must be fixed, exp or lognormal (got {self.spike!r})")

    # CDF of one spike's magnitude plus the noise, evaluated at t (array)
    def _noise_plus_spike_cdf(self, t: np.ndarray) -> np.ndarray:
        s, sig = self.spike_size, self.noise
        if self.spike == "fixed":
            return self._noise_cdf(t - s)
        if self.spike == "exp":
            if sig == 0:
                return np.where(t > 0, -np.expm1(-np.maximum(t, 0) / max(s, 1e-300)), 0.0)
            lam = 1.0 / max(s, 1e-300)
            # exponentially modified Gaussian CDF, the correction term kept in log space
            ls = lam * sig
            tail = np.exp(-lam * t + 0.5 * ls * ls + _scipy_special().log_ndtr(t / sig - ls))
            return np.clip(self._noise_cdf(t) - tail, 0.0, 1.0)
        # lognormal: midpoint rule over the magnitude's quantiles (K points)
        k = 1000
        q = (np.arange(k) + 0.5) / k
        mags = s * np.exp(self.spike_sigma * _scipy_stats().norm.ppf(q))
        out = np.zeros_like(t)
        for chunk in np.array_split(mags, 20):
            out += self._noise_cdf(t[:, None] - chunk[None, :]).sum(axis=1)
        return out / k

    def _noise_cdf(self, t: np.ndarray) -> np.ndarray:
        if self.noise == 0:
            return (t >= 0).astype(float)
        return _scipy_special().ndtr(t / self.noise)

    def _spike_upper(self) -> float:
        if self.spike == "fixed":
            return self.spike_size
        if self.spike == "exp":
            return self.spike_size * 40.0
        return self.spike_size * math.exp(self.spike_sigma * 7.5)

    def rank_cdf(self, x: np.ndarray) -> np.ndarray:
        t = np.asarray(x, float) - self.base
        clean = self._noise_cdf(t)
        if self.p_rank == 0:
            return clean
        return (1 - self.p_rank) * clean + self.p_rank * self._noise_plus_spike_cdf(t)

    def _node_magnitudes(self) -> np.ndarray:
        if self.spike == "fixed":
            return np.array([self.spike_size])
        q = (np.arange(400) + 0.5) / 400  # quantile midpoints of the node spike's magnitude
        if self.spike == "exp":
            return -self.spike_size * np.log1p(-q)
        return self.spike_size * np.exp(self.spike_sigma * _scipy_stats().norm.ppf(q))

    def cluster_cdf(self, x: np.ndarray, nodes: int) -> np.ndarray:
        """CDF of the cluster step (max over ``nodes * ranks_per_node`` ranks) at sorted points ``x``."""
        x = np.asarray(x, float)
        r = self.ranks_per_node
        f_rank = self.rank_cdf(x) ** r
        f_node = f_rank
        if self.p_node > 0:
            # E over the node spike's magnitude m of F(x - m)^r; F below the grid is ~0 (grid starts
            # 9 sigma under the base), so interpolation on the same grid is exact enough and cheap.
            shifted = np.mean([np.interp(x - m, x, f_rank, left=0.0) for m in self._node_magnitudes()], axis=0)
            f_node = (1 - self.p_node) * f_rank + self.p_node * shifted
        return f_node**nodes

    def stats(self, nodes: int) -> StepStats:
        nodes = _check_count("nodes", nodes)
        spread = max(self.noise, 1e-9)
        hi_extra = self._spike_upper() if (self.p_rank > 0 or self.p_node > 0) else 0.0
        lo = self.base - 9 * spread
        hi = self.base + 9 * spread + hi_extra + (2 * hi_extra if self.p_node > 0 else 0.0)
        # The max of many ranks sits far in the upper tail: start the grid where the clean CDF^N is ~0.
        x = np.linspace(lo, hi, self.grid_points)
        cdf = self.cluster_cdf(x, nodes)
        surv = 1.0 - cdf
        a = x[0]
        mean = a + np.trapezoid(surv, x)
        second = a * a + np.trapezoid(2 * x * surv, x)
        std = math.sqrt(max(second - mean * mean, 0.0))
        p50, p99 = np.interp([0.5, 0.99], cdf, x)
        p_spike = cluster_spike_probability(self.p_rank, self.ranks_per_node, nodes, self.p_node)
        return StepStats(nodes, nodes * self.ranks_per_node, float(mean), std, float(p50), float(p99), p_spike)


# ---------------------------------------------------------------- serial-system reliability


def cluster_mtbf(node_mtbf: float | Sequence[float], nodes: int | None = None) -> float:
    """MTBF of a serial system: one value and ``nodes`` (identical nodes), or one MTBF per node."""
    if _is_number(node_mtbf):
        if nodes is None:
            raise TheoryError("give nodes with a single node MTBF")
        return _check_finite("node_mtbf", node_mtbf, 0.0, low_open=True) / _check_count("nodes", nodes)
    values = [_check_finite("node_mtbf", v, 0.0, low_open=True) for v in node_mtbf]
    if not values:
        raise TheoryError("node_mtbf: give at least one node MTBF")
    return 1.0 / sum(1.0 / v for v in values)


def survival_probability(job_length: float, mtbf: float) -> float:
    """Probability that a job of ``job_length`` runs without interruption (exponential failures)."""
    job_length = _check_finite("job_length", job_length, 0.0)
    mtbf = _check_finite("mtbf", mtbf, 0.0, low_open=True)
    return math.exp(-job_length / mtbf)


def interruptions_per_day(mtbf_hours: float) -> float:
    return 24.0 / _check_finite("mtbf", mtbf_hours, 0.0, low_open=True)


# ---------------------------------------------------------------- the sweep the CLI prints


@dataclasses.dataclass(frozen=True)
class SweepRow:
    nodes: int
    ranks: int
    p_cluster: float
    required_p_rank: float | None
    step: StepStats | None
    mtbf_hours: float | None
    p_survive_job: float | None
    interruptions_per_day: float | None


def sweep(
    node_counts: Sequence[int],
    *,
    p_rank: float,
    ranks_per_node: int = 1,
    p_node: float = 0.0,
    target: float | None = DEFAULT_TARGET,
    model: ClusterStepModel | None = None,
    node_mtbf_hours: float | None = None,
    job_hours: float | None = None,
) -> list[SweepRow]:
    rows = []
    for n in node_counts:
        n = _check_count("nodes", n)
        req = required_rate(target, n, ranks_per_node, p_node) if target is not None else None
        step = model.stats(n) if model is not None else None
        mtbf = cluster_mtbf(node_mtbf_hours, n) if node_mtbf_hours is not None else None
        surv = survival_probability(job_hours, mtbf) if (mtbf and job_hours is not None) else None
        rows.append(
            SweepRow(
                nodes=n,
                ranks=n * ranks_per_node,
                p_cluster=cluster_spike_probability(p_rank, ranks_per_node, n, p_node),
                required_p_rank=req,
                step=step,
                mtbf_hours=mtbf,
                p_survive_job=surv,
                interruptions_per_day=interruptions_per_day(mtbf) if mtbf is not None else None,
            )
        )
    return rows

"""Inputs of the analysis tests: the faulty synthetic run's specification and hand-made window tables.

(A module of its own, not conftest, so that the names stay unambiguous when the whole suite runs.)"""

from __future__ import annotations

import numpy as np

from hyperacc.analysis.synthetic import SyntheticFault, SyntheticRun

SLOW_RANK, DATA_RANK, GC_RANK = 5, 2, 6

FAULTY = SyntheticRun(
    ranks=8,
    steps=2000,
    ranks_per_node=4,
    seed=3,
    faults=(
        SyntheticFault("slowdown", (SLOW_RANK,), factor=0.15),
        SyntheticFault("data_stall", (DATA_RANK,), rate=0.03, ms=60),
        SyntheticFault("gc", (GC_RANK,), rate=0.01, ms=50),
    ),
)

MS = 1e6


def windows(self_ms, comm_ms=None, nodes=None, data_ms=None, gc_ms=None, steps=50, window_steps=50):
    """A window table from (ranks x windows) matrices in ms; NaN means the rank sent nothing."""
    self_ms = np.asarray(self_ms, dtype=float)
    ranks, wins = self_ms.shape
    rows = [(r, w) for r in range(ranks) for w in range(wins) if not np.isnan(self_ms[r, w])]
    r_idx = np.array([r for r, _ in rows])
    w_idx = np.array([w for _, w in rows])

    def col(m, default=0.0):
        m = np.full(self_ms.shape, default) if m is None else np.asarray(m, dtype=float)
        return m[r_idx, w_idx] * MS

    nodes = np.zeros(ranks, dtype=int) if nodes is None else np.asarray(nodes)
    return {
        "rank": r_idx.astype(np.int32),
        "node": nodes[r_idx].astype(np.int32),
        "window": w_idx.astype(np.int64),
        "first_step": (w_idx * window_steps).astype(np.int64),
        "last_step": (w_idx * window_steps + window_steps - 1).astype(np.int64),
        "steps": np.full(len(rows), steps, dtype=np.int64),
        "self_ns_median": col(self_ms),
        "data_ns_median": col(data_ms, 1.0),
        "comm_wait_ns_median": col(comm_ms, 5.0),
        "launch_ns_median": np.full(len(rows), np.nan),
        "gc_ns_sum": col(gc_ms) * steps,
        "step_ns_median": col(self_ms) + col(comm_ms, 5.0),
    }


def noisy(ranks, wins, seed=0, base=100.0, sd=1.0):
    return base + sd * np.random.default_rng(seed).standard_normal((ranks, wins))


def host_noise_windows(ranks, wins, rng, base=12.0, sd=0.1, starve=0.03, episodes=False, nodes=None):
    """Window tables of exchangeable ranks on a shared host: each rank's window median is ``base`` ms
    with lognormal noise ``sd``, and in a share ``starve`` of (rank, window) pairs the rank lost its
    cores for a while (self-time 1.5-4x; with ``episodes`` often for two windows in a row). Wall time
    grew in those windows, CPU time did not (it is steadier: 2 % window to window, as measured on the
    jobs of bench/detection.py); the waits follow a synchronous all-reduce."""
    self_ms = base * rng.lognormal(0.0, sd, (ranks, wins))
    starved = rng.random((ranks, wins)) < starve
    if episodes:
        starved[:, 1:] |= starved[:, :-1] & (rng.random((ranks, wins - 1)) < 0.5)
    cpu_ms = 0.9 * base * rng.lognormal(0.0, 0.02, (ranks, wins))
    self_ms = self_ms * np.where(starved, rng.uniform(1.5, 4.0, (ranks, wins)), 1.0)
    comm = self_ms.max(axis=0) - self_ms + 20.0
    cols = windows(self_ms, comm, nodes=nodes)
    cols["cpu_ns_median"] = cpu_ms[cols["rank"], cols["window"]] * MS
    return cols, self_ms, cpu_ms

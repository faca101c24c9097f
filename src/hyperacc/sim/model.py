"""What the simulator assumes, one dataclass per part, and the vectorised draws that implement it.

Every formula here is written down in ``docs/pacing.md`` ("The simulator"). Times are nanoseconds in
float32/float64 arrays. Inside a chunk, per-rank arrays are laid out slot-major, ``[step, slot, node]``,
so that reductions over the GPUs of a node run over a middle axis with a long contiguous inner axis
(several times faster than reducing over 8 contiguous values); rank ``node * gpus_per_node + slot``
is column ``slot * nodes + node``.
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from hyperacc.options import OptionsError
from hyperacc.pacing.controller import PacingConfig

SPIKE_DISTS = ("fixed", "exp", "lognormal")
COMM_SCALES = ("fabric", "none")


SimConfigError = OptionsError  # the name before the one options error; public, kept as an alias


def _check(name: str, ok: bool, allowed: str, value: object) -> None:
    if not ok:
        raise SimConfigError(f"{name}={value!r} is invalid: it must be {allowed}")


@dataclasses.dataclass(frozen=True)
class ComputeModel:
    """Per-rank compute before the gradient collective (docs/pacing.md, "Compute")."""

    base_ms: float = 100.0
    noise_cv: float = 0.02  # Gaussian noise, as a fraction of the rank's mean compute
    locality_gpu: float = 0.0  # fixed offset of GPU slot j: locality_gpu x u_j, u_j ~ U(0,1) seeded
    locality_node: float = 0.0  # fixed offset of node k: locality_node x v_k, v_k ~ U(0,1) seeded
    spike_rate: float = 0.0  # p: probability that a rank spikes in a step
    spike_ms: float = 50.0  # magnitude: fixed, mean (exp) or median (lognormal)
    spike_dist: str = "exp"
    spike_sigma: float = 0.5  # lognormal shape
    node_spike_rate: float = 0.0  # probability that a whole node (all its ranks) spikes in a step
    node_spike_ms: float = 50.0
    # Stabilizers turn random pauses into deterministic ones: a pause of sync_ms on every rank at
    # once every sync_every steps (0: none). Lower spike_rate models the random pauses removed.
    sync_every: int = 0
    sync_ms: float = 0.0

    def __post_init__(self) -> None:
        _check("base_ms", self.base_ms > 0, "> 0", self.base_ms)
        _check("noise_cv", 0 <= self.noise_cv < 1, "in [0, 1)", self.noise_cv)
        _check("locality_gpu", self.locality_gpu >= 0, ">= 0", self.locality_gpu)
        _check("locality_node", self.locality_node >= 0, ">= 0", self.locality_node)
        _check("spike_rate", 0 <= self.spike_rate <= 1, "in [0, 1]", self.spike_rate)
        _check("node_spike_rate", 0 <= self.node_spike_rate <= 1, "in [0, 1]", self.node_spike_rate)
        _check("spike_ms", self.spike_ms >= 0, ">= 0", self.spike_ms)
        _check("node_spike_ms", self.node_spike_ms >= 0, ">= 0", self.node_spike_ms)
        _check(
            "spike_dist", self.spike_dist in SPIKE_DISTS, f"one of {', '.join(SPIKE_DISTS)}", self.spike_dist
        )
        _check("spike_sigma", self.spike_sigma >= 0, ">= 0", self.spike_sigma)
        _check("sync_every", self.sync_every >= 0, ">= 0", self.sync_every)
        _check("sync_ms", self.sync_ms >= 0, ">= 0", self.sync_ms)


@dataclasses.dataclass(frozen=True)
class FabricModel:
    """The exposed gradient all-reduce (docs/pacing.md, "All-reduce and fabric")."""

    exposed_mb: float = 100.0  # gradient bytes whose all-reduce is not hidden behind compute
    intra_gbps: float = 200.0  # GB/s per GPU inside a node (NVLink-class)
    inter_gbps: float = 50.0  # GB/s per node into the fabric (400 Gb/s NIC)
    intra_latency_us: float = 5.0
    inter_latency_us: float = 10.0
    nodes_per_leaf: int = 16  # nodes under one leaf switch (non-blocking inside a leaf)
    oversubscription: float = 1.0  # leaf uplink oversubscription (>= 1); applies once a job spans leaves
    background_load: float = 0.0  # mean fraction of an uplink used by other jobs, per leaf per step
    background_concentration: float = 20.0  # Beta(k m, k (1 - m)) concentration: lower = burstier

    def __post_init__(self) -> None:
        _check("exposed_mb", self.exposed_mb >= 0, ">= 0", self.exposed_mb)
        _check("intra_gbps", self.intra_gbps > 0, "> 0", self.intra_gbps)
        _check("inter_gbps", self.inter_gbps > 0, "> 0", self.inter_gbps)
        _check("intra_latency_us", self.intra_latency_us >= 0, ">= 0", self.intra_latency_us)
        _check("inter_latency_us", self.inter_latency_us >= 0, ">= 0", self.inter_latency_us)
        _check("nodes_per_leaf", self.nodes_per_leaf >= 1, ">= 1", self.nodes_per_leaf)
        _check("oversubscription", self.oversubscription >= 1, ">= 1", self.oversubscription)
        _check("background_load", 0 <= self.background_load < 1, "in [0, 1)", self.background_load)
        _check(
            "background_concentration",
            self.background_concentration > 0,
            "> 0",
            self.background_concentration,
        )


@dataclasses.dataclass(frozen=True)
class EarlyArrivalCost:
    """What arriving early costs (docs/pacing.md, "Early-arrival cost"). All zero: a pure max model."""

    spin_cost: float = 0.0  # beta: slowdown of a computing rank per spinning peer of its node, / (g-1)
    sleep_cost: float = 0.0  # a paced (sleeping) peer costs this fraction of a spinning one
    burst_cost: float = 0.0  # gamma: all-reduce x (1 + gamma x fraction of ranks starting together)
    burst_window_us: float = 500.0  # "together": starting within this window of the last rank

    def __post_init__(self) -> None:
        _check("spin_cost", self.spin_cost >= 0, ">= 0", self.spin_cost)
        _check("sleep_cost", 0 <= self.sleep_cost <= 1, "in [0, 1]", self.sleep_cost)
        _check("burst_cost", self.burst_cost >= 0, ">= 0", self.burst_cost)
        _check("burst_window_us", self.burst_window_us >= 0, ">= 0", self.burst_window_us)


@dataclasses.dataclass(frozen=True)
class SimConfig:
    nodes: int = 4
    gpus_per_node: int = 8
    steps: int = 10_000
    seed: int = 0
    samples_per_rank: int = 32  # per step, for throughput in samples/s
    compute: ComputeModel = dataclasses.field(default_factory=ComputeModel)
    fabric: FabricModel = dataclasses.field(default_factory=FabricModel)
    cost: EarlyArrivalCost = dataclasses.field(default_factory=EarlyArrivalCost)
    pacing: PacingConfig | None = dataclasses.field(default_factory=PacingConfig)  # None: no paced run
    slow_step_frac: float = 0.1  # a step is "slow" above (1 + this) x the baseline median
    measured_spike_frac: float = 0.5  # --from-run: a rank spikes above (1 + this) x its median compute
    replay_block: int = 50  # --from-run: consecutive measured steps replayed together (time correlation)
    comm_scale: str = "fabric"  # --from-run: "fabric" scales the measured transfer to the target shape, "none"
    pace_every: int = 1  # the controller observes and re-plans every k-th step (1: every step, as in a job)

    def __post_init__(self) -> None:
        _check("nodes", self.nodes >= 1, ">= 1", self.nodes)
        _check("gpus_per_node", self.gpus_per_node >= 1, ">= 1", self.gpus_per_node)
        _check("ranks (nodes x gpus_per_node)", self.ranks <= 65536, "<= 65536", self.ranks)
        _check("steps", self.steps >= 1, ">= 1", self.steps)
        _check("samples_per_rank", self.samples_per_rank >= 1, ">= 1", self.samples_per_rank)
        _check("slow_step_frac", self.slow_step_frac > 0, "> 0", self.slow_step_frac)
        _check("pace_every", self.pace_every >= 1, ">= 1", self.pace_every)
        _check("measured_spike_frac", self.measured_spike_frac > 0, "> 0", self.measured_spike_frac)
        _check("replay_block", self.replay_block >= 1, ">= 1", self.replay_block)
        _check("comm_scale", self.comm_scale in COMM_SCALES, f"one of {', '.join(COMM_SCALES)}", self.comm_scale)

    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus_per_node


# ---------------------------------------------------------------------------- compute


def locality_offsets(cfg: SimConfig) -> np.ndarray:
    """Fixed fractional offset of each rank, slot-major ``[slot, node]``; stable as ``nodes`` grows."""
    c = cfg.compute
    slot = np.random.default_rng([cfg.seed, 101]).random(cfg.gpus_per_node) * c.locality_gpu
    node = np.random.default_rng([cfg.seed, 102]).random(cfg.nodes) * c.locality_node
    return (slot[:, None] + node[None, :]).astype(np.float32)


def bernoulli_positions(rng: np.random.Generator, size: int, p: float) -> np.ndarray:
    """Indices in ``range(size)`` of independent Bernoulli(p) successes, drawn by geometric gaps."""
    if p <= 0 or size <= 0:
        return np.zeros(0, np.int64)
    if p >= 1:
        return np.arange(size, dtype=np.int64)
    out: list[np.ndarray] = []
    start = -1
    while True:
        expect = size * p
        n = int(expect + 6 * math.sqrt(expect * (1 - p)) + 16)
        pos = start + np.cumsum(rng.geometric(p, n), dtype=np.int64)
        out.append(pos[pos < size])
        if pos[-1] >= size:
            break
        start = int(pos[-1])
    return np.concatenate(out)


def spike_magnitudes(rng: np.random.Generator, n: int, ms: float, dist: str, sigma: float) -> np.ndarray:
    if dist == "fixed":
        return np.full(n, ms * 1e6, np.float32)
    if dist == "exp":
        return (rng.exponential(ms * 1e6, n)).astype(np.float32)
    return (ms * 1e6 * np.exp(sigma * rng.standard_normal(n))).astype(np.float32)


def draw_compute(
    rng: np.random.Generator, cfg: SimConfig, first_step: int, steps: int, offsets: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Compute time of every rank in ``steps`` steps: ``(C[step, slot, node] ns, spiked[step])``."""
    c = cfg.compute
    g, n = cfg.gpus_per_node, cfg.nodes
    out = np.empty((steps, g, n), np.float32)
    mean = (c.base_ms * 1e6) * (1.0 + offsets)  # [slot, node]
    if c.noise_cv > 0:
        rng.standard_normal(out=out, dtype=np.float32)
        out *= np.float32(c.noise_cv)
        out += np.float32(1.0)
        np.maximum(out, np.float32(0.0), out=out)
        out *= mean[None]
    else:
        out[:] = mean[None]
    spiked = np.zeros(steps, bool)
    flat = out.reshape(-1)
    pos = bernoulli_positions(rng, flat.size, c.spike_rate)
    if pos.size:
        np.add.at(flat, pos, spike_magnitudes(rng, pos.size, c.spike_ms, c.spike_dist, c.spike_sigma))
        spiked[pos // (g * n)] = True
    npos = bernoulli_positions(rng, steps * n, c.node_spike_rate)
    if npos.size:
        t, k = npos // n, npos % n
        mag = spike_magnitudes(rng, npos.size, c.node_spike_ms, c.spike_dist, c.spike_sigma)
        for j in range(g):  # the whole node pauses: every slot of node k
            np.add.at(out[:, j, :], (t, k), mag)
        spiked[t] = True
    if c.sync_every > 0 and c.sync_ms > 0:
        idx = np.arange(first_step, first_step + steps)
        out[idx % c.sync_every == 0] += np.float32(c.sync_ms * 1e6)
    return out, spiked


# ---------------------------------------------------------------------------- all-reduce


def allreduce_ns(fabric: FabricModel, nodes: int, gpus_per_node: int, uplink_load: np.ndarray | float = 0.0):
    """Time of the exposed hierarchical all-reduce: intra-node ring, then inter-node across leaves.

    ``uplink_load`` is the busiest leaf uplink's background load in each step (0 inside one leaf).
    """
    m = fabric.exposed_mb * 1e6
    g = gpus_per_node
    intra = 0.0
    if g > 1:
        intra = (
            2 * (g - 1) / g * m / (fabric.intra_gbps * 1e9) * 1e9
            + 2 * (g - 1) * fabric.intra_latency_us * 1e3
        )
    inter: np.ndarray | float = 0.0
    if nodes > 1:
        bw = fabric.inter_gbps * 1e9
        if nodes > fabric.nodes_per_leaf:
            bw = bw / fabric.oversubscription
        bw = bw * (1.0 - np.asarray(uplink_load, dtype=np.float64))
        inter = (
            2 * (nodes - 1) / nodes * m / bw * 1e9
            + 2 * math.ceil(math.log2(nodes)) * fabric.inter_latency_us * 1e3
        )
    return intra + inter


def draw_comm(rng: np.random.Generator, cfg: SimConfig, steps: int) -> np.ndarray:
    """All-reduce time of each step: background load on the busiest uplink of the leaves spanned."""
    f = cfg.fabric
    leaves = math.ceil(cfg.nodes / f.nodes_per_leaf)
    load: np.ndarray | float = 0.0
    if leaves > 1 and f.background_load > 0:
        k = f.background_concentration
        load = rng.beta(k * f.background_load, k * (1 - f.background_load), size=(steps, leaves)).max(axis=1)
        load = np.minimum(load, 0.95)  # a saturated uplink still moves some traffic
    return np.broadcast_to(
        np.asarray(allreduce_ns(f, cfg.nodes, cfg.gpus_per_node, load), np.float64), (steps,)
    )


# ---------------------------------------------------------------------------- early-arrival cost


def finish_no_delay_max(chunk: np.ndarray, cost: EarlyArrivalCost) -> np.ndarray:
    """Latest compute finish of each step under the spin cost, with no pacing: ``[steps]``.

    Within a node the finish f_r = c_r + beta/(g-1) x sum_i (c_r - c_i)+ grows with c_r, so the node's
    last finisher is its slowest rank and f = c_max + beta/(g-1) x (g c_max - sum c).
    """
    g = chunk.shape[1]
    cmax = chunk.max(axis=1)  # [steps, node]
    if cost.spin_cost > 0 and g > 1:
        csum = chunk.sum(axis=1, dtype=np.float64)
        fin = cmax + cost.spin_cost / (g - 1) * (g * cmax.astype(np.float64) - csum)
        return fin.max(axis=1)
    return cmax.max(axis=1).astype(np.float64)


def finish_times(c: np.ndarray, delay: np.ndarray, cost: EarlyArrivalCost) -> np.ndarray:
    """Compute finish of every rank of one step, ``[slot, node]``, with peers spinning or sleeping.

    A peer i spins from e_i = c_i + d_i (its collective start) and sleeps in [c_i, e_i). A computing rank
    r is slowed by beta/(g-1) per spinning peer, and sleep_cost x that per sleeping peer (first order).
    """
    g = c.shape[0]
    if cost.spin_cost <= 0 or g < 2:
        return c.astype(np.float64)
    c64 = c.astype(np.float64)
    e = c64 + delay
    # pairwise over the slots of each node: [r, i, node]
    spin = c64[:, None, :] - e[None, :, :]
    np.maximum(spin, 0.0, out=spin)
    extra = spin.sum(axis=1)
    if cost.sleep_cost > 0:
        slept = np.minimum(c64[:, None, :], e[None, :, :]) - c64[None, :, :]
        np.maximum(slept, 0.0, out=slept)
        extra += cost.sleep_cost * slept.sum(axis=1)
    return c64 + cost.spin_cost / (g - 1) * extra


def burst_factor(starts: np.ndarray, cost: EarlyArrivalCost) -> float:
    """1 + gamma x fraction of ranks starting the collective within the window of the last one."""
    if cost.burst_cost <= 0:
        return 1.0
    last = starts.max()
    together = np.count_nonzero(starts >= last - cost.burst_window_us * 1e3)
    return 1.0 + cost.burst_cost * together / starts.size


def burst_factor_rows(starts: np.ndarray, cost: EarlyArrivalCost) -> np.ndarray:
    """``burst_factor`` for every step of a chunk ``[steps, ...]``."""
    if cost.burst_cost <= 0:
        return np.ones(starts.shape[0])
    flat = starts.reshape(starts.shape[0], -1)
    last = flat.max(axis=1, keepdims=True)
    together = np.count_nonzero(flat >= last - cost.burst_window_us * 1e3, axis=1)
    return 1.0 + cost.burst_cost * together / flat.shape[1]


# ---------------------------------------------------------------------------- trace-driven compute


@dataclasses.dataclass
class MeasuredRun:
    """A traced run as the replay needs it: every measured rank's compute and wait at every measured
    step (``[ranks, steps]``, NaN where a rank has no record). A step's transfer time (``comm_ns``) is
    the wait of its last arrival, the rank with the most compute (the smallest wait when that rank's
    wait is missing)."""

    path: str
    compute: np.ndarray  # [measured rank, step] ns; NaN = not recorded
    wait: np.ndarray  # [measured rank, step] ns; NaN = not recorded
    ranks: int
    steps: int
    nodes: int = 1
    first_step: int = 0

    @property
    def comm_ns(self) -> np.ndarray:
        """Per measured step: the last arrival's wait (NaN when no rank measured one)."""
        filled = np.where(np.isfinite(self.compute), self.compute, -np.inf)
        last = filled.argmax(axis=0)
        comm = self.wait[last, np.arange(self.wait.shape[1])]
        with np.errstate(all="ignore"):
            fallback = np.nanmin(np.where(np.isfinite(self.wait), self.wait, np.nan), axis=0) if self.wait.size else comm
        return np.where(np.isfinite(comm), comm, fallback)

    @property
    def compute_ns(self) -> list[np.ndarray]:
        """Each measured rank's recorded compute samples."""
        return [row[np.isfinite(row)] for row in self.compute]

    @classmethod
    def from_run_dir(cls, run_dir: str | os.PathLike, skip_steps: int = 5) -> MeasuredRun:
        """Read ``self_ns`` (plus the time after the collective, when recorded) of every rank.

        Compute of a step = self_ns + max(0, step_ns - self_ns - comm_wait_ns - pace_delay_ns); the first
        ``skip_steps`` steps (start-up) are left out. Steps are aligned across ranks by their index.
        """
        from hyperacc.store import RunDirError, read_steps

        names = ["rank", "node", "step", "self_ns", "step_ns", "comm_wait_ns", "pace_delay_ns"]
        table = read_steps(run_dir, columns=names)
        if table.num_rows == 0:
            raise RunDirError(f"{run_dir} holds no step records; trace a job into it first")
        cols = {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}
        rank = cols["rank"].astype(np.int64)
        step = cols["step"].astype(np.int64)
        self_ns = np.asarray(cols["self_ns"], dtype=np.float64)  # nulls become NaN
        step_ns = np.asarray(cols["step_ns"], dtype=np.float64)
        wait_ns = np.asarray(cols["comm_wait_ns"], dtype=np.float64)
        keep = (step >= step.min() + skip_steps) & np.isfinite(self_ns) & (self_ns > 0)
        if not keep.any():
            raise RunDirError(f"{run_dir} has no measured self_ns after the first {skip_steps} steps")
        delay_ns = np.nan_to_num(np.asarray(cols["pace_delay_ns"], dtype=np.float64), nan=0.0)
        # after the collective (optimizer, ...); a pacing delay is neither compute nor wait
        post = np.where(
            np.isfinite(step_ns) & np.isfinite(wait_ns), step_ns - self_ns - wait_ns - delay_ns, 0.0
        )
        compute = self_ns + np.maximum(post, 0.0)
        ranks = np.array(sorted(set(rank[keep].tolist())))
        steps_kept = np.unique(step[keep])
        row = np.searchsorted(ranks, rank[keep])
        col = np.searchsorted(steps_kept, step[keep])
        matrix = np.full((ranks.size, steps_kept.size), np.nan)
        matrix[row, col] = compute[keep]
        waits = np.full((ranks.size, steps_kept.size), np.nan)
        waits[row, col] = wait_ns[keep]
        nodes = len(set(np.asarray(cols["node"])[keep].tolist()))
        return cls(str(run_dir), matrix, waits, int(ranks.size), int(steps_kept.size), nodes, int(steps_kept[0]))

    def spike_threshold(self, frac: float) -> list[float]:
        """Per measured rank: a step is a spike above (1 + frac) x that rank's median compute."""
        return [float(np.median(s)) * (1.0 + frac) for s in self.samples_nonempty()]

    def samples_nonempty(self) -> list[np.ndarray]:
        return [s for s in self.compute_ns if s.size]

    def spike_rates(self, frac: float) -> np.ndarray:
        return np.array(
            [
                float(np.mean(s > t))
                for s, t in zip(self.samples_nonempty(), self.spike_threshold(frac), strict=True)
            ]
        )

    def replayable(self) -> tuple[np.ndarray, np.ndarray]:
        """The measured steps every rank recorded: ``(compute [ranks, steps], comm [steps])``; a step
        without a measured wait gets the median transfer."""
        full = np.isfinite(self.compute).all(axis=0)
        if not full.any():
            from hyperacc.store import RunDirError

            raise RunDirError(f"{self.path}: no step was recorded by every rank; it cannot be replayed")
        comm = self.comm_ns[full]
        fill = float(np.nanmedian(comm)) if np.isfinite(comm).any() else 0.0
        return self.compute[:, full], np.where(np.isfinite(comm), comm, fill)


def measured_rank_map(cfg: SimConfig, measured_ranks: int) -> np.ndarray:
    """Measured rank standing in for each simulated rank, slot-major ``[slot, node]``: rank % measured."""
    g, n = cfg.gpus_per_node, cfg.nodes
    rank = np.arange(n)[None, :] * g + np.arange(g)[:, None]
    return rank % measured_ranks


def replica_map(cfg: SimConfig, measured_ranks: int) -> np.ndarray:
    """Which copy of the measured job each simulated rank belongs to, slot-major: rank // measured."""
    g, n = cfg.gpus_per_node, cfg.nodes
    rank = np.arange(n)[None, :] * g + np.arange(g)[:, None]
    return rank // measured_ranks


def block_steps(rng: np.random.Generator, total: int, length: int, count: int, start: int) -> np.ndarray:
    """Measured step indices for ``count`` simulated steps: runs of ``length`` consecutive measured
    steps from random starting points (a moving-block bootstrap), continuing a run across chunks from
    ``start`` (the simulated step of the chunk's first row)."""
    length = max(1, min(length, total))
    first_block = start // length
    last_block = (start + count - 1) // length
    starts = rng.integers(0, total - length + 1, last_block - first_block + 1)
    offsets = np.arange(start, start + count)
    return starts[offsets // length - first_block] + offsets % length


def draw_measured_compute(
    rng: np.random.Generator, cfg: SimConfig, run: MeasuredRun, first_step: int, steps: int, spike_frac: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Replay measured steps: ``(compute [step, slot, node] ns, spiked [step], comm [step] ns)``.

    Each copy of the measured job (simulated ranks ``k*M .. k*M + M-1``) replays whole measured steps,
    every rank at the same measured step, in blocks of ``cfg.replay_block`` consecutive steps; copies
    draw their blocks independently. The transfer is the measured one of copy 0's step. A step counts as
    spiked when some rank exceeds (1 + spike_frac) x its measured rank's median.
    """
    compute, comm = run.replayable()
    total = compute.shape[1]
    which = measured_rank_map(cfg, run.ranks)  # [slot, node]
    replica = replica_map(cfg, run.ranks)
    copies = int(replica.max()) + 1
    # one independent stream per copy, seeded by the chunk's stream: copies never share a block sequence
    idx = np.stack([block_steps(np.random.default_rng([int(rng.integers(1 << 62)), k]), total, cfg.replay_block,
                                steps, first_step) for k in range(copies)])  # fmt: skip
    out = compute[which[None], idx[replica[None], np.arange(steps)[:, None, None]]].astype(np.float32)
    thresholds = np.array(run.spike_threshold(spike_frac), np.float32)
    spiked = (out > thresholds[which][None]).reshape(steps, -1).any(axis=1)
    return out, spiked, comm[idx[0]]

"""Bulk-synchronous data-parallel training, simulated step by step over chunks of steps.

For each chunk the compute of every rank in every step is drawn at once (``model.draw_compute`` or a
resample of a measured run), then:

- without pacing, each step ends at the latest collective start plus the all-reduce: fully vectorised
  over the chunk;
- with pacing, the real ``PacingController`` plans each step's delays from the observations of the
  steps before it, so the chunk is walked step by step with vector operations over ranks.

Both variants see the same draws, so their difference is the effect of pacing alone.
docs/pacing.md ("The simulator") documents the model and its parameters.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence

import numpy as np

from hyperacc.pacing.controller import PacingController
from hyperacc.sim.model import (
    MeasuredRun,
    SimConfig,
    allreduce_ns,
    burst_factor,
    burst_factor_rows,
    draw_comm,
    draw_compute,
    draw_measured_compute,
    finish_no_delay_max,
    finish_times,
    locality_offsets,
    measured_rank_map,
)
from hyperacc.theory import cluster_spike_probability

CHUNK_ELEMENTS = 4_000_000  # rank-steps drawn at once (~16 MB per float32 array)
WRITE_LIMIT = 5_000_000  # rank-steps a simulated run directory may hold

Progress = Callable[[int], None]


@dataclasses.dataclass
class RunSummary:
    """Step-time statistics of one variant (baseline or paced) at one cluster size."""

    mean_ms: float
    p50_ms: float
    p99_ms: float
    cv: float
    throughput: float  # samples/s
    slow_fraction: float  # steps above (1 + slow_step_frac) x the baseline median
    efficiency: float = math.nan  # throughput / (linear scaling of the smallest size in the sweep)
    pace_on_fraction: float = 0.0  # steps in which pacing was on
    mean_delay_ms: float = 0.0  # mean delay over ranks and steps
    switches: int = 0


@dataclasses.dataclass
class NodeResult:
    nodes: int
    gpus_per_node: int
    ranks: int
    steps: int
    spike_fraction: float  # steps in which at least one rank (or node) spiked, ground truth
    spike_fraction_se: float  # its Monte Carlo standard error
    theory_spike_probability: float
    baseline: RunSummary
    paced: RunSummary | None
    baseline_ns: np.ndarray | None = None  # per-step times, when kept
    paced_ns: np.ndarray | None = None

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.pop("baseline_ns")
        out.pop("paced_ns")
        return out


def summarize(step_ns: np.ndarray, ranks: int, samples_per_rank: int, slow_above_ns: float) -> RunSummary:
    mean = float(step_ns.mean())
    p50, p99 = np.percentile(step_ns, [50, 99])
    return RunSummary(
        mean_ms=mean / 1e6,
        p50_ms=float(p50) / 1e6,
        p99_ms=float(p99) / 1e6,
        cv=float(step_ns.std() / mean) if mean > 0 else 0.0,
        throughput=ranks * samples_per_rank / (mean / 1e9) if mean > 0 else 0.0,
        slow_fraction=float(np.mean(step_ns > slow_above_ns)),
    )


def _chunk_steps(cfg: SimConfig) -> int:
    return max(8, min(cfg.steps, CHUNK_ELEMENTS // cfg.ranks))


def comm_scale(cfg: SimConfig, measured: MeasuredRun) -> float:
    """The factor applied to the measured transfer: the fabric model's ratio between the target shape
    and the measured one (1 at the measured shape, with ``comm_scale="none"``, or when it cannot tell)."""
    if cfg.comm_scale == "none":
        return 1.0
    mnodes = max(1, measured.nodes)
    mgpus = max(1, measured.ranks // mnodes)
    if (mnodes, mgpus) == (cfg.nodes, cfg.gpus_per_node):
        return 1.0
    here = float(allreduce_ns(cfg.fabric, mnodes, mgpus))
    there = float(allreduce_ns(cfg.fabric, cfg.nodes, cfg.gpus_per_node))
    return there / here if here > 0 and there > 0 else 1.0


def replay_assumptions(cfg: SimConfig, measured: MeasuredRun) -> list[str]:
    """Every assumption a trace-driven simulation applies, in words (``hyperacc simulate`` prints them)."""
    m, ranks = measured.ranks, cfg.ranks
    copies = -(-ranks // m)
    f = cfg.fabric
    scale = comm_scale(cfg, measured)
    out = [
        f"measured: {m} ranks on {measured.nodes} node(s), {measured.steps} steps from {measured.path} "
        "(start-up steps left out)",
        "compute of a rank in a step = self-time + time after the collective (wait and pacing delay excluded)",
        f"replay: simulated rank r replays measured rank r mod {m}; {copies} cop{'y' if copies == 1 else 'ies'} "
        f"of the measured job; within a copy every rank replays the same measured step (cross-rank "
        f"correlation kept), in runs of {cfg.replay_block} consecutive steps (over-time correlation kept "
        "within a run); copies draw their runs independently",
        "compute does not change with scale: no contention between more ranks per node is modelled",
    ]
    if scale == 1.0:
        why = "the measured shape" if cfg.comm_scale == "fabric" else "--comm-scale none"
        out.append(f"all-reduce: the measured transfer of the replayed step (copy 0), unscaled ({why})")
    else:
        out.append(
            f"all-reduce: the measured transfer x {scale:.3g}, the fabric model's ratio between "
            f"{cfg.nodes} x {cfg.gpus_per_node} and {measured.nodes} x {measured.ranks // max(1, measured.nodes)} "
            f"(exposed {f.exposed_mb:g} MB, intra {f.intra_gbps:g} GB/s, inter {f.inter_gbps:g} GB/s, "
            f"{f.nodes_per_leaf} nodes per leaf, oversubscription {f.oversubscription:g}); --comm-scale none keeps it"
        )
    c = cfg.cost
    if c.spin_cost or c.burst_cost:
        out.append(f"early-arrival cost on top of the replay: spin {c.spin_cost:g}, sleep {c.sleep_cost:g}, "
                   f"burst {c.burst_cost:g}")  # fmt: skip
    out.append(f"spike: a rank's step above (1 + {cfg.measured_spike_frac:g}) x its measured median; theory "
               "column = 1 - prod(1 - each simulated rank's measured spike rate)")  # fmt: skip
    return out


def simulate(
    cfg: SimConfig,
    measured: MeasuredRun | None = None,
    progress: Progress | None = None,
    keep_steps: bool = False,
    write_run: str | os.PathLike | None = None,
) -> NodeResult:
    """Simulate ``cfg.steps`` steps at ``cfg.nodes x cfg.gpus_per_node`` ranks, with and without pacing."""
    g, n, R, steps = cfg.gpus_per_node, cfg.nodes, cfg.ranks, cfg.steps
    if write_run is not None and R * steps > WRITE_LIMIT:
        raise ValueError(
            f"a simulated run directory of {R} ranks x {steps} steps is too large (limit {WRITE_LIMIT:,} "
            "rank-steps); lower --steps or the node count"
        )
    offsets = locality_offsets(cfg)
    ctl = PacingController(cfg.pacing, ranks=R) if cfg.pacing is not None else None
    base = np.empty(steps)
    paced = np.empty(steps) if ctl else None
    spiked = np.empty(steps, bool)
    on_steps = 0
    delay_sum = 0.0
    scale = comm_scale(cfg, measured) if measured is not None else 1.0
    writer = _RunWriter(write_run, cfg, with_pacing=ctl is not None) if write_run is not None else None
    chunk = _chunk_steps(cfg)
    cost = cfg.cost
    every = cfg.pace_every
    d = np.zeros((g, n), np.int64)

    for t0 in range(0, steps, chunk):
        T = min(chunk, steps - t0)
        rng = np.random.default_rng([cfg.seed, n, g, t0])
        if measured is None:
            C, sp = draw_compute(rng, cfg, t0, T, offsets)
            comm = draw_comm(rng, cfg, T)
        else:
            C, sp, comm = draw_measured_compute(rng, cfg, measured, t0, T, cfg.measured_spike_frac)
            comm = comm * scale
        spiked[t0 : t0 + T] = sp

        # Without pacing: vectorised over the chunk.
        if cost.burst_cost > 0 or writer is not None:
            zero = np.zeros((g, n))
            fin = np.stack([finish_times(C[i], zero, cost) for i in range(T)]) if cost.spin_cost > 0 else C
            base[t0 : t0 + T] = fin.reshape(T, -1).max(axis=1) + comm * burst_factor_rows(fin, cost)
            if writer is not None:
                writer.add(False, t0, fin, np.zeros_like(fin), base[t0 : t0 + T], None)
        else:
            base[t0 : t0 + T] = finish_no_delay_max(C, cost) + comm

        # With pacing: the controller plans step t from the observations of the steps before it.
        if ctl is not None and paced is not None:
            starts_kept = [] if writer is not None else None
            delays_kept = [] if writer is not None else None
            on_kept = [] if writer is not None else None
            for i in range(T):
                step = t0 + i
                update = step % every == 0
                if update:
                    d = ctl.plan(step).reshape(g, n)
                f = finish_times(C[i], d, cost)
                s = f + d
                last = float(s.max())
                t_step = last + float(comm[i]) * burst_factor(s, cost)
                paced[step] = t_step
                if update:
                    flat = s.reshape(-1)
                    ctl.observe(step, flat, t_step - flat)
                if ctl.on:
                    on_steps += 1
                delay_sum += float(d.sum())
                if starts_kept is not None:
                    starts_kept.append(f)
                    delays_kept.append(d.astype(np.float64))
                    on_kept.append((ctl.on, ctl.state.spread_ns))
            if writer is not None:
                writer.add(
                    True, t0, np.stack(starts_kept), np.stack(delays_kept), paced[t0 : t0 + T], on_kept
                )
        if progress is not None:
            progress(T)

    if writer is not None:
        writer.close()
    p_rank, p_node, theory = _theory(cfg, measured)
    frac = float(spiked.mean())
    slow_above = float(np.median(base)) * (1.0 + cfg.slow_step_frac)
    base_sum = summarize(base, R, cfg.samples_per_rank, slow_above)
    paced_sum = None
    if paced is not None and ctl is not None:
        paced_sum = summarize(paced, R, cfg.samples_per_rank, slow_above)
        paced_sum.pace_on_fraction = on_steps / steps
        paced_sum.mean_delay_ms = delay_sum / (steps * R) / 1e6
        paced_sum.switches = ctl.state.switches
    return NodeResult(
        nodes=n,
        gpus_per_node=g,
        ranks=R,
        steps=steps,
        spike_fraction=frac,
        spike_fraction_se=math.sqrt(max(frac * (1 - frac), 1e-12) / steps),
        theory_spike_probability=theory,
        baseline=base_sum,
        paced=paced_sum,
        baseline_ns=base if keep_steps else None,
        paced_ns=paced if keep_steps else None,
    )


def _theory(cfg: SimConfig, measured: MeasuredRun | None) -> tuple[float, float, float]:
    if measured is None:
        c = cfg.compute
        p = cluster_spike_probability(c.spike_rate, cfg.gpus_per_node, cfg.nodes, c.node_spike_rate)
        return c.spike_rate, c.node_spike_rate, p
    # each simulated rank inherits its measured rank's spike rate
    rates = measured.spike_rates(cfg.measured_spike_frac)
    which = measured_rank_map(cfg, rates.size).reshape(-1)
    p_none = float(np.exp(np.sum(np.log1p(-np.minimum(rates[which], 1 - 1e-12)))))
    return float(rates.mean()), 0.0, 1.0 - p_none


def sweep(
    cfg: SimConfig,
    node_counts: Sequence[int],
    measured: MeasuredRun | None = None,
    progress: Progress | None = None,
    keep_steps: bool = False,
) -> list[NodeResult]:
    """``simulate`` at each node count; efficiency is relative to linear scaling of the first size."""
    results = [
        simulate(dataclasses.replace(cfg, nodes=k), measured, progress, keep_steps=keep_steps)
        for k in node_counts
    ]
    if results:
        ref = results[0]
        for r in results:
            scale = r.ranks / ref.ranks
            r.baseline.efficiency = r.baseline.throughput / (ref.baseline.throughput * scale)
            if r.paced is not None:
                r.paced.efficiency = r.paced.throughput / (ref.baseline.throughput * scale)
    return results


class _RunWriter:
    """Writes the simulated steps as a run directory (source ``simulator``) in the shared schema."""

    def __init__(self, run_dir: str | os.PathLike, cfg: SimConfig, with_pacing: bool) -> None:
        import socket

        import pyarrow as pa

        from hyperacc.schema import RankMeta
        from hyperacc.store import step_writer, write_meta

        self.pa = pa
        self.cfg = cfg
        self.with_pacing = with_pacing
        self.writers = {}
        g, n = cfg.gpus_per_node, cfg.nodes
        self.rank = (np.arange(n)[None, :] * g + np.arange(g)[:, None]).reshape(-1)  # slot-major -> rank
        self.node = np.broadcast_to(np.arange(n)[None, :], (g, n)).reshape(-1)
        host = socket.gethostname()
        for r in range(cfg.ranks):
            write_meta(run_dir, RankMeta(r, r % g, r // g, cfg.ranks, g, host, 0, "sim", "sim", "simulator"))
            self.writers[r] = step_writer(run_dir, r)
        self.pending: dict[bool, list] = {False: [], True: []}

    def add(
        self, paced: bool, t0: int, finish: np.ndarray, delay: np.ndarray, step_ns: np.ndarray, on
    ) -> None:
        # the run directory holds the paced variant when there is one, else the baseline
        if paced != self.with_pacing:
            return
        self.pending[paced].append((t0, finish, delay, step_ns, on))

    def close(self) -> None:
        from hyperacc.schema import STEP_SCHEMA

        pa = self.pa
        t_start = 0.0
        for t0, finish, delay, step_ns, on in self.pending[self.with_pacing]:
            T = step_ns.shape[0]
            fin = finish.reshape(T, -1)
            dl = delay.reshape(T, -1)
            starts = np.cumsum(np.concatenate([[t_start], step_ns[:-1]]))
            t_start = float(starts[-1] + step_ns[-1])
            for col in range(fin.shape[1]):
                r = int(self.rank[col])
                self_ns = fin[:, col]  # work before the collective; the pacing delay is not work
                table = {
                    "rank": np.full(T, r, np.int32),
                    "node": np.full(T, int(self.node[col]), np.int32),
                    "step": np.arange(t0, t0 + T, dtype=np.int64),
                    "t_start_ns": starts.astype(np.int64),
                    "step_ns": step_ns.astype(np.int64),
                    "self_ns": self_ns.astype(np.int64),
                    "comm_wait_ns": (step_ns - self_ns - dl[:, col]).astype(np.int64),
                }
                if on is not None:
                    # as the tracer records it: this rank was held back in this step
                    table["pace_on"] = dl[:, col] > 0
                    table["pace_delay_ns"] = dl[:, col].astype(np.int64)
                    table["spread_ns"] = np.array([s for _, s in on], np.int64)
                arrays = [
                    pa.array(table[name], type=field.type) if name in table else pa.nulls(T, field.type)
                    for name, field in zip(STEP_SCHEMA.names, STEP_SCHEMA, strict=True)
                ]
                self.writers[r].write(pa.Table.from_arrays(arrays, schema=STEP_SCHEMA))

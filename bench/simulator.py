"""Simulator benchmark: (a) speed at 2,048 ranks, (b) prediction error against measured jobs here.

(a) ``hyperacc.sim.simulate`` at 256 nodes x 8 GPUs for 100,000 steps (10,000 with ``--quick``):
    without pacing (fully vectorised), with pacing updated every step (the real controller, as in a
    job), and with the controller updated every 10th step. Baseline: the same model written as a plain
    per-step numpy loop, which is what one would write without chunking.
(b) Real DDP jobs (gloo, the tracer's in-band measurement) at 2 and 4 ranks: each is run twice. The
    simulator, fed the first run's directory (``--from-run``), replays it at its own size (compared
    with that run itself: the replay's own error, goal within 10 % on p50 and p99), predicts the second
    run at the same size, and the 2-rank run predicts the 4-rank one (what-if to a larger job).
    Wrap the run in ``flock /tmp/hyperacc-timing.lock``.

    .venv/bin/python bench/simulator.py [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from _machine import describe as machine  # noqa: E402

# ------------------------------------------------------------------------- the measured job (one rank)


def rank_job(run_dir: str, steps: int, batch: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hyperacc import harness
    from hyperacc.trace import Tracer

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(
        nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tracer = Tracer(run_dir, window=0, probe_every=0)
    tracer.attach_ddp(model)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, 512, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    step_ms = []
    t_prev = time.perf_counter()
    for step in range(steps):
        with tracer.step(step):
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        t = time.perf_counter()
        step_ms.append((t - t_prev) * 1e3)
        t_prev = t
    tracer.close()
    harness.write_result({"rank": rank, "step_ms": step_ms})
    harness.finish()


# ------------------------------------------------------------------------- (a) speed


def naive_loop(cfg, steps: int) -> float:
    """The same baseline model, one numpy draw per step (what a first simulator would do)."""
    from hyperacc.sim.model import allreduce_ns, locality_offsets

    rng = np.random.default_rng(0)
    mean = cfg.compute.base_ms * 1e6 * (1 + locality_offsets(cfg)).reshape(-1)
    comm = float(allreduce_ns(cfg.fabric, cfg.nodes, cfg.gpus_per_node))
    t0 = time.perf_counter()
    total = 0.0
    for _ in range(steps):
        c = mean * (1 + cfg.compute.noise_cv * rng.standard_normal(mean.size))
        spikes = rng.random(mean.size) < cfg.compute.spike_rate
        c[spikes] += rng.exponential(cfg.compute.spike_ms * 1e6, int(spikes.sum()))
        total += c.max() + comm
    return time.perf_counter() - t0


def speed(steps: int) -> list[tuple[str, float, float]]:
    from hyperacc.pacing import PacingConfig
    from hyperacc.sim import ComputeModel, EarlyArrivalCost, SimConfig, simulate

    cfg = SimConfig(
        nodes=256, gpus_per_node=8, steps=steps, seed=0, pacing=None,
        compute=ComputeModel(spike_rate=1e-4, locality_gpu=0.05), cost=EarlyArrivalCost(spin_cost=0.3),
    )  # fmt: skip
    rows = []
    naive_steps = max(steps // 20, 500)
    t_naive = naive_loop(cfg, naive_steps) * steps / naive_steps
    rows.append((f"per-step numpy loop (baseline, {naive_steps:,} steps extrapolated)", t_naive, 1.0))
    for label, c in [
        ("simulate, no pacing (chunked, vectorised)", cfg),
        ("simulate, pacing every step (real controller)", dataclasses.replace(cfg, pacing=PacingConfig())),
        ("simulate, pacing every 10th step", dataclasses.replace(cfg, pacing=PacingConfig(), pace_every=10)),
    ]:
        t0 = time.perf_counter()
        r = simulate(c)
        dt = time.perf_counter() - t0
        means = f"mean {r.baseline.mean_ms:.2f} ms" + (f", paced {r.paced.mean_ms:.2f} ms" if r.paced else "")
        rows.append((f"{label}: {means}", dt, t_naive / dt))
    return rows


# ------------------------------------------------------------------------- (b) validation


def measure(nproc: int, steps: int, batch: int, work: Path, tag: str) -> tuple[Path, np.ndarray]:
    from hyperacc import harness

    run_dir = work / f"run-{nproc}-{tag}"
    job = harness.launch(
        __file__, ["--rank-job", str(run_dir), "--steps", str(steps), "--batch", str(batch)],
        nproc=nproc, timeout=600,
    )  # fmt: skip
    if not job.ok:
        raise SystemExit(f"measured job failed:\n{job.explain()}")
    step_ms = np.array(job.results()[0]["step_ms"])
    return run_dir, step_ms[10:]  # start-up steps left out, as the simulator does


LAST_RUN: list[Path] = []  # the run directory of the latest replay (for its assumptions)


def stats(ms: np.ndarray) -> tuple[float, float, float]:
    return float(np.median(ms)), float(np.percentile(ms, 99)), float(ms.std() / ms.mean())


def every_rank(run_dir: Path) -> np.ndarray:
    """Every rank's recorded step_ns (ms) after the start-up steps: the job's steps as analysis sees them."""
    from hyperacc.store import read_steps

    table = read_steps(run_dir, columns=["step", "step_ns"])
    step = table.column("step").to_numpy()
    ms = table.column("step_ns").to_numpy(zero_copy_only=False).astype(float) / 1e6
    keep = (step >= step.min() + 10) & np.isfinite(ms)
    return ms[keep]


def predict(run_dir: Path, nproc: int, steps: int) -> tuple[float, float, float]:
    from hyperacc.sim import MeasuredRun, SimConfig, simulate

    measured = MeasuredRun.from_run_dir(run_dir, skip_steps=10)
    LAST_RUN[:] = [run_dir]
    cfg = SimConfig(nodes=1, gpus_per_node=nproc, steps=steps, seed=1, pacing=None)
    r = simulate(cfg, measured=measured, keep_steps=True)
    return stats(r.baseline_ns / 1e6)


def validation(steps: int, batch: int) -> list[tuple[str, tuple, tuple]]:
    work = Path(tempfile.mkdtemp(prefix="hyperacc-simbench-"))
    runs = {}
    for tag in ("a", "b"):  # interleaved, so load drift falls on both sizes
        for nproc in (2, 4):
            runs[nproc, tag] = measure(nproc, steps, batch, work, tag)
    rows = []
    for nproc in (2, 4):
        replay = predict(runs[nproc, "a"][0], nproc, 20_000)
        rows.append((f"{nproc} ranks: run a replayed, vs run a", stats(runs[nproc, "a"][1]), replay))
        rows.append((f"{nproc} ranks: ... vs run a, every rank", stats(every_rank(runs[nproc, "a"][0])), replay))
        rows.append((f"{nproc} ranks: run a replayed, vs run b", stats(runs[nproc, "b"][1]), replay))
    truth = stats(runs[4, "b"][1])
    rows.append(("4 ranks from a 2-rank run", truth, predict(runs[2, "a"][0], 4, 20_000)))
    # the run-to-run spread of the measurement itself, for scale
    rows.append(("4-rank run a as a guess of run b", truth, stats(runs[4, "a"][1])))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick", action="store_true", help="10,000 simulated steps, short measured runs (< 60 s)"
    )
    p.add_argument("--rank-job", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=64, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_job:
        rank_job(args.rank_job, args.steps, args.batch)
        return

    sim_steps = 10_000 if args.quick else 100_000
    job_steps = 120 if args.quick else 400
    print(f"machine: {machine()}")
    print(f"\n(a) 2,048 ranks (256 nodes x 8) x {sim_steps:,} steps")
    print(f"{'variant':<86} {'seconds':>8} {'speed-up':>9}")
    for label, dt, ratio in speed(sim_steps):
        print(f"{label:<86} {dt:8.2f} {ratio:8.1f}x")

    print(
        f"\n(b) prediction vs measurement: small DDP job (gloo), {job_steps} steps per run, batch {args.batch}"
    )
    print(f"{'case':<38} {'median ms':>21} {'p99 ms':>21} {'CV':>19}")
    print(f"{'':<38} {'meas / pred / err':>21} {'meas / pred / err':>21} {'meas / pred / err':>19}")
    for label, truth, pred in validation(job_steps, args.batch):
        cells = []
        for m, q in zip(truth, pred, strict=True):
            cells.append(f"{m:6.2f} /{q:6.2f} /{(q - m) / m * 100:+4.0f}%")
        print(f"{label:<38} {cells[0]:>21} {cells[1]:>21} {cells[2]:>19}")
    from hyperacc.sim import SimConfig
    from hyperacc.sim.simulate import replay_assumptions

    print("\nassumptions of the replays (hyperacc simulate --from-run prints the same):")
    from hyperacc.sim import MeasuredRun

    for line in replay_assumptions(SimConfig(nodes=1, gpus_per_node=4, pacing=None),
                                   MeasuredRun.from_run_dir(LAST_RUN[0], skip_steps=10)):  # fmt: skip
        print(f"  - {line}")
    print(f"\n{machine()}")


if __name__ == "__main__":
    main()

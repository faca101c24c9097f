"""One rank of ``hyperacc doctor``: ``python -m hyperacc.bootstrap -m hyperacc.preflight.worker``.

Started by ``hyperacc doctor`` through torchrun (``HYPERACC_DOCTOR`` holds the options as JSON,
``HYPERACC_DOCTOR_OUT`` the file to write). Every round, all ranks run the same benchmarks at the same
time, separated by barriers, so ranks compete with each other as they would in training; then
the measurements of every rank are gathered and each node's local rank 0 writes them all to
``HYPERACC_DOCTOR_OUT``. Judging happens in the launcher (``hyperacc.preflight.judge``), not here.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hyperacc import process
from hyperacc.preflight.benchmarks import LocalBenchmarks, NoChaos
from hyperacc.preflight.exchanges import AllReduce, PairExchange
from hyperacc.preflight.options import ENV, ENV_OUT, DoctorOptions
from hyperacc.remediation.exclusion import node_name

# Share of a round's time per benchmark (renormalised over the ones that run here).
_WEIGHTS = {
    "matmul": 0.14, "memory": 0.12, "dispatch": 0.08, "jitter": 0.14, "h2d": 0.05, "d2h": 0.05,
    "reads": 0.12, "allreduce": 0.12, "pairs": 0.18,
}  # fmt: skip
SCHEMA_VERSION = 1


def _chaos() -> Any:
    if not os.environ.get("HYPERACC_CHAOS", "").strip():
        return NoChaos()
    from hyperacc import chaos

    return chaos.install_from_env() or NoChaos()  # the instance the bootstrap installed


def measure(opts: DoctorOptions) -> dict[str, Any]:
    """Run every round on this rank; returns this rank's record (the gathered document's row)."""
    cuda = torch.cuda.is_available()
    # One intra-op thread: a host figure is one core's throughput, and CPU time stays exact (idle
    # OpenMP threads spin, and that spinning would be billed as work when ranks share cores).
    torch.set_num_threads(1)
    local_rank = process.env_int("LOCAL_RANK", 0)
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    me = {
        "rank": rank,
        "local_rank": local_rank,
        "node": process.env_int("GROUP_RANK", 0),
        "host": node_name(),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "pid": os.getpid(),
    }
    table: list[Any] = [None] * world
    dist.all_gather_object(table, me)
    nodes = sorted({r["node"] for r in table})
    bench = LocalBenchmarks(device, opts, _chaos(), rank)
    allreduce = AllReduce(device, opts.exchange_mb)
    pairs = PairExchange(device, opts.exchange_mb, table, rank) if len(nodes) > 1 else None
    active = ["matmul", "memory", "dispatch", "jitter"]
    if cuda:
        active += ["h2d", "d2h"]
    if opts.data and "read_p50" not in bench.skipped:
        active.append("reads")
    active.append("allreduce")
    if pairs is not None:
        active.append("pairs")
    total = sum(_WEIGHTS[a] for a in active)
    per_round = opts.seconds / opts.rounds
    slices = {a: per_round * _WEIGHTS[a] / total for a in active}

    figures: dict[str, dict[str, list[float]]] = {}
    extra: dict[str, list[float]] = {"cpu_share": [], "tick_ns": [], "preempted_ticks": []}
    collectives: dict[str, list[float]] = {"small_ns": [], "large_ns": []}
    exchanges: dict[str, dict[str, list[float]]] = {}
    errors: dict[str, str] = {}

    def keep(name: str, res: dict[str, Any] | None) -> None:
        row = figures.setdefault(name, {"cost_ns": [], "work": []})
        row["cost_ns"].append(float("nan") if res is None else float(res["cost_ns"]))
        row["work"].append(float("nan") if res is None else float(res.get("work", 1.0)))

    for _round in range(opts.rounds):
        shares = []
        for name in active:
            if name in ("allreduce", "pairs"):
                continue
            dist.barrier()
            try:
                if name == "reads":
                    both = bench.reads(slices[name])
                    keep("read_p50", both[0] if both else None)
                    keep("read_p99", both[1] if both else None)
                    continue
                res = getattr(bench, name)(slices[name])
            except Exception as exc:  # noqa: BLE001 - one failing benchmark must not stop the others
                errors.setdefault(name, f"{type(exc).__name__}: {exc}")
                res = None
            keep(name, res)
            if res is not None and name in ("matmul", "memory", "dispatch"):
                shares.append(res["cpu_share"])
            if res is not None and name == "jitter":
                extra["tick_ns"].append(res.get("tick_ns", float("nan")))
                extra["preempted_ticks"].append(float(res.get("preempted", 0)))
        extra["cpu_share"].append(float(sum(shares) / len(shares)) if shares else float("nan"))
        res = allreduce.run(slices["allreduce"])
        for key in collectives:
            collectives[key].append(res[key])
        if pairs is not None:
            got = pairs.run(slices["pairs"])
            for partner, vals in got.items():
                row = exchanges.setdefault(partner, {"small_ns": [], "large_ns": []})
                row["small_ns"].append(vals["small_ns"])
                row["large_ns"].append(vals["large_ns"])
    bench.close()
    return {
        **me,
        "figures": figures,
        "extra": extra,
        "skipped": dict(bench.skipped),
        "errors": errors,
        "allreduce": {**collectives, "large_bytes": allreduce.large_bytes, "world_size": world},
        "exchanges": exchanges,
        "exchange_bytes": pairs.large_bytes if pairs is not None else None,
    }


def main() -> None:
    raw = os.environ.get(ENV, "").strip()
    opts = DoctorOptions.from_json(raw) if raw else DoctorOptions()
    out = os.environ.get(ENV_OUT)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    t0 = time.time()
    dist.init_process_group(backend, timeout=timedelta(seconds=max(300, 10 * opts.seconds)))
    gather_group = dist.new_group(backend="gloo") if backend == "nccl" else None
    try:
        record = measure(opts)
    except Exception:  # noqa: BLE001 - say which rank failed and how, then fail the job
        print(f"hyperacc doctor: rank {dist.get_rank()} failed:\n{traceback.format_exc()}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)
    world = dist.get_world_size()
    records: list[Any] = [None] * world
    dist.all_gather_object(records, record, group=gather_group)
    if out and process.env_int("LOCAL_RANK", 0) == 0:
        doc = {
            "schema_version": SCHEMA_VERSION,
            "options": json.loads(opts.to_json()),
            "world_size": world,
            "backend": backend,
            "wall_s": time.time() - t0,
            "ranks": sorted(records, key=lambda r: r["rank"]),
        }
        tmp = f"{out}.tmp"
        with open(tmp, "w") as fh:
            json.dump(doc, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out)
    from hyperacc import harness

    harness.finish()  # barrier, destroy, os._exit: the exit that survives gloo's teardown


if __name__ == "__main__":
    main()

"""NUMA / CPU binding: which cores each local rank and each of its DataLoader workers runs on.

A rank that the scheduler moves across sockets, or whose loader workers fight its main thread for a
core, runs slower on some steps than others: a per-rank disturbance that the all-reduce turns into a
cluster spike. The plan reads the machine from sysfs (a root parameter lets tests use fake trees):

    GPU PCI bus id -> /sys/bus/pci/devices/<id>/numa_node -> /sys/devices/system/node/node<N>/cpulist

splits each NUMA node's cores among the local ranks placed on it, and inside a rank's share gives each
DataLoader worker its own core. An affinity the process inherited (``torchrun --numa-binding``,
``numactl``, ``taskset``, a container cpuset) is planned inside, never widened. Reading sysfs never
initialises CUDA. Rules and defaults: docs/stabilizers.md, "NUMA / CPU binding".
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import logging
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from hyperacc.stabilize.topology import (  # noqa: F401 - parse_cpulist, GPU_VENDORS: re-exported, as before
    DISPLAY_CLASS_PREFIX,
    GPU_VENDORS,
    GPUInfo,
    Topology,
    format_cpulist,
    parse_cpulist,
    read_topology,
)

log = logging.getLogger(__name__)


# ------------------------------------------------------------------ the plan


@dataclasses.dataclass(frozen=True)
class RankBinding:
    local_rank: int
    gpu: GPUInfo | None
    numa_node: int | None  # node whose memory the rank should prefer; None when unknown
    cpus: tuple[int, ...]  # the rank's whole share: main process + workers
    main_cpus: tuple[int, ...]  # where the rank's main process (and its intra-op threads) runs
    worker_cpus: tuple[tuple[int, ...], ...]  # one entry per DataLoader worker
    threads: int  # torch.set_num_threads for the main process (physical cores of main_cpus)
    shared: bool = False  # the share overlaps another rank's (more ranks than cores)
    source: str = "plan"  # "plan" | "inherited" (the launcher's per-process mask kept as the share)

    def to_dict(self) -> dict[str, Any]:
        return {
            "local_rank": self.local_rank,
            "gpu": None if self.gpu is None else dataclasses.asdict(self.gpu),
            "numa_node": self.numa_node,
            "cpus": format_cpulist(self.cpus),
            "main_cpus": format_cpulist(self.main_cpus),
            "worker_cpus": [format_cpulist(w) for w in self.worker_cpus],
            "threads": self.threads,
            "shared": self.shared,
            "source": self.source,
        }


@dataclasses.dataclass(frozen=True)
class AffinityPlan:
    nproc: int
    workers_per_rank: int
    allowed: tuple[int, ...]
    inherited: str  # "none" | "cpuset" (container, same for every rank) | "per-process" (launcher)
    ranks: tuple[RankBinding, ...]
    warnings: tuple[str, ...]
    numa_nodes: dict[int, tuple[int, ...]]

    def to_dict(self) -> dict[str, Any]:
        return {
            "nproc": self.nproc,
            "workers_per_rank": self.workers_per_rank,
            "allowed": format_cpulist(self.allowed),
            "inherited": self.inherited,
            "numa_nodes": {str(n): format_cpulist(c) for n, c in self.numa_nodes.items()},
            "ranks": [r.to_dict() for r in self.ranks],
            "warnings": list(self.warnings),
        }


Core = tuple[int, ...]  # the allowed CPUs of one physical core


def _cores(cpus: Iterable[int], core_of: dict[int, int]) -> list[Core]:
    groups: dict[int, list[int]] = {}
    for c in sorted(cpus):
        groups.setdefault(core_of.get(c, c), []).append(c)
    return [tuple(g) for _, g in sorted(groups.items(), key=lambda kv: kv[1][0])]


def _flat(cores: Sequence[Core]) -> tuple[int, ...]:
    return tuple(sorted({c for core in cores for c in core}))


MIN_MAIN_CORES = 2  # the main process keeps at least this many cores when the share has more than one


def main_core_count(share: int, workers: int, main_cores: int | None) -> int:
    """Cores the main process keeps out of a share of ``share`` cores with ``workers`` workers.

    ``main_cores`` when given (at most ``share - 1``); else one core per worker and the rest to the
    main process, but never fewer than ``MIN_MAIN_CORES`` (it runs the step, its intra-op threads and
    the loader's pin-memory thread); the whole share without workers, and everyone shares a single core."""
    if workers == 0 or share <= 1:
        return share
    if main_cores is not None:
        return max(1, min(main_cores, share - 1))
    return max(min(MIN_MAIN_CORES, share - 1), share - workers)


def _split_share(
    share: Sequence[Core], workers: int, main_cores: int | None, warnings: list[str], local_rank: int
) -> tuple[list[Core], list[list[Core]]]:
    """Main cores first, then the rest divided among the workers with no core left idle: contiguous
    blocks whose sizes differ by at most one, or, with more workers than cores, each core shared by
    workers in contiguous runs."""
    n = len(share)
    if workers == 0:
        return list(share), []
    if n == 1:
        warnings.append(
            f"local rank {local_rank}: 1 core for the main process and {workers} workers; they share it"
        )
        return list(share), [list(share) for _ in range(workers)]
    m = main_core_count(n, workers, main_cores)
    main, rest = list(share[:m]), list(share[m:])
    r = len(rest)
    if r >= workers:
        return main, [rest[w * r // workers : (w + 1) * r // workers] for w in range(workers)]
    warnings.append(f"local rank {local_rank}: {workers} workers on {r} cores; workers share cores")
    return main, [[rest[w * r // workers]] for w in range(workers)]


def _classify(allowed: set[int], topo: Topology) -> str:
    container = set(topo.container_cpus) if topo.container_cpus else set(topo.online)
    if allowed >= container:
        return "cpuset" if container != set(topo.online) else "none"
    return "per-process"


def _topology_and_allowed(
    sysfs_root: str | os.PathLike, topology: Topology | None, visible_devices: str | None, allowed: Any
) -> tuple[Topology, set[int]]:
    """The topology (read from sysfs unless given) and the allowed online CPUs: this process's mask on
    the real machine, every online CPU of a fake sysfs tree."""
    real = Path(sysfs_root).resolve() == Path("/sys").resolve()
    if topology is None:
        visible = visible_devices if visible_devices is not None else (
            os.environ.get("CUDA_VISIBLE_DEVICES") if real else None
        )  # fmt: skip
        topology = read_topology(sysfs_root, visible_devices=visible)
    if allowed is None:
        allowed = os.sched_getaffinity(0) if real and hasattr(os, "sched_getaffinity") else topology.online
    return topology, set(allowed) & set(topology.online)


def plan_affinity(
    nproc: int,
    workers_per_rank: int = 0,
    *,
    sysfs_root: str | os.PathLike = "/sys",
    topology: Topology | None = None,
    allowed: Iterable[int] | None = None,
    main_cores: int | None = None,
    visible_devices: str | None = None,
) -> AffinityPlan:
    """The binding of every local rank of this node.

    ``allowed`` is the CPU set to plan inside (default: this process's affinity when ``sysfs_root`` is
    the real /sys, else every online CPU of the tree). ``visible_devices`` defaults to
    ``CUDA_VISIBLE_DEVICES`` for the real /sys."""
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1 (got {nproc}); pass the number of ranks on this node")
    if workers_per_rank < 0:
        raise ValueError(f"workers_per_rank must be >= 0 (got {workers_per_rank})")
    topology, allowed_set = _topology_and_allowed(sysfs_root, topology, visible_devices, allowed)
    if not allowed_set:
        raise ValueError("the allowed CPU set has no online CPU of this topology")
    warnings: list[str] = []
    inherited = _classify(allowed_set, topology)
    pools = {n: [c for c in cs if c in allowed_set] for n, cs in topology.numa_nodes.items()}
    pools = {n: cs for n, cs in pools.items() if cs}

    # Which NUMA node (pool) each local rank is placed on.
    gpus = topology.gpus
    rank_gpu: list[GPUInfo | None] = [None] * nproc
    if gpus:
        if nproc > len(gpus):
            warnings.append(f"{nproc} ranks but {len(gpus)} GPUs visible; ranks share GPUs")
        rank_gpu = [gpus[i % len(gpus)] for i in range(nproc)]
        unknown = sorted(
            {g.bus_id for g in rank_gpu if g is not None and g.numa_node not in topology.numa_nodes}
        )
        if unknown:
            warnings.append(
                f"GPU(s) {', '.join(unknown)} report no NUMA node (numa_node -1): binding by CPU share "
                "only, without NUMA locality"
            )
            pools = {-1: sorted(allowed_set)}
            rank_node = [-1] * nproc
        else:
            rank_node = [g.numa_node for g in rank_gpu]  # type: ignore[union-attr]
            outside = [r for r in range(nproc) if rank_node[r] not in pools]
            order = sorted(pools)
            for j, r in enumerate(outside):
                warnings.append(
                    f"local rank {r}: its GPU's NUMA node {rank_node[r]} has no allowed CPU; "
                    f"placed on node {order[j % len(order)]}"
                )
                rank_node[r] = order[j % len(order)]
    else:
        order = sorted(pools)
        rank_node = [order[i * len(order) // nproc] for i in range(nproc)]

    shares: dict[int, list[Core]] = {}
    shared: dict[int, bool] = {}
    for node, cpus in pools.items():
        ranks_here = [r for r in range(nproc) if rank_node[r] == node]
        if not ranks_here:
            continue
        cores = _cores(cpus, topology.core_of)
        k, c = len(ranks_here), len(cores)
        if c >= k:
            for j, r in enumerate(ranks_here):
                shares[r] = cores[j * c // k : (j + 1) * c // k]
                shared[r] = False
        else:
            label = "the allowed CPUs" if node == -1 else f"NUMA node {node}"
            warnings.append(f"{k} ranks on {c} cores of {label}; ranks share cores")
            for j, r in enumerate(ranks_here):
                shares[r] = [cores[j % c]]
                shared[r] = True

    bindings = []
    for r in range(nproc):
        main, workers = _split_share(shares[r], workers_per_rank, main_cores, warnings, r)
        bindings.append(
            RankBinding(
                local_rank=r,
                gpu=rank_gpu[r],
                numa_node=None if rank_node[r] == -1 else rank_node[r],
                cpus=_flat(shares[r]),
                main_cpus=_flat(main),
                worker_cpus=tuple(_flat(w) for w in workers),
                threads=max(1, len(main)),
                shared=shared[r],
            )
        )
    return AffinityPlan(
        nproc, workers_per_rank, tuple(sorted(allowed_set)), inherited, tuple(bindings), tuple(warnings),
        dict(topology.numa_nodes),
    )  # fmt: skip


def binding_for_rank(
    local_rank: int,
    nproc: int,
    workers_per_rank: int = 0,
    *,
    sysfs_root: str | os.PathLike = "/sys",
    topology: Topology | None = None,
    allowed: Iterable[int] | None = None,
    main_cores: int | None = None,
    visible_devices: str | None = None,
) -> tuple[RankBinding, AffinityPlan]:
    """This rank's binding, composing with a launcher that already bound it.

    Without a per-process mask (none, or a container cpuset every rank shares) the plan is made
    inside the allowed CPUs. With a per-process mask (narrower than the container): when it contains
    the share planned for this rank (``torchrun --numa-binding=node`` or ``socket``), that share is
    used; when it is no larger than a fair share of the rank's NUMA node and lies inside it
    (``--numa-binding=exclusive`` or ``core-complex``, ``numactl --physcpubind``), the launcher's choice
    is kept whole; otherwise the rank is planned inside the mask, with a warning."""
    if not 0 <= local_rank < nproc:
        raise ValueError(f"local_rank {local_rank} is outside 0..{nproc - 1}")
    topology, allowed_set = _topology_and_allowed(sysfs_root, topology, visible_devices, allowed)
    if _classify(allowed_set, topology) != "per-process":
        plan = plan_affinity(
            nproc, workers_per_rank, topology=topology, allowed=allowed_set, main_cores=main_cores
        )
        return plan.ranks[local_rank], plan
    # The launcher bound this process. Plan as if unbound (what every rank computes alike), then
    # keep the planned share when the mask contains it, or take the launcher's choice.
    container = set(topology.container_cpus or topology.online)
    free = plan_affinity(nproc, workers_per_rank, topology=topology, allowed=container, main_cores=main_cores)
    plan = dataclasses.replace(free, allowed=tuple(sorted(allowed_set)), inherited="per-process")
    mine = free.ranks[local_rank]
    if set(mine.cpus) <= allowed_set:
        return mine, plan
    same_pool = [r for r in free.ranks if r.numa_node == mine.numa_node]
    pool_cores = _cores({c for r in same_pool for c in r.cpus}, topology.core_of)
    fair = math.ceil(len(pool_cores) / max(1, len(same_pool)))
    pool_cpus = {c for core in pool_cores for c in core}
    warn: list[str] = []
    if len(_cores(allowed_set, topology.core_of)) <= fair and allowed_set <= pool_cpus:
        share = _cores(allowed_set, topology.core_of)  # the launcher's exclusive share: keep it whole
    else:
        share = _cores(set(mine.cpus) & allowed_set or allowed_set, topology.core_of)
        warn.append(
            f"local rank {local_rank}: inherited mask {format_cpulist(allowed_set)} does not contain the "
            f"planned share {format_cpulist(mine.cpus)}; planned inside the mask"
        )
    main, workers = _split_share(share, workers_per_rank, main_cores, warn, local_rank)
    binding = dataclasses.replace(
        mine,
        cpus=_flat(share),
        main_cpus=_flat(main),
        worker_cpus=tuple(_flat(w) for w in workers),
        threads=max(1, len(main)),
        shared=False,
        source="inherited",
    )
    return binding, dataclasses.replace(plan, warnings=plan.warnings + tuple(warn))


# ------------------------------------------------------------------ applying it (side effects)


def set_process_affinity(cpus: Iterable[int]) -> None:
    """Bind every existing thread of this process (threads created later inherit it)."""
    cpus = set(cpus)
    os.sched_setaffinity(0, cpus)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = []
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except (ProcessLookupError, PermissionError):
            pass  # the thread ended meanwhile, or is not ours to move


def thread_affinities() -> dict[int, set[int]]:
    """The CPU mask of every thread of this process (for checks and reports)."""
    out = {}
    for t in os.listdir("/proc/self/task"):
        try:
            out[int(t)] = set(os.sched_getaffinity(int(t)))
        except (ProcessLookupError, OSError):
            pass
    return out


def bind_memory(node: int | None) -> str:
    """Prefer ``node`` for this thread's and its future threads' allocations (libnuma's
    ``numa_set_preferred``: falls back to other nodes instead of failing). Returns what was done."""
    if node is None:
        return "memory not bound (NUMA node unknown)"
    name = ctypes.util.find_library("numa") or "libnuma.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return "memory not bound (libnuma not installed; `apt-get install libnuma1` or use numactl)"
    if lib.numa_available() < 0:
        return "memory not bound (kernel reports no NUMA support)"
    lib.numa_set_preferred.argtypes = [ctypes.c_int]
    lib.numa_set_preferred.restype = None
    lib.numa_set_preferred(int(node))
    return f"memory prefers NUMA node {node}"


def apply_binding(binding: RankBinding, *, set_threads: bool = True, memory: bool = True) -> dict[str, Any]:
    """Pin this process to ``binding.main_cpus``, size torch's intra-op pool, prefer the node's memory."""
    set_process_affinity(binding.main_cpus)
    done: dict[str, Any] = {"main_cpus": format_cpulist(binding.main_cpus)}
    if set_threads:
        import torch

        torch.set_num_threads(binding.threads)
        done["threads"] = binding.threads
    if memory:
        done["memory"] = bind_memory(binding.numa_node)
    return done


def format_plan(plan: AffinityPlan) -> str:
    """The plan as a plain-text table (what ``hyperacc affinity --show`` prints)."""
    nodes = ", ".join(f"node{n}: {format_cpulist(c)}" for n, c in sorted(plan.numa_nodes.items()))
    header = ("rank", "GPU", "PCI bus id", "node", "main CPUs", "threads", "worker CPUs")
    rows = [
        (
            str(r.local_rank),
            "-" if r.gpu is None else str(r.gpu.index),
            "-" if r.gpu is None else r.gpu.bus_id,
            "?" if r.numa_node is None else str(r.numa_node),
            format_cpulist(r.main_cpus) + (" (shared)" if r.shared else ""),
            str(r.threads),
            " | ".join(format_cpulist(w) for w in r.worker_cpus) or "-",
        )
        for r in plan.ranks
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = [
        f"NUMA nodes: {nodes}",
        f"allowed CPUs: {format_cpulist(plan.allowed)}  (inherited mask: {plan.inherited})  "
        f"ranks: {plan.nproc}  workers/rank: {plan.workers_per_rank}",
        "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip(),
    ]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.extend(f"warning: {w}" for w in plan.warnings)
    return "\n".join(lines)

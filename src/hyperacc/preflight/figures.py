"""What the pre-flight check measures: one entry per figure, with the resource it speaks for.

Every figure is stored as a *cost* (nanoseconds per unit of work, higher is worse), so that one robust
rule judges all of them the same way; ``work`` turns a cost back into the throughput a person reads
(GFLOP/s, GB/s). Rules and defaults: docs/doctor.md.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Figure:
    name: str
    label: str  # what a person calls it
    resource: str  # the resource a slow value points at
    unit: str  # display unit
    throughput: bool  # displayed as work per second (True) or as a time (False)
    floor: str  # absolute materiality floor: "none", "floor_ns" or "launch_floor_ns" (DetectionOptions)
    clock: str  # "cpu": process CPU time (host work, immune to preemption) or "wall"

    def display(self, cost_ns: float, work: float) -> float:
        """The value a person reads: work per second in ``unit`` or a time in ``unit``."""
        if self.throughput:
            return work / cost_ns  # bytes/ns == GB/s, flop/ns == GFLOP/s
        return cost_ns / {"us": 1e3, "ms": 1e6}.get(self.unit, 1.0)


# Per-rank figures, judged across ranks (and across nodes). The order is the order of the output.
RANK_FIGURES: dict[str, Figure] = {
    f.name: f
    for f in (
        Figure("matmul", "matmul throughput", "compute", "GFLOP/s", True, "none", "cpu"),
        Figure("memory", "host memory bandwidth", "memory", "GB/s", True, "none", "cpu"),
        Figure("dispatch", "op dispatch / launch latency", "dispatch", "us", False, "launch_floor_ns", "cpu"),
        Figure("jitter", "Python/GIL jitter (p99 tick excess)", "jitter", "us", False, "floor_ns", "cpu"),
        Figure("h2d", "pinned host-to-device copy", "pcie", "GB/s", True, "none", "wall"),
        Figure("d2h", "pinned device-to-host copy", "pcie", "GB/s", True, "none", "wall"),
        Figure("read_p50", "data read latency p50", "storage", "ms", False, "floor_ns", "wall"),
        Figure("read_p99", "data read latency p99", "storage", "ms", False, "floor_ns", "wall"),
        Figure("p2p", "exchange with other nodes (best partner)", "network", "GB/s", True, "none", "wall"),
    )
}

# What a slow resource is called in a verdict, and what to do about it (docs/doctor.md, "Next steps").
RESOURCES: dict[str, tuple[str, str]] = {
    "cpu": (
        "host CPU (several CPU-bound figures slow)",
        "check CPU frequency and thermals (`cpupower frequency-info`, BIOS power profile) and other load "
        "on that host; leave it out until it is fixed",
    ),
    "compute": (
        "compute (matmul)",
        "check the device's clocks, thermals and power cap (`nvidia-smi -q -d CLOCK,PERFORMANCE`) or "
        "the host's CPU frequency",
    ),
    "memory": (
        "host memory bandwidth",
        "check the memory configuration (populated channels, NUMA placement: `hyperacc affinity`)",
    ),
    "dispatch": (
        "op dispatch / kernel launch path",
        "the host is slow to launch work: bind ranks to cores (`hyperacc affinity`), check CPU frequency "
        "and other processes on that host",
    ),
    "jitter": (
        "scheduling (long pauses of the Python thread)",
        "look for what interrupts the process (other daemons, interrupts, SMIs: `perf sched`, "
        "`/proc/interrupts`); isolate the training cores",
    ),
    "pcie": (
        "host-device link (PCIe)",
        "check the link width and speed (`nvidia-smi -q | grep -A3 'Link Width'`, `lspci -vv`) and "
        "that the rank is bound to the GPU's NUMA node",
    ),
    "storage": (
        "storage (data reads)",
        "check the file system mount and the disk on that host; prefetch or cache the data set locally "
        "(docs/data.md)",
    ),
    "network": (
        "network interface (every exchange with this node)",
        "check the node's NIC (link speed, errors: `ibstat`, `ethtool -S`) and its switch port",
    ),
    "link": (
        "network link (only the exchange between these two nodes)",
        "check the path between the two nodes (cables, switch ports); the nodes themselves are healthy",
    ),
    "contention": (
        "share of CPU (its ranks waited for cores more than on other nodes)",
        "another job or daemon takes that host's cores: keep other work off it or bind ranks to cores",
    ),
}

# Figures that measure the host's cores: when several are slow on one rank, the host's CPU is the cause.
CPU_FIGURES = ("matmul", "memory", "dispatch")

"""Fake sysfs trees of real machine shapes, for binding plans that cannot be tried on this machine.

(A module of its own, not conftest.py: several test directories have a conftest.)"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from hyperacc.stabilize.affinity import format_cpulist


def make_sysfs(
    root: Path,
    nodes: dict[int, Iterable[int]],
    *,
    siblings: dict[int, int] | None = None,
    pci: Iterable[tuple[str, str, str, int]] = (),
    cpuset: Iterable[int] | None = None,
) -> Path:
    """Write a sysfs tree: NUMA nodes with their CPUs, hyperthread pairs (cpu -> sibling), PCI devices
    ``(bus_id, class, vendor, numa_node)`` and optionally a cgroup cpuset."""
    siblings = siblings or {}
    all_cpus = sorted({c for cs in nodes.values() for c in cs})
    (root / "devices/system/cpu").mkdir(parents=True, exist_ok=True)
    (root / "devices/system/cpu/online").write_text(format_cpulist(all_cpus) + "\n")
    for cpu in all_cpus:
        topo = root / f"devices/system/cpu/cpu{cpu}/topology"
        topo.mkdir(parents=True, exist_ok=True)
        group = sorted({cpu, siblings.get(cpu, cpu)} | {c for c, s in siblings.items() if s == cpu})
        topo.joinpath("thread_siblings_list").write_text(format_cpulist(group) + "\n")
    for node, cpus in nodes.items():
        d = root / f"devices/system/node/node{node}"
        d.mkdir(parents=True, exist_ok=True)
        d.joinpath("cpulist").write_text(format_cpulist(cpus) + "\n")
    for bus, cls, vendor, numa in pci:
        d = root / "bus/pci/devices" / bus
        d.mkdir(parents=True, exist_ok=True)
        d.joinpath("class").write_text(cls + "\n")
        d.joinpath("vendor").write_text(vendor + "\n")
        d.joinpath("numa_node").write_text(f"{numa}\n")
    if cpuset is not None:
        (root / "fs/cgroup").mkdir(parents=True, exist_ok=True)
        (root / "fs/cgroup/cpuset.cpus.effective").write_text(format_cpulist(cpuset) + "\n")
    return root


NVIDIA_3D = "0x030200"
NVIDIA = "0x10de"
# Devices every GPU server has that are not GPUs: NVSwitch (bridge class), BMC VGA, NIC.
NOT_GPUS = [
    ("0000:03:00.0", "0x030000", "0x1a03", -1),  # ASPEED BMC VGA
    ("0000:05:00.0", "0x068000", NVIDIA, 0),  # NVSwitch
    ("0000:0c:00.0", "0x020700", "0x15b3", 0),  # Mellanox InfiniBand
]

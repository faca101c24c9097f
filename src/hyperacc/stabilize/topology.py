"""The machine's topology as sysfs shows it (NUMA nodes, their CPUs and physical cores, the GPUs and
their NUMA node) and the kernel's cpulist text; read by the affinity plan (``affinity.py``)."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger("hyperacc.stabilize.affinity")  # the plan's logger, as before the split


GPU_VENDORS = {"0x10de": "nvidia", "0x1002": "amd"}

DISPLAY_CLASS_PREFIX = "0x03"  # PCI base class 03: display controllers (VGA, 3D, other)


def parse_cpulist(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]`` (the kernel's list format)."""
    out: list[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if sep:
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(lo))
    return sorted(set(out))


def format_cpulist(cpus: Iterable[int]) -> str:
    """The inverse of :func:`parse_cpulist`: ``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    items = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        parts.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ",".join(parts)


@dataclasses.dataclass(frozen=True)
class GPUInfo:
    index: int  # visible device index (what cuda:<index> means)
    bus_id: str  # PCI address, e.g. 0000:18:00.0
    numa_node: int  # -1 when the firmware does not say
    vendor: str = "nvidia"


@dataclasses.dataclass(frozen=True)
class Topology:
    numa_nodes: dict[int, tuple[int, ...]]  # node -> its online CPUs
    core_of: dict[int, int]  # cpu -> its core (lowest CPU among its hyperthread siblings)
    gpus: tuple[GPUInfo, ...]
    online: tuple[int, ...]
    container_cpus: tuple[int, ...] | None  # cgroup cpuset of this process, when readable


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _visible_indices(visible: str | None, count: int) -> list[int] | None:
    """CUDA_VISIBLE_DEVICES as indices into the bus-ordered GPU list; None when it names GPUs by UUID."""
    if visible is None:
        return list(range(count))
    out = []
    for item in visible.split(","):
        item = item.strip()
        if not item:
            continue
        if not item.lstrip("-").isdigit():
            return None
        idx = int(item)
        if idx < 0:
            break  # CUDA stops at the first invalid index
        if idx < count:
            out.append(idx)
    return out


def read_topology(sysfs_root: str | os.PathLike = "/sys", *, visible_devices: str | None = None) -> Topology:
    """Read NUMA nodes, CPU cores and GPUs from ``sysfs_root``. GPUs are display-class PCI devices of
    NVIDIA or AMD, in PCI bus order (``CUDA_DEVICE_ORDER=PCI_BUS_ID``), filtered by ``visible_devices``
    (the value of ``CUDA_VISIBLE_DEVICES``; pass None for all)."""
    root = Path(sysfs_root)
    online_text = _read(root / "devices/system/cpu/online")
    nodes: dict[int, tuple[int, ...]] = {}
    node_dir = root / "devices/system/node"
    if node_dir.is_dir():
        for d in sorted(node_dir.glob("node[0-9]*")):
            text = _read(d / "cpulist")
            if text is not None:
                nodes[int(d.name[4:])] = tuple(parse_cpulist(text))
    online = parse_cpulist(online_text) if online_text else sorted({c for cs in nodes.values() for c in cs})
    if not online:
        raise ValueError(
            f"no CPUs found under {root} (neither devices/system/cpu/online nor node cpulists); "
            "pass the sysfs root of a Linux machine (default /sys)"
        )
    online_set = set(online)
    nodes = {n: tuple(c for c in cs if c in online_set) for n, cs in nodes.items()}
    nodes = {n: cs for n, cs in nodes.items() if cs}  # memory-only nodes hold no CPUs
    if not nodes:
        nodes = {0: tuple(online)}
    core_of: dict[int, int] = {}
    for cpu in online:
        topo = root / f"devices/system/cpu/cpu{cpu}/topology"
        text = _read(topo / "thread_siblings_list") or _read(topo / "core_cpus_list")
        siblings = [c for c in parse_cpulist(text) if c in online_set] if text else []
        core_of[cpu] = min(siblings) if siblings else cpu
    gpus: list[GPUInfo] = []
    pci = root / "bus/pci/devices"
    if pci.is_dir():
        found = []
        for dev in sorted(pci.iterdir()):
            cls, vendor = _read(dev / "class"), _read(dev / "vendor")
            if cls and vendor in GPU_VENDORS and cls.startswith(DISPLAY_CLASS_PREFIX):
                numa = _read(dev / "numa_node")
                found.append((dev.name, int(numa) if numa and numa.lstrip("-").isdigit() else -1, vendor))
        indices = _visible_indices(visible_devices, len(found))
        if indices is None:
            log.warning(
                "hyperacc.stabilize: CUDA_VISIBLE_DEVICES names GPUs by UUID; cannot map them to PCI "
                "devices from sysfs, so all %d GPUs are planned in bus order",
                len(found),
            )
            indices = list(range(len(found)))
        for visible_index, idx in enumerate(indices):
            bus, numa, vendor = found[idx]
            gpus.append(GPUInfo(visible_index, bus, numa, GPU_VENDORS[vendor]))
    container = None
    cg = _read(root / "fs/cgroup/cpuset.cpus.effective")
    if cg:
        container = tuple(c for c in parse_cpulist(cg) if c in online_set) or None
    return Topology(nodes, core_of, tuple(gpus), tuple(online), container)

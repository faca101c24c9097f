"""The binding plan on fake sysfs trees of real shapes, and on this machine."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from fake_sysfs import NOT_GPUS, NVIDIA, NVIDIA_3D, make_sysfs

from hyperacc.stabilize.affinity import (
    AffinityPlan,
    binding_for_rank,
    format_cpulist,
    parse_cpulist,
    plan_affinity,
    read_topology,
)

# ------------------------------------------------------------------ topologies of real shapes


@pytest.fixture
def two_sockets_4_gpus_each(tmp_path: Path) -> Path:
    """2 sockets x 24 cores with hyperthreads (0-23 + 48-71 | 24-47 + 72-95), 4 GPUs per socket."""
    nodes = {0: [*range(0, 24), *range(48, 72)], 1: [*range(24, 48), *range(72, 96)]}
    siblings = {c: c + 48 for c in range(48)}
    gpus = [
        ("0000:1a:00.0", NVIDIA_3D, NVIDIA, 0), ("0000:1c:00.0", NVIDIA_3D, NVIDIA, 0),
        ("0000:3d:00.0", NVIDIA_3D, NVIDIA, 0), ("0000:3f:00.0", NVIDIA_3D, NVIDIA, 0),
        ("0000:88:00.0", NVIDIA_3D, NVIDIA, 1), ("0000:8a:00.0", NVIDIA_3D, NVIDIA, 1),
        ("0000:b1:00.0", NVIDIA_3D, NVIDIA, 1), ("0000:b3:00.0", NVIDIA_3D, NVIDIA, 1),
    ]  # fmt: skip
    return make_sysfs(tmp_path / "sys", nodes, siblings=siblings, pci=[*gpus, *NOT_GPUS])


@pytest.fixture
def eight_gpus_one_socket(tmp_path: Path) -> Path:
    """2 sockets x 16 cores, no hyperthreads; all 8 GPUs hang off socket 0."""
    nodes = {0: range(0, 16), 1: range(16, 32)}
    gpus = [
        (f"0000:{b:02x}:00.0", NVIDIA_3D, NVIDIA, 0) for b in (0x17, 0x31, 0x4B, 0x65, 0x81, 0x9B, 0xB5, 0xCF)
    ]
    return make_sysfs(tmp_path / "sys", nodes, pci=[*gpus, *NOT_GPUS])


@pytest.fixture
def gpus_without_numa(tmp_path: Path) -> Path:
    """A VM: 2 NUMA nodes of 8 CPUs but the GPUs report numa_node -1."""
    nodes = {0: range(0, 8), 1: range(8, 16)}
    gpus = [(f"0000:00:{d:02x}.0", NVIDIA_3D, NVIDIA, -1) for d in (4, 5, 6, 7)]
    return make_sysfs(tmp_path / "sys", nodes, pci=gpus)


@pytest.fixture
def tiny_cpu_node(tmp_path: Path) -> Path:
    """One node with 2 CPUs and no GPU (like this machine)."""
    return make_sysfs(tmp_path / "sys", {0: [0, 1]})


# ------------------------------------------------------------------ checks


def check_invariants(
    plan: AffinityPlan, topo_nodes: dict[int, tuple[int, ...]], siblings: dict[int, int]
) -> None:
    """What every plan must satisfy: shares inside the allowed set and the rank's node, main and
    workers partition the share, workers distinct when there are enough cores, siblings together."""
    for r in plan.ranks:
        assert set(r.cpus) <= set(plan.allowed)
        if r.numa_node is not None:
            assert set(r.cpus) <= set(topo_nodes[r.numa_node])
        parts = [set(r.main_cpus), *[set(w) for w in r.worker_cpus]]
        if not r.shared and len(r.cpus) > len(r.worker_cpus):
            union = set().union(*parts)
            assert union == set(r.cpus)
            assert sum(len(p) for p in parts) == len(union), f"rank {r.local_rank}: main/workers overlap"
        for cpu in r.cpus:
            if cpu in siblings:
                assert siblings[cpu] in r.cpus, f"cpu {cpu} split from its hyperthread sibling"
        assert r.threads >= 1
    if not any(r.shared for r in plan.ranks):
        seen: set[int] = set()
        for r in plan.ranks:
            assert not (seen & set(r.cpus)), "two ranks share a CPU"
            seen |= set(r.cpus)


def test_cpulist_round_trip() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpulist([11, 10, 8, 3, 2, 1, 0]) == "0-3,8,10-11"
    assert parse_cpulist(format_cpulist([5])) == [5]
    assert parse_cpulist("") == []


def test_two_sockets_four_gpus_each(two_sockets_4_gpus_each: Path) -> None:
    topo = read_topology(two_sockets_4_gpus_each)
    assert [g.bus_id for g in topo.gpus][:2] == ["0000:1a:00.0", "0000:1c:00.0"]
    assert len(topo.gpus) == 8  # NVSwitch, BMC VGA and NIC are not GPUs
    plan = plan_affinity(8, 4, sysfs_root=two_sockets_4_gpus_each)
    assert plan.warnings == ()
    siblings = {c: c + 48 for c in range(48)} | {c + 48: c for c in range(48)}
    check_invariants(plan, topo.numa_nodes, siblings)
    r0, r4 = plan.ranks[0], plan.ranks[4]
    assert r0.numa_node == 0 and r4.numa_node == 1
    # 24 cores per socket / 4 ranks = 6 cores each; 4 workers get a core each, main keeps 2.
    assert r0.cpus == (*range(0, 6), *range(48, 54))
    assert r0.main_cpus == (0, 1, 48, 49)
    assert r0.worker_cpus == ((2, 50), (3, 51), (4, 52), (5, 53))
    assert r0.threads == 2
    assert r4.cpus == (*range(24, 30), *range(72, 78))
    assert plan.ranks[7].cpus == (*range(42, 48), *range(90, 96))


def test_eight_gpus_on_one_socket(eight_gpus_one_socket: Path) -> None:
    plan = plan_affinity(8, 1, sysfs_root=eight_gpus_one_socket)
    topo = read_topology(eight_gpus_one_socket)
    check_invariants(plan, topo.numa_nodes, {})
    for r in plan.ranks:
        assert r.numa_node == 0  # the GPUs' socket, even though socket 1 is idle
        assert r.main_cpus == (2 * r.local_rank,)
        assert r.worker_cpus == ((2 * r.local_rank + 1,),)
    assert not any(set(r.cpus) & set(range(16, 32)) for r in plan.ranks)


def test_gpus_with_numa_node_minus_one(gpus_without_numa: Path) -> None:
    plan = plan_affinity(4, 0, sysfs_root=gpus_without_numa)
    assert any("numa_node -1" in w for w in plan.warnings)
    for r in plan.ranks:
        assert r.numa_node is None
        assert r.cpus == tuple(range(4 * r.local_rank, 4 * r.local_rank + 4))
        assert r.threads == 4
    check_invariants(plan, read_topology(gpus_without_numa).numa_nodes, {})


def test_more_ranks_than_cores(tiny_cpu_node: Path) -> None:
    plan = plan_affinity(4, 1, sysfs_root=tiny_cpu_node)
    assert any("share cores" in w for w in plan.warnings)
    assert [r.cpus for r in plan.ranks] == [(0,), (1,), (0,), (1,)]
    assert all(r.shared for r in plan.ranks)
    for r in plan.ranks:  # the worker has no core of its own: it shares the rank's
        assert r.worker_cpus == (r.main_cpus,)


@pytest.fixture
def twelve_cores_per_rank(tmp_path: Path) -> Path:
    """One node of 24 cores, no GPU: two ranks get 12 cores each."""
    return make_sysfs(tmp_path / "sys", {0: range(0, 24)})


def test_no_core_idles_with_main_cores(twelve_cores_per_rank: Path) -> None:
    # 12 cores, main keeps 2, 4 workers: the other 10 cores all go to the workers (2, 3, 2, 3)
    plan = plan_affinity(2, 4, sysfs_root=twelve_cores_per_rank, main_cores=2)
    check_invariants(plan, read_topology(twelve_cores_per_rank).numa_nodes, {})
    for r in plan.ranks:
        used = set(r.main_cpus).union(*map(set, r.worker_cpus))
        assert used == set(r.cpus), f"rank {r.local_rank}: idle cores {set(r.cpus) - used}"
        assert len(r.main_cpus) == 2 and r.threads == 2
        assert [len(w) for w in r.worker_cpus] == [2, 3, 2, 3]
    assert plan.warnings == ()


def test_main_process_keeps_two_cores_when_workers_outnumber_the_share(twelve_cores_per_rank: Path) -> None:
    plan = plan_affinity(2, 11, sysfs_root=twelve_cores_per_rank)
    for r in plan.ranks:
        assert len(r.main_cpus) == 2 and r.threads == 2  # not 1 core and 1 thread
        rest = set(r.cpus) - set(r.main_cpus)
        assert set().union(*map(set, r.worker_cpus)) == rest  # 10 cores for 11 workers, none idle
        assert all(len(w) == 1 for w in r.worker_cpus)
    assert any("11 workers on 10 cores" in w for w in plan.warnings)
    # with few workers the main process keeps the rest, one core per worker
    plan = plan_affinity(2, 4, sysfs_root=twelve_cores_per_rank)
    assert [len(plan.ranks[0].main_cpus), *map(len, plan.ranks[0].worker_cpus)] == [8, 1, 1, 1, 1]


def test_main_core_count_rule() -> None:
    from hyperacc.stabilize.affinity import main_core_count

    assert main_core_count(12, 0, None) == 12
    assert main_core_count(12, 4, None) == 8
    assert main_core_count(12, 11, None) == 2
    assert main_core_count(12, 20, None) == 2
    assert main_core_count(2, 3, None) == 1  # a share of 2: one for the main process, one for the workers
    assert main_core_count(1, 3, None) == 1
    assert main_core_count(12, 4, 2) == 2 and main_core_count(12, 4, 30) == 11


def test_text_plan_is_format_plan(two_sockets_4_gpus_each: Path) -> None:
    from hyperacc.commands.affinity import command
    from hyperacc.stabilize.affinity import format_plan

    res = CliRunner().invoke(command, ["--nproc-per-node", "8", "--workers-per-rank", "4", "--sysfs-root",
                                       str(two_sockets_4_gpus_each)])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert res.output.rstrip("\n") == format_plan(plan_affinity(8, 4, sysfs_root=two_sockets_4_gpus_each))


def test_cpu_only_ranks_spread_over_nodes(eight_gpus_one_socket: Path, tmp_path: Path) -> None:
    root = make_sysfs(tmp_path / "cpu-only", {0: range(0, 8), 1: range(8, 16)})
    plan = plan_affinity(4, 0, sysfs_root=root)
    assert [r.numa_node for r in plan.ranks] == [0, 0, 1, 1]
    assert [r.cpus for r in plan.ranks] == [
        (0, 1, 2, 3),
        (4, 5, 6, 7),
        tuple(range(8, 12)),
        tuple(range(12, 16)),
    ]


def test_cuda_visible_devices_selects_gpus(two_sockets_4_gpus_each: Path) -> None:
    plan = plan_affinity(2, 0, sysfs_root=two_sockets_4_gpus_each, visible_devices="5,1")
    assert [r.gpu.bus_id for r in plan.ranks] == ["0000:8a:00.0", "0000:1c:00.0"]
    assert [r.numa_node for r in plan.ranks] == [1, 0]


def test_container_cpuset_is_planned_inside(tmp_path: Path) -> None:
    nodes = {0: range(0, 16), 1: range(16, 32)}
    gpus = [("0000:17:00.0", NVIDIA_3D, NVIDIA, 0), ("0000:81:00.0", NVIDIA_3D, NVIDIA, 1)]
    cpuset = [*range(0, 4), *range(16, 20)]
    root = make_sysfs(tmp_path / "sys", nodes, pci=gpus, cpuset=cpuset)
    rank1, plan = binding_for_rank(1, 2, 1, sysfs_root=root, allowed=cpuset)
    assert plan.inherited == "cpuset"
    assert rank1.cpus == (16, 17, 18, 19) and rank1.worker_cpus == ((19,),) and rank1.source == "plan"


def test_torchrun_node_binding_is_split_among_the_nodes_ranks(two_sockets_4_gpus_each: Path) -> None:
    node1 = [*range(24, 48), *range(72, 96)]  # what `torchrun --numa-binding=node` gives ranks 4-7
    b, plan = binding_for_rank(5, 8, 4, sysfs_root=two_sockets_4_gpus_each, allowed=node1)
    assert plan.inherited == "per-process"
    assert b.source == "plan"
    assert b.cpus == (*range(30, 36), *range(78, 84))  # the same share as without the launcher's mask


def test_torchrun_exclusive_binding_is_kept(two_sockets_4_gpus_each: Path) -> None:
    # `--numa-binding=exclusive` may split the node differently; the launcher's share is kept whole.
    mine = [*range(31, 37), *range(79, 85)]
    b, _ = binding_for_rank(5, 8, 4, sysfs_root=two_sockets_4_gpus_each, allowed=mine)
    assert b.source == "inherited"
    assert set(b.cpus) == set(mine)
    assert len(b.worker_cpus) == 4 and len({w for w in b.worker_cpus}) == 4
    assert set(b.main_cpus).isdisjoint(c for w in b.worker_cpus for c in w)


def test_this_machine_plan_fits_the_affinity() -> None:
    allowed = os.sched_getaffinity(0)
    plan = plan_affinity(2, 1)
    assert set(plan.allowed) == allowed & set(read_topology().online)
    for r in plan.ranks:
        assert r.cpus and set(r.cpus) <= allowed
    if len(allowed) >= 2:
        assert not set(plan.ranks[0].cpus) & set(plan.ranks[1].cpus)


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="nproc must be >= 1"):
        plan_affinity(0)
    with pytest.raises(ValueError, match="local_rank 3 is outside"):
        binding_for_rank(3, 2)


def test_cli_show_json_matches_the_plan(two_sockets_4_gpus_each: Path) -> None:
    from hyperacc.commands.affinity import command

    res = CliRunner().invoke(
        command,
        ["--show", "--nproc-per-node", "8", "--workers-per-rank", "4", "--sysfs-root", str(two_sockets_4_gpus_each),
         "--json"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data == plan_affinity(8, 4, sysfs_root=two_sockets_4_gpus_each).to_dict()
    table = CliRunner().invoke(
        command, ["--sysfs-root", str(two_sockets_4_gpus_each), "--workers-per-rank", "4"]
    )
    assert table.exit_code == 0 and "0000:b3:00.0" in table.output  # nproc defaults to the GPU count


def test_cli_bad_input_is_one_line(tmp_path: Path) -> None:
    from hyperacc.commands.affinity import command

    res = CliRunner().invoke(command, ["--sysfs-root", str(tmp_path / "missing")])
    assert res.exit_code != 0
    assert res.output.strip().count("\n") == 0 and "not a directory" in res.output
    res = CliRunner().invoke(command, ["--nproc-per-node", "0"])
    assert res.exit_code != 0 and "nproc must be >= 1" in res.output and "Traceback" not in res.output


INHERITED_PROBE = """
import json, os
from hyperacc.stabilize import stabilize
from hyperacc.stabilize.affinity import thread_affinities
before = sorted(os.sched_getaffinity(0))
stab = stabilize(gc=False, memory=False, allocator=False, affinity={"workers_per_rank": 1, "nproc": 1, "local_rank": 0})
print(json.dumps({"before": before, "binding": stab.binding.to_dict(),
                  "threads": sorted({tuple(sorted(m)) for m in thread_affinities().values()})}))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_a_launchers_mask_is_kept_in_a_real_process() -> None:
    """Like `numactl --physcpubind` or `torchrun --numa-binding=exclusive`: the process starts bound to
    one CPU; the stabilizer plans inside that mask instead of widening it."""
    import subprocess
    import sys

    cpu = max(os.sched_getaffinity(0))
    out = subprocess.run(
        [sys.executable, "-c", INHERITED_PROBE], capture_output=True, text=True, timeout=120,
        preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["before"] == [cpu]
    assert res["binding"]["source"] == "inherited"
    assert res["binding"]["main_cpus"] == str(cpu) and res["binding"]["worker_cpus"] == [str(cpu)]
    assert res["threads"] == [[cpu]]


def test_hyperacc_affinity_is_registered(two_sockets_4_gpus_each: Path) -> None:
    from hyperacc.cli import cli

    res = CliRunner().invoke(
        cli, ["affinity", "--show", "--sysfs-root", str(two_sockets_4_gpus_each), "--json"]
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["nproc"] == 8


def test_memory_binding_prefers_the_node_through_libnuma() -> None:
    import ctypes
    import ctypes.util

    from hyperacc.stabilize.affinity import bind_memory

    assert bind_memory(None).startswith("memory not bound")
    name = ctypes.util.find_library("numa")
    if name is None:
        pytest.skip("libnuma not installed")
    lib = ctypes.CDLL(name)
    if lib.numa_available() < 0:
        pytest.skip("no NUMA support in this kernel")
    node = min(read_topology().numa_nodes)
    try:
        assert bind_memory(node) == f"memory prefers NUMA node {node}"
        assert lib.numa_preferred() == node
    finally:
        lib.numa_set_localalloc()  # back to the default policy for the rest of the tests

"""process.place(): the one reader of this process's place in the job (torchrun's environment)."""

from hyperacc import process

TORCHRUN = {
    "RANK": "5", "LOCAL_RANK": "1", "GROUP_RANK": "2", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "2",
    "GROUP_WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400",
    "TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "3",
}  # fmt: skip


def test_a_torchrun_rank_reads_its_place():
    here = process.place(TORCHRUN)
    assert (here.rank, here.local_rank, here.node, here.world_size, here.local_world_size) == (5, 1, 2, 8, 2)
    assert (here.nodes, here.master_addr, here.master_port) == (4, "10.0.0.1", 29400)
    assert (here.run_id, here.restart_count, here.max_restarts) == ("job7", 1, 3)
    assert here.node_count() == 4


def test_outside_a_launcher_it_is_one_process_and_bad_values_count_as_unset():
    here = process.place({})
    assert (here.rank, here.local_rank, here.node, here.world_size, here.master_addr) == (0, 0, 0, None, None)
    assert here.run_id == "local" and here.node_count() == 1
    odd = process.place({"RANK": "three", "MASTER_PORT": "", "WORLD_SIZE": "x", "MASTER_ADDR": "  "})
    assert (odd.rank, odd.master_port, odd.world_size, odd.master_addr) == (0, None, None, None)


def test_node_count_without_group_world_size_comes_from_the_ranks_per_node():
    env = {k: v for k, v in TORCHRUN.items() if k != "GROUP_WORLD_SIZE"}
    assert process.place(env).node_count() == 4  # 8 ranks, 2 per node
    assert process.place(env).node_count(world_size=6) == 3
    env.pop("LOCAL_WORLD_SIZE")
    assert process.place(env).node_count() == 1  # ranks per node unknown: one node


def test_it_reads_the_environment_now(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    assert process.place().rank == 3
    monkeypatch.setenv("RANK", "4")
    assert process.place().rank == 4

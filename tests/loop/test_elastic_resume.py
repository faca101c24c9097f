"""hyperacc.elastic: a resumed run is the run that was never interrupted, and the data position carries
over to another number of ranks without reading a sample twice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hyperacc import harness, store
from hyperacc.data.pipeline import make_loader
from hyperacc.elastic import Checkpointer, carry_data_position, reshard_position

WORKER = Path(__file__).parent / "workers" / "resume_rank.py"


@pytest.mark.multirank
def test_a_resumed_run_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    # 30 steps straight, saving at step 20 (saving changes nothing); then a second job resumes there
    straight = harness.launch(WORKER, ["--steps", "30", "--ckpt", ckpt, "--every", "20"], nproc=2, timeout=240)
    assert straight.ok, straight.explain()
    # the second job traced (`hyperacc run`): its tracer numbers the steps it runs as the run it continues
    run_dir = tmp_path / "run"
    resumed = harness.launch(WORKER, ["--steps", "30", "--ckpt", ckpt, "--every", "20"], nproc=2, timeout=240,
                             traced={"run-dir": str(run_dir), "trace": json.dumps({"window": 0})})  # fmt: skip
    assert resumed.ok, resumed.explain()
    table = store.read_steps(run_dir, columns=["rank", "step"])
    for rank in range(2):
        assert [r["step"] for r in table.to_pylist() if r["rank"] == rank] == list(range(20, 30))
    for s, r in zip(straight.results(), resumed.results(), strict=True):
        assert s["first"] == 0 and r["first"] == 20
        assert sorted(map(int, r["losses"])) == list(range(20, 30))
        # model, AdamW state, StepLR, dropout RNG and data position all restored: bit-identical
        assert r["checksum"] == s["checksum"]
        assert r["lr"] == s["lr"]
        assert r["losses"] == {k: s["losses"][k] for k in r["losses"]}
        assert r["seen"] == {k: s["seen"][k] for k in r["seen"]}


class Indexed(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> int:
        return i


def consume(world: int, batches: int | None, state: dict | None = None, saved_world: int | None = None):
    """Each rank's loader of a ``world``-rank job: read ``batches`` (None: the rest of the epoch)."""
    seen, states = [], []
    for rank in range(world):
        loader = make_loader(Indexed(), 10, rank=rank, world_size=world, seed=5, drop_last=True)
        if state is not None:
            loader.load_state_dict(carry_data_position(state, saved_world, world))
        loader.set_epoch(loader.epoch)
        for n, batch in enumerate(loader):
            if batches is not None and n >= batches:
                break
            seen += batch.tolist()
        states.append(loader.state_dict())
    return seen, states


@pytest.mark.parametrize(("before", "after"), [(6, 4), (4, 6), (3, 2), (2, 2)])
def test_the_data_position_carries_to_another_world_size(before: int, after: int) -> None:
    seen_before, states = consume(before, 7)
    assert len({s["batches"] for s in states}) == 1  # synchronous training: the same on every rank
    seen_after, _ = consume(after, None, states[0], before)
    assert not set(seen_before) & set(seen_after), "a sample was read twice"
    assert len(seen_after) == len(set(seen_after))
    skipped = 1000 - len(seen_before) - len(seen_after)
    # unread: less than a batch per new rank at the switch, and the epoch tail that drop_last leaves
    assert 0 <= skipped < after * (2 * 10 + 1)


def test_reshard_position_is_the_first_unread_global_position() -> None:
    assert reshard_position(7, 6, 4) == 11  # 42 batches read; 4 ranks x 11 = 44 >= 42
    assert reshard_position(7, 4, 6) == 5
    assert reshard_position(0, 3, 5) == 0
    assert reshard_position(9, 2, 2) == 9
    with pytest.raises(ValueError):
        reshard_position(-1, 2, 2)


def test_single_process_round_trip_and_bad_arguments(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = Checkpointer(tmp_path, every=2, model=model, optimizer=opt)
    assert ckpt.resume() == 0
    for step in range(1, 5):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        ckpt.step_end(step)
    saved = [p.name for p in sorted(tmp_path.iterdir())]
    assert saved == ["step-000000002", "step-000000004"]
    weights = model.weight.detach().clone()
    after = torch.randn(3)  # the RNG stream after the save
    model2 = torch.nn.Linear(4, 2)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    again = Checkpointer(tmp_path, every=2, model=model2, optimizer=opt2)
    assert again.resume() == 4
    assert torch.equal(model2.weight, weights)
    assert torch.equal(torch.randn(3), after)  # RNG restored to the state at the save
    assert opt2.state_dict()["state"][0]["momentum_buffer"].abs().sum() > 0
    with pytest.raises(ValueError, match="every"):
        Checkpointer(tmp_path, every=0, model=model)
    with pytest.raises(ValueError, match="state_dict"):
        Checkpointer(tmp_path, every=1, model=model, loader=object())

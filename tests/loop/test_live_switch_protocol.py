"""The live switch protocol of ``remediation.live`` on a real c10d TCPStore: the decider proposes a step,
every rank acknowledges it with its own current step, and the last one agrees one step for all, never
earlier than the proposal and never closer than the lead to the newest acknowledged step. A rank that
never acknowledges leaves the switch unagreed everywhere."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from hyperacc.remediation.config import RemediationConfig
from hyperacc.remediation.live import LiveRemediation
from hyperacc.remediation.policy import Decision

LEAD = 7


@pytest.fixture
def server():
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    yield f"127.0.0.1:{store.port}"
    del store


def _job(tmp_path, address: str, steps: list[int], world_size: int):
    config = RemediationConfig(mode="auto", run_dir=str(tmp_path), gc_lead_steps=LEAD)
    decider = LiveRemediation(config, rank=0, applies=False, decides=True, store_address=address, prefix="t/")
    return decider, _ranks(config, address, "t/", steps, world_size)


def _ranks(config: RemediationConfig, address: str, prefix: str, steps: list[int], world_size: int):
    """The applying half of ``len(steps)`` ranks, rank r at step ``steps[r]``."""
    return [
        LiveRemediation(config, rank=r, decides=False, store_address=address, prefix=prefix, poll_s=0.02,
                        world_size=world_size, current_step=lambda r=r: steps[r])  # fmt: skip
        for r in range(len(steps))
    ]


def _propose(decider: LiveRemediation, step: int) -> str:
    return decider._publish(Decision("gc-schedule", "gc_schedule", "act", "all ranks", f"step {step}", "test", step))


def _wait(ranks: list[LiveRemediation], timeout_s: float = 30.0) -> list[dict[str, int]]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all(r.agreed for r in ranks):
        time.sleep(0.02)
    return [r.agreed for r in ranks]


def _propose_and_close(decider: LiveRemediation, ranks: list[LiveRemediation], step: int,
                       timeout_s: float = 30.0) -> list[dict[str, int]]:  # fmt: skip
    """Propose ``step``, wait for the ranks to agree it (or the timeout), stop them: what each agreed."""
    try:
        _propose(decider, step)
        return _wait(ranks, timeout_s)
    finally:
        for r in ranks:
            r.close()


def test_ranks_ahead_of_the_proposal_agree_the_newest_step_plus_the_lead(tmp_path, server) -> None:
    decider, ranks = _job(tmp_path, server, [130, 131, 130, 129], world_size=4)
    try:
        assert "proposed for step 120" in _propose(decider, 120)
        # the decider's guess lagged: the ranks are already past 120; all agree 131 + LEAD
        assert _wait(ranks) == [{"gc_schedule": 131 + LEAD}] * 4
    finally:
        for r in ranks:
            r.close()


def test_ranks_behind_the_proposal_keep_the_proposed_step(tmp_path, server) -> None:
    decider, ranks = _job(tmp_path, server, [60, 61, 61, 60], world_size=4)
    try:
        _propose(decider, 100)
        assert _wait(ranks) == [{"gc_schedule": 100}] * 4
    finally:
        for r in ranks:
            r.close()


def test_a_rank_that_never_acknowledges_leaves_the_switch_unagreed(tmp_path, server) -> None:
    decider, ranks = _job(tmp_path, server, [50, 50, 50], world_size=4)  # rank 3 is missing
    try:
        _propose(decider, 100)
        assert _wait(ranks, timeout_s=1.0) == [{}] * 3
        assert not any(r.on is False for r in ranks)  # still on, still waiting
    finally:
        for r in ranks:
            r.close()


def test_an_error_on_one_rank_drops_the_switch_on_every_rank(tmp_path, server) -> None:
    decider, ranks = _job(tmp_path, server, [10, 10], world_size=2)
    try:
        ranks[1]._off_everywhere(RuntimeError("injected"))
        _propose(decider, 100)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and ranks[0].on:
            time.sleep(0.02)
        assert not ranks[0].on and ranks[0].agreed == {}
    finally:
        for r in ranks:
            r.close()


def test_a_switch_is_proposed_again_to_the_ranks_of_an_elastic_restart(tmp_path, server) -> None:
    # the ranks restart (an elastic restart after a drain or a failure) with none of the stabilizers the
    # first ranks started: the node agent, which outlives them, proposes every switch it made again under
    # the restarted ranks' prefix, so the job keeps what was decided once per run
    from hyperacc.remediation.events import read_events

    decider, ranks = _job(tmp_path, server, [130, 131], world_size=2)
    config = decider.config
    assert _propose_and_close(decider, ranks, 140) == [{"gc_schedule": 140}] * 2
    restarted = _ranks(config, server, "t/1/", [100, 100], world_size=2)
    try:
        decider.retarget("t/1/")
        # resumed from a checkpoint at step 100: the newest acknowledged step plus the lead
        assert _wait(restarted) == [{"gc_schedule": 100 + LEAD}] * 2
        carried = [e for e in read_events(tmp_path) if e.get("kind") == "carry"]
        assert [(e["rule"], e["action"], e["status"]) for e in carried] == [("gc-schedule", "gc_schedule", "proposed")]
        decider.retarget("t/1/")  # the same ranks again: nothing more
        assert len([e for e in read_events(tmp_path) if e.get("kind") == "carry"]) == 1
    finally:
        for r in restarted:
            r.close()


def test_a_switch_proposed_to_ranks_that_never_agreed_it_is_proposed_to_their_restart(tmp_path, server) -> None:
    # decided while the ranks were halted (waiting out a drain), never agreed: the restart gets it
    decider, ranks = _job(tmp_path, server, [400], world_size=2)  # rank 1 halted, never acknowledges
    assert _propose_and_close(decider, ranks, 513, timeout_s=0.5) == [{}]
    restarted = _ranks(decider.config, server, "t/1/", [400, 400], world_size=2)
    try:
        decider.retarget("t/1/")
        assert _wait(restarted) == [{"gc_schedule": 400 + LEAD}] * 2
    finally:
        for r in restarted:
            r.close()


def test_the_live_view_shows_a_carry_of_each_restart(tmp_path) -> None:
    from hyperacc.present.live_view import RunFollower
    from hyperacc.remediation.events import append_event

    follower = RunFollower([tmp_path])
    for prefix in ("t/1/", "t/2/"):
        append_event(tmp_path, {"kind": "carry", "rule": "gc-schedule", "action": "gc_schedule",
                                "status": "proposed", "target": "all ranks", "at": f"prefix {prefix}"})  # fmt: skip
        assert follower._read_remediation(tmp_path), prefix  # a new line for each restart
    assert not follower._read_remediation(tmp_path)  # and nothing more


def test_the_restarted_ranks_store_of_their_own_gets_the_switch(tmp_path, server) -> None:
    # agents that do not share their rendezvous store with the workers (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1,
    # which a drain needs): each attempt of the ranks has a store of its own, and the first one is gone
    decider, ranks = _job(tmp_path, server, [130, 131], world_size=2)
    assert _propose_and_close(decider, ranks, 140) == [{"gc_schedule": 140}] * 2
    second = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    address = f"127.0.0.1:{second.port}"
    restarted = _ranks(decider.config, address, "t/1/", [20, 20], world_size=2)
    try:
        decider.retarget("t/1/", address)
        assert _wait(restarted) == [{"gc_schedule": 20 + LEAD}] * 2
        assert decider.on
    finally:
        for r in restarted:
            r.close()
        del second


def test_a_switch_agreed_before_the_checkpoints_load_moves_with_the_resumed_step_numbers(tmp_path, server) -> None:
    # an elastic restart: the agent proposes its switch again at once, the restarted ranks acknowledge it
    # at their step 0, before their checkpoint's load, then their tracers number the steps from the
    # checkpoint's step 250 (``Tracer.resume_at``): the agreed step moves with them, on every rank alike,
    # instead of being long past (before 2026-12-05 every rank started it at its first step, "LATE")
    config = RemediationConfig(mode="auto", run_dir=str(tmp_path), gc_lead_steps=LEAD)
    decider = LiveRemediation(config, rank=0, applies=False, decides=True, store_address=server, prefix="t/")
    steps = [0, 0]
    resumed: list[tuple[int, int] | None] = [None]
    ranks = [
        LiveRemediation(config, rank=r, decides=False, store_address=server, prefix="t/", poll_s=0.02, world_size=2,
                        current_step=lambda r=r: steps[r], resumed=lambda: resumed[0])  # fmt: skip
        for r in range(2)
    ]
    started: list[list[tuple[int, str]]] = [[], []]
    for r, rank in enumerate(ranks):
        rank.record = lambda kind, step, detail, r=r: started[r].append((step, detail))
    assert _propose_and_close(decider, ranks, 0) == [{"gc_schedule": LEAD}] * 2
    resumed[0] = (0, 250)
    for rank in ranks:
        for step in range(250, 250 + LEAD + 2):
            rank.step(step)
        for stabilizer in rank.stabilizers:
            stabilizer.close()
    assert [[step for step, _ in s] for s in started] == [[250 + LEAD]] * 2, started
    assert all("LATE" not in detail for s in started for _, detail in s), started

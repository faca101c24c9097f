"""An internal error of pacing on one rank switches pacing off on every rank (``trace.failsafe.
OffOnEveryRank`` over a real c10d TCPStore; two ranks' hooks in one process, each with its own client)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch.distributed as dist

from hyperacc.pacing import PacingConfig
from hyperacc.pacing.runtime import PacingHook
from hyperacc.trace.failsafe import OffOnEveryRank


@pytest.fixture
def address():
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    yield server.port
    del server


def _client(port: int):
    return dist.TCPStore("127.0.0.1", port, None, False, wait_for_workers=False)


def _until(cond, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not cond():
        time.sleep(0.02)
    return cond()


def test_a_part_published_off_on_one_rank_is_taken_once_on_the_others(address) -> None:
    ranks = [OffOnEveryRank("t/off/", r, (lambda c=_client(address): c), poll_s=0.02) for r in range(3)]
    for r in ranks:
        r.watch(("gc", "memory"))
    try:
        ranks[1].publish("gc", RuntimeError("boom"))
        assert _until(lambda: all(r.elsewhere for r in ranks))
        for r in ranks:
            assert r.take() == [("gc", "rank 1: RuntimeError: boom")]
            assert r.take() == []  # once
    finally:
        for r in ranks:
            r.close()


def test_pacing_that_fails_on_one_rank_stops_on_every_rank(address) -> None:
    hooks = [PacingHook(PacingConfig(), rank=r, world_size=2) for r in range(2)]  # each watches
    for h in hooks:
        # each rank's own client of the job's store, under one key prefix (in one process the hooks are
        # the first and the second made; in a job each rank's is its first)
        h._everywhere.get_store = lambda c=_client(address): c
        h._everywhere.prefix = "t/pacing/off/"
    try:
        hooks[1].observe(0, np.zeros(3), None)  # 3 arrivals for a world of 2: an internal error on rank 1
        assert not hooks[1].enabled
        assert _until(lambda: bool(hooks[0]._everywhere.elsewhere))
        assert hooks[0].enabled  # until its next step
        assert hooks[0].delay_before(5) == 0 and not hooks[0].enabled
        hooks[0].observe(6, np.zeros(2), None)  # nothing more is taken in
        assert hooks[0].delay_before(6) == 0
    finally:
        for h in hooks:
            h._everywhere.close()

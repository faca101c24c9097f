"""Measurements that need other ranks: all-reduce over the job and exchanges between pairs of nodes.

All-reduce: every rank times ``reps`` small (latency) and large (bandwidth) all-reduces after a
barrier; the repetition counts are agreed once (the slowest rank's calibration), so every rank issues
the same collectives.

Node pairs: a round-robin tournament (the circle method) pairs every node with every other node once
per round, disjoint pairs at the same time. Within a pair, local rank ``l`` of one node exchanges with
local rank ``l`` of the other (every rail at once, as in training): a ping-pong of a small message
(latency) and of a large one (bandwidth), the lower rank sending first. The lower rank picks the
repetition count for its slice and sends it first, so both sides agree without a collective.
docs/doctor.md, "Network".
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist


def round_robin(nodes: int) -> list[list[tuple[int, int]]]:
    """Every pair of ``nodes`` exactly once, in rounds of disjoint pairs (circle method)."""
    ids: list[int | None] = list(range(nodes))
    if nodes % 2:
        ids.append(None)  # a bye
    n = len(ids)
    rounds = []
    for _ in range(n - 1):
        pairs = []
        for i in range(n // 2):
            a, b = ids[i], ids[n - 1 - i]
            if a is not None and b is not None:
                pairs.append((min(a, b), max(a, b)))
        rounds.append(pairs)
        ids = [ids[0], ids[-1], *ids[1:-1]]
    return rounds


class AllReduce:
    def __init__(self, device: torch.device, exchange_mb: int) -> None:
        self.device = device
        self.small = torch.zeros(2, device=device)
        self.large = torch.zeros(exchange_mb * 2**20 // 4, device=device)
        self.large_bytes = self.large.numel() * 4
        self.reps: tuple[int, int] | None = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _time(self, tensor: torch.Tensor, reps: int) -> float:
        dist.barrier()
        t0 = time.perf_counter_ns()
        for _ in range(reps):
            dist.all_reduce(tensor)
        self._sync()
        return (time.perf_counter_ns() - t0) / reps

    def run(self, slice_s: float) -> dict[str, float]:
        if self.reps is None:  # calibrate once, agree on the slowest rank's counts
            small = self._time(self.small, 3)
            large = self._time(self.large, 1)
            worst = torch.tensor([small, large], dtype=torch.float64, device=self.device)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            small, large = (float(v) for v in worst.cpu())
            self.reps = (
                max(3, min(2000, int(0.3 * slice_s * 1e9 / max(small, 1.0)))),
                max(2, min(500, int(0.7 * slice_s * 1e9 / max(large, 1.0)))),
            )
        return {"small_ns": self._time(self.small, self.reps[0]), "large_ns": self._time(self.large, self.reps[1])}


class PairExchange:
    """Ping-pong with the same local rank of another node."""

    def __init__(self, device: torch.device, exchange_mb: int, table: list[dict[str, Any]], rank: int) -> None:
        self.device = device
        self.rank = rank
        self.small = torch.zeros(2, device=device)
        self.large = torch.zeros(exchange_mb * 2**20 // 4, device=device)
        self.large_bytes = self.large.numel() * 4
        self.count = torch.zeros(2, dtype=torch.int64, device=device)
        me = next(r for r in table if r["rank"] == rank)
        self.node, self.local = me["node"], me["local_rank"]
        self.peer: dict[int, int] = {  # node -> the rank with my local rank on that node
            r["node"]: r["rank"] for r in table if r["local_rank"] == self.local and r["node"] != self.node
        }
        self.nodes = sorted({r["node"] for r in table})
        self.schedule = round_robin(len(self.nodes))
        self._last: dict[int, tuple[float, float]] = {}  # partner node -> (small, large) ns

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _pingpong(self, peer: int, tensor: torch.Tensor, reps: int, first: bool) -> float:
        t0 = time.perf_counter_ns()
        for _ in range(reps):
            if first:
                dist.send(tensor, peer)
                dist.recv(tensor, peer)
            else:
                dist.recv(tensor, peer)
                dist.send(tensor, peer)
        self._sync()
        return (time.perf_counter_ns() - t0) / reps

    def run(self, slice_s: float) -> dict[str, dict[str, float]]:
        """One tournament; returns {partner node: {"small_ns", "large_ns"}} for this rank."""
        out: dict[str, dict[str, float]] = {}
        per_pairing = slice_s / max(len(self.schedule), 1)
        for pairs in self.schedule:
            dist.barrier()
            partner = None
            for a, b in pairs:
                if self.node in (self.nodes[a], self.nodes[b]):
                    partner = self.nodes[b] if self.nodes[a] == self.node else self.nodes[a]
            if partner is None or partner not in self.peer:
                continue
            peer = self.peer[partner]
            first = self.rank < peer
            if first:  # choose the repetition counts for this slice and tell the partner
                small, large = self._last.get(partner, (0.0, 0.0))
                if not large:
                    small = self._pingpong(peer, self.small, 2, True)
                    large = self._pingpong(peer, self.large, 1, True)
                self.count[0] = max(3, min(2000, int(0.2 * per_pairing * 1e9 / max(small, 1.0))))
                self.count[1] = max(2, min(500, int(0.8 * per_pairing * 1e9 / max(large, 1.0))))
                dist.send(self.count, peer)
            else:
                if partner not in self._last:
                    self._pingpong(peer, self.small, 2, False)
                    self._pingpong(peer, self.large, 1, False)
                dist.recv(self.count, peer)
            reps_small, reps_large = int(self.count[0]), int(self.count[1])
            small = self._pingpong(peer, self.small, reps_small, first)
            large = self._pingpong(peer, self.large, reps_large, first)
            self._last[partner] = (small, large)
            out[str(partner)] = {"small_ns": small, "large_ns": large}
        return out

"""Live aggregation at thousands of ranks: what gathering the windows costs the process that judges them,
how far behind the verdicts are, and how much the store holds, with and without one silent rank.

Two ways, side by side in one run, against one real TCPStore (the judging process's) with one client
per publisher:

- ``ranks``: every rank publishes its own window row (``WindowAggregator``, a job traced without
  ``hyperacc run``: one append and one count per rank and window, one connection per rank);
- ``agents``: one node agent per ``--per-node`` ranks publishes its node's rows as one batch
  (``hyperacc run``'s ``LiveNode``: one append and one count per node and window).

The judging side is the real ``WindowGatherer`` with the real ``LiveDetector`` on a thread of its own,
polling every 0.5 s; its CPU is that thread's CPU time (``time.thread_time``) divided by the windows it
judged. The publishers are threads of this process that publish window w of every rank or node at
``w x period_s`` (their CPU is spread over the job's ranks or nodes in a real job, so it is not counted).
"Behind" is the time from the last row of a window reaching the store to its verdict; with a silent
rank the first window waits its grace (``--grace-s``), and no later window waits one of its own
("windows that waited the grace": behind by more than 0.9 x grace; the next window may still wait for
the first, which is judged before it, for less than the grace).

    .venv/bin/python bench/live_aggregation.py            # 1,024 and 4,096 ranks, 8 ranks per node
    .venv/bin/python bench/live_aggregation.py --quick    # 256 and 1,024 ranks
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch.distributed as dist
from _machine import describe as machine

from hyperacc.analysis.live_aggregate import WindowGatherer
from hyperacc.analysis.options import DetectionOptions
from hyperacc.analysis.window_store import publish_rows
from hyperacc.analysis.windows import WindowStream

WINDOW = 50


def template_row() -> dict[str, Any]:
    """One window row as a rank's ``WindowStream`` makes it, from 300 steps of plausible timings."""
    rng = np.random.default_rng(0)
    n = 300
    step = rng.normal(100e6, 3e6, n)
    cols = {"rank": np.zeros(n, np.int64), "node": np.zeros(n, np.int64), "step": np.arange(n, dtype=np.int64),
            "step_ns": step, "self_ns": step * 0.7, "data_ns": rng.normal(2e6, 2e5, n),
            "forward_ns": step * 0.3, "backward_ns": step * 0.35, "comm_wait_ns": step * 0.25,
            "optimizer_ns": step * 0.05, "gc_ns": np.zeros(n), "cpu_ns": step * 0.9}  # fmt: skip
    stream = WindowStream(DetectionOptions(window_steps=WINDOW))
    rows = stream.add(cols) + stream.close()
    return rows[0]


def rows_of(template: dict[str, Any], w: int, ranks: range, per_node: int, rng: np.random.Generator) -> list[dict]:
    out = []
    for r in ranks:
        row = dict(template)
        row.update(rank=r, node=r // per_node, window=w, first_step=w * WINDOW, last_step=w * WINDOW + WINDOW - 1)
        row["self_ns_median"] = float(template["self_ns_median"]) * (1.0 + 0.02 * rng.standard_normal())
        out.append(row)
    return out


def connect(port: int) -> Any:
    timeout = datetime.timedelta(seconds=60)
    return dist.PrefixStore("bench/", dist.TCPStore("127.0.0.1", port, None, False, timeout=timeout,
                                                    wait_for_workers=False))  # fmt: skip


def run(ranks: int, per_node: int, mode: str, silent: bool, windows: int, period_s: float,
        grace_s: float) -> dict[str, Any]:  # fmt: skip
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    groups = [range(r, r + 1) for r in range(ranks)] if mode == "ranks" else [
        range(n, min(n + per_node, ranks)) for n in range(0, ranks, per_node)]  # fmt: skip
    silent_rank = ranks - 1 if silent else None
    with ThreadPoolExecutor(64) as pool:  # a client's connect takes about 0.2 s here; ranks connect at once
        clients = list(pool.map(lambda _: connect(server.port), groups))
    leader_store = connect(server.port)
    template = template_row()
    published: dict[int, float] = {}  # window -> when its last row reached the store
    judged: dict[int, float] = {}
    keys: list[int] = []
    gatherer = WindowGatherer(ranks, window=WINDOW, grace_s=grace_s, nodes=max(ranks // per_node, 1),
                              on_window=lambda w, got, missing: judged.setdefault(w, time.monotonic()))  # fmt: skip
    first = 1
    gatherer.note(first)
    stop = threading.Event()
    cpu = [0.0]

    def judge() -> None:
        t0 = time.thread_time()
        while not stop.is_set():
            gatherer.gather(leader_store)
            keys.append(server.num_keys())
            if len(judged) >= windows:
                break
            stop.wait(0.5)
        cpu[0] = time.thread_time() - t0

    judging = threading.Thread(target=judge)
    judging.start()
    rng = np.random.default_rng(1)
    start = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        for k in range(windows):
            w = first + k
            time.sleep(max(0.0, start + k * period_s - time.monotonic()))
            batches = [rows_of(template, w, [r for r in g if r != silent_rank], per_node, rng) for g in groups]  # type: ignore[arg-type]
            list(pool.map(lambda pair: publish_rows(pair[0], pair[1]) if pair[1] else None, zip(clients, batches, strict=True)))
            published[w] = time.monotonic()
    judging.join(timeout=windows * period_s + 4 * grace_s + 60)
    stop.set()
    judging.join()
    behind = [judged[w] - published[w] for w in sorted(judged) if w in published]
    return {
        "ranks": ranks, "mode": mode, "silent": silent, "publishers": len(groups), "judged": len(judged),
        "cpu_ms": 1e3 * cpu[0] / max(len(judged), 1),
        "behind_median_s": statistics.median(behind) if behind else float("nan"),
        "behind_max_s": max(behind) if behind else float("nan"),
        "waited_grace": sum(b > 0.9 * grace_s for b in behind),  # a window that waited a grace of its own
        "keys_max": max(keys) if keys else 0,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="256 and 1,024 ranks, 5 windows")
    ap.add_argument("--ranks", type=int, nargs="*", help="sizes (default 1024 4096; quick: 256 1024)")
    ap.add_argument("--per-node", type=int, default=8)
    ap.add_argument("--windows", type=int, default=None, help="windows per run (default 8; quick: 5)")
    ap.add_argument("--period-s", type=float, default=2.0, help="seconds between windows")
    ap.add_argument("--grace-s", type=float, default=4.0, help="the gatherer's grace for a late rank")
    args = ap.parse_args()
    sizes = args.ranks or ([256, 1024] if args.quick else [1024, 4096])
    windows = args.windows or (5 if args.quick else 8)
    print(f"# live aggregation: {machine()}")
    print(f"# {windows} windows of {WINDOW} steps every {args.period_s} s, {args.per_node} ranks per node, "
          f"grace {args.grace_s} s; judged by WindowGatherer + LiveDetector polling every 0.5 s")  # fmt: skip
    print("| ranks | who publishes | publishers | silent rank | judging CPU per window | behind, median / max "
          "| windows that waited the grace | store keys, max |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    results = {}
    for ranks in sizes:
        for silent in (False, True):
            for mode in ("ranks", "agents"):
                r = run(ranks, args.per_node, mode, silent, windows, args.period_s, args.grace_s)
                results[(ranks, silent, mode)] = r
                print(f"| {ranks} | {mode} | {r['publishers']} | {'one' if silent else 'none'} | {r['cpu_ms']:.1f} ms "
                      f"| {r['behind_median_s']:.2f} / {r['behind_max_s']:.2f} s | {r['waited_grace']} of {r['judged']} "
                      f"| {r['keys_max']} |", flush=True)  # fmt: skip
    print(f"\n# live episodes, judged by the agent that holds rank 0 over every rank's last blocks "
          f"({args.per_node} ranks per node; each other node's agent sends its ranks' blocks at most every "
          f"nodes / agent.BLOCK_KEYS_PER_S s)")  # fmt: skip
    print("| ranks | CPU per judgement | without the job's slowdowns | judged again after (agent.EPISODE_DUTY) "
          "| one node's new block on the wire | reading every other node's, wall / CPU | a 2x slow rank said |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for ranks in sorted({64, *sizes}):
        e = episodes_cost(ranks, args.per_node)
        print(f"| {ranks} | {e['cpu_s'] * 1e3:.0f} ms | {e['cpu_without_slowdowns_s'] * 1e3:.0f} ms "
              f"| {e['interval_s']:.2f} s | {e['wire_bytes']:,} B "
              f"| {e['keys']} keys: {e['read_s'] * 1e3:.0f} / {e['read_cpu_s'] * 1e3:.0f} ms "
              f"| {'yes' if e['found'] else 'no'} |", flush=True)  # fmt: skip
    for ranks in sizes:
        for silent in (False, True):
            a, b = results[(ranks, silent, "agents")], results[(ranks, silent, "ranks")]
            print(f"# {ranks} ranks, {'one silent rank' if silent else 'all report'}: judging CPU per window, "
                  f"node agents / every rank publishing = {a['cpu_ms'] / max(b['cpu_ms'], 1e-9):.2f}")  # fmt: skip


def episodes_cost(ranks: int, per_node: int, judgements: int = 3) -> dict[str, Any]:
    """The leader's live episodes (``analysis.live_episodes``) at ``ranks``: every rank's history of
    ``KEEP_BLOCKS`` blocks, one rank 2x slower over its last 30, then one new block of every rank per
    judgement. Returns the CPU of one judgement (this thread's), the interval the agent then waits
    (``agent.EPISODE_DUTY``), one node's blocks on the wire per block, and whether the slow rank was said."""
    from hyperacc.agent import EPISODE_DUTY
    from hyperacc.analysis.episodes import RankBlocks
    from hyperacc.analysis.live_episodes import KEEP_BLOCKS, LiveEpisodes, encode_blocks

    rng = np.random.default_rng(1)
    opts = DetectionOptions(window_steps=WINDOW)
    slow = ranks // 2

    def blocks(first: int, n: int) -> list[RankBlocks]:
        out = []
        b = np.arange(first, first + n, dtype=np.int64)
        selfs = [50e6 * np.exp(rng.normal(0, 0.03, n)) * np.where((r == slow) & (b >= KEEP_BLOCKS - 30), 2.0, 1.0)
                 for r in range(ranks)]  # fmt: skip
        job = (np.max(selfs, axis=0) * 1.1).astype(np.float32)  # lockstep: every rank's step is the slowest's
        for r, s in enumerate(selfs):
            f = np.full(n, 1e5, np.float32)
            out.append(RankBlocks(r, r // per_node, b, s.astype(np.float32), (0.8 * s).astype(np.float32),
                                  np.full(n, opts.episode_block_steps, np.uint16), vol=f, data=f, gap=0 * f, sys=f,
                                  faults=0 * f, delay=f, other=f, job_step=job))  # fmt: skip
        return out

    def judged(with_slowdowns: bool) -> tuple[float, list[tuple[int, str]]]:
        live = LiveEpisodes(opts)
        if not with_slowdowns:
            live.slowdowns = None
        live.add(blocks(0, KEEP_BLOCKS))
        said = live.judge()
        costs = []
        for j in range(judgements):
            live.add(blocks(KEEP_BLOCKS + j, 1))
            began = time.thread_time()
            said += live.judge()
            costs.append(time.thread_time() - began)
        return statistics.median(costs), said

    # the job's own slowdowns (``analysis.live_slowdowns``) run inside each judgement: timed without them too
    without, _ = judged(False)
    cost, said = judged(True)
    # one pass of every other node's agent sending its ranks' new block, and the leader reading them all
    # from its real TCPStore (live_episodes.BlockInbox, as LiveNode reads them: a check, a get and a delete
    # per key)
    from hyperacc.analysis.live_episodes import BlockInbox, send_blocks

    served = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    nodes = _per_node(blocks(KEEP_BLOCKS + judgements, 1), per_node)[1:]
    client = dist.TCPStore("127.0.0.1", served.port, None, False, wait_for_workers=False)
    for node in nodes:
        send_blocks(client, node)
    inbox = BlockInbox(grace_s=4.0)
    t0, c0 = time.monotonic(), time.thread_time()
    got = inbox.take(served)
    read_s, read_cpu = time.monotonic() - t0, time.thread_time() - c0
    assert len(got) == ranks - per_node
    return {
        "cpu_s": cost,
        "cpu_without_slowdowns_s": without,
        "interval_s": (1 + EPISODE_DUTY) * cost,
        "wire_bytes": len(encode_blocks(nodes[0])),
        "read_s": read_s,
        "read_cpu_s": read_cpu,
        "keys": len(nodes),
        "found": any(text.startswith(f"rank {slow} ") for _, text in said),
    }


def _per_node(blocks: list[Any], per_node: int) -> list[list[Any]]:
    return [blocks[i : i + per_node] for i in range(0, len(blocks), per_node)]


if __name__ == "__main__":
    main()

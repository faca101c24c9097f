"""Episodes while training runs (docs/detection.md, "Episodes", live): the change-point rule of
``analysis.episodes`` over a bounded history of every rank's blocks, in the node agent.

* ``BlockStream``: one rank's step records as they arrive -> its per-block medians (``RankBlocks``), a
  block once a later step shows it complete; the warm-up left out as offline.
* ``LiveEpisodes``: keeps the newest ``keep_blocks`` blocks of every rank, runs ``detect_episodes``
  over them when new blocks arrive, and returns a line for each episode newly confirmed and for each
  that ended. Memory: ranks x ``keep_blocks`` x a few floats.

Pure: the caller (``agent.LiveNode``) reads the records and writes the lines as live findings.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from hyperacc.analysis.change_points import log_ratio
from hyperacc.analysis.diagnosis import kind_word
from hyperacc.analysis.episodes import (
    PER_BLOCK,
    Episode,
    RankBlocks,
    began_with,
    detect_episodes,
    rank_blocks,
)
from hyperacc.analysis.live_slowdowns import LiveSlowdowns
from hyperacc.analysis.options import DetectionOptions
from hyperacc.stats import nan_median

log = logging.getLogger(__name__)

KEEP_BLOCKS = 200  # blocks of history per rank the live rule judges (1,000 steps at 5 steps a block)
SILENT_S = 30.0  # a rank that sent no block for this long is not waited for (the windows' grace, grace_s)


class BlockStream:
    """One rank's step columns, in step order, -> its complete blocks (``add``) and the rest (``close``)."""

    # the input wait and whether it is the gap of a loop without a DataLoader: an episode in that gap that
    # grew with the CPU time is the rank's own work between steps (kind host_work), live as offline; the
    # voluntary context switches: a rank that blocked off its CPU (a read, a lock, a sleep), live as offline;
    # the step time: the job's own slowdowns (``live_slowdowns``)
    _NAMES = ("step", "self_ns", "dev_self_ns", "cpu_ns", "data_ns", "data_gap", "vol_ctx_switches", "sys_cpu_ns",
              "minor_faults", "run_delay_ns", "comm_run_delay_ns", "other_ns", "step_ns")  # fmt: skip

    def __init__(self, rank: int, node: int, opts: DetectionOptions) -> None:
        self.rank, self.node, self.opts = rank, node, opts
        self._first: int | None = None
        self._cols: dict[str, np.ndarray] = {}

    def add(self, cols: Mapping[str, np.ndarray]) -> RankBlocks | None:
        steps = np.asarray(cols["step"], dtype=np.int64)
        if not steps.size:
            return None
        if self._first is None:
            self._first = int(steps[0])
        keep = steps >= self._first + self.opts.warmup_steps
        new = {k: np.asarray(cols[k], dtype=np.float64)[keep] if k != "step" else steps[keep]
               for k in self._NAMES if k in cols}  # fmt: skip
        self._cols = {k: np.concatenate([self._cols[k], v]) for k, v in new.items()} if self._cols else new
        if not self._cols or not self._cols["step"].size:
            return None
        width = self.opts.episode_block_steps
        done = self._cols["step"] < (int(self._cols["step"][-1]) // width) * width  # the last block may grow
        return self._emit(done)

    def close(self) -> RankBlocks | None:
        if not self._cols or not self._cols["step"].size:
            return None
        return self._emit(np.ones(self._cols["step"].size, dtype=bool))

    def _emit(self, done: np.ndarray) -> RankBlocks | None:
        if not done.any():
            return None
        out = rank_blocks(self.rank, self.node, {k: v[done] for k, v in self._cols.items()}, self.opts, job=True)
        self._cols = {k: v[~done] for k, v in self._cols.items()}
        return out


class LiveEpisodes:
    """Confirms episodes from streaming blocks; says each once when confirmed and once when it ends."""

    def __init__(self, opts: DetectionOptions, keep_blocks: int = KEEP_BLOCKS,
                 straggler: Callable[[int], bool] | None = None, silent_s: float = SILENT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.opts = opts
        self.keep_blocks = keep_blocks
        self.silent_s, self.clock = silent_s, clock
        self._heard: dict[int, float] = {}  # rank -> when its last new blocks came (``clock``)
        self.straggler = straggler or (lambda rank: False)  # the window rules' call on a rank
        self._history: dict[int, RankBlocks] = {}
        self._open: dict[int, Episode] = {}  # rank -> the episode said to be going on
        self._said: dict[int, int] = {}  # rank -> last step of the episodes already said
        self._ended: dict[int, tuple[int, int]] = {}  # rank -> (since, until) of its latest episode said ended
        self._missing: dict[int, int] = {}  # rank -> the newest block when its open episode was first not found
        self._first: dict[int, int] = {}  # rank -> the first block it was seen with
        self._fresh = False  # blocks added since the last judgement
        # the job's own slowdowns over the same history (``live_slowdowns``); None: switched off by an error
        self.slowdowns: LiveSlowdowns | None = LiveSlowdowns(opts)

    def update(self, blocks: Sequence[RankBlocks | None]) -> list[tuple[int, str]]:
        """New blocks in; (step, line) for what is newly confirmed or ended."""
        return self.judge() if self.add(blocks) else []

    def add(self, blocks: Sequence[RankBlocks | None]) -> bool:
        """New blocks into the bounded history, not judged yet (``judge``); whether there were any."""
        fresh = [b for b in blocks if b is not None and b.block.size]
        if not fresh:
            return False
        self._fresh = True
        now = self.clock()
        for b in fresh:
            self._history[b.rank] = _joined(self._history.get(b.rank), b)
            self._first.setdefault(b.rank, int(b.block[0]))
            self._heard[b.rank] = now
        newest = max(int(h.block[-1]) for h in self._history.values() if h.block.size)
        # a rank silent for longer than the history (its node's agent stopped sending) leaves it: its empty
        # history would make every rank's common span nothing, and nothing would be judged again
        self._history = {rank: kept for rank, h in self._history.items()
                         if (kept := _since(h, newest - self.keep_blocks + 1)).block.size}  # fmt: skip
        return True

    def judge(self) -> list[tuple[int, str]]:
        """(step, line) for what the blocks added since the last call newly confirm or end."""
        if not self._fresh:
            return []
        self._fresh = False
        # Live judges with less of the run than offline: the host's floor is what it did so far. So it
        # waits until every rank's history holds spike_window steps (what the spike rule learns the
        # host over) and asks the whole minimum effect above that floor, not half (docs/detection.md,
        # "Episodes", Live): a clean loaded run was once given an episode at step 84 that offline,
        # with the whole run, was not.
        # Every rank's: the blocks are judged only where min_ranks ranks have them, so one rank whose
        # records arrived ahead of the others' does not make a short common history look long enough.
        # A rank that has sent nothing for ``silent_s`` (it died, or its node's agent stopped) keeps its
        # blocks in the history, where they count in the others' medians, but neither the common span nor
        # the frontier waits for it: they would until it left the history (``keep_blocks``, 1,000 steps),
        # and no episode of the others would end meanwhile.
        since = self.clock() - self.silent_s
        heard = [h for r, h in self._history.items() if self._heard.get(r, -math.inf) >= since]
        heard = heard or list(self._history.values())
        span = min(int(h.block[-1] - h.block[0] + 1) if h.block.size else 0 for h in heard)
        if span * self.opts.episode_block_steps < self.opts.spike_window:
            return []
        # An episode that was over before that much history existed was judged against a floor learnt
        # mostly from itself: it is left to ``analyze`` (a clean loaded run's rank 2 was said slow over
        # steps 45-69, 1.4x in CPU time, where the other ranks reached the same later in the run).
        floor_from = max(self._first.values()) * self.opts.episode_block_steps + self.opts.spike_window
        out: list[tuple[int, str]] = []
        # Only episodes with evidence preemption does not give: CPU time (more work), or the voluntary
        # context switches of a rank that blocked off its CPU (preemption switches a thread involuntarily).
        # A wall-time-only stretch of a busy host's wander is, early in a run, a record of the run so far
        # that later stretches of other ranks match; only the whole run (``analyze``) tells the two apart.
        found = [e for e in detect_episodes(list(self._history.values()), self.opts, floor_effect=1.0)
                 if e.metric == "cpu_ns" or _blocked(e)]  # fmt: skip
        missing = [r for r, going in self._open.items() if not any(_overlap(going, e) for e in found)]
        frontier = min(int(h.block[-1]) for h in heard if h.block.size)  # judged by every rank still heard
        self._missing = {r: self._missing.get(r, frontier) for r in missing}
        for rank in missing:
            # no longer judged an episode (its history moved on): ended by the rank's newest block, once the
            # rank is seen back at its level (below), and once it has not been found while every rank's
            # blocks moved on by the shortest episode's: an update can hold the first blocks of another
            # rank's fail-slow before the blocks that close this one, and that start, too short yet to
            # judge, counts in this one's floor until it is judged itself (docs/detection.md, "Episodes")
            if frontier - self._missing[rank] < math.ceil(self.opts.episode_min_steps / self.opts.episode_block_steps):
                continue
            if not self._back(self._open[rank], self._open[rank].until_step):
                continue
            going = self._open.pop(rank)
            last = int(self._history[rank].block[-1] + 1) * self.opts.episode_block_steps - 1
            out.append((last, f"rank {rank} (node {going.node}) was slow from step {going.since_step}; "
                              f"no longer by step {last}"))  # fmt: skip
            self._said[rank] = last
            self._ended[rank] = (going.since_step, last)
        for e in found:
            if self.straggler(e.rank) or e.until_step <= self._said.get(e.rank, -1):
                continue
            going = self._open.get(e.rank)
            if going is None and e.since_step > self._said.get(e.rank, -1) and e.until_step >= floor_from:
                out.append((e.confirmed_step, _started(e)))
                self._open[e.rank] = going = e
            if going is not None and not e.active and self._back(going, e.until_step):
                out.append((e.until_step, _ended(going, e)))
                del self._open[e.rank]
                self._said[e.rank] = e.until_step
                self._ended[e.rank] = (going.since_step, e.until_step)
        if self.slowdowns is not None:
            # what the ranks' own findings explain is theirs (``slowdowns.explained``)
            findings = [{"rank": e.rank, "since_step": e.since_step, "until_step": e.until_step}
                        for e in (*found, *self._open.values())] + self.ended()  # fmt: skip
            try:
                # the run's first judged blocks still in every rank's history: a slowdown from the start is
                # judged against the level after it
                start = all(h.block.size and int(h.block[0]) <= self._first.get(h.rank, -1) for h in heard)
                out += self.slowdowns.judge(heard, frontier, floor_from, findings, self.straggler, from_start=start)
            except Exception as exc:  # noqa: BLE001 - the newest rule: its fault leaves the episodes whole
                self.slowdowns = None
                log.warning("hyperacc: the live rule of the job's slowdowns switched off (%s: %s)",
                            type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")  # fmt: skip
        return out

    def recovered(self, rank: int, since_step: int, window_steps: int) -> bool:
        """``rank`` was said back from an episode that began with a straggler confirmed since ``since_step``
        (no later than one window after it, and ending after it) and none of its episodes is going on:
        ``episodes.recovered_stragglers``' rule, on what was said live."""
        span = self._ended.get(rank)
        return (rank not in self._open and span is not None and span[1] >= since_step
                and began_with(span[0], since_step, window_steps))  # fmt: skip

    def ended(self) -> list[dict[str, Any]]:
        """Each rank's latest episode said ended, as ``rank``, ``since_step``, ``until_step`` and ``active``
        (False): what the window rules leave out of a straggler beside it."""
        return [{"rank": r, "since_step": a, "until_step": b, "active": False} for r, (a, b) in self._ended.items()]

    def close(self) -> list[tuple[int, str]]:
        """Episodes still going on at the end of what was seen."""
        out = []
        span = math.ceil(self.opts.episode_min_steps / self.opts.episode_block_steps)  # the shortest episode's blocks
        for e in self._open.values():
            h = self._history.get(e.rank)
            last = int(h.block[-span] * self.opts.episode_block_steps) - 1 if h is not None and h.block.size >= span else -1
            if last >= e.since_step and self._back(e, last):
                out.append((e.confirmed_step, f"rank {e.rank} (node {e.node}) was slow from step {e.since_step}; "
                                              f"back at its level by step {last + 1}"))  # fmt: skip
            else:
                out.append((e.confirmed_step, f"rank {e.rank} (node {e.node}) was still slow at the end"))
        return out + (self.slowdowns.close() if self.slowdowns is not None else [])

    def _back(self, e: Episode, until_step: int) -> bool:
        """Whether the rank is seen back after ``until_step``: over at least ``episode_min_steps`` of blocks
        after it, the median of its log ratio to the other ranks' median (in the episode's channel) is
        nearer that median before the onset than the episode's own median, at least within half the
        minimum effect of it and never the minimum effect or more above it. The change points measure the
        shift back against the rank's typical level (the median of its history), which is its level
        outside the episode only while the episode is less than half of that history; early in a run a
        lasting episode is most of it, and a shift back measured then is the typical level moving into
        the episode (a replayed 150-step fault from step 60 was said to have ended at step 84)."""
        h = self._history.get(e.rank)
        if h is None or not h.block.size:
            return False
        name = "cpu_ns" if e.metric == "cpu_ns" else "self_ns"
        others = [o for r, o in self._history.items() if r != e.rank and o.block.size]
        if not others:
            return False
        grid = np.full((len(others), h.block.size), np.nan)
        for i, o in enumerate(others):
            _, mine, theirs = np.intersect1d(h.block, o.block, return_indices=True)
            grid[i, mine] = getattr(o, name)[theirs]
        # the log ratio to the other ranks' median of each of the rank's blocks (NaN: not judged)
        x = log_ratio(getattr(h, name).astype(np.float64)[None, :], nan_median(grid, axis=0)[None, :])[0]
        width = self.opts.episode_block_steps
        first = h.block * width
        before = x[(first + width - 1 < e.since_step) & np.isfinite(x)]
        after = x[(first > until_step) & np.isfinite(x)]
        during = x[(first + width - 1 >= e.since_step) & (first <= until_step) & np.isfinite(x)]
        if before.size == 0 or after.size * width < self.opts.episode_min_steps:
            return False
        # back: nearer its level before than the episode's own, at least within half the minimum effect
        # of the level before and never the minimum effect or more above it (a shift that large is still
        # a slowdown). A 7x episode after which the host had moved its load so that the rank sat 1.14x
        # above its level before was never said to end (a fresh-clone CI run, 2026-12-05).
        level, effect = float(np.median(before)), math.log(self.opts.episode_min_effect)
        bar = effect / 2
        if during.size:
            bar = min(max(bar, (float(np.median(during)) - level) / 2), effect)
        return float(np.median(after)) - level < bar


def _started(e: Episode) -> str:
    ratio = f"{e.slowdown:.2f}x" if e.slowdown is not None else "above"
    return (
        f"rank {e.rank} (node {e.node}) is slow since step {e.since_step} ({kind_word(e.kind)}: self-time {ratio} the "
        f"cluster median), an episode confirmed at step {e.confirmed_step}"
    )


def _ended(first: Episode, e: Episode) -> str:
    return f"rank {e.rank} (node {e.node}) was slow from step {first.since_step} to {e.until_step}, then recovered"


def _blocked(e: Episode) -> bool:
    """The episode rests on the rank's voluntary context switches: host and blocked, or a wait between steps."""
    return (e.kind == "host" and e.blocked_per_step is not None) or e.kind_basis == "off_cpu"


def _overlap(a: Episode, b: Episode) -> bool:
    return a.rank == b.rank and a.since_step <= b.until_step and b.since_step <= a.until_step


def _joined(old: RankBlocks | None, new: RankBlocks) -> RankBlocks:
    if old is None or not old.block.size:
        return new
    keep = old.block < new.block[0]  # a block seen again (the rest of a partial one) is replaced
    # a column one of the two lacks is not measured over the joined blocks
    fields = {name: None if getattr(old, name) is None or getattr(new, name) is None
              else np.concatenate([getattr(old, name)[keep], getattr(new, name)]) for name in PER_BLOCK}  # fmt: skip
    return dataclasses.replace(new, block=np.concatenate([old.block[keep], new.block]),
                               steps=np.concatenate([old.steps[keep], new.steps]), **fields)  # fmt: skip


def _since(h: RankBlocks, first_block: int) -> RankBlocks:
    keep = h.block >= first_block
    if keep.all():
        return h
    return h.mapped(lambda a: a[keep], block=h.block[keep], steps=h.steps[keep])


# Blocks on the wire, from a node agent to the agent that judges every rank (a multi-node job): one
# frame (``window_store.encode_frame``) per rank, its columns the block numbers, the steps and the
# per-block columns it measured, so that a column a rank did not measure stays None where it is read.
_WIRE_FIXED = ("rank", "node", "width", "block", "steps")


def encode_blocks(blocks: Sequence[RankBlocks]) -> bytes:
    """Ranks' blocks -> bytes (``decode_blocks`` reads them back, each column as ``rank_blocks`` made it)."""
    from hyperacc.analysis.window_store import encode_frame

    out = []
    for b in blocks:
        present = [name for name in PER_BLOCK if getattr(b, name) is not None]
        n = b.block.size
        values = np.vstack([np.full(n, b.rank), np.full(n, b.node), np.full(n, b.width), b.block, b.steps,
                            *(getattr(b, name) for name in present)]).astype(np.float64)  # fmt: skip
        out.append(encode_frame([*_WIRE_FIXED, *present], values))
    return b"".join(out)


def decode_blocks(data: bytes, where: str = "live episode blocks") -> list[RankBlocks]:
    """Bytes of ``encode_blocks`` -> the ranks' blocks. Raises ValueError naming ``where`` for bytes that
    are not whole frames or frames that are not blocks."""
    from hyperacc.analysis.window_store import iter_frames

    out = []
    for _, columns, values in iter_frames(data, where):
        fixed, measured = tuple(columns[: len(_WIRE_FIXED)]), set(columns[len(_WIRE_FIXED) :])
        if fixed != _WIRE_FIXED or not measured <= set(PER_BLOCK):
            raise ValueError(f"{where}: a frame of columns {columns} is not a rank's blocks")
        if not values.shape[1]:
            continue
        col = dict(zip(columns, values, strict=True))
        per_block = {name: col[name].astype(np.float32) if name in col else None for name in PER_BLOCK}
        out.append(RankBlocks(int(col["rank"][0]), int(col["node"][0]), block=col["block"].astype(np.int64),
                              steps=col["steps"].astype(np.uint16), width=int(col["width"][0]), **per_block))  # fmt: skip
    return out


def merged_blocks(blocks: Sequence[RankBlocks | None], keep_blocks: int = KEEP_BLOCKS) -> list[RankBlocks]:
    """Blocks of several reads, in the order read -> one ``RankBlocks`` per rank, its newest ``keep_blocks``
    (what a node agent holds for the judging agent while the store does not answer: bounded)."""
    per_rank: dict[int, RankBlocks] = {}
    for b in blocks:
        if b is not None and b.block.size:
            per_rank[b.rank] = joined = _joined(per_rank.get(b.rank), b)
            per_rank[b.rank] = _since(joined, int(joined.block[-1]) - keep_blocks + 1)
    return list(per_rank.values())


def send_blocks(store: Any, blocks: Sequence[RankBlocks]) -> None:
    """A node agent's new blocks of its ranks, for the agent that judges every rank's: one numbered key
    (``blocks/<i>``, ``i`` from the count ``blocks/n``), which that agent deletes once read
    (``BlockInbox``)."""
    if blocks:
        payload = encode_blocks(blocks)
        store.set(f"blocks/{int(store.add('blocks/n', 1))}", payload)


class BlockInbox:
    """The judging agent's side of ``send_blocks``: the blocks sent since the last call, each key deleted
    once read. A key counted but not there is waited for ``grace_s`` (its sender may be between the count
    and the write), then skipped (its sender failed in between), so that one never stops the rest. A
    store error keeps what was read and leaves the rest for the next call."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.read = 0  # keys read (or skipped) so far
        self._absent: tuple[str, float] | None = None  # the counted key not there yet, since when (monotonic)

    def take(self, store: Any, final: bool = False) -> list[RankBlocks]:
        from hyperacc.analysis.window_store import STORE_ERRORS

        out: list[RankBlocks] = []
        try:
            count = int(store.add("blocks/n", 0))
            while self.read < count:
                key = f"blocks/{self.read + 1}"
                if store.check([key]):
                    data = store.get(key)
                    store.delete_key(key)
                    out += decode_blocks(data, f"the blocks under {key} in the node agents' store")
                elif not final:
                    if self._absent is None or self._absent[0] != key:
                        self._absent = (key, time.monotonic())
                    if time.monotonic() - self._absent[1] < self.grace_s:
                        break
                self._absent = None
                self.read += 1
        except STORE_ERRORS:
            pass
        return out

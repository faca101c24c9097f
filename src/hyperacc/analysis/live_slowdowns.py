"""The job's slowdowns while training runs (docs/detection.md, "Slowdowns of the job", Live): the offline
rule (``slowdowns.slowdowns_of_blocks``) over the bounded history of every rank's blocks that the live
episodes keep (``live_episodes.LiveEpisodes``), in the node agent that judges every rank.

* **The job's blocks.** Live there is no per-step step time of the slowest rank; each rank's blocks carry
  their median step time (``RankBlocks.job_step``), and the job's step time in a block is the median of
  its ranks' (in lockstep every rank's step lasts as long as the slowest one's). Only blocks that every
  rank still heard from has sent are judged (the frontier), so a rank whose records arrived first does
  not decide.
* **Only what names ranks** (their self-time rose) is said, after ``spike_window`` steps of every rank's
  history before it (why: the comment above ``LiveSlowdowns``).
* **Said** once when the rule confirms it, once when it is over (the rule finds it ended, or no longer
  finds it once every rank's blocks moved on by the shortest slowdown's, and in both cases the job's step
  time is seen back near its level before, ``LiveSlowdowns._back``), one at a time: the job has one step
  time. A slowdown that a rank's episode, said or found, or a confirmed straggler already
  explains is left to that finding (``slowdowns.explained``), as offline.

Pure: ``LiveEpisodes.judge`` calls it with its history; the lines go out as live findings.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from hyperacc.analysis.diagnosis import slowdown_who
from hyperacc.analysis.episodes import RankBlocks
from hyperacc.analysis.options import DetectionOptions
from hyperacc.analysis.slowdowns import Slowdown, explained, ranks_job_blocks, slowdowns_of_blocks

# Live, a slowdown is said only where it names ranks (their self-time rose): where none rose, offline tells
# ``communication`` (the last rank's wait rose at each step) from ``in_turn`` (ranks late by turns), but
# live only each rank's block medians are known, and the least of their median waits rises in both (each
# rank waits long at the steps another is last); and a clean job beside a busy loop, its level learnt from
# what it did so far, was given such a line (docs/detection.md, "Slowdowns of the job", Live). So the rule
# runs here without the waits, and what it cannot name (``unknown``) is left to ``analyze``.


class LiveSlowdowns:
    """Confirms the job's slowdowns from the live history; says each once when confirmed, once when over."""

    def __init__(self, opts: DetectionOptions) -> None:
        self.opts = opts
        self._open: Slowdown | None = None  # the slowdown said to be going on
        self._said = -1  # last step of the slowdowns already said over
        self._missing: int | None = None  # the frontier when the open one was first not found
        self._until = -1  # the last step the open one was found going on

    def judge(self, history: Sequence[RankBlocks], frontier: int, floor_from: int,
              findings: Sequence[Mapping[str, Any]], straggler: Callable[[int], bool],
              from_start: bool = False) -> list[tuple[int, str]]:  # fmt: skip
        """(step, line) for what the history through block ``frontier`` newly confirms or ends. Nothing is
        said of a slowdown that began before step ``floor_from`` (the first step at which every rank's
        history held ``spike_window`` steps: the job's level before it would be learnt from less), but
        one slow from the run's first judged steps while the history still holds them (``from_start``):
        that one is judged against the level after it, as offline, and said once, when it is over.
        ``findings``: the ranks' episodes (``rank``, ``since_step``, ``until_step``); ``straggler``:
        whether the window rules confirmed a rank."""
        width = max([self.opts.episode_block_steps, *(h.width for h in history)])
        ranks = [_through(h, frontier) for h in history]
        block, value = ranks_job_blocks(ranks)  # through the frontier already
        # as the live episodes: the whole minimum effect above the job's wander so far, not half of it
        found = [s for s in slowdowns_of_blocks(block, value, width, ranks, self.opts, floor_effect=1.0,
                                                from_start=from_start)
                 if s.ranks and not explained(s.to_dict(), findings)
                 and not any(straggler(r) for r in s.ranks)]  # fmt: skip
        out: list[tuple[int, str]] = []
        for s in [s for s in found if s.from_start]:
            if self._said < 0 and self._open is None:  # the first thing said of the job, or never
                out.append((s.until_step, _from_start(s)))
                self._over(s.until_step)
        found = [s for s in found if not s.from_start]
        going = self._open
        if going is not None and not any(_overlap(going, s) for s in found):
            # no longer found (the history moved on, or what it was is now a rank's finding): over once the
            # job's step time is seen back at its level, and not before every rank's blocks moved on by the
            # shortest slowdown's without it. A slowdown that has lasted most of the history is not found
            # either (the level outside it is then its own), and is not over.
            self._missing = frontier if self._missing is None else self._missing
            waited = frontier - self._missing >= math.ceil(self.opts.episode_min_steps / width)
            if waited and self._back(going, self._until, block, value, width):
                last = (frontier + 1) * width - 1
                out.append((last, f"the job's step time, up {going.slowdown:.2f}x since step {going.since_step}, "
                                  f"is back at its level by step {last}"))  # fmt: skip
                self._over(last)
        else:
            self._missing = None
        for s in found:
            if s.until_step <= self._said:
                continue
            if self._open is None and s.since_step > max(self._said, floor_from):
                out.append((s.confirmed_step, _started(s)))
                self._open, self._until = s, s.until_step
            if self._open is not None and _overlap(self._open, s):
                self._until = max(self._until, s.until_step)
                if not s.active and self._back(self._open, s.until_step, block, value, width):
                    out.append((s.until_step, _ended(self._open, s)))
                    self._over(s.until_step)
        return out

    def _back(self, going: Slowdown, until: int, block: np.ndarray, value: np.ndarray, width: int) -> bool:
        """Whether the job's step time is seen back after step ``until``: over the newest
        ``episode_min_steps`` of blocks after it, its median over the level before the slowdown (as said
        when confirmed, so that a history that has moved past it still knows it) is under half the
        slowdown's own rise, at least half the minimum effect, never the minimum effect (the live episodes'
        rule, ``LiveEpisodes._back``). The newest, not all since: a slowdown over most of the history was
        last found long before it ended."""
        span = math.ceil(self.opts.episode_min_steps / width)
        after = value[(block * width > until) & np.isfinite(value)][-span:]
        if after.size < span or not going.baseline_ns > 0:
            return False
        effect = math.log(self.opts.episode_min_effect)
        rise = math.log(going.step_ns / going.baseline_ns)
        return math.log(float(np.median(after)) / going.baseline_ns) < min(max(effect / 2, rise / 2), effect)

    @property
    def going(self) -> Slowdown | None:
        """The slowdown said to be going on (the metrics' ``hyperacc_job_slowdown``), None between them."""
        return self._open

    def close(self) -> list[tuple[int, str]]:
        """The slowdown still going on at the end of what was seen."""
        if self._open is None:
            return []
        s, self._open = self._open, None
        return [(s.confirmed_step, f"the job's step time, up {s.slowdown:.2f}x since step {s.since_step}, was still up at the end")]

    def _over(self, last: int) -> None:
        self._said, self._open, self._missing = last, None, None


def _through(h: RankBlocks, frontier: int) -> RankBlocks:
    keep = h.block <= frontier
    return h if keep.all() else h.mapped(lambda a: a[keep], block=h.block[keep], steps=h.steps[keep])


def _overlap(a: Slowdown, b: Slowdown) -> bool:
    return a.since_step <= b.until_step and b.since_step <= a.until_step


def _from_start(s: Slowdown) -> str:
    return (f"the job's step time was {s.slowdown:.2f}x its later level from the start (steps {s.since_step}-"
            f"{s.until_step}, {s.step_ns / 1e6:.3g} -> {s.baseline_ns / 1e6:.3g} ms, {s.job_time_lost_ns / 1e9:.3g} s "
            f"lost): {slowdown_who(s.to_dict())}")  # fmt: skip


def _started(s: Slowdown) -> str:
    return (f"the job's step time is up {s.slowdown:.2f}x since step {s.since_step} (its slowest rank's, "
            f"{s.baseline_ns / 1e6:.3g} -> {s.step_ns / 1e6:.3g} ms), confirmed at step {s.confirmed_step}: "
            f"{slowdown_who(s.to_dict())}")  # fmt: skip


def _ended(first: Slowdown, s: Slowdown) -> str:
    return (f"the job's step time was up {s.slowdown:.2f}x from step {first.since_step} to {s.until_step} "
            f"({s.job_time_lost_ns / 1e9:.3g} s lost), then back at its level: {slowdown_who(s.to_dict())}")


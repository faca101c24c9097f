"""LiveDetector fed window by window, as the tracer's rank-0 thread feeds it while training runs."""

import numpy as np
import pyarrow as pa
import pytest
from analysis_runs import SLOW_RANK

from hyperacc.analysis import LiveDetector
from hyperacc.analysis.columns import discover, read_rank
from hyperacc.analysis.windows import concat_windows, summarize_windows, window_table


def window_stream(run_dir, drop_rank=None, drop_from=None):
    layout = discover(run_dir)
    parts = [summarize_windows(read_rank(src.segments), window_steps=50, min_samples=10)
             for src in layout.sources.values()]  # fmt: skip
    cols = concat_windows(parts)
    for w in np.unique(cols["window"]):
        keep = cols["window"] == w
        if drop_rank is not None and w >= drop_from:
            keep &= cols["rank"] != drop_rank
        yield int(w), window_table({k: v[keep] for k, v in cols.items()})


def test_one_line_when_the_slow_rank_is_confirmed_and_no_repeats(faulty_run):
    live = LiveDetector(world_size=8, nodes=2)
    said = []
    for w, table in window_stream(faulty_run):
        said += [(w, line) for line in live.update(table)]
    assert len(said) == 1, said
    w, line = said[0]
    assert (w + 1) * 50 <= 300, "confirmed within 300 steps"
    assert line.startswith(f"rank {SLOW_RANK} (node 1) is a compute straggler")
    assert "victims" in line
    assert live.confirmed == {SLOW_RANK: "compute"}


def test_a_straggler_the_live_episodes_saw_recover_is_not_said(faulty_run):
    # the windows reach the leader after the blocks: a rank whose slowdown the live episodes already saw
    # end is not said a straggler from its windows (offline: episodes.recovered_stragglers)
    asked = []

    def recovered(rank: int, since_step: int) -> bool:
        asked.append((rank, since_step))
        return rank == SLOW_RANK

    live = LiveDetector(world_size=8, nodes=2, recovered=recovered)
    assert [line for _, t in window_stream(faulty_run) for line in live.update(t)] == []
    assert live.confirmed == {} and {r for r, _ in asked} == {SLOW_RANK}


def test_a_clean_run_says_nothing(clean_run):
    live = LiveDetector(world_size=8, nodes=2)
    assert [line for _, t in window_stream(clean_run) for line in live.update(t)] == []


def test_a_rank_that_stops_reporting_is_never_judged_fast_or_slow(faulty_run):
    live = LiveDetector(world_size=8, nodes=2)
    lines = [
        line
        for _, t in window_stream(faulty_run, drop_rank=SLOW_RANK, drop_from=10)
        for line in live.update(t)
    ]
    assert lines[0].startswith(f"rank {SLOW_RANK} (node 1) is a compute straggler")
    # once its summaries stop it ages out of the recent windows without being called recovered
    assert len(lines) == 1 and live.confirmed == {}


def test_history_is_bounded(faulty_run):
    live = LiveDetector(world_size=8, nodes=2, persist_n=5)
    for _, table in window_stream(faulty_run):
        live.update(table)
    assert np.unique(live._history["window"]).size <= live.keep_windows


def test_bad_input_is_refused_with_a_clear_message():
    live = LiveDetector(world_size=4, nodes=1)
    with pytest.raises(ValueError, match="WINDOW_SCHEMA"):
        live.update(pa.table({"rank": [0]}))
    with pytest.raises(ValueError, match="unknown detection option"):
        LiveDetector(world_size=4, nodes=1, bogus=1)
    assert live.update(pa.table({c: pa.array([], pa.int64()) for c in
                                 ("rank", "node", "window", "first_step", "last_step", "steps")})) == []  # fmt: skip


def test_recovery_is_said_once_when_the_rank_keeps_reporting():
    from analysis_runs import noisy, windows

    self_ms = noisy(8, 24)
    self_ms[4, :8] *= 1.3  # slow for 8 windows, then healthy
    cols = windows(self_ms)
    live = LiveDetector(world_size=8, nodes=1)
    said = []
    for w in range(24):
        keep = cols["window"] == w
        said += [(w, line) for line in live.update(window_table({k: v[keep] for k, v in cols.items()}))]
    assert [w for w, _ in said] == [2, 9]  # recovered once its last two windows are back at the median
    assert said[0][1].startswith("rank 4 (node 0) is a compute straggler")
    assert said[1][1] == "rank 4 is no longer a straggler"

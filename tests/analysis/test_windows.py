"""One window summary for the live and the offline path: WindowStream gives diagnose's own rows."""

import json

import numpy as np
import pytest
from analysis_runs import SLOW_RANK

from hyperacc.analysis import LiveDetector, diagnose
from hyperacc.analysis.columns import discover, read_rank
from hyperacc.analysis.options import DetectionOptions
from hyperacc.analysis.run_reduce import reduce_rank
from hyperacc.analysis.windows import (
    SUMMARY_COLUMNS,
    WindowStream,
    rows_table,
    summarize_windows,
    window_rows,
)


def _stream_rows(cols, opts, chunk):
    stream = WindowStream(opts)
    rows = []
    n = cols["step"].size
    for lo in range(0, n, chunk):
        rows += stream.add({k: v[lo : lo + chunk] for k, v in cols.items()})
    return rows + stream.close()


@pytest.mark.parametrize("chunk", [7, 50, 333])
def test_the_stream_gives_the_offline_rows_whatever_the_batches(faulty_run, chunk):
    opts = DetectionOptions()
    layout = discover(faulty_run)
    for rank in (SLOW_RANK, 2, 6):  # the slow rank, the data-stall rank, the GC rank
        cols = read_rank(layout.sources[rank].segments)
        offline = window_rows(reduce_rank(rank, rank // 4, dict(cols), opts).windows)
        live = _stream_rows(cols, opts, chunk)
        assert [r["window"] for r in live] == [r["window"] for r in offline]
        for a, b in zip(live, offline, strict=True):
            assert a.keys() == b.keys() == set(SUMMARY_COLUMNS)
            for k in a:
                assert a[k] == pytest.approx(b[k], nan_ok=True), (rank, a["window"], k)


def test_the_rows_survive_json_and_the_live_verdict_is_the_offline_one(faulty_run):
    # what the tracer's aggregation does: each rank streams its rows through the store as JSON, rank 0
    # feeds LiveDetector window by window
    opts = DetectionOptions()
    layout = discover(faulty_run)
    by_window: dict[int, list] = {}
    for src in layout.sources.values():
        for row in _stream_rows(read_rank(src.segments), opts, 100):
            by_window.setdefault(row["window"], []).append(json.loads(json.dumps(row)))
    live = LiveDetector(world_size=8, nodes=2)
    said = [line for w in sorted(by_window) for line in live.update(rows_table(by_window[w]))]
    offline = diagnose(faulty_run).to_dict()
    assert set(live.confirmed.items()) == {(s["rank"], s["kind"]) for s in offline["stragglers"]}
    assert any(line.startswith(f"rank {SLOW_RANK} (node 1) is a compute straggler") for line in said)
    # the intermittent data stalls of rank 2 are said once, as offline
    assert sum("rank 2 (node 0) stalls in data loading" in line for line in said) == 1
    assert [(e["rank"], e["cause"]) for e in offline["rank_causes"]][:1] == [(2, "data")]


def test_warm_up_and_spikes_are_left_out_of_the_medians_and_counted():
    n = 300
    rng = np.random.default_rng(0)
    self_ns = 10e6 * (1 + 0.01 * rng.standard_normal(n))
    data_ns = np.full(n, 1e6)
    data_ns[[100, 200]] += 60e6
    self_ns[[100, 200]] += 60e6
    self_ns[:10] *= 5  # warm-up
    cols = {"rank": np.zeros(n, int), "node": np.zeros(n, int), "step": np.arange(n), "step_ns": self_ns + 2e6,
            "self_ns": self_ns, "data_ns": data_ns, "comm_wait_ns": np.full(n, 2e6)}  # fmt: skip
    w = summarize_windows(cols, DetectionOptions())
    assert w["window"].tolist() == [0, 1, 2, 3, 4, 5]
    assert w["steps"].tolist() == [40, 50, 49, 50, 49, 50] and w["judged_steps"].tolist() == [40, 50, 50, 50, 50, 50]
    assert w["spikes_data"].tolist() == [0, 0, 1, 0, 1, 0]
    assert np.all(np.abs(w["self_ns_median"] - 10e6) < 0.05 * 10e6)
    assert np.isnan(w["cpu_ns_median"]).all()  # not measured is not zero
    assert np.isnan(w["self_run_delay_ns_median"]).all()
    # the run-queue delay within the self-time: less the part inside DDP's wait where it was timed
    cols["run_delay_ns"] = np.full(n, 3e6)
    assert np.allclose(summarize_windows(cols, DetectionOptions())["self_run_delay_ns_median"], 3e6)
    cols["comm_run_delay_ns"] = np.where(np.arange(n) >= 150, 1e6, np.nan)  # not timed (no DDP wait), then timed
    assert summarize_windows(cols, DetectionOptions())["self_run_delay_ns_median"].tolist() == [3e6] * 3 + [2e6] * 3


def test_windows_wider_than_the_run_or_sparse_steps_give_the_same_medians_in_little_memory():
    """A step's place in the medians' grid is its place among its window's steps where no window is full:
    windows of 10**12 steps cost what the run's steps cost, and give what windows of 300 give."""
    n = 300
    rng = np.random.default_rng(1)
    self_ns = 10e6 * (1 + 0.05 * rng.standard_normal(n))
    cols = {"rank": np.zeros(n, int), "node": np.zeros(n, int), "step": np.arange(n), "step_ns": self_ns + 2e6,
            "self_ns": self_ns, "data_ns": np.full(n, 1e6), "comm_wait_ns": np.full(n, 2e6)}  # fmt: skip
    exact = summarize_windows(cols, DetectionOptions(window_steps=300))
    huge = summarize_windows(cols, DetectionOptions(window_steps=10**12))
    for name in SUMMARY_COLUMNS:
        if name not in ("first_step", "last_step", "window"):
            assert np.array_equal(exact[name], huge[name], equal_nan=True), name
    sparse = {**cols, "step": np.arange(n) * 10**9}  # one step a window of 50 (step 0 is the warm-up's)
    assert summarize_windows(sparse, DetectionOptions())["window"].size == n - 1

"""A rank read and reduced in chunks (a rank of a week) gives the findings of the whole rank."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hyperacc.analysis import diagnose
from hyperacc.analysis.cluster import reduce_source
from hyperacc.analysis.columns import NotInChunks, discover, read_rank, read_rank_chunks
from hyperacc.analysis.options import DetectionOptions
from hyperacc.analysis.run_reduce import RankFindings, reduce_rank, reduce_rank_chunks
from hyperacc.analysis.synthetic import SyntheticFault, SyntheticRun, write_run

# 60 segments of 50 steps per rank: chunks of 600 rows are a dozen segments each
SPEC = SyntheticRun(
    ranks=8, steps=3000, ranks_per_node=4, seed=5, segment_steps=50,
    faults=(SyntheticFault("slowdown", (5,), factor=0.2, start_step=1200),
            SyntheticFault("data_stall", (2,), rate=0.03, ms=60),
            SyntheticFault("gc", (6,), rate=0.02, ms=40),
            SyntheticFault("host", (1,), rate=0.02, ms=30)),
)  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return write_run(tmp_path_factory.mktemp("chunks") / "run", SPEC)


def assert_same(a: RankFindings, b: RankFindings) -> None:
    for field in dataclasses.fields(RankFindings):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if field.name == "blocks":
            assert (x is None) == (y is None)
            if x is not None:
                for f in dataclasses.fields(x):
                    u, v = getattr(x, f.name), getattr(y, f.name)
                    if isinstance(u, np.ndarray) or isinstance(v, np.ndarray):
                        np.testing.assert_array_equal(u, v, err_msg=f"blocks.{f.name}")
                    else:
                        assert u == v, f"blocks.{f.name}"
        elif isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y, err_msg=field.name)
        elif field.name == "windows":
            assert x.keys() == y.keys()
            for k in x:
                np.testing.assert_allclose(x[k], y[k], rtol=1e-12, err_msg=f"windows.{k}")
        elif field.name in ("time_lost", "cause_time"):
            assert x.keys() == y.keys() and all(x[k] == pytest.approx(y[k], rel=1e-9, nan_ok=True) for k in x), field.name
        elif field.name == "dispersion":
            assert x.keys() == y.keys() and all(np.allclose(x[k], y[k], rtol=1e-9) for k in x), field.name
        elif isinstance(x, float):
            assert x == pytest.approx(y, rel=1e-9, nan_ok=True), field.name
        else:
            assert x == y, field.name


def test_every_rank_reduced_in_chunks_gives_the_whole_rank_findings(run):
    opts = DetectionOptions()
    layout = discover(run)
    for rank, src in layout.sources.items():
        chunks = list(read_rank_chunks(src.segments, 600))
        assert len(chunks) >= 4 and all(c["step"].size >= 600 for c in chunks[:-1])
        whole = read_rank(src.segments)
        np.testing.assert_array_equal(np.concatenate([c["step"] for c in chunks]), whole["step"])
        node = rank // SPEC.ranks_per_node
        assert_same(reduce_rank_chunks(rank, node, lambda s=src: read_rank_chunks(s.segments, 600), opts),
                    reduce_rank(rank, node, whole, opts))  # fmt: skip


def test_a_run_diagnosed_in_chunks_has_the_same_diagnosis(run):
    whole = diagnose(run).to_dict()
    chunked = diagnose(run, rank_chunk_steps=700).to_dict()
    assert chunked["options"].pop("rank_chunk_steps") == 700
    whole["options"].pop("rank_chunk_steps")
    assert [(s["rank"], s["kind"]) for s in whole["stragglers"]] == [(5, "compute")]
    assert chunked["stragglers"] == whole["stragglers"]
    assert chunked["episodes"] == whole["episodes"]
    assert chunked["spikes"]["per_rank"] == whole["spikes"]["per_rank"]
    assert chunked["spikes"]["cluster"] == pytest.approx(whole["spikes"]["cluster"])
    assert chunked["verdict"] == whole["verdict"]


def _columns(n: int, seed: int) -> dict[str, np.ndarray]:
    """One rank's columns with gaps in every measured series, and a device clock from step 1,700 on."""
    rng = np.random.default_rng(seed)
    step = np.arange(n, dtype=np.int64) + 3
    step_ns = rng.lognormal(np.log(30e6), 0.05, n)
    step_ns[rng.random(n) < 0.02] *= 3  # spikes
    comm = rng.lognormal(np.log(2e6), 0.1, n)
    comm[rng.random(n) < 0.1] = np.nan
    dev = np.full(n, np.nan)
    dev[1700:] = comm[1700:] * 0.9
    self_ns = step_ns - np.nan_to_num(comm)
    self_ns[rng.random(n) < 0.2] = np.nan
    data = rng.lognormal(np.log(1e6), 0.2, n)
    data[400:900] = np.nan  # a stretch with no input wait measured
    gc = np.where(rng.random(n) < 0.01, 20e6, 0.0)
    gc[:1000] = np.nan  # a column first measured late
    return {"step": step, "step_ns": step_ns, "comm_wait_ns": comm, "dev_comm_wait_ns": dev,
            "self_ns": self_ns, "data_ns": data, "gc_ns": gc, "cpu_ns": step_ns * 0.8}  # fmt: skip


@pytest.mark.parametrize("size", [257, 500, 1003])
def test_chunks_of_any_size_with_gaps_and_a_clock_first_measured_late(size):
    cols = _columns(3000, seed=size)
    opts = DetectionOptions(spike_window=31, window_steps=20, episode_block_steps=5)

    def chunks():
        return ({k: v[i:i + size] for k, v in cols.items()} for i in range(0, cols["step"].size, size))

    chunked = reduce_rank_chunks(0, 0, chunks, opts)
    whole = reduce_rank(0, 0, cols, opts)
    assert whole.comm_clock == chunked.comm_clock == "device"
    assert whole.spikes.size > 20
    assert_same(chunked, whole)


def test_segments_out_of_order_are_not_chunked_and_the_rank_is_read_whole(run):
    src = discover(run).sources[2]
    shuffled = dataclasses.replace(src, segments=src.segments[30:] + src.segments[:30])
    with pytest.raises(NotInChunks):
        list(read_rank_chunks(shuffled.segments, 600))
    opts = DetectionOptions(rank_chunk_steps=600)
    assert_same(reduce_source(0, shuffled, opts), reduce_rank(2, 0, read_rank(src.segments), opts))


def test_a_rank_without_records_has_no_findings_and_one_of_warm_up_only_those_of_the_whole_rank():
    opts = DetectionOptions()
    assert reduce_rank_chunks(0, 0, lambda: iter(()), opts) is None
    cols = {k: v[:8] for k, v in _columns(100, seed=1).items()}  # 8 steps: all within the warm-up
    chunks = lambda: ({k: v[i:i + 3] for k, v in cols.items()} for i in (0, 3, 6))  # noqa: E731
    assert_same(reduce_rank_chunks(0, 0, chunks, opts), reduce_rank(0, 0, cols, opts))

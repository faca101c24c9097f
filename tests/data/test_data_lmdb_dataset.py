"""LMDB dataset: builder round trips, clear errors, lazy per-process env, sampler-aware prefetch."""

from __future__ import annotations

import pickle
import time

import numpy as np
import pytest
import torch

from hyperacc.data.lmdb_dataset import (
    CorruptDatabaseError,
    LMDBDataset,
    build_lmdb,
    evict_from_page_cache,
    resident_fraction,
    upcoming_positions,
)
from hyperacc.data.sampler import OnDemandDistributedSampler

lmdb = pytest.importorskip("lmdb", reason="the data extra is not installed (pip install -e '.[data]')")


def test_array_database_round_trips(tmp_path):
    x = np.random.default_rng(0).integers(0, 255, (20, 3, 4, 5), dtype=np.uint8)
    ds = LMDBDataset(build_lmdb(tmp_path / "db", x))
    assert len(ds) == 20
    for i in (0, 7, 19):
        assert torch.equal(ds[i], torch.from_numpy(x[i]))
    ds.close()


def test_tuple_of_arrays_round_trips(tmp_path):
    x = np.random.default_rng(1).normal(size=(10, 6)).astype(np.float32)
    y = np.arange(10, dtype=np.int64)
    ds = LMDBDataset(build_lmdb(tmp_path / "db", (x, y)))
    xi, yi = ds[3]
    assert torch.equal(xi, torch.from_numpy(x[3])) and int(yi) == 3


def test_folder_and_bytes_sources(tmp_path):
    folder = tmp_path / "files"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.bin").write_bytes(b"bee")
    (folder / "a.bin").write_bytes(b"ay")
    (folder / "sub" / "c.bin").write_bytes(b"")
    ds = LMDBDataset(build_lmdb(tmp_path / "fdb", folder))
    assert [ds[i] for i in range(len(ds))] == [b"ay", b"bee", b""]
    assert ds.name(2) == "sub/c.bin"
    raw = LMDBDataset(build_lmdb(tmp_path / "bdb", (bytes([i]) * i for i in range(5))))
    assert [raw[i] for i in range(5)] == [bytes([i]) * i for i in range(5)]


def test_custom_decode(tmp_path):
    ds = LMDBDataset(build_lmdb(tmp_path / "db", [b"12", b"34"]), decode=lambda buf: int(bytes(buf)))
    assert ds[1] == 34


def test_missing_path_corrupt_db_and_missing_key_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found at .*nope.*build_lmdb"):
        LMDBDataset(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="without data.mdb"):
        LMDBDataset(empty)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "data.mdb").write_bytes(b"this is not an lmdb file" * 1000)
    with pytest.raises(CorruptDatabaseError, match="bad.*rebuild"):
        LMDBDataset(bad)
    # an LMDB written by someone else, with a hole in its keys
    other = tmp_path / "other"
    env = lmdb.open(str(other), map_size=1 << 24)
    with env.begin(write=True) as txn:
        for i in (0, 1, 3):
            txn.put(f"{i:010d}".encode(), b"v")
    env.close()
    ds = LMDBDataset(other, length=4)
    assert ds[3] == b"v"
    with pytest.raises(KeyError, match="0000000002.*index 2.*key_format"):
        ds[2]
    with pytest.raises(IndexError, match="out of range"):
        ds[4]
    with pytest.raises(FileExistsError, match="overwrite=True"):
        build_lmdb(other, [b"x"])


def test_environment_is_opened_lazily_per_process_and_not_pickled(tmp_path):
    ds = LMDBDataset(build_lmdb(tmp_path / "db", np.zeros((4, 2), np.uint8)))
    assert ds._env is None  # nothing open until the first read
    ds[0]
    assert ds._env is not None
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._env is None and torch.equal(clone[1], torch.zeros(2, dtype=torch.uint8))


def test_upcoming_positions_follow_the_dataloader_round_robin():
    # one worker: simply the next positions
    assert upcoming_positions(5, batch_size=4, num_workers=1, lookahead=3, num_samples=100) == [6, 7, 8]
    # two workers, batch 4: worker 0 reads batches 0, 2, 4 -> positions 0-3, 8-11, 16-19
    assert upcoming_positions(2, batch_size=4, num_workers=2, lookahead=6, num_samples=100) == [
        3,
        8,
        9,
        10,
        11,
        16,
    ]
    # worker 1 at the end of its batch jumps to batch 3
    assert upcoming_positions(7, batch_size=4, num_workers=2, lookahead=2, num_samples=100) == [12, 13]
    # never past the epoch
    assert upcoming_positions(97, batch_size=1, num_workers=1, lookahead=8, num_samples=100) == [98, 99]
    assert upcoming_positions(7, batch_size=4, num_workers=2, lookahead=4, num_samples=12) == []


def _wait(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_prefetcher_touches_the_samples_this_worker_reads_next(tmp_path):
    ds = LMDBDataset(build_lmdb(tmp_path / "db", np.zeros((200, 16), np.uint8)))
    sampler = OnDemandDistributedSampler(ds, 2, 1, seed=4)
    ds.attach_sampler(sampler, batch_size=4, lookahead=6, num_workers=3)
    first = sampler.index_at(0)
    ds[first]
    pf = ds.prefetcher
    assert pf is not None and _wait(lambda: pf.touched >= 6)
    # worker 0 of 3, batch 4: rest of batch 0 (positions 1-3), then batch 3 (positions 12-14)
    assert list(pf.recent) == [sampler.index_at(p) for p in (1, 2, 3, 12, 13, 14)]
    # following the predicted order needs no re-synchronisation
    for p in (1, 2, 3, 12):
        ds[sampler.index_at(p)]
    time.sleep(0.1)
    assert pf.resyncs == 1
    ds.close()
    assert not pf.alive


def test_prefetch_brings_upcoming_pages_into_the_page_cache(tmp_path):
    n, size = 64, 64 * 1024
    db = build_lmdb(tmp_path / "db", np.random.default_rng(0).integers(0, 255, (n, size), dtype=np.uint8))
    evict_from_page_cache(db)
    if not resident_fraction(db) < 0.05:
        pytest.skip("page cache eviction has no effect on this filesystem")
    ds = LMDBDataset(db, readahead=False)
    sampler = OnDemandDistributedSampler(ds, 1, 0)
    ds.attach_sampler(sampler, batch_size=1, lookahead=16)
    ds[sampler.index_at(0)]
    assert _wait(lambda: ds.prefetcher.touched >= 16)
    # 1 read + 16 prefetched samples of 64 resident; without prefetch it would be about 1 in 64
    assert resident_fraction(db) > 14 / n
    ds.close()


def test_dataloader_with_two_workers_and_prefetch_reads_every_sample_once(tmp_path):
    from hyperacc.data.pipeline import make_loader

    x = np.arange(90, dtype=np.int64).reshape(90, 1)
    ds = LMDBDataset(build_lmdb(tmp_path / "db", x))
    assert int(ds[89]) == 89  # the parent has the environment open when the workers fork
    loader = make_loader(ds, 4, rank=0, world_size=1, num_workers=2, prefetch_to="cpu", lookahead=8)
    loader.set_epoch(1)
    got = torch.cat([b.view(-1) for b in loader]).tolist()
    assert got == loader.sampler.indices(0, 90).tolist()


def _report_epoch(sampler, go, out):
    go.wait(30)
    out.put(sampler.epoch)


def test_worker_copies_of_an_attached_sampler_follow_set_epoch(tmp_path):
    # A persistent DataLoader worker keeps the sampler it was forked with; after attach_sampler the
    # epoch lives in shared memory, so the worker's prefetch plan follows later set_epoch calls.
    import multiprocessing as mp

    ds = LMDBDataset(build_lmdb(tmp_path / "db", np.zeros((10, 1), np.uint8)))
    sampler = OnDemandDistributedSampler(ds, 1, 0)
    ds.attach_sampler(sampler)
    ctx = mp.get_context("fork")
    go, out = ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_report_epoch, args=(ds._sampler, go, out))
    child.start()
    sampler.set_epoch(7)
    go.set()
    try:
        assert out.get(timeout=30) == 7
    finally:
        child.join(30)
    assert pickle.loads(pickle.dumps(sampler)).epoch == 7


def test_readahead_default_is_off_with_a_prefetcher_and_on_without(tmp_path):
    db = build_lmdb(tmp_path / "db", np.zeros((8, 16), dtype=np.uint8))
    plain = LMDBDataset(db)
    assert plain.effective_readahead is True
    plain[0]
    assert plain._env.flags()["readahead"] is True  # what py-lmdb opened
    plain.attach_sampler(OnDemandDistributedSampler(plain, 1, 0), batch_size=1)
    assert plain.effective_readahead is False
    plain[1]  # reopened without readahead at the next read
    assert plain._env.flags()["readahead"] is False
    plain.close()
    assert LMDBDataset(db, readahead=True).attach_sampler(OnDemandDistributedSampler(8, 1, 0)).effective_readahead

"""make_loader assembles the parts; cold_read_comparison produces the demo's figures."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from hyperacc.data.pipeline import Loader, cold_read_comparison, cold_read_table, make_loader
from hyperacc.data.sampler import OnDemandDistributedSampler


def _dataset(n: int = 50) -> TensorDataset:
    return TensorDataset(torch.arange(n).float().view(n, 1), torch.arange(n))


def _labels(loader) -> list[int]:
    return torch.cat([y for _, y in loader]).tolist()


@pytest.mark.parametrize(
    "kind,cls", [("ondemand", OnDemandDistributedSampler), ("torch", DistributedSampler)]
)
def test_make_loader_builds_the_chosen_sampler(kind, cls):
    loader = make_loader(_dataset(), 4, rank=1, world_size=3, sampler=kind, seed=2)
    assert isinstance(loader, Loader) and isinstance(loader.sampler, cls)
    assert len(loader) == len(loader.dataloader) == 5  # 17 samples per rank, batches of 4
    loader.set_epoch(3)
    assert loader.sampler.epoch == 3
    assert len(_labels(loader)) == 17


def test_drop_last_applies_to_sampler_and_last_batch():
    loader = make_loader(_dataset(50), 4, rank=0, world_size=3, drop_last=True)
    assert len(loader.sampler) == 16 and len(loader) == 4
    assert len(_labels(loader)) == 16


def test_prefetch_to_cpu_yields_the_same_batches_in_order():
    plain = make_loader(_dataset(), 8, rank=0, world_size=2, seed=5)
    fetched = make_loader(_dataset(), 8, rank=0, world_size=2, seed=5, prefetch_to="cpu")
    assert fetched.prefetcher is not None
    assert _labels(plain) == _labels(fetched)


def test_state_dict_resumes_at_the_next_unconsumed_batch():
    full = make_loader(_dataset(100), 5, rank=0, world_size=2, seed=1)
    full.set_epoch(2)
    expected = _labels(full)
    loader = make_loader(_dataset(100), 5, rank=0, world_size=2, seed=1, prefetch_to="cpu", num_workers=0)
    loader.set_epoch(2)
    seen = []
    for i, (_, y) in enumerate(loader):
        seen += y.tolist()
        if i == 3:
            state = loader.state_dict()
            break
    assert state["batches"] == 4 and state["epoch"] == 2
    resumed = make_loader(_dataset(100), 5, rank=0, world_size=2, seed=1)
    resumed.load_state_dict(state)
    assert seen + _labels(resumed) == expected
    with pytest.raises(ValueError, match="batch_size"):
        make_loader(_dataset(100), 7, rank=0, world_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="ondemand"):
        make_loader(_dataset(100), 5, rank=0, world_size=2, sampler="torch").load_state_dict(state)


def test_bad_arguments():
    with pytest.raises(ValueError, match="sampler"):
        make_loader(_dataset(), 4, rank=0, world_size=1, sampler="random")
    with pytest.raises(ValueError, match="batch_sampler"):
        make_loader(_dataset(), 4, rank=0, world_size=1, batch_sampler=None)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            make_loader(_dataset(), 4, rank=0, world_size=1, prefetch_to="cuda")


def test_cold_read_comparison_reports_both_cases(tmp_path):
    result = cold_read_comparison(tmp_path, samples=40, sample_bytes=32 * 1024, compute_ms=0.5)
    assert result["samples"] == 40 and result["readahead"] is None
    for case in ("without_prefetch", "with_prefetch"):
        figures = result[case]
        assert 0 < figures["p50_ms"] <= figures["p99_ms"] <= figures["max_ms"]
    assert 0.0 <= result["resident_after_evict"] <= 1.0
    assert (tmp_path / "cold-read.lmdb" / "data.mdb").exists()
    table = cold_read_table(result)
    assert "without prefetch" in table and "with sampler-aware prefetch" in table

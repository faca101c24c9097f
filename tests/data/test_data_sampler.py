"""The on-demand sampler keeps DistributedSampler's contract while computing indices on demand."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import scipy.stats
from torch.utils.data import DistributedSampler

from hyperacc.data.sampler import FeistelPermutation, OnDemandDistributedSampler


def _global_order(n: int, replicas: int, drop_last: bool, seed: int = 0, epoch: int = 0) -> list[list[int]]:
    out = []
    for rank in range(replicas):
        s = OnDemandDistributedSampler(n, replicas, rank, shuffle=True, seed=seed, drop_last=drop_last)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 7, 10, 64, 100, 1000, 1025])
def test_feistel_is_a_bijection_with_an_inverse(n):
    for key in range(3):
        perm = FeistelPermutation(n, key)
        values = perm.apply(np.arange(n, dtype=np.uint64)).tolist()
        assert sorted(values) == list(range(n))
        assert [perm(p) for p in range(n)] == values
        assert [perm.inverse(v) for v in values] == list(range(n))


@pytest.mark.parametrize("n", [0, 1, 2, 10, 11, 12, 13, 97])
@pytest.mark.parametrize("replicas", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("drop_last", [False, True])
def test_unshuffled_order_equals_distributed_sampler(n, replicas, drop_last):
    for rank in range(replicas):
        ref = DistributedSampler(range(n), replicas, rank, shuffle=False, drop_last=drop_last)
        ours = OnDemandDistributedSampler(n, replicas, rank, shuffle=False, drop_last=drop_last)
        assert list(ours) == list(ref)
        assert len(ours) == len(ref)


@pytest.mark.parametrize("n,replicas", [(10, 3), (11, 4), (97, 8), (1, 3), (5, 5)])
def test_shuffled_epoch_is_a_partition_with_wraparound_padding(n, replicas):
    ranks = _global_order(n, replicas, drop_last=False)
    lengths = {len(r) for r in ranks}
    assert lengths == {len(DistributedSampler(range(n), replicas, 0, drop_last=False))}
    total = lengths.pop() * replicas
    # Rebuild the global list: rank r holds positions r, r+R, ...
    glob = [None] * total
    for rank, idx in enumerate(ranks):
        glob[rank::replicas] = idx
    assert sorted(glob[:n]) == list(range(n))  # every index exactly once before padding
    assert glob[n:] == [glob[p % n] for p in range(n, total)]  # padding wraps the permuted list


@pytest.mark.parametrize("n,replicas", [(10, 3), (11, 4), (97, 8), (12, 4)])
def test_drop_last_drops_the_tail_and_never_repeats(n, replicas):
    ranks = _global_order(n, replicas, drop_last=True)
    ref_len = len(DistributedSampler(range(n), replicas, 0, drop_last=True))
    assert all(len(r) == ref_len for r in ranks)
    flat = [i for r in ranks for i in r]
    assert len(flat) == len(set(flat)) == ref_len * replicas <= n


def test_same_seed_and_epoch_give_the_same_order_everywhere_and_others_differ():
    a = _global_order(1000, 4, False, seed=3, epoch=5)
    b = _global_order(1000, 4, False, seed=3, epoch=5)
    assert a == b
    other_epoch = _global_order(1000, 4, False, seed=3, epoch=6)
    other_seed = _global_order(1000, 4, False, seed=4, epoch=5)
    same_pos = np.mean(np.array(a) == np.array(other_epoch))
    assert same_pos < 0.05  # a fresh permutation agrees on ~1/N of positions
    assert np.mean(np.array(a) == np.array(other_seed)) < 0.05


def test_positions_are_uniform_over_epochs_chi_square():
    n, epochs = 32, 2000
    counts = np.zeros((n, n))
    s = OnDemandDistributedSampler(n, 1, 0)
    for e in range(epochs):
        s.set_epoch(e)
        counts[s.indices(0, n), np.arange(n)] += 1
    expected = epochs / n
    chi2 = ((counts - expected) ** 2 / expected).sum()
    p = scipy.stats.chi2.sf(chi2, (n - 1) ** 2)
    assert p > 1e-3, f"index-by-position counts are not uniform (chi2={chi2:.0f}, p={p:.2e})"


def test_no_correlation_between_index_and_position_or_neighbours():
    n = 100_003
    v = OnDemandDistributedSampler(n, 1, 0, seed=11).indices(0, n).astype(np.float64)
    pos = np.arange(n, dtype=np.float64)
    bound = 5 / np.sqrt(n)  # ~5 sigma for independent data
    assert abs(np.corrcoef(v, pos)[0, 1]) < bound
    assert abs(np.corrcoef(v[:-1], v[1:])[0, 1]) < bound
    # successive pairs of residues are uniform too
    pairs = np.zeros((16, 16))
    np.add.at(pairs, (v[:-1].astype(int) % 16, v[1:].astype(int) % 16), 1)
    chi2 = ((pairs - pairs.mean()) ** 2 / pairs.mean()).sum()
    assert scipy.stats.chi2.sf(chi2, 255) > 1e-3


def test_huge_dataset_is_served_without_materialising_it():
    n = 10**12  # a list of this many indices could never be built here
    s = OnDemandDistributedSampler(n, 8, 3, seed=1)
    it = iter(s)
    first = [next(it) for _ in range(5000)]
    assert len(set(first)) == len(first)
    assert all(0 <= i < n for i in first)
    assert s.index_at(len(s) - 1) < n
    assert s.position_of(first[1234]) == 1234


def test_iteration_lookups_and_inverse_agree():
    s = OnDemandDistributedSampler(1001, 3, 2, seed=5, block_size=64)
    s.set_epoch(2)
    order = list(s)
    assert order == s.indices(0, len(s)).tolist()
    assert [s.index_at(k) for k in range(len(s))] == order
    for k, index in enumerate(order):
        assert s.position_of(index) == order.index(index) <= k
    # An index this rank never reads has no position here but one on another rank.
    stranger = next(i for i in range(1001) if s.position_of(i) is None)
    others = [OnDemandDistributedSampler(1001, 3, r, seed=5) for r in (0, 1)]
    for o in others:
        o.set_epoch(2)
    assert any(o.position_of(stranger) is not None for o in others)


@pytest.mark.parametrize("stop_after", [0, 1, 63, 64, 65, 500, 667])
def test_state_dict_resumes_mid_epoch_exactly(stop_after):
    s = OnDemandDistributedSampler(2000, 3, 1, seed=9, block_size=64)
    s.set_epoch(4)
    full = list(s)
    it = iter(s)
    seen = [next(it) for _ in range(stop_after)]
    state = s.state_dict()
    assert state == {"yielded": stop_after, "epoch": 4, "seed": 9}
    fresh = OnDemandDistributedSampler(2000, 3, 1, seed=0, block_size=64)
    fresh.load_state_dict(pickle.loads(pickle.dumps(state)))
    assert seen + list(fresh) == full
    assert list(fresh) == full  # only the next iteration resumes; the one after is a full epoch


def test_torchdata_style_state_with_only_yielded():
    s = OnDemandDistributedSampler(100, 2, 0)
    full = list(s)
    s.load_state_dict({"yielded": 17})
    assert list(s) == full[17:]
    with pytest.raises(ValueError, match="yielded"):
        s.load_state_dict({})
    with pytest.raises(ValueError, match="negative"):
        s.load_state_dict({"yielded": -1})


def test_pickles_mid_iteration():
    s = OnDemandDistributedSampler(500, 2, 1, seed=2)
    it = iter(s)
    next(it)
    clone = pickle.loads(pickle.dumps(s))
    assert list(clone) == list(s)


def test_bad_arguments_give_clear_errors():
    with pytest.raises(ValueError, match="rank"):
        OnDemandDistributedSampler(10, 2, 2)
    with pytest.raises(ValueError, match="num_replicas"):
        OnDemandDistributedSampler(10, 0, 0)
    with pytest.raises(RuntimeError, match="not initialised"):
        OnDemandDistributedSampler(10)
    with pytest.raises(IndexError):
        OnDemandDistributedSampler(10, 1, 0).index_at(10)


def _parity(order: list[int]) -> int:
    return sum(a > b for i, a in enumerate(order) for b in order[i + 1 :]) % 2


def test_small_datasets_get_every_ordering_equally_often():
    """n = 5: 120 orderings; a Feistel network gave counts 105-341 around 167 (p = 3e-197)."""
    import itertools

    n, epochs = 5, 12_000
    s = OnDemandDistributedSampler(n, 1, 0, seed=0)
    counts = dict.fromkeys(itertools.permutations(range(n)), 0)
    for e in range(epochs):
        s.set_epoch(e)
        counts[tuple(s)] += 1
    observed = np.array(list(counts.values()))
    assert observed.min() > 0  # every ordering occurs
    assert scipy.stats.chisquare(observed).pvalue > 1e-3


@pytest.mark.parametrize("n", [16, 64])
def test_odd_and_even_permutations_both_occur(n):
    """A Feistel network makes only even permutations of a power-of-two domain (0 odd in 4,000)."""
    s = OnDemandDistributedSampler(n, 1, 0, seed=3)
    parities = []
    for e in range(2000):
        s.set_epoch(e)
        parities.append(_parity(list(s)))
    odd = sum(parities)
    assert scipy.stats.binomtest(odd, len(parities), 0.5).pvalue > 1e-3
    feistel = FeistelPermutation(n, 7)
    assert _parity(feistel.apply(np.arange(n, dtype=np.uint64)).tolist()) == 0  # why it is not used here


@pytest.mark.parametrize("n", [0, 1, 2, 5, 100, 1000])
def test_exact_permutation_is_a_bijection_with_an_inverse(n):
    from hyperacc.data.sampler import ExactPermutation

    perm = ExactPermutation(n, 99)
    values = perm.apply(np.arange(n, dtype=np.uint64)).tolist()
    assert sorted(values) == list(range(n))
    assert [perm(p) for p in range(n)] == values
    assert [perm.inverse(v) for v in values] == list(range(n))


def test_exact_shuffle_up_to_exact_max_then_feistel():
    from hyperacc.data.sampler import EXACT_MAX, ExactPermutation

    assert isinstance(OnDemandDistributedSampler(EXACT_MAX, 1, 0).permutation(), ExactPermutation)
    assert isinstance(OnDemandDistributedSampler(EXACT_MAX + 1, 1, 0).permutation(), FeistelPermutation)
    assert isinstance(OnDemandDistributedSampler(10, 1, 0, exact_max=0).permutation(), FeistelPermutation)
    with pytest.raises(ValueError, match="exact_max"):
        OnDemandDistributedSampler(10, 1, 0, exact_max=-1)


@pytest.mark.parametrize("exact_max", [0, 10_000])
def test_both_orders_keep_the_contract_and_resume(exact_max):
    n, replicas = 1001, 3
    for rank in range(replicas):
        s = OnDemandDistributedSampler(n, replicas, rank, seed=4, exact_max=exact_max, block_size=64)
        s.set_epoch(1)
        full = list(s)
        assert len(full) == len(DistributedSampler(range(n), replicas, rank))
        assert [s.index_at(k) for k in range(len(s))] == full
        assert all(s.position_of(i) == full.index(i) for i in full[:50])
        it = iter(s)
        seen = [next(it) for _ in range(100)]
        fresh = OnDemandDistributedSampler(n, replicas, rank, seed=0, exact_max=exact_max, block_size=64)
        fresh.load_state_dict(s.state_dict())
        assert seen + list(fresh) == full

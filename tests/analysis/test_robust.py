import numpy as np
import pytest

from hyperacc.analysis.robust import median_mad, modified_z, rolling_median, rolling_median_at, tukey_fences


def test_modified_z_on_a_hand_made_column():
    z, med, mad = modified_z(np.array([100.0, 101.0, 99.0, 115.0]), axis=0)
    assert med == pytest.approx(100.5)
    assert mad == pytest.approx(1.0)
    assert z[3] == pytest.approx(0.6745 * 14.5)
    assert abs(z[:3]).max() < 1.1


def test_modified_z_is_per_column_and_ignores_nan():
    values = np.array([[1.0, 10.0], [2.0, np.nan], [3.0, 30.0], [50.0, 20.0]])
    z, med, _ = modified_z(values, axis=0)
    assert med.tolist() == [2.5, 20.0]
    assert np.isnan(z[1, 1])
    assert z[3, 0] > 3.5


def test_zero_mad_is_floored_so_identical_ranks_do_not_make_everything_infinite():
    values = np.array([100.0, 100.0, 100.0, 115.0])
    z, _, mad = modified_z(values, axis=0, min_mad_rel=0.01)
    assert mad == pytest.approx(1.0)
    assert z[:3].tolist() == [0.0, 0.0, 0.0]
    assert z[3] == pytest.approx(0.6745 * 15)
    z0, _, _ = modified_z(values, axis=0)  # no floor: infinitely far, but the median itself stays at 0
    assert np.isinf(z0[3]) and z0[0] == 0.0


def test_tukey_fences_match_the_textbook_quartiles():
    lo, hi = tukey_fences(np.arange(1.0, 10.0), k=1.5)  # Q1=3, Q3=7, IQR=4
    assert (lo, hi) == (pytest.approx(-3.0), pytest.approx(13.0))
    lo2, hi2 = tukey_fences(np.array([[1.0, np.nan], [2.0, 2.0], [3.0, 4.0]]), k=1.0, axis=0)
    assert hi2[1] == pytest.approx(3.5 + 1.0 * 1.0)  # [2, 4]: Q1=2.5, Q3=3.5


def test_all_missing_gives_nan_not_zero():
    med, mad = median_mad(np.full((3, 2), np.nan), axis=0)
    assert np.isnan(med).all() and np.isnan(mad).all()


def test_rolling_median_follows_a_level_shift_without_lag():
    x = np.r_[np.full(100, 10.0), np.full(100, 20.0)]
    m = rolling_median(x, 21)
    assert m[:100].max() == 10.0 and m[100:].min() == 20.0
    spiky = np.full(50, 5.0)
    spiky[25] = 500.0
    assert rolling_median(spiky, 11).max() == 5.0


@pytest.mark.parametrize("window", [1, 4, 101, 10_000])
def test_rolling_median_at_some_steps_is_the_whole_series_median_there(window):
    rng = np.random.default_rng(window)
    x = np.round(rng.normal(10.0, 2.0, 3000), 1)  # ties too
    at = np.r_[0, 1, np.flatnonzero(rng.random(3000) < 0.05), 2998, 2999]
    assert np.array_equal(rolling_median_at(x, window, at), rolling_median(x, window)[at])
    assert rolling_median_at(x, window, np.zeros(0, dtype=np.int64)).size == 0


def test_leave_one_out_fence_matches_brute_force():
    from hyperacc.analysis.robust import loo_upper_fence

    rng = np.random.default_rng(0)
    for _ in range(100):
        n, m = int(rng.integers(3, 9)), int(rng.integers(1, 4))
        v = rng.random((n, m))
        v[rng.random((n, m)) < 0.2] = np.nan
        got = loo_upper_fence(v, 1.5)
        for i in range(n):
            for j in range(m):
                others = np.delete(v[:, j], i)
                others = others[~np.isnan(others)]
                if np.isnan(v[i, j]) or others.size < 3:
                    assert np.isnan(got[i, j])
                else:
                    q1, q3 = np.percentile(others, [25, 75])
                    assert got[i, j] == pytest.approx(q3 + 1.5 * (q3 - q1))


def test_a_slow_rank_cannot_hide_behind_its_own_fence():
    from hyperacc.analysis.robust import loo_upper_fence

    col = np.array([[2.497], [2.678], [2.959], [2.643]])  # four ranks (ms), one 12 % slower
    assert col[2, 0] < tukey_fences(col, 1.5)[1][0]  # the whole column's fence hides it
    assert col[2, 0] > loo_upper_fence(col, 1.5)[2, 0]  # the others' fence does not


@pytest.mark.parametrize(("n", "window"), [(1, 1), (7, 101), (400, 101), (2595, 101), (2596, 101), (50_000, 21)])
def test_rolling_median_of_a_short_series_is_scipys_without_scipy(n, window):
    # short series (the node agent's live windows) are filtered in numpy: the same values as scipy's
    from scipy.ndimage import median_filter

    x = np.round(np.random.default_rng(n).normal(10.0, 2.0, n), 1)  # ties too
    w = min(window, n) - (min(window, n) % 2 == 0)
    assert np.array_equal(rolling_median(x, window), median_filter(x, size=w, mode="nearest"))

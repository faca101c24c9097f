"""Robust statistics over columns: median/MAD modified z-scores, Tukey IQR fences, rolling medians.

Everything here is vectorised over numpy arrays and treats NaN as "not measured": a missing value is
left out of every median, quantile and count, never read as zero. Rules and defaults: docs/detection.md.
"""

from __future__ import annotations

import numpy as np

from hyperacc.stats import nan_median  # the one median (hyperacc.stats); re-exported here


def run_slice(pos: np.ndarray) -> slice | None:
    """``pos`` as a slice where it is one increasing run of positions (a rank without a gap in its steps,
    the usual case): an operation on a slice is several times faster than on an index; else None."""
    if pos.size > 1 and int(pos[-1]) - int(pos[0]) + 1 == pos.size and bool((pos[1:] > pos[:-1]).all()):
        return slice(int(pos[0]), int(pos[-1]) + 1)
    return None


def group_starts(keys: np.ndarray) -> np.ndarray:
    """Where each group of equal values of sorted ``keys`` begins (the first index of each window or block
    of sorted steps), without sorting again as ``np.unique`` would."""
    return np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))


# MAD of a normal distribution is 0.6745 sigma (Iglewicz & Hoaglin's modified z-score).
MAD_Z = 0.6745
MAD_TO_SIGMA = 1.4826


def median_mad(values: np.ndarray, axis: int | None = 0) -> tuple[np.ndarray, np.ndarray]:
    """(median, median absolute deviation) along ``axis``, NaN-aware."""
    values = np.asarray(values, dtype=np.float64)
    med = nan_median(values, axis=axis)
    dev = np.abs(values - (np.expand_dims(med, axis) if axis is not None else med))
    return med, nan_median(dev, axis=axis)


def modified_z(
    values: np.ndarray, axis: int | None = 0, min_mad_rel: float = 0.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Modified z-score ``0.6745 * (x - median) / MAD`` along ``axis``; returns (z, median, mad).

    ``min_mad_rel`` floors the MAD at that fraction of ``|median|``: when most values are identical the
    MAD is 0 and any difference would be infinitely significant. NaN values get NaN scores.
    """
    values = np.asarray(values, dtype=np.float64)
    med, mad = median_mad(values, axis=axis)
    floor = min_mad_rel * np.abs(med)
    mad = np.fmax(mad, floor)
    med_b = np.expand_dims(med, axis) if axis is not None else med
    mad_b = np.expand_dims(mad, axis) if axis is not None else mad
    with np.errstate(divide="ignore", invalid="ignore"):
        z = MAD_Z * (values - med_b) / mad_b
    # 0/0 (value at the median, zero spread) is not an outlier; x/0 with x != 0 is infinitely far.
    z = np.where((mad_b == 0) & (values == med_b), 0.0, z)
    return z, med, mad


def nan_quantiles(values: np.ndarray, qs: tuple[float, ...], axis: int = 0) -> list[np.ndarray]:
    """Linear-interpolation quantiles (numpy's default method) ignoring NaN, vectorised along ``axis``."""
    values = np.asarray(values, dtype=np.float64)
    ordered = np.sort(values, axis=axis)  # NaN sorts last
    n = np.count_nonzero(~np.isnan(values), axis=axis, keepdims=True)
    out = []
    for q in qs:
        pos = q * np.maximum(n - 1, 0)
        lo = np.floor(pos).astype(np.int64)
        hi = np.minimum(lo + 1, np.maximum(n - 1, 0))
        a = np.take_along_axis(ordered, lo, axis=axis)
        b = np.take_along_axis(ordered, hi, axis=axis)
        value = np.where(n > 0, a + (pos - lo) * (b - a), np.nan)
        out.append(np.squeeze(value, axis=axis))
    return out


def tukey_fences(values: np.ndarray, k: float = 1.5, axis: int | None = 0) -> tuple[np.ndarray, np.ndarray]:
    """Tukey's fences ``(Q1 - k*IQR, Q3 + k*IQR)`` along ``axis``, NaN-aware (linear quantiles)."""
    values = np.asarray(values, dtype=np.float64)
    if axis is None:
        values, axis = values.ravel(), 0
    q1, q3 = nan_quantiles(values, (0.25, 0.75), axis=axis)
    iqr = q3 - q1
    return q1 - k * iqr, q3 + k * iqr


def loo_upper_fence(values: np.ndarray, k: float = 1.5) -> np.ndarray:
    """For each element of a (n x m) matrix, Tukey's upper fence ``Q3 + k*IQR`` of the OTHER values of its
    column (leave-one-out, linear quartiles, NaN-aware); NaN where fewer than three others remain.

    A slow value cannot then widen its own fence: with four ranks, the slowest one moves Q3 a quarter
    of the way towards itself and can hide behind it.
    """
    (q1, q3), m = _loo_quantiles(values, (0.25, 0.75))
    fence = q3 + k * (q3 - q1)
    return np.where((m >= 3) & ~np.isnan(values), fence, np.nan)


def loo_median(values: np.ndarray) -> np.ndarray:
    """For each element of a (n x m) matrix, the median of the OTHER values of its column (NaN-aware; NaN
    where none remains). A slow value does not pull its own reference up: with four ranks the median of
    all four is the mean of the two middle ones, and the slow rank's ratio to it comes out biased low."""
    values = np.asarray(values)
    if values.dtype != np.float32:
        values = values.astype(np.float64, copy=False)
    if values.ndim != 2 or values.size == 0:
        return np.full(values.shape, np.nan, dtype=values.dtype)
    # columns are independent: a bounded slice of them at a time keeps the temporaries small
    step = max(1, _LOO_CELLS // max(values.shape[0], 1))
    if values.shape[1] > step:
        return np.concatenate([loo_median(values[:, i : i + step]) for i in range(0, values.shape[1], step)], axis=1)
    # Column by column (rows of the transpose, contiguous): only the middle of each sorted column is
    # needed. Without an element at sorted position i, the median of the other n - 1 is, with
    # h = (n - 2) // 2 for n even: s[h + 1] if i <= h else s[h]; for n odd, h = (n - 1) // 2:
    # (s[h] + s[h + 1]) / 2 if i <= h - 1, (s[h - 1] + s[h + 1]) / 2 if i == h, else (s[h - 1] + s[h]) / 2.
    # i <= h is x <= s[h] (equal values give the same others). Ties at s[h] resolve the same way.
    cols = np.ascontiguousarray(values.T)
    ordered = np.sort(cols, axis=1)  # NaN last
    n = np.count_nonzero(~np.isnan(cols), axis=1)[:, None]
    last = cols.shape[1] - 1

    def at(k: np.ndarray) -> np.ndarray:
        return np.take_along_axis(ordered, np.clip(k, 0, last), axis=1)

    even = n % 2 == 0
    h = np.where(even, (n - 2) // 2, (n - 1) // 2)
    s_lo, s_h, s_hi = at(h - 1), at(h), at(h + 1)
    with np.errstate(invalid="ignore"):
        below, equal = cols < s_h, cols == s_h
        odd_med = np.where(below, (s_h + s_hi) / 2, np.where(equal, (s_lo + s_hi) / 2, (s_lo + s_h) / 2))
        even_med = np.where(cols <= s_h, s_hi, s_h)
    med = np.where(even, even_med, odd_med)
    return np.where((n - 1 >= 1) & ~np.isnan(cols), med, np.nan).T


_LOO_CELLS = 1 << 21  # values ``loo_median`` works on at a time


def _loo_quantiles(values: np.ndarray, qs: tuple[float, ...]) -> tuple[list[np.ndarray], np.ndarray]:
    """Linear quantiles of the other values of each element's column, and the count of those others."""
    values = np.asarray(values, dtype=np.float64)
    # Column by column, as rows of the transpose (contiguous: sorting along the strided axis was 3x
    # slower at 1,000 ranks x 2,000 windows). NaN last. Any sort will do: tied values may swap
    # positions, but leaving out either of two equal values leaves the same others (5x faster than a
    # stable sort at 4,096 ranks here).
    cols = np.ascontiguousarray(values.T)
    order = np.argsort(cols, axis=1, kind="quicksort")
    ordered = np.take_along_axis(cols, order, axis=1)
    pos = np.empty_like(order)
    np.put_along_axis(pos, order, np.arange(cols.shape[1])[None, :], axis=1)  # each value's sorted index
    m = np.count_nonzero(~np.isnan(cols), axis=1)[:, None] - 1  # others per column
    top = np.maximum(m - 1, 0)

    def quantile(q: float) -> np.ndarray:
        p = q * top
        lo = np.floor(p).astype(np.int64)
        hi = np.minimum(lo + 1, top)
        lo_full = np.clip(lo + (lo >= pos), 0, cols.shape[1] - 1)  # skip the value itself
        hi_full = np.clip(hi + (hi >= pos), 0, cols.shape[1] - 1)
        a = np.take_along_axis(ordered, lo_full, axis=1)
        b = np.take_along_axis(ordered, hi_full, axis=1)
        return (a + (p - lo) * (b - a)).T

    return [quantile(q) for q in qs], m.T


def rolling_median(values: np.ndarray, window: int) -> np.ndarray:
    """Centred rolling median of a 1-D series without NaN (edges repeat the nearest value).

    A centred window does not lag behind a level shift, so the steps just after a persistent slowdown
    starts are not mistaken for spikes.
    """
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return values.copy()
    window = max(1, min(int(window), values.size))
    if window % 2 == 0:
        window = max(1, window - 1)
    if values.size * window <= _SMALL_ROLLING:
        # a short series (the node agent's live windows): the same values in numpy, so that the agent
        # never imports scipy (0.16 s of CPU, most of it scipy parsing its own docstrings)
        return rolling_median_at(values, window, np.arange(values.size))
    from scipy.ndimage import median_filter  # scipy only where a long series is filtered (not in a rank)

    return median_filter(values, size=window, mode="nearest")


_SMALL_ROLLING = 1 << 18  # values x window below which numpy's copy of the windows (2 MiB) is cheaper


def rolling_median_at(values: np.ndarray, window: int, at: np.ndarray) -> np.ndarray:
    """``rolling_median(values, window)[at]``, computed at positions ``at`` only (the same values): where
    a rule needs the rolling median of a few steps, not of the whole series."""
    values = np.asarray(values, dtype=np.float64)
    at = np.asarray(at, dtype=np.int64)
    if values.size == 0 or at.size == 0:
        return np.zeros(at.size)
    window = max(1, min(int(window), values.size))
    if window % 2 == 0:
        window = max(1, window - 1)
    half = window // 2
    windows = np.lib.stride_tricks.sliding_window_view(np.pad(values, half, mode="edge"), window)
    return np.median(windows[at], axis=1)


def binom_sf(k: np.ndarray | float, n: np.ndarray | float, p: np.ndarray | float) -> np.ndarray:
    """P(Binomial(n, p) >= k), elementwise (k, n integers; NaN where n < 0).

    Summed in log space from the pmf, so it needs no statistics package: the live detector runs in a
    training process, where importing one costs seconds of a held interpreter lock.
    """
    k_a, n_a, p_a = np.broadcast_arrays(*(np.asarray(x, dtype=np.float64) for x in (k, n, p)))
    out = np.empty(k_a.shape)
    for idx in np.ndindex(k_a.shape):
        out[idx] = _binom_sf_one(float(k_a[idx]), float(n_a[idx]), float(p_a[idx]))
    return out


def _binom_sf_one(k: float, n: float, p: float) -> float:
    import math

    if not (n >= 0 and 0.0 <= p <= 1.0) or math.isnan(k):
        return math.nan
    k, n = math.ceil(k), int(round(n))
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    j = np.arange(k + 1, n + 1, dtype=np.float64)
    # log C(n, j) from log C(n, k), term by term: C(n, j) = C(n, j - 1) (n - j + 1) / j
    log_c = math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
    log_c = np.concatenate(([log_c], log_c + np.cumsum(np.log(n - j + 1) - np.log(j))))
    jj = np.arange(k, n + 1, dtype=np.float64)
    logpmf = log_c + jj * math.log(p) + (n - jj) * math.log1p(-p)
    top = float(logpmf.max())
    return float(min(1.0, math.exp(top) * np.exp(logpmf - top).sum()))


def hypergeom_sf(k: int, total: int, marked: int, drawn: int) -> float:
    """P(X >= k) for X the marked items among ``drawn`` taken without replacement from ``total`` items of
    which ``marked`` are marked (the hypergeometric tail), from log-gamma terms: no statistics package."""
    import math

    lo, hi = max(k, 0, drawn - (total - marked)), min(marked, drawn)
    if lo > hi:
        return 0.0

    def log_c(n: int, r: int) -> float:
        return math.lgamma(n + 1) - math.lgamma(r + 1) - math.lgamma(n - r + 1)

    x = np.arange(lo, hi + 1)
    terms = np.array([log_c(marked, int(i)) + log_c(total - marked, drawn - int(i)) for i in x]) - log_c(total, drawn)
    top = float(terms.max())
    return float(min(1.0, math.exp(top) * np.exp(terms - top).sum()))


def rank_sum_greater_p(before: np.ndarray, after: np.ndarray) -> float:
    """One-sided p-value that ``after`` tends to be larger than ``before`` (the Mann-Whitney rank-sum
    test, normal approximation with continuity and tie corrections; NaN left out). 1.0 where either side
    is empty or every value is equal. No statistics package, as ``binom_sf``."""
    import math

    a, b = np.asarray(before, dtype=np.float64), np.asarray(after, dtype=np.float64)
    a, b = a[~np.isnan(a)], b[~np.isnan(b)]
    na, nb = a.size, b.size
    if na == 0 or nb == 0:
        return 1.0
    _, inverse, counts = np.unique(np.concatenate([a, b]), return_inverse=True, return_counts=True)
    first = np.cumsum(counts) - counts
    ranks = (first + (counts + 1) / 2.0)[inverse]  # mid-ranks, 1-based
    u = float(ranks[na:].sum()) - nb * (nb + 1) / 2.0
    n = na + nb
    var = na * nb / 12.0 * ((n + 1) - float((counts**3 - counts).sum()) / (n * (n - 1)))
    if var <= 0:
        return 1.0
    z = (u - na * nb / 2.0 - 0.5) / math.sqrt(var)
    return 0.5 * math.erfc(z / math.sqrt(2.0))

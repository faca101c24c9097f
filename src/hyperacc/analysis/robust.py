"""Robust statistics over columns: median/MAD modified z-scores, Tukey IQR fences, rolling medians.

Everything here is vectorised over numpy arrays and treats NaN as "not measured": a missing value is
left out of every median, quantile and count, never read as zero. Rules and defaults: docs/detection.md.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import numpy as np
from scipy.ndimage import median_filter

# MAD of a normal distribution is 0.6745 sigma (Iglewicz & Hoaglin's modified z-score).
MAD_Z = 0.6745
MAD_TO_SIGMA = 1.4826


def nan_median(values: np.ndarray, axis: int | None = None) -> np.ndarray:
    """Median ignoring NaN; all-NaN slices give NaN without a warning."""
    values = np.asarray(values, dtype=np.float64)
    if not np.isnan(values).any():
        return np.median(values, axis=axis)
    with _quiet():
        return np.nanmedian(values, axis=axis)


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


def tukey_fences(values: np.ndarray, k: float = 1.5, axis: int | None = 0) -> tuple[np.ndarray, np.ndarray]:
    """Tukey's fences ``(Q1 - k*IQR, Q3 + k*IQR)`` along ``axis``, NaN-aware (linear quantiles)."""
    values = np.asarray(values, dtype=np.float64)
    with _quiet():
        if np.isnan(values).any():
            q1, q3 = np.nanpercentile(values, [25.0, 75.0], axis=axis)
        else:
            q1, q3 = np.percentile(values, [25.0, 75.0], axis=axis)
    iqr = q3 - q1
    return q1 - k * iqr, q3 + k * iqr


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
    return median_filter(values, size=window, mode="nearest")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence numpy's 'All-NaN slice' RuntimeWarnings: an all-missing slice is an answer (NaN)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield

"""The median, defined once for every layer: the conventional one, the mean of the two middle values of
an even count (numpy's ``median``).

Light on purpose (numpy only, nothing else at import): training ranks use it (the pacing controller,
the live view, the stabilizers) without pulling in the analysis stack. A missing value (NaN, and None
in a Python sequence) means "not measured" and is left out, never read as zero.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np


def median(values: Iterable[float | None]) -> float:
    """Median of the measured values of a Python sequence (None and NaN left out); NaN when none is left."""
    vals = sorted(float(v) for v in values if v is not None and not math.isnan(v))
    n = len(vals)
    if n == 0:
        return math.nan
    k = n // 2
    return vals[k] if n % 2 else 0.5 * (vals[k - 1] + vals[k])


def nan_median(values: np.ndarray, axis: int | None = None) -> np.ndarray:
    """Median ignoring NaN along ``axis`` (all of it when None); all-NaN slices give NaN without a warning.

    Sort-based (NaN sorts last), so it stays vectorised where ``np.nanmedian`` falls back to masked
    arrays or a Python loop over slices.
    """
    values = np.asarray(values, dtype=np.float64)
    if axis is None:
        values = values.ravel()
        axis = 0
    if values.shape[axis] == 0:
        return np.full(np.delete(values.shape, axis), np.nan) if values.ndim > 1 else np.float64(np.nan)
    if not np.isnan(values).any():
        return np.median(values, axis=axis)
    med = last_axis_nan_median(np.moveaxis(values, axis, -1))[0]
    return med if med.ndim else np.float64(med)


def last_axis_nan_median(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The median over the last axis of the values that are not NaN, and their count (NaN where none;
    a float input keeps its dtype). Slices without NaN take the middle one or two by a partial sort, the
    rest are sorted (NaN last) and the middle one or two picked by the count: the same values as
    ``np.median`` of each slice's measured values, faster where most slices are whole."""
    width = values.shape[-1]
    whole = ~np.isnan(values).any(axis=-1)
    med = np.full(values.shape[:-1], np.nan, dtype=np.result_type(values.dtype, np.float32))
    n = np.zeros(values.shape[:-1], dtype=np.intp)
    if width == 0:
        return med, n
    mid = width // 2
    if whole.any():
        kth = mid if width % 2 else (mid - 1, mid)
        parted = np.partition(values[whole], kth, axis=-1)
        med[whole] = parted[:, mid] if width % 2 else (parted[:, mid - 1] + parted[:, mid]) / 2
        n[whole] = width
    if not whole.all():
        ordered = np.sort(values[~whole], axis=-1)
        count = np.count_nonzero(~np.isnan(ordered), axis=-1)
        lo = np.take_along_axis(ordered, np.clip((count - 1) // 2, 0, width - 1)[:, None], axis=-1)[:, 0]
        hi = np.take_along_axis(ordered, np.clip(count // 2, 0, width - 1)[:, None], axis=-1)[:, 0]
        med[~whole] = np.where(count > 0, (lo + hi) / 2, np.nan)
        n[~whole] = count
    return med, n


def median_inplace(values: np.ndarray) -> float:
    """Median of a 1-D float buffer without NaN, by a partial sort in place (the buffer is scratch): no
    copy, for code that runs every step. NaN when the buffer is empty."""
    n = values.shape[0]
    if n == 0:
        return math.nan
    k = n // 2
    values.partition(k)
    if n % 2:
        return float(values[k])
    return 0.5 * (float(values[k]) + float(values[:k].max()))

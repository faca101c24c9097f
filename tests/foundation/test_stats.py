"""The one median (hyperacc.stats): the conventional one everywhere, and light enough for a rank."""

import math
import subprocess
import sys

import numpy as np
import pytest

from hyperacc.stats import last_axis_nan_median, median, median_inplace, nan_median


@pytest.mark.parametrize(
    "values, expected",
    [
        ([3.0, 1.0, 2.0], 2.0),
        ([4.0, 1.0, 3.0, 2.0], 2.5),  # even count: the mean of the two middle values, not the upper one
        ([1.0, None, 3.0, float("nan"), 2.0, 10.0], 2.5),  # None and NaN are "not measured"
        ([7.0], 7.0),
    ],
)
def test_the_three_forms_agree_with_numpy(values, expected):
    measured = [v for v in values if v is not None and not math.isnan(v)]
    assert median(values) == expected == float(np.median(measured))
    arr = np.array([math.nan if v is None else v for v in values])
    assert float(nan_median(arr)) == expected
    assert median_inplace(np.array(measured)) == expected


def test_nothing_measured_is_nan_not_zero():
    assert math.isnan(median([]))
    assert math.isnan(median([None, float("nan")]))
    assert math.isnan(float(nan_median(np.array([np.nan, np.nan]))))
    assert math.isnan(median_inplace(np.zeros(0)))


def test_nan_median_along_an_axis_leaves_nan_out_per_slice():
    grid = np.array([[1.0, np.nan, 5.0], [2.0, np.nan, np.nan], [4.0, np.nan, 6.0], [10.0, np.nan, 7.0]])
    got = nan_median(grid, axis=0)
    assert got[0] == 3.0 and math.isnan(got[1]) and got[2] == 6.0


@pytest.mark.parametrize("width", [1, 2, 5, 6, 50])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_last_axis_median_equals_numpys_of_each_slices_measured_values(width, dtype):
    # whole slices take the partial-sort path, slices with NaN the sorted one: the same values either way
    rng = np.random.default_rng(width)
    values = rng.normal(size=(6, 40, width)).astype(dtype)
    values[rng.random(values.shape) < 0.03] = np.nan
    values[0, 0] = np.nan  # nothing measured
    med, n = last_axis_nan_median(values)
    assert med.dtype == dtype and np.isnan(med[0, 0]) and n[0, 0] == 0
    for i in np.ndindex(values.shape[:-1]):
        kept = values[i][~np.isnan(values[i])]
        assert n[i] == kept.size
        if kept.size:
            assert med[i] == np.median(kept).astype(dtype), i
    assert np.array_equal(nan_median(values.astype(np.float64), axis=-1), last_axis_nan_median(values.astype(np.float64))[0],
                          equal_nan=True)  # fmt: skip


def test_median_inplace_uses_the_buffer_as_scratch_and_copies_nothing():
    buf = np.array([5.0, 1.0, 4.0, 2.0])
    assert median_inplace(buf[:4]) == 3.0
    assert sorted(buf.tolist()) == [1.0, 2.0, 4.0, 5.0]  # reordered in place, same values


def test_importing_it_pulls_in_no_analysis_stack():
    code = (
        "import sys, hyperacc.stats, hyperacc.pacing.controller\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('scipy', 'pyarrow', 'torch')"
        " or m.startswith('hyperacc.analysis'))\n"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

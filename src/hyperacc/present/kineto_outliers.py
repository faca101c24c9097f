"""Cross-rank outlier test on CUDA runtime API latency of imported Kineto traces (docs/detection.md,
"Runtime API latency"): the analysis' own test, per API, with the same ``DetectionOptions``."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from hyperacc.analysis.options import DetectionOptions

MIN_RANKS = DetectionOptions().min_ranks  # the cross-rank test needs this many ranks (the analysis' own)


def runtime_api_outliers(
    runtime: pa.Table, metric: str = "median_ns", opts: DetectionOptions | None = None
) -> pa.Table:
    """The runtime API table with, per API, the analysis' cross-rank outlier test on ``metric``
    (``outliers.cross_rank_outliers``: modified z and the other ranks' Tukey fence, at least
    ``min_slowdown`` and ``launch_floor_ns`` above the median, with the same ``DetectionOptions``).
    Adds ``z``, ``excess`` (ratio to the cross-rank median, minus 1), ``outlier`` and ``judged`` (False
    where fewer than ``min_ranks`` ranks called the API: not tested)."""
    from hyperacc.analysis.outliers import cross_rank_outliers

    opts = opts or DetectionOptions()
    if runtime.num_rows == 0:
        return (
            runtime.append_column("z", pa.array([], pa.float64()))
            .append_column("excess", pa.array([], pa.float64()))
            .append_column("outlier", pa.array([], pa.bool_()))
            .append_column("judged", pa.array([], pa.bool_()))
        )
    api = np.asarray(runtime.column("api").to_pylist(), dtype=object)
    vals = runtime.column(metric).to_numpy(zero_copy_only=False).astype(np.float64)
    z = np.full(len(api), np.nan)
    excess = np.full(len(api), np.nan)
    flagged = np.zeros(len(api), dtype=bool)
    judged = np.zeros(len(api), dtype=bool)
    for name in dict.fromkeys(api.tolist()):
        sel = np.flatnonzero(api == name)
        f, zz, ratio, j = cross_rank_outliers(vals[sel], opts, float(opts.launch_floor_ns))
        z[sel], excess[sel], flagged[sel], judged[sel] = zz, ratio - 1.0, f, j
    return (
        runtime.append_column("z", pa.array(z))
        .append_column("excess", pa.array(excess))
        .append_column("outlier", pa.array(flagged))
        .append_column("judged", pa.array(judged))
    )

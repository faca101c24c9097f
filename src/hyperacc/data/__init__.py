"""The data path without spikes: on-demand sampler, device prefetch, LMDB storage, YUV decoding.

* :class:`OnDemandDistributedSampler` - DistributedSampler's contract with O(1) memory.
* :class:`DevicePrefetcher` - triple-buffer pinned prefetch to the device (bounded queue on CPU).
* :class:`LMDBDataset`, :func:`build_lmdb` - LMDB storage with sampler-aware page prefetch.
* :func:`yuv_to_rgb`, :class:`YUVToRGB` - YUV 4:2:0 to RGB and resize as tensor operations.
* :func:`make_loader` - all of the above assembled for one rank.

Usage, rules and defaults: docs/data.md.
"""

from hyperacc.data.lmdb_dataset import CorruptDatabaseError, LMDBDataset, build_lmdb
from hyperacc.data.pipeline import Loader, cold_read_comparison, make_loader
from hyperacc.data.prefetch import DevicePrefetcher
from hyperacc.data.sampler import OnDemandDistributedSampler
from hyperacc.data.yuv import YUVToRGB, yuv_to_rgb

__all__ = [
    "CorruptDatabaseError",
    "DevicePrefetcher",
    "LMDBDataset",
    "Loader",
    "OnDemandDistributedSampler",
    "YUVToRGB",
    "build_lmdb",
    "cold_read_comparison",
    "make_loader",
    "yuv_to_rgb",
]

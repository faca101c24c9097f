"""The data path assembled: sampler + DataLoader + device prefetch, and the cold-read demonstration.

``make_loader`` is what ``examples/train_ddp.py`` calls; its signature is stable. ``cold_read_comparison``
is what ``make demo`` prints: per-sample data time on a cold page cache with and without the
sampler-aware LMDB prefetch. Rules and defaults: docs/data.md.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from hyperacc.data.lmdb_dataset import LMDBDataset, build_lmdb, evict_from_page_cache, resident_fraction
from hyperacc.data.prefetch import DevicePrefetcher
from hyperacc.data.sampler import OnDemandDistributedSampler

__all__ = ["Loader", "cold_read_comparison", "cold_read_table", "make_loader", "read_latencies"]

SAMPLERS = ("ondemand", "torch")


class Loader:
    """A DataLoader with its distributed sampler and optional device prefetch.

    Iterate it like a DataLoader. ``set_epoch(e)`` before each epoch (forwards to the sampler);
    ``state_dict()``/``load_state_dict()`` resume mid-epoch exactly at the next unconsumed batch
    (on-demand sampler only). ``.dataloader``, ``.sampler`` and ``.prefetcher`` are the parts.
    """

    def __init__(
        self,
        dataloader: DataLoader,
        sampler: OnDemandDistributedSampler | DistributedSampler,
        prefetcher: DevicePrefetcher | None,
    ) -> None:
        self.dataloader = dataloader
        self.sampler = sampler
        self.prefetcher = prefetcher
        self.batch_size = int(dataloader.batch_size or 1)
        self._consumed = 0
        self._resume_batches = 0

    def __len__(self) -> int:
        return len(self.dataloader)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        return int(self.sampler.epoch)

    def __iter__(self) -> Iterator[Any]:
        self._consumed, self._resume_batches = self._resume_batches, 0
        source = self.prefetcher if self.prefetcher is not None else self.dataloader
        return self._count(iter(source))

    def _count(self, it: Iterator[Any]) -> Iterator[Any]:
        for batch in it:
            self._consumed += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """Where the consumer is: ``{"epoch", "batches", "batch_size", "seed", "num_replicas"}``."""
        return {
            "epoch": self.epoch,
            "batches": self._consumed,
            "batch_size": self.batch_size,
            "seed": int(self.sampler.seed),
            "num_replicas": int(self.sampler.num_replicas),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next ``iter()`` starts at batch ``state["batches"]`` of ``state["epoch"]``."""
        if not isinstance(self.sampler, OnDemandDistributedSampler):
            raise ValueError(
                "mid-epoch resume needs sampler='ondemand' (DistributedSampler keeps no position)"
            )
        for key in ("epoch", "batches"):
            if key not in state:
                raise ValueError(f"loader state has no {key!r}; pass what Loader.state_dict() returned")
        if int(state.get("batch_size", self.batch_size)) != self.batch_size:
            raise ValueError(
                f"loader state was saved with batch_size={state['batch_size']}, this loader uses {self.batch_size}"
            )
        if int(state.get("num_replicas", self.sampler.num_replicas)) != self.sampler.num_replicas:
            raise ValueError(
                f"loader state was saved with {state['num_replicas']} ranks, this job has "
                f"{self.sampler.num_replicas}: positions would not match"
            )
        batches = int(state["batches"])
        self.sampler.load_state_dict(
            {
                "yielded": batches * self.batch_size,
                "epoch": int(state["epoch"]),
                "seed": state.get("seed", self.sampler.seed),
            }
        )
        self._resume_batches = batches


def make_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    rank: int,
    world_size: int,
    sampler: str = "ondemand",
    seed: int = 0,
    num_workers: int = 0,
    prefetch_to: str | None = None,
    shuffle: bool = True,
    drop_last: bool = False,
    lookahead: int = 16,
    **dataloader_kwargs: Any,
) -> Loader:
    """Build the input pipeline for one rank.

    ``sampler``: ``"ondemand"`` (:class:`OnDemandDistributedSampler`, O(1) memory) or ``"torch"``
    (``DistributedSampler``, the baseline). ``drop_last`` applies to both the sampler and the last
    partial batch. If ``dataset`` has ``attach_sampler`` (:class:`LMDBDataset`) and the sampler is
    on-demand, the dataset prefetches the pages of upcoming samples (``lookahead`` per worker).
    ``prefetch_to``: ``None`` (plain DataLoader), ``"cuda"``/``"cuda:N"`` (triple-buffer pinned
    prefetch to that device) or ``"cpu"`` (bounded prefetch queue). Other keyword arguments go to
    ``torch.utils.data.DataLoader`` (``collate_fn``, ``persistent_workers``, ``prefetch_factor``, ...).
    """
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler={sampler!r} is not one of {SAMPLERS}")
    for bad in ("sampler", "batch_sampler", "shuffle"):
        if bad in dataloader_kwargs:
            raise ValueError(
                f"make_loader sets the DataLoader's {bad} itself; pass shuffle=, seed= and drop_last= to make_loader"
            )
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if sampler == "ondemand":
        s: OnDemandDistributedSampler | DistributedSampler = OnDemandDistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        attach = getattr(dataset, "attach_sampler", None)
        if callable(attach):
            attach(s, batch_size=batch_size, lookahead=lookahead)
    else:
        s = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
    prefetcher_device = None
    if prefetch_to is not None:
        prefetcher_device = torch.device(prefetch_to)
        if prefetcher_device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"prefetch_to={prefetch_to!r} but CUDA is not available here; use 'cpu' or None")
        # The prefetcher pins into its own reused buffers: a pinned copy per batch would be wasted work.
        dataloader_kwargs.setdefault("pin_memory", False)
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=s,
        num_workers=num_workers,
        drop_last=drop_last,
        **dataloader_kwargs,
    )
    prefetcher = DevicePrefetcher(loader, prefetcher_device) if prefetcher_device is not None else None
    return Loader(loader, s, prefetcher)


# ----------------------------------------------------------------------------- cold-read demonstration


def _percentiles(ms: np.ndarray) -> dict[str, float]:
    return {
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "max_ms": float(ms.max()),
        "mean_ms": float(ms.mean()),
    }


def read_latencies(
    db: str | os.PathLike,
    *,
    prefetch: bool,
    readahead: bool | None = None,
    compute_ms: float = 2.0,
    lookahead: int = 16,
    seed: int = 0,
    limit: int | None = None,
) -> np.ndarray:
    """Per-sample data time (ms) of one pass over ``db`` in on-demand sampler order, one rank, with
    ``compute_ms`` of idle time per sample standing in for the device step."""
    ds = LMDBDataset(db, readahead=readahead)
    try:
        sampler = OnDemandDistributedSampler(ds, num_replicas=1, rank=0, seed=seed)
        if prefetch:
            ds.attach_sampler(sampler, batch_size=1, lookahead=lookahead)
        n = len(sampler) if limit is None else min(limit, len(sampler))
        out = np.empty(n, dtype=np.float64)
        compute_s = compute_ms / 1e3
        for k, index in enumerate(sampler):
            if k >= n:
                break
            t0 = time.perf_counter()
            ds[index]
            out[k] = (time.perf_counter() - t0) * 1e3
            if compute_s:
                time.sleep(compute_s)  # the CPU is idle while the device computes
        return out
    finally:
        ds.close()


def cold_read_comparison(
    workdir: str | os.PathLike | None = None,
    *,
    samples: int | None = None,
    sample_bytes: int = 100_000,
    compute_ms: float = 2.0,
    lookahead: int = 16,
    quick: bool = True,
    readahead: bool | None = None,
) -> dict[str, Any]:
    """Cold page cache: per-sample data time without and with the sampler-aware prefetch.

    Builds an LMDB of ``samples`` random values of ``sample_bytes`` under ``workdir`` (a temporary
    directory when None), evicts it from the page cache before each pass (``posix_fadvise``), then
    reads it in sampler order with ``compute_ms`` of idle time per sample. ``samples`` defaults to 600
    (quick) or 3000. Returns the figures, including how much of the file was still cached right after
    eviction (``resident_after_evict``: near 0 means the reads really were cold).
    """
    if samples is None:
        samples = 600 if quick else 3000
    if samples < 2 or sample_bytes < 1:
        raise ValueError("samples must be >= 2 and sample_bytes >= 1")
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="hyperacc-cold-") as tmp:
            result = _cold_read(Path(tmp), samples, sample_bytes, compute_ms, lookahead, readahead)
            result["db"] = None  # removed with the temporary directory
            return result
    Path(workdir).mkdir(parents=True, exist_ok=True)
    return _cold_read(Path(workdir), samples, sample_bytes, compute_ms, lookahead, readahead)


def _cold_read(
    base: Path, samples: int, sample_bytes: int, compute_ms: float, lookahead: int, readahead: bool | None
) -> dict[str, Any]:
    db = base / "cold-read.lmdb"
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    build_lmdb(db, rng.integers(0, 256, size=(samples, sample_bytes), dtype=np.uint8), overwrite=True)
    build_s = time.perf_counter() - t0

    runs: dict[str, Any] = {}
    resident: dict[str, float] = {}
    for name, prefetch in (("without_prefetch", False), ("with_prefetch", True)):
        evict_from_page_cache(db)
        resident[name] = resident_fraction(db)
        ms = read_latencies(db, prefetch=prefetch, readahead=readahead, compute_ms=compute_ms, lookahead=lookahead)
        runs[name] = _percentiles(ms)
    without, with_ = runs["without_prefetch"], runs["with_prefetch"]
    return {
        "db": str(db),
        "samples": samples,
        "sample_bytes": sample_bytes,
        "compute_ms": compute_ms,
        "lookahead": lookahead,
        "readahead": readahead,
        "build_s": build_s,
        "resident_after_evict": max(resident.values()),
        "without_prefetch": without,
        "with_prefetch": with_,
        "p99_ratio": without["p99_ms"] / with_["p99_ms"] if with_["p99_ms"] > 0 else float("inf"),
        "p50_ratio": without["p50_ms"] / with_["p50_ms"] if with_["p50_ms"] > 0 else float("inf"),
    }


def _readahead_words(readahead: bool | None) -> str:
    return "default (off with prefetch, on without)" if readahead is None else ("on" if readahead else "off")


def cold_read_table(result: dict[str, Any]) -> str:
    """The figures of :func:`cold_read_comparison` as a small text table (what the demo prints)."""
    lines = [
        f"cold LMDB reads: {result['samples']} samples x {result['sample_bytes'] / 1e3:.0f} kB, "
        f"readahead {_readahead_words(result['readahead'])}, "
        f"{result['compute_ms']:g} ms compute per sample; page cache evicted before each pass "
        f"({result['resident_after_evict']:.0%} of the file still cached)",
        f"{'per-sample data time':<32} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}",
    ]
    for label, key in (
        ("without prefetch", "without_prefetch"),
        ("with sampler-aware prefetch", "with_prefetch"),
    ):
        f = result[key]
        lines.append(f"{label:<32} {f['p50_ms']:>8.3f} {f['p99_ms']:>8.3f} {f['max_ms']:>8.2f}")
    lines.append(f"p99 without / with prefetch: {result['p99_ratio']:.1f}x")
    return "\n".join(lines)

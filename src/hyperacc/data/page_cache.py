"""The page cache around a memory-mapped file: evict a file, measure how much of it is resident, and
the prefetch plan (``PagePrefetcher``: a background thread touching the pages of the keys a rank reads
next). Used by ``lmdb_dataset.LMDBDataset``; docs/data.md."""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("hyperacc.data.lmdb_dataset")  # the dataset's logger, as before the split

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

_MADV_WILLNEED = 3


def _data_file(path: Path) -> Path:
    return path / "data.mdb" if path.is_dir() else path


def evict_from_page_cache(path: str | os.PathLike) -> None:
    """Drop a database file's cached pages (fsync, then ``posix_fadvise(DONTNEED)``; no root needed).

    Pages still mapped by an open environment in any process stay resident: close readers first."""
    file = _data_file(Path(path))
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_fraction(path: str | os.PathLike) -> float:
    """Fraction of a database file's pages in the page cache (``mincore``), or NaN if unknown."""
    import mmap

    file = _data_file(Path(path))
    size = file.stat().st_size
    if size == 0:
        return 0.0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        pages = (size + _PAGE - 1) // _PAGE
        vec = (ctypes.c_ubyte * pages)()
        with file.open("rb") as fh, mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ) as mm:
            view = np.frombuffer(mm, dtype=np.uint8)
            rc = libc.mincore(ctypes.c_void_p(int(view.ctypes.data)), size, vec)
            del view  # the mmap cannot close while a buffer is exported
        if rc != 0:
            return float("nan")
        return float((np.frombuffer(vec, dtype=np.uint8) & 1).mean())
    except (OSError, AttributeError, TypeError, ValueError):
        return float("nan")


def _address(buf: Any) -> int:
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data) if len(buf) else 0


def upcoming_positions(
    position: int, *, batch_size: int, num_workers: int, lookahead: int, num_samples: int
) -> list[int]:
    """Local sampler positions this worker reads after ``position``, nearest first.

    DataLoader hands batch ``b`` (positions ``[b*B, (b+1)*B)``) to worker ``b mod W``; the worker
    reading ``position`` therefore reads the rest of its batch, then batches ``b+W``, ``b+2W``, ...
    """
    if batch_size < 1 or num_workers < 1:
        raise ValueError("batch_size and num_workers must be >= 1")
    out: list[int] = []
    batch = position // batch_size
    p = position + 1
    while len(out) < lookahead and p < num_samples:
        if p // batch_size != batch:
            batch += num_workers
            p = batch * batch_size
            if p >= num_samples:
                break
        out.append(p)
        p += 1
    return out


class PagePrefetcher:
    """Background page toucher for one process. ``notify(index)`` is all the reading thread does."""

    def __init__(
        self,
        env: Any,
        key: Callable[[int], bytes],
        sampler: Any,
        *,
        batch_size: int,
        num_workers: int,
        lookahead: int,
        max_ahead_bytes: int,
    ) -> None:
        # No reference to the dataset: an abandoned dataset is collected and its finaliser stops us.
        self._env = env
        self._key = key
        self._sampler = sampler
        self._batch_size = batch_size
        self._num_workers = max(1, num_workers)
        self._lookahead = lookahead
        self._max_ahead_bytes = max_ahead_bytes
        self._latest: int | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._expected: dict[int, int] = {}  # index -> position, from the last plan
        self._expected_epoch: int | None = None
        self._done: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.touched = 0
        self.touched_bytes = 0
        self.resyncs = 0
        self.recent: collections.deque[int] = collections.deque(maxlen=4 * max(lookahead, 1))
        self.enabled = True
        self._scratch = (ctypes.c_char * (1 << 20))()
        try:
            self._libc = ctypes.CDLL(None, use_errno=True)
            self._libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            self._libc = None
        self._thread = threading.Thread(target=self._run, name="hyperacc-lmdb-prefetch", daemon=True)
        self._thread.start()

    def notify(self, index: int) -> None:
        self._latest = index
        self._wake.set()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _position(self, index: int) -> int | None:
        pos = self._expected.get(index) if self._expected_epoch == self._sampler.epoch else None
        if pos is not None:
            return pos
        # Off the plan (first read, a resume, a new epoch): invert the permutation.
        self.resyncs += 1
        return self._sampler.position_of(index)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.wait(0.5)
                self._wake.clear()
                index = self._latest
                if index is None or self._stop.is_set():
                    continue
                pos = self._position(index)
                if pos is None:
                    continue
                positions = upcoming_positions(
                    pos,
                    batch_size=self._batch_size,
                    num_workers=self._num_workers,
                    lookahead=self._lookahead,
                    num_samples=len(self._sampler),
                )
                if not positions:
                    continue
                indices = [self._sampler.index_at(p) for p in positions]
                self._expected = dict(zip(indices, positions, strict=True))
                self._expected_epoch = self._sampler.epoch
                self._touch([i for i in indices if i not in self._done])
        except Exception as exc:  # noqa: BLE001 - prefetch is an optimisation: log once, switch off
            self.enabled = False
            log.warning("hyperacc LMDB prefetch switched off after an internal error: %r", exc)

    def _touch(self, indices: list[int]) -> None:
        if not indices:
            return
        with self._env.begin(buffers=True) as txn:
            spans: list[tuple[int, int, int]] = []
            budget = self._max_ahead_bytes
            for i in indices:
                value = txn.get(self._key(i))
                if value is None:
                    continue
                n = len(value)
                if n > budget:
                    break
                budget -= n
                spans.append((i, _address(value), n))
            # Ask the kernel for all of them at once (one deep I/O queue), then wait for each in order.
            if self._libc is not None:
                for _, addr, n in spans:
                    if n:
                        start = addr - addr % _PAGE
                        self._libc.madvise(start, addr + n - start, _MADV_WILLNEED)
            chunk = len(self._scratch)
            for i, addr, n in spans:
                if self._stop.is_set():
                    return
                for off in range(0, n, chunk):
                    ctypes.memmove(self._scratch, addr + off, min(chunk, n - off))  # faults pages in, no GIL
                self._done[i] = None
                if len(self._done) > 4 * self._lookahead:
                    self._done.popitem(last=False)
                self.recent.append(i)
                self.touched += 1
                self.touched_bytes += n

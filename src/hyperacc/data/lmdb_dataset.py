"""Map-style dataset over an LMDB database, without cold-read spikes.

A cold random read from a memory-mapped LMDB faults its pages in while the training step waits. Two
things remove that from the step (defaults chosen by measurement, docs/data.md "Defaults"):

* ``readahead`` is py-lmdb's flag. By default (``None``) it is off when a sampler-aware prefetcher is
  attached (the prefetcher reads exactly the pages that will be asked for; readahead's neighbours cost
  I/O, and on a sparse file they kept a 9 ms p99 tail) and on otherwise (with nothing else reading
  ahead, it gives the lowest mean read).
* A sampler-aware page prefetcher: ``attach_sampler(sampler, batch_size)`` gives the dataset the
  :class:`~hyperacc.data.sampler.OnDemandDistributedSampler` that drives it. Each process (each
  DataLoader worker) then runs one background thread that, from the index just requested, works out
  which samples this worker reads next (DataLoader hands batches to workers round-robin) and touches
  their pages (``madvise(MADV_WILLNEED)`` then a copy into a small scratch buffer, both outside the
  GIL). It is bounded in depth (``lookahead`` samples) and in bytes (``max_ahead_bytes``), and an
  error inside it logs one line and switches it off; reads never depend on it.

The environment is opened lazily in each process (LMDB handles are not fork-safe) and never pickled.
``build_lmdb`` writes a database from a folder, from arrays or from an iterable of byte strings.
Rules and defaults: docs/data.md.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from hyperacc.data.page_cache import (  # evict_from_page_cache, ...: re-exported (__all__)
    PagePrefetcher,
    _data_file,
    evict_from_page_cache,
    resident_fraction,
    upcoming_positions,
)

__all__ = [
    "CorruptDatabaseError",
    "LMDBDataset",
    "PagePrefetcher",
    "build_lmdb",
    "evict_from_page_cache",
    "resident_fraction",
    "upcoming_positions",
]

log = logging.getLogger(__name__)

META_KEY = b"__hyperacc_meta__"
FORMAT = "hyperacc-lmdb/1"
DEFAULT_KEY_FORMAT = "{:010d}"


def _lmdb():
    try:
        import lmdb
    except ImportError as exc:  # pragma: no cover - lmdb is in the [data] extra
        raise ImportError("hyperacc.data.lmdb_dataset needs py-lmdb: pip install 'hyperacc[data]'") from exc
    return lmdb


class CorruptDatabaseError(ValueError):
    """The path exists but is not a readable LMDB database (or its metadata is damaged)."""


# ----------------------------------------------------------------------------- builder


def build_lmdb(
    path: str | os.PathLike,
    source: str | os.PathLike | np.ndarray | Sequence[np.ndarray] | Iterable[bytes],
    *,
    overwrite: bool = False,
    map_size: int | None = None,
    pattern: str = "*",
    commit_bytes: int = 64 << 20,
) -> Path:
    """Write an LMDB database at ``path`` (a directory) that :class:`LMDBDataset` reads.

    ``source`` is one of:
      * a folder: every file matching ``pattern`` below it (sorted by relative path) becomes one
        sample (its bytes); the relative names are stored and returned by ``LMDBDataset.name(i)``;
      * a numpy array ``(N, ...)``: sample ``i`` is ``array[i]`` (decoded back to a tensor);
      * a tuple/list of numpy arrays with the same first dimension: sample ``i`` is a tuple of tensors;
      * any other iterable of ``bytes``: sample ``i`` is the ``i``-th byte string.
    Keys are ``"{:010d}"`` of the index, so key order is index order.
    """
    lmdb = _lmdb()
    path = Path(path)
    if (path / "data.mdb").exists() or (path.exists() and path.is_file()):
        if not overwrite:
            raise FileExistsError(f"{path} already holds a database; pass overwrite=True to replace it")
        if path.is_file():
            path.unlink()
        else:
            shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)

    meta: dict[str, Any] = {"format": FORMAT, "key_format": DEFAULT_KEY_FORMAT}
    names: list[str] | None = None
    items: Iterable[bytes | memoryview]
    if isinstance(source, str | os.PathLike):
        folder = Path(source)
        if not folder.is_dir():
            raise FileNotFoundError(
                f"build_lmdb: source folder {folder} does not exist or is not a directory"
            )
        files = sorted(p for p in folder.rglob(pattern) if p.is_file())
        if not files:
            raise ValueError(f"build_lmdb: no files matching {pattern!r} under {folder}")
        names = [str(p.relative_to(folder)) for p in files]
        meta["kind"] = "files"
        items = (p.read_bytes() for p in files)
        estimate = sum(p.stat().st_size for p in files)
    elif isinstance(source, np.ndarray) or (
        isinstance(source, tuple | list) and source and all(isinstance(a, np.ndarray) for a in source)
    ):
        arrays = [source] if isinstance(source, np.ndarray) else list(source)
        n = len(arrays[0])
        if any(len(a) != n for a in arrays):
            raise ValueError(f"build_lmdb: arrays differ in length: {[len(a) for a in arrays]}")
        arrays = [np.ascontiguousarray(a) for a in arrays]
        meta["kind"] = "array" if isinstance(source, np.ndarray) else "arrays"
        meta["fields"] = [{"dtype": a.dtype.str, "shape": list(a.shape[1:])} for a in arrays]
        items = (b"".join(a[i].tobytes() for a in arrays) for i in range(n))
        estimate = sum(a.nbytes for a in arrays)
    else:
        meta["kind"] = "bytes"
        items = iter(source)  # type: ignore[arg-type]
        estimate = 0

    if map_size is None:
        # Virtual address space only; the file grows with the data. Large enough for unknown sizes.
        map_size = max(1 << 40 if estimate == 0 else int(estimate * 2) + (256 << 20), 64 << 20)
    env = lmdb.open(str(path), map_size=map_size, subdir=True, readahead=False, meminit=False, max_dbs=0)
    try:
        count = 0
        pending = 0
        txn = env.begin(write=True)
        try:
            for value in items:
                txn.put(DEFAULT_KEY_FORMAT.format(count).encode(), bytes(value), append=True)
                count += 1
                pending += len(value)
                if pending >= commit_bytes:
                    txn.commit()
                    txn = env.begin(write=True)
                    pending = 0
            meta["length"] = count
            if names is not None:
                meta["names"] = names
            txn.put(META_KEY, json.dumps(meta).encode())
            txn.commit()
        except BaseException:
            txn.abort()
            raise
        env.sync(True)
    finally:
        env.close()
    return path


# ----------------------------------------------------------------------------- environments


class _Environments:
    """One open environment per database file per process.

    LMDB (and py-lmdb, which refuses it) does not allow opening the same files twice in one process,
    so every dataset over a file in a process shares one handle, counted by users. A process forked
    from one that had it open inherits a handle it must not use: the first acquire in the child
    closes its copy (which only unmaps and closes the child's own descriptors; with ``lock=False``
    nothing is shared) and opens a fresh one.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[tuple[int, int], list[Any]] = {}  # file id -> [pid, env, users]

    @staticmethod
    def _file_id(path: Path) -> tuple[int, int]:
        st = os.stat(_data_file(path))
        return (st.st_dev, st.st_ino)

    def acquire(self, path: Path, opener: Callable[[], Any]) -> tuple[tuple[int, int], Any]:
        key = self._file_id(path)
        pid = os.getpid()
        with self._lock:
            for k, (owner, env, _) in list(self._open.items()):
                if owner != pid:
                    del self._open[k]
                    try:
                        env.close()
                    except Exception:  # noqa: BLE001 - the inherited copy is being discarded anyway
                        log.debug("closing an inherited LMDB handle failed", exc_info=True)
            entry = self._open.get(key)
            if entry is None:
                entry = self._open[key] = [pid, opener(), 0]
            entry[2] += 1
            return key, entry[1]

    def release(self, key: tuple[int, int]) -> None:
        with self._lock:
            entry = self._open.get(key)
            if entry is None or entry[0] != os.getpid():
                return
            entry[2] -= 1
            if entry[2] <= 0:
                del self._open[key]
                entry[1].close()


_ENVIRONMENTS = _Environments()


# ----------------------------------------------------------------------------- dataset


class LMDBDataset(Dataset):
    """Map-style dataset over an LMDB database written by :func:`build_lmdb` (or any LMDB whose keys
    are ``key_format.format(index)``).

    ``decode(buffer) -> sample`` turns the raw value (a memoryview valid only during the call) into a
    sample; the default returns a tensor for array databases and ``bytes`` otherwise.
    ``readahead`` is py-lmdb's flag (False maps to ``MDB_NORDAHEAD``, i.e. ``MADV_RANDOM``); ``None``
    (default): off once :meth:`attach_sampler` was called, on otherwise, as measured in docs/data.md
    ("Defaults"). It applies when a process opens the file (lazily, at its first read).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        decode: Callable[[memoryview], Any] | None = None,
        readahead: bool | None = None,
        lock: bool = False,
        key_format: str | None = None,
        length: int | None = None,
    ) -> None:
        self.path = Path(path)
        self.readahead = readahead
        self.lock = lock
        self._decode_fn = decode
        if not self.path.exists():
            raise FileNotFoundError(
                f"LMDB database not found at {self.path}: build one with hyperacc.data.build_lmdb(path, source)"
            )
        if self.path.is_dir() and not (self.path / "data.mdb").exists():
            raise FileNotFoundError(
                f"{self.path} is a directory without data.mdb: not an LMDB database. "
                "Build one with hyperacc.data.build_lmdb(path, source)"
            )
        key, env = _ENVIRONMENTS.acquire(self.path, self._open)
        try:
            with env.begin() as txn:
                raw = txn.get(META_KEY)
                entries = env.stat()["entries"]
        except _lmdb().Error as exc:
            raise CorruptDatabaseError(
                f"LMDB database at {self.path} is unreadable ({exc}); rebuild it"
            ) from exc
        finally:
            _ENVIRONMENTS.release(key)
        self.meta: dict[str, Any] = {}
        if raw is not None:
            try:
                self.meta = json.loads(bytes(raw))
                if not isinstance(self.meta, dict) or "length" not in self.meta:
                    raise ValueError("no length")
            except ValueError as exc:
                raise CorruptDatabaseError(
                    f"LMDB database at {self.path} has damaged metadata under {META_KEY!r} ({exc}); rebuild it"
                ) from exc
        self.key_format = key_format or self.meta.get("key_format", DEFAULT_KEY_FORMAT)
        if length is not None:
            self.length = int(length)
        elif "length" in self.meta:
            self.length = int(self.meta["length"])
        else:
            self.length = int(entries)
        self._fields = [(np.dtype(f["dtype"]), tuple(f["shape"])) for f in self.meta.get("fields", [])]
        self._env = None
        self._env_key: tuple[int, int] | None = None
        self._pid: int | None = None
        self._sampler: Any = None
        self._prefetch_cfg: dict[str, int] = {}
        self._prefetcher: PagePrefetcher | None = None

    # -- environment, lazily per process
    def _open(self):
        lmdb = _lmdb()
        subdir = self.path.is_dir()
        try:
            return lmdb.open(
                str(self.path),
                subdir=subdir,
                readonly=True,
                lock=self.lock,
                readahead=self.effective_readahead,
                meminit=False,
                max_readers=256,
            )
        except lmdb.Error as exc:
            raise CorruptDatabaseError(
                f"cannot open {self.path} as an LMDB database ({exc}); it is corrupt or not LMDB: rebuild it"
            ) from exc

    @property
    def effective_readahead(self) -> bool:
        """The readahead this process opens the file with: the given one, else off with a prefetcher."""
        if self.readahead is not None:
            return bool(self.readahead)
        return getattr(self, "_sampler", None) is None

    def _environment(self):
        pid = os.getpid()
        if self._env is None or self._pid != pid:
            # A forked worker must not use its parent's handle; the parent's prefetch thread is not here.
            self._env_key, self._env = _ENVIRONMENTS.acquire(self.path, self._open)
            self._pid = pid
            self._prefetcher = None
        return self._env

    def _key(self, index: int) -> bytes:
        return self.key_format.format(index).encode()

    # -- Dataset
    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        index = int(index)
        if not 0 <= index < self.length:
            raise IndexError(
                f"index {index} out of range for LMDB dataset {self.path} of length {self.length}"
            )
        env = self._environment()
        if self._sampler is not None:
            pf = self._prefetcher
            if pf is None:
                pf = self._start_prefetcher()
            if pf is not None:
                pf.notify(index)
        key = self._key(index)
        try:
            with env.begin(buffers=True) as txn:
                value = txn.get(key)
                if value is None:
                    raise KeyError(
                        f"key {key.decode()!r} (index {index}) not found in LMDB database {self.path}; "
                        f"was it built with build_lmdb, or does key_format={self.key_format!r} match its keys?"
                    )
                return self._decode(value)
        except _lmdb().Error as exc:
            raise CorruptDatabaseError(
                f"reading index {index} from {self.path} failed ({exc}); rebuild it"
            ) from exc

    def _decode(self, value: memoryview) -> Any:
        if self._decode_fn is not None:
            return self._decode_fn(value)
        kind = self.meta.get("kind")
        if kind in ("array", "arrays"):
            out = []
            off = 0
            for dtype, shape in self._fields:
                count = int(np.prod(shape)) if shape else 1
                arr = np.frombuffer(value, dtype=dtype, count=count, offset=off).reshape(shape).copy()
                off += count * dtype.itemsize
                out.append(torch.from_numpy(arr))
            return out[0] if kind == "array" else tuple(out)
        return bytes(value)

    def name(self, index: int) -> str:
        """The source file name of sample ``index`` (folder-built databases)."""
        names = self.meta.get("names")
        if names is None:
            raise KeyError(f"{self.path} was not built from a folder: it stores no names")
        return names[index]

    # -- prefetch
    def attach_sampler(
        self,
        sampler: Any,
        *,
        batch_size: int = 1,
        lookahead: int = 16,
        max_ahead_bytes: int = 64 << 20,
        num_workers: int | None = None,
    ) -> LMDBDataset:
        """Prefetch the pages of the samples ``sampler`` will ask for next.

        ``sampler`` must offer ``position_of(index)``, ``index_at(position)`` and ``len()``, as
        :class:`OnDemandDistributedSampler` does. ``batch_size`` is the DataLoader's; ``num_workers``
        defaults to the worker count seen inside each worker. Returns ``self``.
        """
        for attr in ("position_of", "index_at", "__len__"):
            if not hasattr(sampler, attr):
                raise TypeError(
                    f"attach_sampler needs a sampler with position_of/index_at (OnDemandDistributedSampler); "
                    f"{type(sampler).__name__} has no {attr}"
                )
        if batch_size < 1 or lookahead < 1 or max_ahead_bytes < 1:
            raise ValueError("batch_size, lookahead and max_ahead_bytes must be >= 1")
        self.detach_sampler()
        if self.readahead is None and self._env is not None and self._pid == os.getpid():
            # Opened with readahead on before a prefetcher was attached: reopen at the next read.
            _ENVIRONMENTS.release(self._env_key)
            self._env, self._env_key, self._pid = None, None, None
        share = getattr(sampler, "share_epoch", None)
        if callable(share):
            share()  # so worker copies (persistent workers too) follow set_epoch
        self._sampler = sampler
        self._prefetch_cfg = {
            "batch_size": int(batch_size),
            "lookahead": int(lookahead),
            "max_ahead_bytes": int(max_ahead_bytes),
            "num_workers": -1 if num_workers is None else int(num_workers),
        }
        return self

    def detach_sampler(self) -> None:
        if self._prefetcher is not None and self._pid == os.getpid():
            self._prefetcher.stop()
        self._prefetcher = None
        self._sampler = None

    def _start_prefetcher(self) -> PagePrefetcher | None:
        cfg = self._prefetch_cfg
        info = get_worker_info()
        workers = cfg["num_workers"]
        if workers < 0:
            workers = info.num_workers if info is not None else 1
        try:
            self._prefetcher = PagePrefetcher(
                self._environment(),
                self._key,
                self._sampler,
                batch_size=cfg["batch_size"],
                num_workers=workers,
                lookahead=cfg["lookahead"],
                max_ahead_bytes=cfg["max_ahead_bytes"],
            )
        except Exception as exc:  # noqa: BLE001 - never break reads because prefetch failed
            log.warning("hyperacc LMDB prefetch could not start, reading without it: %r", exc)
            self._sampler = None
            return None
        return self._prefetcher

    @property
    def prefetcher(self) -> PagePrefetcher | None:
        """This process's prefetcher (None until the first read with a sampler attached)."""
        return self._prefetcher if self._pid == os.getpid() else None

    def close(self) -> None:
        """Stop this process's prefetch thread and close its environment."""
        if self._pid == os.getpid():
            busy = False
            if self._prefetcher is not None:
                self._prefetcher.stop()
                busy = self._prefetcher.alive
            if self._env_key is not None and not busy:
                # Closing under a thread that still reads the map would fault; leave it open then.
                _ENVIRONMENTS.release(self._env_key)
        self._prefetcher = None
        self._env = None
        self._env_key = None
        self._pid = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_env"] = None
        state["_env_key"] = None
        state["_pid"] = None
        state["_prefetcher"] = None
        return state

    def __del__(self) -> None:
        try:
            if getattr(self, "_pid", None) == os.getpid():
                self.close()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass

    def __repr__(self) -> str:
        return f"LMDBDataset({str(self.path)!r}, length={self.length}, readahead={self.effective_readahead})"

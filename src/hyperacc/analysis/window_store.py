"""Window rows through a c10d store: the connection, retries with backoff, and the binary frames that
carry one sender's rows (a rank's, or a node agent's for its node) to the process that judges them.

Shared by the publishers (``live_aggregate.WindowAggregator`` on a rank, the node agent) and the
gatherer (``live_aggregate.WindowGatherer``); docs/tracing.md, "Live aggregation".
"""

from __future__ import annotations

import datetime
import json
import logging
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from hyperacc import process
from hyperacc.analysis.windows import float_columns
from hyperacc.trace.failsafe import one_line

log = logging.getLogger("hyperacc.live")


def connect_store(address: str | None = None, timeout_s: float = 10.0) -> Any:
    """A c10d store every rank of this job can reach, or None (single process without torchrun).

    A fresh client of the TCPStore at ``address`` ("host:port"), by default the launcher's
    (MASTER_ADDR:MASTER_PORT, the one torchrun's rendezvous already uses); without those, the default
    process group's store. A store that is gone (the job ended, its port closed) raises OSError at once:
    a plain TCP connection is tried first, since torch's client retries a refused port until its timeout
    and prints a C++ backtrace to stderr each time.
    """
    import torch.distributed as dist

    if address:
        addr, _, text = address.rpartition(":")
        port: int | None = int(text)
    else:
        here = process.place()
        addr, port = here.master_addr, here.master_port
    timeout = datetime.timedelta(seconds=timeout_s)
    if addr and port:
        socket.create_connection((addr, port), timeout=min(timeout_s, 5.0)).close()
        return dist.TCPStore(addr, port, None, False, timeout=timeout, wait_for_workers=False)
    if dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    return None


class StoreDown(Exception):
    """The c10d store could not be reached or answered with an error (retried with backoff)."""


class Backoff:
    """When to try an unreachable store again: 1 s, then doubling up to ``cap_s``; says once that the
    store is unreachable and once that it answers again (``what`` names the part)."""

    def __init__(self, what: str, cap_s: float = 30.0) -> None:
        self.what = what
        self.cap_s = cap_s
        self.failures = 0
        self._until = 0.0

    def ready(self) -> bool:
        return time.monotonic() >= self._until

    @property
    def down(self) -> bool:
        return self.failures > 0

    def failed(self, exc: BaseException) -> None:
        if self.failures == 0:
            log.warning("hyperacc live: %s: the c10d store is unreachable (%s); retrying with backoff",
                        self.what, one_line(exc))  # fmt: skip
        self.failures += 1
        self._until = time.monotonic() + min(self.cap_s, 2.0 ** (self.failures - 1))

    def succeeded(self) -> None:
        if self.failures:
            log.warning("hyperacc live: %s: the c10d store answers again", self.what)
        self.failures = 0
        self._until = 0.0


# Store errors: torch's DistStoreError and DistNetworkError are RuntimeErrors, a refused connection an OSError.
STORE_ERRORS = (RuntimeError, OSError, TimeoutError)

# Window rows kept for a store that does not answer: the newest, at most this many (older ones dropped).
OUTBOX_ROWS = 4096

# A judged window's key ``w<N>/done`` stays this many windows, so a row that comes later is dropped by its
# publisher instead of leaving a key nobody deletes.
DONE_KEPT = 8


# One sender's window rows on the wire, one frame per append, so that the frames of many senders
# appended to one key are read back as columns without parsing text or making a dict per row (JSON rows
# cost rank 0 about 60 ms per window at 4,096 ranks): the magic, the number of rows and the header's
# length (u32 little-endian each), the header (the column names as a JSON list), then the values as
# float64 little-endian, one column after the other (NaN: not measured). Every value of a window row
# is a number. Senders with the same columns send the same header, so the reader parses each header
# once and joins their values in one step, whether 512 node agents or 4,096 ranks sent them.
_FRAME_MAGIC = b"HWR2"
_FRAME_HEAD = struct.Struct("<4sII")


def encode_rows(rows: list[dict[str, Any]]) -> bytes:
    """Window rows -> one frame (``decode_frames`` reads any number of them back as columns)."""
    columns = list(dict.fromkeys(k for r in rows for k in r))
    values = np.array([[r.get(c) for c in columns] for r in rows], dtype=np.float64).reshape(len(rows), len(columns))
    return encode_frame(columns, values.T)


def encode_frame(columns: list[str], values: np.ndarray) -> bytes:
    """One frame: ``values`` (column x row) under ``columns``."""
    head = json.dumps(columns, separators=(",", ":")).encode()
    return (_FRAME_HEAD.pack(_FRAME_MAGIC, values.shape[1] if values.ndim == 2 else 0, len(head)) + head
            + np.ascontiguousarray(values, dtype="<f8").tobytes())  # fmt: skip


def iter_frames(data: bytes, where: str) -> Iterator[tuple[bytes, list[str], np.ndarray]]:
    """Frames appended one after another -> (header bytes, columns, values as column x row), in order.
    Raises ValueError naming ``where`` for bytes that are not whole frames."""
    view = memoryview(data)
    parsed: dict[bytes, list[str]] = {}  # each header parsed once
    pos, size = 0, len(view)
    while pos < size:
        if size - pos < _FRAME_HEAD.size:
            raise ValueError(f"{where}: {size - pos} trailing bytes are not a frame (truncated)")
        magic, n, head_size = _FRAME_HEAD.unpack_from(view, pos)
        start = pos + _FRAME_HEAD.size
        head = bytes(view[start : start + head_size])
        columns = parsed.get(head)
        if columns is None:
            try:
                columns = json.loads(head) if magic == _FRAME_MAGIC else None
            except ValueError:
                columns = None
            if not isinstance(columns, list) or not all(isinstance(c, str) for c in columns):
                raise ValueError(f"{where}: bytes at offset {pos} are not a window-rows frame")
            parsed[head] = columns
        start += head_size
        end = start + 8 * n * len(columns)
        if end > size:
            raise ValueError(f"{where}: the frame at offset {pos} is truncated ({size - start} of "
                             f"{end - start} bytes of values)")  # fmt: skip
        yield head, columns, np.frombuffer(view[start:end], dtype="<f8").reshape(len(columns), n)
        pos = end


def decode_frames(data: bytes, where: str = "window rows") -> dict[str, np.ndarray]:
    """Frames appended one after another -> the columns of ``windows.rows_columns`` ((window, rank)
    order, NaN or -1 where a sender had no such column). Raises ValueError naming ``where`` for bytes
    that are not whole frames."""
    groups: dict[bytes, tuple[list[str], list[np.ndarray]]] = {}  # header -> (columns, value blocks)
    for head, columns, values in iter_frames(data, where):
        groups.setdefault(head, (columns, []))[1].append(values)
    parts = [(columns, np.concatenate(blocks, axis=1)) for columns, blocks in groups.values()]
    names = list(dict.fromkeys(c for columns, _ in parts for c in columns))
    merged = {}
    for name in names:
        pieces = [block[columns.index(name)] if name in columns else np.full(block.shape[1], np.nan)
                  for columns, block in parts]  # fmt: skip
        merged[name] = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
    return float_columns(merged)


def publish_rows(store: Any, rows: list[dict[str, Any]]) -> list[int]:
    """Append window rows to their window's key, one append (one frame, ``encode_rows``) and one count
    per window; a window already judged (``w<N>/done``) takes no more rows. Returns the windows
    published."""
    by_window: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        by_window.setdefault(int(row["window"]), []).append(row)
    for w, batch in sorted(by_window.items()):
        if store.check([f"w{w}/done"]):
            continue  # judged without these rows: they would leave a key behind
        store.append(f"w{w}", encode_rows(batch))
        store.add(f"w{w}/n", len(batch))
    return sorted(by_window)

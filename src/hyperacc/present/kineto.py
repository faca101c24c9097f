"""Import torch.profiler (Kineto) traces into a run directory, and measure CUDA runtime API latency.

One trace file per rank (``.json`` or ``.json.gz``, as ``export_chrome_trace`` or
``tensorboard_trace_handler`` write them) becomes that rank's step records in the shared
``STEP_SCHEMA``, so the same analysis reads a traced, a simulated and an imported run. What maps to
what is written down in docs/presentation.md ("Kineto import").

A single rank's trace can be gigabytes. The file is read in chunks of ~1 M characters and the
``traceEvents`` array is decoded a chunk's worth of events at a time with the C JSON scanner; each event
is inspected and dropped with its chunk, and only the few fields needed later are kept, in compact typed
arrays (``array.array``), never as Python objects per event. Peak memory is about two chunks plus 20-40
bytes per kept event (CUDA runtime calls, collective kernels, annotations, steps); CPU operators, the
bulk of a trace, keep nothing.

A truncated file (a job killed while writing, a cut ``.gz``) is imported up to where it ends, with a
warning; a corrupt or step-less file raises ``KinetoTraceError`` naming the file, and ``import_traces``
records it and goes on with the other ranks.
"""

from __future__ import annotations

import array
import dataclasses
import datetime as _dt
import io
import json
import os
import re
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hyperacc.analysis.options import DetectionOptions
from hyperacc.schema import EVENT_SCHEMA, STEP_SCHEMA, RankMeta
from hyperacc.store import event_writer, step_writer, write_meta

# Where an import leaves what does not fit the step schema.
KINETO_DIR = "kineto"
RUNTIME_API_FILE = "runtime_api.parquet"
IMPORT_REPORT_FILE = "import.json"

RUNTIME_API_SCHEMA = pa.schema(
    [
        pa.field("rank", pa.int32(), nullable=False),
        pa.field("api", pa.string(), nullable=False),
        pa.field("calls", pa.int64()),
        pa.field("median_ns", pa.float64()),
        pa.field("p99_ns", pa.float64()),
        pa.field("max_ns", pa.float64()),
        pa.field("total_ns", pa.float64()),
    ]
)

# The CUDA runtime calls the latency table shows first (the seed's hyper-trace signal); every other
# runtime or driver call found in the traces follows.
KEY_RUNTIME_APIS: tuple[str, ...] = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpyAsync",
    "cudaMemsetAsync",
    "cudaMalloc",
    "cudaFree",
)
_LAUNCH_APIS = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"})
_SYNC_APIS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"})
_MALLOC_APIS = frozenset({"cudaMalloc", "cuMemAlloc", "cuMemAlloc_v2"})
_RUNTIME_CATS = frozenset({"cuda_runtime", "cuda_driver", "runtime", "driver", "Runtime", "Driver"})

# Annotation name -> phase, first match wins (case-insensitive). Time covered by no matching
# annotation is ``other``; nested annotations count for the innermost one.
PHASE_PATTERNS: tuple[tuple[str, str], ...] = (
    ("data", r"dataloader|data[ _]?load|\bdata\b|next_batch|get_batch"),
    ("h2d", r"\bh2d\b|htod|to_device|copy_to_device|host_to_device"),
    ("backward", r"backward"),
    ("forward", r"forward"),
    ("optimizer", r"optimizer|optim\b|zero_grad|\.step#|\bopt_step\b"),
)
_PHASE_IDS = {name: i for i, (name, _) in enumerate(PHASE_PATTERNS)}
_PHASE_RES = tuple(re.compile(p, re.IGNORECASE) for _, p in PHASE_PATTERNS)
_STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")
_COLLECTIVE_PREFIXES = ("nccl", "rccl")
_HOST_COLLECTIVE_PREFIXES = ("gloo:",)
_FIELDS = frozenset({"distributedInfo", "host_name", "hostname", "baseTimeNanoseconds"})  # top-level keys kept

_CHUNK_CHARS = 1 << 20
_MAX_VALUE_CHARS = 256 << 20  # a single JSON value (one event, INFO list, ...) larger than this is corrupt
_decoder = json.JSONDecoder()


class KinetoTraceError(ValueError):
    """A trace file that cannot be imported; the message names the file and what to do."""


# --------------------------------------------------------------------------------------------------
# Streaming reader


class _Truncated(Exception):
    """The document ends before it is complete (a cut file): what was read so far is kept."""


class _GzipTail(io.RawIOBase):
    """A gzip stream that reads up to where it ends: a cut or damaged stream yields every byte that
    could be decompressed before the damage, then end of file (``truncated`` says why)."""

    def __init__(self, path: Path) -> None:
        self._raw = open(path, "rb")  # noqa: SIM115
        self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)
        self._pending = b""
        self._done = False
        self.truncated: str | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # type: ignore[override]
        while not self._pending and not self._done:
            chunk = self._raw.read(1 << 16)
            try:
                if not chunk:
                    self._pending = self._z.flush()
                    if not self._z.eof:
                        self.truncated = "the compressed stream ends early"
                    self._done = True
                    break
                self._pending = self._z.decompress(chunk)
                if self._z.eof and self._z.unused_data:  # another gzip member follows
                    rest = self._z.unused_data
                    self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)
                    self._pending += self._z.decompress(rest)
            except zlib.error as exc:
                self.truncated = f"the compressed stream is damaged ({exc})"
                self._done = True
        n = min(len(b), len(self._pending))
        b[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


class _Reader:
    """Walks a Chrome-trace JSON document chunk by chunk; yields ``traceEvents`` items one at a time.

    Both layouts Chrome's trace format allows are read: an object with a ``traceEvents`` array, and a
    bare array of events. A UTF-8 byte-order mark is skipped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._gzip: _GzipTail | None = None
        raw: io.BufferedIOBase
        if _is_gzip(path):
            self._gzip = _GzipTail(path)
            raw = io.BufferedReader(self._gzip)
        else:
            raw = open(path, "rb")  # noqa: SIM115
        self._text = io.TextIOWrapper(raw, encoding="utf-8-sig", errors="strict")
        self.buf = ""
        self.pos = 0
        self.eof = False
        self.consumed = 0  # characters dropped from the front of the buffer
        self._single_until = -1  # decode events one at a time up to this position (see _batch)
        self.truncated: str | None = None  # why the document ends early, when it does

    @property
    def position(self) -> int:
        return self.consumed + self.pos

    def close(self) -> None:
        self._text.close()

    def _fail(self, what: str) -> KinetoTraceError:
        return KinetoTraceError(
            f"{self.path}: {what} (near character {self.consumed + self.pos}); the trace is truncated or "
            "corrupt: export it again (torch.profiler export_chrome_trace) or leave it out"
        )

    def _refill(self) -> bool:
        if self.eof:
            return False
        try:
            chunk = self._text.read(_CHUNK_CHARS)
        except (EOFError, OSError, zlib.error, UnicodeDecodeError) as exc:
            raise self._fail(f"cannot read ({type(exc).__name__}: {exc})") from None
        if not chunk:
            self.eof = True
            return False
        if self.pos:
            self.consumed += self.pos
            self._single_until -= self.pos
            self.buf = self.buf[self.pos :] + chunk
            self.pos = 0
        else:
            self.buf += chunk
        return True

    def _skip_ws(self) -> str:
        """Skips whitespace; returns the next character ('' at end of file) without consuming it."""
        while True:
            buf, n = self.buf, len(self.buf)
            while self.pos < n and buf[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < n:
                return buf[self.pos]
            if not self._refill():
                return ""

    def _expect(self, chars: str) -> str:
        c = self._skip_ws()
        if c == "":
            raise _Truncated(f"it ends where one of {chars!r} was expected")
        if c not in chars:
            raise self._fail(f"expected one of {chars!r}, found {c!r}")
        self.pos += 1
        return c

    def _value(self) -> Any:
        """Decodes the JSON value at the cursor, reading more input until it is complete."""
        if self._skip_ws() == "":
            raise _Truncated("it ends where a value was expected")
        while True:
            try:
                obj, end = _decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as exc:
                if len(self.buf) - self.pos > _MAX_VALUE_CHARS:
                    raise self._fail(f"invalid JSON: {exc.msg}") from None
                if self.eof or not self._refill():
                    # The text runs to the end of the file: a document that was cut, unless it visibly
                    # closes after the damage (then it is corrupt).
                    if self.buf.rstrip().endswith(("]}", "]")):
                        raise self._fail(f"invalid JSON: {exc.msg}") from None
                    raise _Truncated(f"invalid JSON at the end of the file ({exc.msg})") from None
                continue
            # A number ending exactly at the buffer end may continue in the next chunk.
            if end >= len(self.buf) and not self.eof and self._refill():
                continue
            self.pos = end
            return obj

    def document(self, on_event, on_field) -> None:
        """Parses the top-level object: ``on_field(key, value)`` for small fields, ``on_event(ev)``
        for each element of ``traceEvents`` (or of a top-level array). A document that ends early is
        read up to its end and ``truncated`` says why."""
        try:
            self._document(on_event, on_field)
        except _Truncated as exc:
            why = self._gzip.truncated if self._gzip is not None and self._gzip.truncated else str(exc)
            self.truncated = f"{why}, near character {self.position}"

    def _document(self, on_event, on_field) -> None:
        c = self._skip_ws()
        if c == "":
            raise self._fail("the file is empty")
        if c == "[":  # the JSON Array Format: events only
            self._events(on_event)
            return
        self._expect("{")
        if self._skip_ws() == "}":
            self.pos += 1
            return
        while True:
            key = self._value()
            if not isinstance(key, str):
                raise self._fail("expected an object key")
            self._expect(":")
            if key == "traceEvents":
                self._events(on_event)
            else:
                on_field(key, self._value())
            if self._expect(",}") == "}":
                return

    def _events(self, on_event) -> None:
        self._expect("[")
        if self._skip_ws() == "]":
            self.pos += 1
            return
        while True:
            batch = self._batch()
            if batch is None:
                on_event(self._value())
            else:
                for ev in batch:
                    on_event(ev)
            if self._expect(",]") == "]":
                return
            self._skip_ws()

    def _batch(self) -> list | None:
        """Many whole events at once: decodes ``[`` + text up to a ``},`` + ``]`` in one C call.

        The cut is only a guess at an event boundary; it is right exactly when the slice decodes (a cut
        inside an event or a string leaves an unclosed object or string). None: decode one event. When
        three guesses fail (``},`` inside strings), the events up to the first guess are decoded one at
        a time before batches are tried again, so a file full of such strings costs one failed try per
        chunk, not per event.
        """
        if self.pos < self._single_until:
            return None
        if len(self.buf) - self.pos < _CHUNK_CHARS:
            self._refill()
        end = min(len(self.buf), self.pos + _CHUNK_CHARS)
        first = cut = self.buf.rfind("},", self.pos, end)
        for _ in range(3):
            if cut <= self.pos:
                return None
            try:
                batch = _decoder.decode("[" + self.buf[self.pos : cut + 1] + "]")
            except json.JSONDecodeError:
                cut = self.buf.rfind("},", self.pos, cut)
                continue
            self.pos = cut + 1
            return batch
        self._single_until = first
        return None


def _is_gzip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


# --------------------------------------------------------------------------------------------------
# One rank's trace


@dataclasses.dataclass
class RankTrace:
    """What one trace file yields: its step records and its runtime API latencies."""

    path: Path
    rank: int | None  # from distributedInfo; None when the trace has none
    world_size: int | None
    backend: str | None
    hostname: str | None
    pid: int
    device: str  # "cuda" when GPU activity was traced, else "cpu"
    steps: pa.Table  # STEP_SCHEMA; rank/node filled in by import_traces
    events: pa.Table  # EVENT_SCHEMA: collective kernels, memory peaks
    runtime: pa.Table  # RUNTIME_API_SCHEMA
    events_seen: int
    truncated: str | None = None  # why the file ends early (its readable part was imported)
    runtime_calls: tuple[dict[int, str], np.ndarray, np.ndarray] | None = None  # names, name ids, durations (us)


class _Collector:
    """Keeps the few fields the import needs from each event, in typed arrays."""

    def __init__(self) -> None:
        self.fields: dict[str, Any] = {}
        self.n = 0
        self.step_num = array.array("q")
        self.step_ts = array.array("d")
        self.step_dur = array.array("d")
        self.step_tid = array.array("q")
        self.pid = -1
        self.ann_ts = array.array("d")
        self.ann_dur = array.array("d")
        self.ann_tid = array.array("q")
        self.ann_phase = array.array("b")
        self.rt_name = array.array("i")
        self.rt_ts = array.array("d")
        self.rt_dur = array.array("d")
        self.rt_corr = array.array("q")
        self.k_ts = array.array("d")
        self.k_dur = array.array("d")
        self.k_corr = array.array("q")
        self.k_label = array.array("i")
        self.k_elems = array.array("d")
        self.mem_ts = array.array("d")
        self.mem_total = array.array("d")
        self.mem_dev = array.array("i")
        self.h_ts = array.array("d")  # host-side collectives (gloo:*): start, duration, label
        self.h_dur = array.array("d")
        self.h_label = array.array("i")
        self.gpu_seen = False
        self.names: dict[str, int] = {}  # runtime API name -> id
        self.labels: dict[str, int] = {}  # collective label -> id
        self._phase_of: dict[str, int] = {}
        self._tids: dict[Any, int] = {}

    def field(self, key: str, value: Any) -> None:
        if key in _FIELDS:
            self.fields[key] = value

    def _tid(self, tid: Any) -> int:
        if isinstance(tid, int):
            return tid
        got = self._tids.get(tid)
        if got is None:
            got = self._tids[tid] = -(len(self._tids) + 1)
        return got

    def _phase(self, name: str) -> int:
        got = self._phase_of.get(name)
        if got is None:
            got = -1
            for i, rx in enumerate(_PHASE_RES):
                if rx.search(name):
                    got = i
                    break
            if len(self._phase_of) < 100_000:
                self._phase_of[name] = got
        return got

    def event(self, ev: Any) -> None:
        self.n += 1
        if not isinstance(ev, dict):
            return
        ph = ev.get("ph")
        if ph == "X":
            cat = ev.get("cat")
            name = ev.get("name")
            if isinstance(name, str) and name.startswith(_HOST_COLLECTIVE_PREFIXES) and cat != "kernel":
                # gloo runs a collective on its own thread: the annotation spans launch to completion,
                # the wait for the slowest peer included (as an NCCL kernel's duration does)
                try:
                    self.h_ts.append(float(ev["ts"]))
                    self.h_dur.append(float(ev.get("dur", 0.0)))
                except (KeyError, TypeError, ValueError):
                    return
                label = name.split(":", 1)[1]
                lid = self.labels.get(label)
                if lid is None:
                    lid = self.labels[label] = len(self.labels)
                self.h_label.append(lid)
                return
            if cat == "cpu_op" or cat == "python_function":
                # older profilers filed ProfilerStep#N under cpu_op; everything else here is skipped
                name = ev.get("name")
                if not (isinstance(name, str) and name.startswith("ProfilerStep#")):
                    return
            try:
                ts = float(ev["ts"])
                dur = float(ev.get("dur", 0.0))
            except (KeyError, TypeError, ValueError):
                return
            name = ev.get("name", "")
            if cat in _RUNTIME_CATS:
                rid = self.names.get(name)
                if rid is None:
                    rid = self.names[name] = len(self.names)
                self.rt_name.append(rid)
                self.rt_ts.append(ts)
                self.rt_dur.append(dur)
                args = ev.get("args") or {}
                corr = args.get("correlation", -1)
                self.rt_corr.append(corr if isinstance(corr, int) else -1)
                return
            if cat == "kernel" or cat == "Kernel":
                self.gpu_seen = True
                if isinstance(name, str) and name[:4].lower() in _COLLECTIVE_PREFIXES:
                    args = ev.get("args") or {}
                    label = args.get("Collective name") or _collective_label(name)
                    lid = self.labels.get(label)
                    if lid is None:
                        lid = self.labels[label] = len(self.labels)
                    corr = args.get("correlation", -1)
                    elems = args.get("In msg nelems", float("nan"))
                    self.k_ts.append(ts)
                    self.k_dur.append(dur)
                    self.k_corr.append(corr if isinstance(corr, int) else -1)
                    self.k_label.append(lid)
                    self.k_elems.append(float(elems) if isinstance(elems, (int, float)) else float("nan"))
                return
            if cat == "gpu_user_annotation" or cat == "gpu_memcpy" or cat == "gpu_memset":
                self.gpu_seen = True
                return
            if not isinstance(name, str):
                return
            m = _STEP_RE.match(name)
            tid = self._tid(ev.get("tid", 0))
            if m:
                self.step_num.append(int(m.group(1)))
                self.step_ts.append(ts)
                self.step_dur.append(dur)
                self.step_tid.append(tid)
                if self.pid < 0 and isinstance(ev.get("pid"), int):
                    self.pid = ev["pid"]
                return
            if cat == "user_annotation":
                phase = self._phase(name)
                if phase >= 0:
                    self.ann_ts.append(ts)
                    self.ann_dur.append(dur)
                    self.ann_tid.append(tid)
                    self.ann_phase.append(phase)
        elif ph == "i" or ph == "I":
            if ev.get("name") != "[memory]":
                return
            args = ev.get("args") or {}
            if args.get("Device Type") != 1:  # CUDA device memory only
                return
            try:
                self.mem_ts.append(float(ev["ts"]))
                self.mem_total.append(float(args.get("Total Allocated", 0)))
                self.mem_dev.append(int(args.get("Device Id", 0)))
            except (KeyError, TypeError, ValueError):
                return


def _collective_label(kernel: str) -> str:
    # ncclKernel_AllReduce_RING_LL_Sum_float(...) / ncclDevKernel_AllGather_RING_LL(...) -> AllReduce
    base = kernel.split("(", 1)[0]
    parts = base.split("_")
    return parts[1] if len(parts) > 1 else base


def scan_trace(path: str | os.PathLike) -> RankTrace:
    """Reads one torch.profiler trace file (streaming) into step records and runtime API latencies.

    Raises ``KinetoTraceError`` (naming the file) for a missing, truncated, corrupt or step-less trace.
    """
    p = Path(path)
    if not p.is_file():
        raise KinetoTraceError(f"{p}: no such trace file; pass torch.profiler .json or .json.gz files")
    col = _Collector()
    try:
        reader = _Reader(p)
    except OSError as exc:
        raise KinetoTraceError(f"{p}: cannot open ({exc})") from None
    try:
        reader.document(col.event, col.field)
    finally:
        reader.close()
    if not col.step_num:
        if reader.truncated:
            raise KinetoTraceError(
                f"{p}: the trace is truncated ({reader.truncated}) before any ProfilerStep#N; "
                "export it again (torch.profiler export_chrome_trace) or leave it out"
            )
        raise KinetoTraceError(
            f"{p}: no ProfilerStep#N annotations among {col.n} events; record the trace with "
            "torch.profiler.profile(schedule=...) and call prof.step() once per training step"
        )
    trace = _build(p, col)
    trace.truncated = reader.truncated
    return trace


def _np(a: array.array, dtype) -> np.ndarray:
    return np.frombuffer(a, dtype=dtype) if len(a) else np.empty(0, dtype=dtype)


def _build(path: Path, col: _Collector) -> RankTrace:
    info = col.fields.get("distributedInfo") or {}
    if not isinstance(info, dict):
        info = {}
    rank = info.get("rank") if isinstance(info.get("rank"), int) else None
    world = info.get("world_size") if isinstance(info.get("world_size"), int) else None
    backend = info.get("backend") if isinstance(info.get("backend"), str) else None
    host = col.fields.get("host_name") or col.fields.get("hostname")
    base_ns = col.fields.get("baseTimeNanoseconds")
    base_ns = int(base_ns) if isinstance(base_ns, (int, float)) else 0

    s_num = _np(col.step_num, np.int64)
    s_ts = _np(col.step_ts, np.float64)
    s_dur = _np(col.step_dur, np.float64)
    s_tid = _np(col.step_tid, np.int64)
    order = np.argsort(s_ts, kind="stable")
    s_num, s_ts, s_dur, s_tid = s_num[order], s_ts[order], s_dur[order], s_tid[order]
    # A step repeated (several profiling windows in one file) keeps its first occurrence.
    _, first = np.unique(s_num, return_index=True)
    keep = np.sort(first)
    s_num, s_ts, s_dur, s_tid = s_num[keep], s_ts[keep], s_dur[keep], s_tid[keep]
    s_end = s_ts + s_dur
    n = len(s_num)

    def step_of(ts: np.ndarray) -> np.ndarray:
        """Index of the step whose [start, end) holds each timestamp, -1 if none."""
        idx = np.searchsorted(s_ts, ts, side="right") - 1
        ok = idx >= 0
        ok[ok] &= ts[ok] < s_end[idx[ok]]
        return np.where(ok, idx, -1)

    # Phases: innermost matching annotation on the step's thread, clipped to the step.
    phase_ns = np.zeros((len(PHASE_PATTERNS), n), dtype=np.float64)
    a_ts, a_dur = _np(col.ann_ts, np.float64), _np(col.ann_dur, np.float64)
    a_tid, a_ph = _np(col.ann_tid, np.int64), _np(col.ann_phase, np.int8)
    if len(a_ts):
        a_step = step_of(a_ts)
        sel = a_step >= 0
        sel[sel] &= a_tid[sel] == s_tid[a_step[sel]]
        a_step, a_ts, a_end, a_ph = a_step[sel], a_ts[sel], (a_ts + a_dur)[sel], a_ph[sel]
        order = np.argsort(a_step, kind="stable")
        a_step, a_ts, a_end, a_ph = a_step[order], a_ts[order], a_end[order], a_ph[order]
        bounds = np.searchsorted(a_step, np.arange(n + 1))
        for i in range(n):
            lo, hi = bounds[i], bounds[i + 1]
            if lo == hi:
                continue
            _phase_sweep(s_ts[i], s_end[i], a_ts[lo:hi], a_end[lo:hi], a_ph[lo:hi], phase_ns[:, i])

    # Runtime calls: per-step launch latency, host syncs, device allocations.
    r_name = _np(col.rt_name, np.int32)
    r_ts, r_dur = _np(col.rt_ts, np.float64), _np(col.rt_dur, np.float64)
    r_corr = _np(col.rt_corr, np.int64)
    names = {v: k for k, v in col.names.items()}
    launch_ns = np.full(n, np.nan)
    host_syncs = np.zeros(n, dtype=np.int64)
    device_allocs = np.zeros(n, dtype=np.int64)
    if len(r_ts):
        r_step = step_of(r_ts)
        is_launch = np.isin(r_name, [i for i, nm in names.items() if nm in _LAUNCH_APIS])
        is_sync = np.isin(r_name, [i for i, nm in names.items() if nm in _SYNC_APIS])
        is_malloc = np.isin(r_name, [i for i, nm in names.items() if nm in _MALLOC_APIS])
        inside = r_step >= 0
        host_syncs = np.bincount(r_step[inside & is_sync], minlength=n)[:n].astype(np.int64)
        device_allocs = np.bincount(r_step[inside & is_malloc], minlength=n)[:n].astype(np.int64)
        lsel = inside & is_launch
        if lsel.any():
            ls, ld = r_step[lsel], r_dur[lsel]
            order = np.lexsort((ld, ls))
            ls, ld = ls[order], ld[order]
            b = np.searchsorted(ls, np.arange(n + 1))
            for i in range(n):
                if b[i + 1] > b[i]:
                    launch_ns[i] = float(np.median(ld[b[i] : b[i + 1]])) * 1e3

    # Collective kernels: a step owns the kernels it launched (correlation id), else those that start
    # inside it on the GPU timeline.
    k_ts, k_dur = _np(col.k_ts, np.float64), _np(col.k_dur, np.float64)
    k_corr, k_label = _np(col.k_corr, np.int64), _np(col.k_label, np.int32)
    k_elems = _np(col.k_elems, np.float64)
    k_step = step_of(k_ts) if len(k_ts) else np.empty(0, dtype=np.int64)
    if len(k_ts) and len(r_corr):
        c_order = np.argsort(r_corr)
        sorted_corr = r_corr[c_order]
        pos = np.clip(np.searchsorted(sorted_corr, k_corr), 0, len(sorted_corr) - 1)
        hit = (sorted_corr[pos] == k_corr) & (k_corr >= 0)
        launch_step = step_of(r_ts[c_order[pos]])
        k_step = np.where(hit & (launch_step >= 0), launch_step, k_step)
    comm_ns = np.zeros(n)
    if len(k_ts):
        sel = k_step >= 0
        comm_ns = np.bincount(k_step[sel], weights=k_dur[sel], minlength=n)[:n] * 1e3
    h_ts, h_dur = _np(col.h_ts, np.float64), _np(col.h_dur, np.float64)
    h_label = _np(col.h_label, np.int32)
    has_host_comm = bool(len(h_ts)) and not len(k_ts)
    if has_host_comm:
        # Host collectives (gloo) of a step: the union of their spans from the step's start to its end
        # (buckets overlap one another; the part outside the step belongs to no step).
        comm_ns = _union_per_step(s_ts, s_end, h_ts, h_ts + h_dur) * 1e3

    step_ns = s_dur * 1e3
    cpu_phase_total = phase_ns.sum(axis=0) * 1e3
    has_phases = bool(len(a_ts))
    has_gpu = col.gpu_seen or len(r_ts) > 0

    def col_i64(values: np.ndarray, valid: np.ndarray | bool = True) -> pa.Array:
        v = np.rint(values).astype(np.int64)
        mask = ~np.broadcast_to(np.asarray(valid, dtype=bool), v.shape)
        return pa.array(v, type=pa.int64(), mask=mask)

    cols: dict[str, pa.Array] = {
        "rank": pa.array(np.zeros(n, dtype=np.int32)),
        "node": pa.array(np.zeros(n, dtype=np.int32)),
        "step": pa.array(s_num),
        "t_start_ns": pa.array(_wall_ns(base_ns, s_ts)),
        "step_ns": col_i64(step_ns),
        # Without visible collectives a multi-rank step cannot be split into work and wait.
        "self_ns": col_i64(np.maximum(step_ns - comm_ns, 0.0), has_gpu or has_host_comm or (world or 1) <= 1),
    }
    for name in ("data", "h2d", "forward", "backward", "optimizer"):
        cols[f"{name}_ns"] = col_i64(phase_ns[_PHASE_IDS[name]] * 1e3, has_phases)
    cols["comm_wait_ns"] = col_i64(comm_ns, has_gpu or has_host_comm)
    cols["other_ns"] = col_i64(np.maximum(step_ns - cpu_phase_total, 0.0), has_phases)
    cols["launch_ns"] = col_i64(np.nan_to_num(launch_ns), ~np.isnan(launch_ns))
    cols["host_syncs"] = col_i64(host_syncs, has_gpu)
    cols["device_allocs"] = col_i64(device_allocs, has_gpu)
    steps = pa.table(
        {f.name: cols.get(f.name, pa.nulls(n, type=f.type)) for f in STEP_SCHEMA}, schema=STEP_SCHEMA
    )

    if has_host_comm:  # the host collectives become the collective events
        k_ts, k_dur, k_label = h_ts, h_dur, h_label
        k_step, k_elems = step_of(h_ts), np.full(len(h_ts), np.nan)
    events = _events_table(col, base_ns, k_ts, k_dur, k_step, k_label, k_elems, s_num, step_of)
    runtime = _runtime_table(r_name, r_dur, names)
    return RankTrace(
        path=path,
        rank=rank,
        world_size=world,
        backend=backend,
        hostname=host if isinstance(host, str) else None,
        pid=col.pid,
        device="cuda" if has_gpu else "cpu",
        steps=steps,
        events=events,
        runtime=runtime,
        events_seen=col.n,
        runtime_calls=(names, r_name, r_dur),
    )


def _union_per_step(s_ts: np.ndarray, s_end: np.ndarray, c_ts: np.ndarray, c_end: np.ndarray) -> np.ndarray:
    """Per step, the length (us) of the union of the intervals clipped to [start, end) of the step."""
    out = np.zeros(len(s_ts))
    order = np.argsort(c_ts, kind="stable")
    c_ts, c_end = c_ts[order], c_end[order]
    for i in range(len(s_ts)):
        sel = (c_end > s_ts[i]) & (c_ts < s_end[i])
        if not sel.any():
            continue
        a = np.clip(c_ts[sel], s_ts[i], s_end[i])
        b = np.clip(c_end[sel], s_ts[i], s_end[i])
        total, cur_a, cur_b = 0.0, a[0], b[0]
        for x, y in zip(a[1:].tolist(), b[1:].tolist(), strict=True):
            if x > cur_b:
                total += cur_b - cur_a
                cur_a, cur_b = x, y
            else:
                cur_b = max(cur_b, y)
        out[i] = total + (cur_b - cur_a)
    return out


def _wall_ns(base_ns: int, ts_us: np.ndarray) -> np.ndarray:
    """Trace timestamps (µs, float) as integer wall-clock ns without float64 rounding at 1e18."""
    whole = np.floor(ts_us)
    return base_ns + whole.astype(np.int64) * 1000 + np.rint((ts_us - whole) * 1e3).astype(np.int64)


def _phase_sweep(t0, t1, starts, ends, phases, out) -> None:
    """Adds to ``out[phase]`` the time (µs) of [t0, t1) whose innermost covering annotation has that
    phase. Annotations on one thread nest, so the innermost is the latest-starting one that covers."""
    starts = np.clip(starts, t0, t1)
    ends = np.clip(ends, t0, t1)
    edges = np.unique(np.concatenate(([t0, t1], starts, ends)))
    mids = (edges[:-1] + edges[1:]) * 0.5
    widths = np.diff(edges)
    cover = (starts[None, :] <= mids[:, None]) & (ends[None, :] > mids[:, None])
    any_cover = cover.any(axis=1)
    if not any_cover.any():
        return
    innermost = np.argmax(np.where(cover, starts[None, :], -np.inf), axis=1)
    np.add.at(out, phases[innermost[any_cover]], widths[any_cover])


def _events_table(col, base_ns, k_ts, k_dur, k_step, k_label, k_elems, s_num, step_of) -> pa.Table:
    labels = {v: k for k, v in col.labels.items()}
    parts = []
    if len(k_ts):
        step = np.where(k_step >= 0, s_num[np.maximum(k_step, 0)], -1)
        parts.append(
            {
                "step": pa.array(step, mask=k_step < 0),
                "t_ns": pa.array(_wall_ns(base_ns, k_ts)),
                "kind": pa.array(np.full(len(k_ts), "collective", dtype=object), type=pa.string()),
                "duration_ns": pa.array(np.rint(k_dur * 1e3).astype(np.int64)),
                "value": pa.array(k_elems, mask=np.isnan(k_elems)),
                "detail": pa.array([labels[i] for i in k_label.tolist()], type=pa.string()),
            }
        )
    m_ts = _np(col.mem_ts, np.float64)
    if len(m_ts):
        # Peak allocated device memory per step and device, from the profiler's memory events.
        m_total, m_dev = _np(col.mem_total, np.float64), _np(col.mem_dev, np.int32)
        m_step = step_of(m_ts)
        sel = m_step >= 0
        if sel.any():
            key = m_step[sel].astype(np.int64) * 1024 + m_dev[sel]
            uniq, inv = np.unique(key, return_inverse=True)
            peak = np.full(len(uniq), -np.inf)
            np.maximum.at(peak, inv, m_total[sel])
            first_ts = np.full(len(uniq), np.inf)
            np.minimum.at(first_ts, inv, m_ts[sel])
            idx = uniq // 1024
            parts.append(
                {
                    "step": pa.array(s_num[idx]),
                    "t_ns": pa.array(_wall_ns(base_ns, first_ts)),
                    "kind": pa.array(np.full(len(uniq), "memory_peak", dtype=object), type=pa.string()),
                    "duration_ns": pa.nulls(len(uniq), pa.int64()),
                    "value": pa.array(peak),
                    "detail": pa.array([f"cuda:{d}" for d in (uniq % 1024).tolist()], type=pa.string()),
                }
            )
    tables = []
    for part in parts:
        m = len(part["step"])
        part = {"rank": pa.array(np.zeros(m, dtype=np.int32)), **part}
        tables.append(pa.table(part).cast(EVENT_SCHEMA))
    if not tables:
        return EVENT_SCHEMA.empty_table()
    return pa.concat_tables(tables)


def _runtime_table(r_name: np.ndarray, r_dur: np.ndarray, names: dict[int, str]) -> pa.Table:
    rows: dict[str, list] = {k: [] for k in RUNTIME_API_SCHEMA.names}
    if len(r_name):
        order = np.lexsort((r_dur, r_name))
        sn, sd = r_name[order], r_dur[order] * 1e3
        b = np.searchsorted(sn, np.arange(len(names) + 1))
        for i in range(len(names)):
            d = sd[b[i] : b[i + 1]]
            if not len(d):
                continue
            rows["rank"].append(0)
            rows["api"].append(names[i])
            rows["calls"].append(len(d))
            rows["median_ns"].append(float(np.median(d)))
            rows["p99_ns"].append(float(np.quantile(d, 0.99)))
            rows["max_ns"].append(float(d[-1]))
            rows["total_ns"].append(float(d.sum()))
    return pa.table(rows, schema=RUNTIME_API_SCHEMA)


# --------------------------------------------------------------------------------------------------
# Cross-rank outlier test on runtime API latency (docs/detection.md, "Runtime API latency")

MIN_RANKS = DetectionOptions().min_ranks  # the cross-rank test needs this many ranks (the analysis' own)


def runtime_api_outliers(
    runtime: pa.Table, metric: str = "median_ns", opts: DetectionOptions | None = None
) -> pa.Table:
    """The runtime API table with, per API, the analysis' cross-rank outlier test on ``metric``
    (``stragglers.cross_rank_outliers``: modified z and the other ranks' Tukey fence, at least
    ``min_slowdown`` and ``launch_floor_ns`` above the median, with the same ``DetectionOptions``).
    Adds ``z``, ``excess`` (ratio to the cross-rank median, minus 1), ``outlier`` and ``judged`` (False
    where fewer than ``min_ranks`` ranks called the API: not tested)."""
    from hyperacc.analysis.stragglers import cross_rank_outliers

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


# --------------------------------------------------------------------------------------------------
# Import into a run directory


@dataclasses.dataclass
class ImportResult:
    run_dir: Path
    ranks: dict[int, Path]  # rank -> trace file imported
    errors: list[tuple[Path, str]]  # files that could not be imported, and why
    runtime: pa.Table  # RUNTIME_API_SCHEMA, every imported rank
    steps: int  # step records written
    events_seen: int
    warnings: list[str] = dataclasses.field(default_factory=list)  # imported, but worth a look


def find_traces(inputs: Sequence[str | os.PathLike]) -> list[Path]:
    """Trace files named directly or found (non-recursively) in the given directories."""
    found: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found += sorted(
                q for q in p.iterdir() if q.is_file() and (q.name.endswith(".json") or q.name.endswith(".json.gz"))
            )
        else:
            found.append(p)
    return found


_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)


def import_traces(
    inputs: Sequence[str | os.PathLike],
    run_dir: str | os.PathLike,
    *,
    ranks_per_node: int | None = None,
    progress=None,
) -> ImportResult:
    """Imports one trace per rank into ``run_dir`` (which must not already hold step records).

    Rank: ``distributedInfo.rank``, else ``rank<N>`` in the file name, else the file's position.
    Node: ``rank // ranks_per_node`` when given, else one node per distinct ``host_name`` (ordered by
    lowest rank), else 0. Files that fail are listed in ``errors``; the others are imported.
    """
    out = Path(run_dir)
    if (out / "steps").is_dir() and any((out / "steps").iterdir()):
        raise KinetoTraceError(f"{out} already holds step records; pass a new --run-dir for the import")
    files = find_traces(inputs)
    if not files:
        raise KinetoTraceError(f"no trace files (.json or .json.gz) in {', '.join(map(str, inputs))}")
    traces: list[RankTrace] = []
    errors: list[tuple[Path, str]] = []
    events_seen = 0
    for f in files:
        try:
            tr = scan_trace(f)
        except KinetoTraceError as exc:
            errors.append((f, str(exc)))
        else:
            traces.append(tr)
            events_seen += tr.events_seen
        if progress is not None:
            progress(f)

    claims: dict[int, list[RankTrace]] = {}
    for pos, tr in enumerate(traces):
        rank = tr.rank
        if rank is None:
            m = _RANK_IN_NAME.search(tr.path.name)
            rank = int(m.group(1)) if m else pos
        claims.setdefault(rank, []).append(tr)
    if not claims:
        detail = "; ".join(msg for _, msg in errors)
        raise KinetoTraceError(f"no trace could be imported: {detail}")
    _one_job(claims)
    warnings: list[str] = []
    ranks: dict[int, RankTrace] = {}
    for rank, group in sorted(claims.items()):
        merged, refused = _merge_windows(rank, group)
        ranks[rank] = merged
        errors += refused
        if len(group) - len(refused) > 1:
            warnings.append(
                f"rank {rank}: {len(group) - len(refused)} profiling windows ("
                + ", ".join(tr.path.name for tr in group if all(tr.path != p for p, _ in refused))
                + ") imported as one rank"
            )
    for tr in ranks.values():
        if tr.truncated:
            warnings.append(f"{tr.path}: truncated ({tr.truncated}); its {tr.steps.num_rows} complete steps were imported")
    warnings += _time_overlap(ranks)
    world = max([tr.world_size or 0 for tr in ranks.values()] + [max(ranks) + 1])
    nodes = _nodes(ranks, ranks_per_node)
    local: dict[int, list[int]] = {}
    for r in sorted(ranks):
        local.setdefault(nodes[r], []).append(r)

    out.mkdir(parents=True, exist_ok=True)
    runtime_parts = []
    written = 0
    for r in sorted(ranks):
        tr = ranks[r]
        node = nodes[r]
        n = tr.steps.num_rows
        steps = tr.steps.set_column(0, "rank", pa.array(np.full(n, r, dtype=np.int32)))
        steps = steps.set_column(1, "node", pa.array(np.full(n, node, dtype=np.int32)))
        step_writer(out, r).write(steps)
        written += n
        if tr.events.num_rows:
            ev = tr.events.set_column(0, "rank", pa.array(np.full(tr.events.num_rows, r, dtype=np.int32)))
            event_writer(out, r).write(ev)
        runtime_parts.append(
            tr.runtime.set_column(0, "rank", pa.array(np.full(tr.runtime.num_rows, r, dtype=np.int32)))
        )
        write_meta(
            out,
            RankMeta(
                rank=r,
                local_rank=local[node].index(r),
                node=node,
                world_size=world,
                local_world_size=len(local[node]),
                hostname=tr.hostname or "unknown",
                pid=tr.pid,
                backend=tr.backend or "unknown",
                device=tr.device,
                source="kineto",
            ),
        )
    runtime = pa.concat_tables(runtime_parts) if runtime_parts else RUNTIME_API_SCHEMA.empty_table()
    kdir = out / KINETO_DIR
    kdir.mkdir(exist_ok=True)
    pq.write_table(runtime, kdir / RUNTIME_API_FILE)
    report = {
        "ranks": {str(r): str(ranks[r].path) for r in sorted(ranks)},
        "errors": [{"file": str(p), "error": msg} for p, msg in errors],
        "warnings": warnings,
        "world_size": world,
    }
    (kdir / IMPORT_REPORT_FILE).write_text(json.dumps(report, indent=1))
    return ImportResult(
        run_dir=out,
        ranks={r: ranks[r].path for r in sorted(ranks)},
        errors=errors,
        runtime=runtime,
        steps=written,
        events_seen=events_seen,
        warnings=warnings,
    )


def _one_job(claims: dict[int, list[RankTrace]]) -> None:
    """Traces of different jobs must not be analysed as one: their world sizes must agree."""
    sizes: dict[int, list[str]] = {}
    for group in claims.values():
        for tr in group:
            if tr.world_size is not None:
                sizes.setdefault(tr.world_size, []).append(tr.path.name)
    if len(sizes) > 1:
        detail = "; ".join(f"world size {w} in {', '.join(names[:3])}" + (" ..." if len(names) > 3 else "")
                           for w, names in sorted(sizes.items()))  # fmt: skip
        raise KinetoTraceError(
            f"the traces come from different jobs ({detail}); pass the traces of one job (one per rank)"
        )


def _merge_windows(rank: int, group: list[RankTrace]) -> tuple[RankTrace, list[tuple[Path, str]]]:
    """One rank's trace files: several profiling windows (``tensorboard_trace_handler`` writes one file
    per window) become one rank; a file whose steps repeat steps already taken is refused."""
    kept = [group[0]]
    refused: list[tuple[Path, str]] = []
    seen = set(group[0].steps.column("step").to_pylist())
    for tr in group[1:]:
        steps = set(tr.steps.column("step").to_pylist())
        if steps & seen:
            refused.append((tr.path, f"{tr.path}: rank {rank} is also claimed by {kept[0].path} with the same steps; "
                                     "pass one trace per rank and profiling window"))  # fmt: skip
            continue
        kept.append(tr)
        seen |= steps
    if len(kept) == 1:
        return kept[0], refused
    kept.sort(key=lambda t: t.steps.column("step")[0].as_py())
    names: dict[str, int] = {}
    ids, durs = [], []
    for tr in kept:
        if tr.runtime_calls is None:
            continue
        tnames, tid, tdur = tr.runtime_calls
        remap = np.array([names.setdefault(tnames[i], len(names)) for i in range(len(tnames))], dtype=np.int32)
        ids.append(remap[tid] if len(tid) else tid)
        durs.append(tdur)
    all_ids = np.concatenate(ids) if ids else np.empty(0, dtype=np.int32)
    all_durs = np.concatenate(durs) if durs else np.empty(0)
    by_id = {v: k for k, v in names.items()}
    first = kept[0]
    merged = dataclasses.replace(
        first,
        steps=pa.concat_tables([t.steps for t in kept]),
        events=pa.concat_tables([t.events for t in kept]),
        runtime=_runtime_table(all_ids, all_durs, by_id),
        events_seen=sum(t.events_seen for t in kept),
        truncated="; ".join(t.truncated for t in kept if t.truncated) or None,
        runtime_calls=(by_id, all_ids, all_durs),
    )
    return merged, refused


def _time_overlap(ranks: dict[int, RankTrace]) -> list[str]:
    """A rank whose steps overlap no other rank's in wall-clock time was probably recorded in another
    job (or another day): said, not refused (clocks of different hosts can disagree)."""
    spans = {}
    for r, tr in ranks.items():
        t0 = tr.steps.column("t_start_ns").to_numpy(zero_copy_only=False)
        dur = tr.steps.column("step_ns").cast(pa.float64()).to_numpy(zero_copy_only=False)
        if len(t0) and np.isfinite(dur).any():
            spans[r] = (float(t0.min()), float(np.nanmax(t0 + np.nan_to_num(dur))))
    if len(spans) < 2:
        return []
    out = []
    for r, (a, b) in sorted(spans.items()):
        others = [(c, d) for q, (c, d) in spans.items() if q != r]
        if not any(c <= b and a <= d for c, d in others):
            day = _dt.datetime.fromtimestamp(a / 1e9, tz=_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
            out.append(
                f"rank {r} ({ranks[r].path.name}): its steps ({day}) overlap no other rank's in time; "
                "were these traces recorded in one job?"
            )
    return out


def _nodes(ranks: dict[int, RankTrace], ranks_per_node: int | None) -> dict[int, int]:
    if ranks_per_node:
        return {r: r // ranks_per_node for r in ranks}
    hosts: dict[str, int] = {}
    out = {}
    for r in sorted(ranks):
        h = ranks[r].hostname
        if h is None:
            out[r] = 0
            continue
        if h not in hosts:
            hosts[h] = len(hosts)
        out[r] = hosts[h]
    return out


def read_runtime_api(run_dir: str | os.PathLike) -> pa.Table | None:
    """The runtime API latency table an import left in ``run_dir``, or None."""
    path = Path(run_dir) / KINETO_DIR / RUNTIME_API_FILE
    if not path.is_file():
        return None
    return pq.read_table(path)

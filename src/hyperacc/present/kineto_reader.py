"""The streaming reader of Kineto trace files: ``traceEvents`` decoded a chunk at a time from ``.json``
or ``.json.gz`` (a truncated file read up to where it ends). Used by ``kineto_trace.scan_trace``."""

from __future__ import annotations

import io
import json
import zlib
from pathlib import Path
from typing import Any

_CHUNK_CHARS = 1 << 20

_MAX_VALUE_CHARS = 256 << 20  # a single JSON value (one event, INFO list, ...) larger than this is corrupt

_decoder = json.JSONDecoder()


class KinetoTraceError(ValueError):
    """A trace file that cannot be imported; the message names the file and what to do."""


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

"""Straggler detection while training runs, over the window summaries that reach the analyzer rank.

Pure: ``LiveDetector.update(window_table)`` takes the newest window rows (``windows.summarize_windows``
through ``windows.WindowStream``, in WINDOW_SCHEMA plus its extra columns) and returns one-line
messages for what it newly confirms (a straggler, a change of its kind, a straggler that recovered, a
rank whose spikes of one cause stand out from the other ranks').
The caller (the tracer's background thread on rank 0) logs them, and reports ranks whose summaries
are late itself; a rank without a summary is simply not judged in that window. It applies the same rules as ``hyperacc analyze`` (docs/detection.md) to a bounded history of
windows, so memory does not grow with the length of the run.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from hyperacc.analysis.diagnosis import basis_phrase, excess_noun, excess_phrase, kind_word, metric_phrase
from hyperacc.analysis.excess import RankExcess, excess_from_windows
from hyperacc.analysis.options import DetectionOptions
from hyperacc.analysis.outliers import window_grid
from hyperacc.analysis.stragglers import Straggler, detect_stragglers
from hyperacc.analysis.windows import EXTRA_WINDOW_COLUMNS, RANK_CAUSES
from hyperacc.schema import fields

if TYPE_CHECKING:
    import pyarrow as pa

_WINDOW_NAMES = tuple(f[0] for f in fields("WINDOW_SCHEMA"))

_REQUIRED = ("rank", "node", "window", "first_step", "last_step", "steps")


class LiveDetector:
    """Confirms stragglers from streaming window summaries; remembers what it already said."""

    def __init__(self, world_size: int, nodes: int, *, recovered: Callable[[int, int], bool] | None = None,
                 beside: Callable[[], Sequence[Mapping[str, Any]]] | None = None, **options: Any) -> None:  # fmt: skip
        if world_size < 1 or nodes < 1:
            raise ValueError(f"world_size and nodes must be >= 1 (got {world_size}, {nodes})")
        self.world_size = int(world_size)
        self.nodes = int(nodes)
        # ``recovered(rank, since_step)``: the live episodes saw that rank back from a slowdown that began
        # with the straggler (offline: ``episodes.recovered_stragglers``); not said, as offline
        self.recovered = recovered or (lambda rank, since_step: False)
        # ``beside()``: the episodes the live episodes said ended, each rank's latest (``rank``,
        # ``since_step``, ``until_step``, ``active``); a straggler is judged without the windows of one
        # listed beside it (offline: ``episodes.stragglers_beside_episodes``)
        self.beside = beside
        self.opts = DetectionOptions.from_mapping(options)
        self.keep_windows = max(2 * self.opts.persist_n, 10)
        self._history: dict[str, np.ndarray] = {}
        self._parts: list[dict[str, np.ndarray]] = []  # the updates the history is made of, oldest first
        self._reported: dict[int, str] = {}  # rank -> kind already announced
        # (rank, cause) of rank-specific spikes said, and for how many updates in a row each was not found
        self._excess_reported: dict[tuple[int, str], RankExcess] = {}
        self._excess_absent: dict[tuple[int, str], int] = {}
        self._active: list[Straggler] = []

    @property
    def confirmed(self) -> dict[int, str]:
        """Ranks currently confirmed as stragglers, with their kind."""
        return dict(self._reported)

    @property
    def active_stragglers(self) -> list[Straggler]:
        """The stragglers active in the newest judged window (what ``update`` last saw), rank order."""
        return list(self._active)

    @property
    def history(self) -> dict[str, np.ndarray]:
        """The recent windows judged (at most ``keep_windows``), as columns; a copy."""
        return {k: v.copy() for k, v in self._history.items()}

    def update(self, window_table: pa.Table | Mapping[str, np.ndarray]) -> list[str]:
        """Judge the newest windows: a WINDOW_SCHEMA table, or the same as numpy columns
        (``windows.rows_columns``: what rank 0's aggregation passes, without loading pyarrow)."""
        cols = _to_columns(window_table)
        if cols["rank"].size == 0:
            return []
        self._append(cols)
        messages: list[str] = []
        grid = window_grid(self._history, self.opts)
        found = detect_stragglers(grid, self.opts)
        if self.beside is not None and any(s.active for s in found):
            from hyperacc.analysis.episodes import stragglers_beside_episodes

            found = stragglers_beside_episodes(found, self.beside(), grid, self.opts)
        active = {s.rank: s for s in found if s.active and not self.recovered(s.rank, s.since_step)}
        self._active = [active[r] for r in sorted(active)]
        for rank in sorted(active):
            s = active[rank]
            before = self._reported.get(rank)
            if before != s.kind:
                messages.append(_straggler_line(s, before))
                self._reported[rank] = s.kind
        newest = self._history["window"].max()
        reporting = set(self._history["rank"][self._history["window"] == newest].tolist())
        for rank in sorted(set(self._reported) - set(active)):
            del self._reported[rank]
            if rank in reporting:  # a rank that stopped reporting did not recover; it is just not judged
                messages.append(f"rank {rank} is no longer a straggler")
        current = {(e.rank, e.cause): e for e in excess_from_windows(self._history, RANK_CAUSES, self.opts)}
        for key in sorted(set(current) - set(self._excess_reported)):
            messages.append(_excess_line(current[key]))
        self._excess_reported.update(current)
        # A rank-specific cause said before and not found over the recent windows in ``persist_n`` updates in
        # a row is said to be over, as a straggler's is: the live view keeps a rank's latest line, which must
        # not stay a claim the windows no longer hold (a rank's loader starved over its first 140 steps, not
        # after). Not at the first update without it: a GC culprit of a recorded run dropped out of the
        # history for one window and came back, and was said again each time.
        for key in sorted(set(self._excess_reported) - set(current)):
            self._excess_absent[key] = absent = self._excess_absent.get(key, 0) + 1
            if absent >= self.opts.persist_n:
                gone = self._excess_reported.pop(key)
                del self._excess_absent[key]
                if key[0] in reporting:
                    messages.append(_excess_over_line(gone))
        for key in current:
            self._excess_absent.pop(key, None)
        return messages

    def _append(self, cols: dict[str, np.ndarray]) -> None:
        # The history is the kept updates' columns concatenated: an update older than the kept windows is
        # dropped whole, so a new window costs one concatenation and no masking copy (about 7 ms a window
        # at 4,096 ranks); only an update that straddles the edge is masked.
        parts = [*self._parts, cols]
        newest = max(int(p["window"].max()) for p in parts)
        edge = newest - self.keep_windows  # windows up to here are dropped
        parts = [p for p in parts if int(p["window"].max()) > edge]
        names = [k for k in cols if all(k in p for p in parts)]
        merged = {k: np.concatenate([p[k] for p in parts]) if len(parts) > 1 else parts[0][k] for k in names}
        if int(merged["window"].min()) <= edge:
            keep = merged["window"] > edge
            merged = {k: v[keep] for k, v in merged.items()}
        self._parts = parts
        self._history = merged


def _straggler_line(s: Straggler, before: str | None) -> str:
    what = f"{kind_word(s.kind)} straggler" if s.kind != "node" else f"straggler on slow node {s.node}"
    ratio = f"{s.slowdown:.2f}x" if s.slowdown is not None else "far above"
    # a slow node's ranks against the other nodes' (half the ranks slow move the cluster median itself)
    versus = "the cluster median"
    if s.kind == "node" and s.node_ratio is not None:
        ratio, versus = f"{s.node_ratio:.2f}x", "the other nodes'"
    line = (
        f"rank {s.rank} (node {s.node}) is a {what}: {metric_phrase(s.to_dict())} {ratio} "
        f"{versus} in {s.windows_flagged} of {s.windows_seen} recent windows, since step {s.since_step}"
    )
    if before is not None:
        line += f" (was: {before})"
    if s.comm_wait_ns is not None and s.cluster_comm_wait_ns is not None:
        line += (
            f"; it waits {s.comm_wait_ns / 1e6:.3g} ms in the collective vs {s.cluster_comm_wait_ns / 1e6:.3g} ms "
            "for the median rank (the others are victims)"
        )
    basis = basis_phrase(s.to_dict())
    if basis:
        line += f"; {basis}"
    return line


def _excess_line(e: RankExcess) -> str:
    return (
        f"{excess_phrase(e.to_dict())} over the recent windows ({e.spikes} spikes in {e.steps} steps); "
        "the other ranks' spikes are a floor they share"
    )


def _excess_over_line(e: RankExcess) -> str:
    return f"rank {e.rank} (node {e.node}) no longer has more {excess_noun(e.cause)} than the other ranks over the recent windows"


def _to_columns(table: pa.Table | Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    pa = sys.modules.get("pyarrow")
    if isinstance(table, Mapping):
        return _mapping_columns(table)
    if pa is None or not isinstance(table, pa.Table):
        raise TypeError(
            "LiveDetector.update takes a pyarrow Table in WINDOW_SCHEMA, or its columns as a mapping "
            f"(got {type(table).__name__})"
        )
    missing = [c for c in _REQUIRED if c not in table.column_names]
    if missing:
        raise ValueError(
            f"window table lacks column(s) {missing}; it must follow hyperacc.schema.WINDOW_SCHEMA"
        )
    out: dict[str, np.ndarray] = {}
    names = set(table.column_names)
    extras = [c for c in EXTRA_WINDOW_COLUMNS if c in names]
    for name in list(_WINDOW_NAMES) + extras:
        if name not in names:
            out[name] = np.full(table.num_rows, np.nan)
            continue
        col = table.column(name)
        if name in _REQUIRED:
            out[name] = col.to_numpy(zero_copy_only=False).astype(np.int64)
        else:
            out[name] = col.cast(pa.float64()).to_numpy(zero_copy_only=False)
    return out


def _mapping_columns(cols: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    missing = [c for c in _REQUIRED if c not in cols]
    if missing:
        raise ValueError(f"window columns lack {missing}; they must follow hyperacc.schema.WINDOW_SCHEMA")
    n = len(cols["rank"])
    out: dict[str, np.ndarray] = {}
    for name in list(_WINDOW_NAMES) + [c for c in EXTRA_WINDOW_COLUMNS if c in cols]:
        if name not in cols:
            out[name] = np.full(n, np.nan)
        elif name in _REQUIRED:
            out[name] = np.asarray(cols[name]).astype(np.int64)
        else:
            out[name] = np.asarray(cols[name], dtype=np.float64)
    return out

"""Import torch.profiler (Kineto) traces into a run directory, and measure CUDA runtime API latency.

The import lives here; its parts are siblings: ``kineto_reader`` (the streaming file reader),
``kineto_collector`` (what is kept of each event), ``kineto_trace`` (one rank's trace turned into step
records: ``scan_trace``) and ``kineto_outliers`` (the cross-rank test on runtime API latency).

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

import dataclasses
import datetime as _dt
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hyperacc.present.kineto_collector import PHASE_PATTERNS
from hyperacc.present.kineto_outliers import MIN_RANKS, runtime_api_outliers
from hyperacc.present.kineto_reader import KinetoTraceError
from hyperacc.present.kineto_trace import RUNTIME_API_SCHEMA, RankTrace, _runtime_table, scan_trace
from hyperacc.schema import RankMeta
from hyperacc.store import event_writer, step_writer, write_meta

__all__ = [  # the import's API, with the names its parts (kineto_*) hold
    "IMPORT_REPORT_FILE",
    "KEY_RUNTIME_APIS",
    "KINETO_DIR",
    "MIN_RANKS",
    "PHASE_PATTERNS",
    "RUNTIME_API_FILE",
    "RUNTIME_API_SCHEMA",
    "ImportResult",
    "KinetoTraceError",
    "RankTrace",
    "find_traces",
    "import_traces",
    "read_runtime_api",
    "runtime_api_outliers",
    "scan_trace",
]

# Where an import leaves what does not fit the step schema.
KINETO_DIR = "kineto"
RUNTIME_API_FILE = "runtime_api.parquet"
IMPORT_REPORT_FILE = "import.json"


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

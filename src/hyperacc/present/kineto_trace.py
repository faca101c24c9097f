"""One rank's Kineto trace (``scan_trace``): the step records, events and runtime API calls built from
what the event collector (``kineto_collector``) kept of the file the reader (``kineto_reader``) streams."""

from __future__ import annotations

import array
import dataclasses
import os
from pathlib import Path

import numpy as np
import pyarrow as pa

from hyperacc.present.kineto_collector import PHASE_PATTERNS, _Collector
from hyperacc.present.kineto_reader import KinetoTraceError, _Reader
from hyperacc.schema import EVENT_SCHEMA, STEP_SCHEMA

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


_LAUNCH_APIS = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"})

_SYNC_APIS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"})

_MALLOC_APIS = frozenset({"cudaMalloc", "cuMemAlloc", "cuMemAlloc_v2"})

_PHASE_IDS = {name: i for i, (name, _) in enumerate(PHASE_PATTERNS)}


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

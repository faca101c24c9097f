"""The report's sections of the second document's view: coordination and failure modes, resources, and
the comparison with a baseline run (``hyperacc report RUN --baseline RUN_B``).

Each function returns ``(section id, title, plotly figure or None, note, html)``; ``report.build_report``
places them after the projection. Figures follow the report's other plots (``report._base_layout``, ms
on the y axis, steps on the x axis). The numbers come from the diagnosis document (docs/detection.md,
"Coordination and failure modes", "Resources") and ``analysis.compare``; nothing is judged here.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

Section = tuple[str, str, "dict | None", str, str]
_MODE_WORDS = {
    "sync_amplification": "synchronisation amplification (waiting for late arrivals)",
    "fabric_contention": "fabric contention (the collective itself slower)",
    "locality": "GPU locality / intra-node position",
    "runtime": "runtime and control (GC, allocator, host)",
}
_VERDICT_COLOURS = {"likely": "#b00", "no": "#2a7", "not enough evidence": "#888"}


def _layout(**kw: Any) -> dict:
    from hyperacc.present.report_figures import _base_layout

    return _base_layout(**kw)


def _table(headers: list[str], rows: list[list[Any]], flag_rows: set[int] | None = None) -> str:
    from hyperacc.present.report_figures import _table as table

    return table(headers, rows, flag_rows)


def _ms(ns: float | None) -> str:
    return "-" if ns is None else f"{ns / 1e6:.3g} ms"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def _num(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def coordination_section(diag: Mapping[str, Any] | None) -> Section | None:
    """Step-time distribution, where the time of synchronisation goes, the arrival-spread trend, and
    the failure modes with their evidence."""
    c = (diag or {}).get("coordination") or {}
    if not c:
        return None
    parts: list[str] = []
    d = c.get("distribution")
    if d:
        parts.append("<h3>Step time of the cluster (the slowest rank's step)</h3>" + _table(
            ["steps", "p50", "p90", "p99", "p99.9", "CV", "jitter", "steps/s", "samples/s"],
            [[d["steps"], _ms(d["p50_ns"]), _ms(d["p90_ns"]), _ms(d["p99_ns"]), _ms(d["p999_ns"]), _num(d["cv"]),
              _pct(d["jitter"]), _num(d["steps_per_s"]),
              _num(d.get("samples_per_s")) if d.get("samples_per_s") else "- (give --batch-size)"]]))  # fmt: skip
    cost = c.get("cost")
    if cost:
        parts.append(
            f"<p>{_pct(cost['wait_share'])} of step time is spent waiting in collectives: "
            f"{_pct(cost['collective_share'])} the collective's own cost (the least wait of each step), "
            f"{_pct(cost['late_share'])} waiting for late arrivals. Arrival spread p50 {_ms(cost['spread_p50_ns'])}, "
            f"p99 {_ms(cost['spread_p99_ns'])}; from the first to the last third of the run the spread changed "
            f"{_num(cost['spread_trend'])}x and the collective's own cost {_num(cost['collective_trend'])}x "
            f"({html.escape(str(c.get('clock', 'host')))} clock).</p>"
        )
    else:
        parts.append("<p class='note'>Waits in collectives were not measured on two or more ranks on one clock: "
                     "the coordination cost is not known.</p>")  # fmt: skip
    modes = c.get("failure_modes") or []
    if modes:
        rows = [[_MODE_WORDS.get(m["mode"], m["mode"]), m["verdict"], _pct(m["share"]), m["evidence"], m["tells_apart"]]
                for m in modes]  # fmt: skip
        parts.append("<h3>Lost time by failure mode</h3><p class='note'>'not enough evidence' where the records "
                     "cannot tell; docs/detection.md, \"Coordination and failure modes\"</p>"
                     + _table(["failure mode", "verdict", "share of step time", "evidence", "what tells it apart"],
                              rows, {i for i, m in enumerate(modes) if m["verdict"] == "likely"}))  # fmt: skip
    trend = c.get("spread_trend") or []
    fig = None
    if trend:
        x = [(t["first_step"] + t["last_step"]) / 2 for t in trend]
        text = [f"steps {t['first_step']}-{t['last_step']}" for t in trend]
        fig = {
            "data": [
                {"type": "scatter", "mode": "lines+markers", "name": "arrival spread (largest - least wait), median",
                 "x": x, "y": [t["spread_p50_ns"] / 1e6 for t in trend], "text": text,
                 "line": {"color": "#d62728"}},
                {"type": "scatter", "mode": "lines+markers", "name": "collective's own cost (least wait), median",
                 "x": x, "y": [t["collective_p50_ns"] / 1e6 for t in trend], "text": text,
                 "line": {"color": "#ff7f0e", "dash": "dot"}},
            ],
            "layout": _layout(height=340, xaxis={"title": {"text": "step"}}, yaxis={"title": {"text": "ms"}},
                              legend={"orientation": "h", "y": 1.15}),
        }  # fmt: skip
    note = "arrival spread and the collective's own cost per step range: a growing spread with a flat cost is " \
        "synchronisation amplification; a growing cost with a flat spread is fabric contention"
    parts.append("<style>#coordination td,#comparison td:first-child{text-align:left}</style>")
    return ("coordination", "Coordination and failure modes", fig, note if fig else "", "".join(parts))


def resources_section(diag: Mapping[str, Any] | None, samples: pa.Table | None, max_ranks: int = 64,
                      max_points: int = 600) -> Section | None:  # fmt: skip
    """RSS of each rank over the run (CUDA allocated where measured), memory creep and imbalance."""
    res = (diag or {}).get("resources") or {}
    if samples is None or not samples.num_rows:
        if not res:
            return None
        return ("resources", "Resources", None, "", "<p class='note'>No resource samples in this run directory "
                "(RUN_DIR/resources): traced by an older hyperacc, or an import.</p>")  # fmt: skip
    rank = samples.column("rank").to_numpy(zero_copy_only=False)
    t = samples.column("t_ns").cast(pa.float64(), safe=False).to_numpy(zero_copy_only=False)
    t0 = float(np.nanmin(t))
    flagged = {int(c["rank"]) for c in res.get("creep") or []} | {int(i["rank"]) for i in res.get("imbalance") or []}
    shown = sorted(set(np.unique(rank).tolist()), key=lambda r: (r not in flagged, r))[:max_ranks]
    data = []
    for metric, dash, word in (("rss_bytes", "solid", "RSS"), ("cuda_allocated_bytes", "dot", "CUDA allocated")):
        v = samples.column(metric).cast(pa.float64()).to_numpy(zero_copy_only=False)
        if not np.isfinite(v).any():
            continue
        for r in sorted(shown):
            sel = np.flatnonzero((rank == r) & np.isfinite(v))
            if sel.size > max_points:
                sel = sel[np.linspace(0, sel.size - 1, max_points).round().astype(np.int64)]
            colour = "#d62728" if r in flagged else None
            trace = {"type": "scatter", "mode": "lines", "name": f"rank {r} {word}", "x": np.round((t[sel] - t0) / 1e9, 2).tolist(),
                     "y": np.round(v[sel] / 2**20, 1).tolist(), "line": {"width": 2 if colour else 1, "dash": dash}}  # fmt: skip
            if colour:
                trace["line"]["color"] = colour
            data.append(trace)
    fig = {"data": data, "layout": _layout(height=360, xaxis={"title": {"text": "seconds since the first sample"}},
                                           yaxis={"title": {"text": "MiB"}}, showlegend=len(data) <= 16)}  # fmt: skip
    judged = res.get("judged") or {}
    parts = [f"<p class='note'>{res.get('samples', 0)} samples of {res.get('ranks', 0)} ranks, taken off the training "
             f"thread. Memory creep: {html.escape(str(judged.get('creep', '-')))}. Imbalance across ranks: "
             f"{html.escape(str(judged.get('imbalance', '-')))}. Rules: docs/detection.md, \"Resources\".</p>"]  # fmt: skip
    findings = res.get("findings") or []
    parts.append("<ul>" + "".join(f"<li>{html.escape(f)}</li>" for f in findings) + "</ul>" if findings
                 else "<p>No memory creep and no rank out of line.</p>")  # fmt: skip
    rows = [[r["rank"], _num(r.get("rss_bytes_median", math.nan) / 2**20), _num(r.get("rss_bytes_growth", math.nan) / 2**20),
             _num(r.get("cpu_util")), _num(r.get("cuda_peak_bytes", math.nan) / 2**20)]
            for r in (res.get("per_rank") or [])[:max_ranks]]  # fmt: skip
    if rows:
        parts.append(_table(["rank", "RSS median MiB", "RSS growth MiB", "CPU cores busy", "CUDA peak MiB"], rows,
                            {i for i, r in enumerate((res.get("per_rank") or [])[:max_ranks]) if r["rank"] in flagged}))
    note = "flagged ranks in red" if flagged else ""
    return ("resources", "Resources", fig, note, "".join(parts))


def comparison_section(diag: Mapping[str, Any] | None, baseline: Mapping[str, Any] | None, name: str,
                       baseline_name: str) -> Section | None:  # fmt: skip
    """This run against a baseline run: every figure, its change, the 95 % interval where it is a rate."""
    if not diag or not baseline:
        return None
    from hyperacc.analysis.compare import compare, figures_of

    figs = [figures_of(baseline), figures_of(diag)]
    changes = compare(figs)
    rows, worse = [], set()
    for i, c in enumerate(changes):
        unit = figs[0][c.name].unit
        interval = "-" if c.low is None else f"{100 * c.low:+.2f} to {100 * c.high:+.2f} pp"
        rows.append([c.name, _fig(c.base, unit), _fig(c.value, unit), _change(c.delta, c.relative, unit), interval,
                     "worse" if c.worse else ""])  # fmt: skip
        if c.worse:
            worse.add(i)
    html_rows = _table(["figure", "baseline", "this run", "change", "95 % interval", ""], rows, worse)
    names = ["p50", "p90", "p99", "p999"]
    fig = {
        "data": [
            {"type": "bar", "name": f"baseline: {baseline_name}", "x": names,
             "y": [figs[0][n].value for n in names], "marker": {"color": "#9aa"}},
            {"type": "bar", "name": f"this run: {name}", "x": names,
             "y": [figs[1][n].value for n in names], "marker": {"color": "#1f77b4"}},
        ],
        "layout": _layout(height=320, barmode="group", yaxis={"title": {"text": "step time (ms)"}},
                          legend={"orientation": "h", "y": 1.15}),
    }  # fmt: skip
    head = (f"<p>Baseline: {html.escape(baseline_name)} ({baseline.get('world_size')} ranks, {baseline.get('steps')} "
            f"steps). Red rows went the wrong way; a rate's change is significant when its interval excludes 0. "
            "The same figures as `hyperacc compare`.</p>")  # fmt: skip
    return ("comparison", "Comparison with the baseline", fig, "step-time percentiles of both runs", head + html_rows)


def _fig(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    return f"{100 * v:.2f} %" if unit == "%" else f"{v:.3g} ms" if unit == "ms" else _num(v)


def _change(delta: float | None, rel: float | None, unit: str) -> str:
    if delta is None:
        return "-"
    if unit == "%":
        return f"{100 * delta:+.2f} pp"
    text = f"{delta:+.3g}" + (" ms" if unit == "ms" else "")
    return text + (f" ({100 * rel:+.1f} %)" if rel is not None else "")


def sections(diag: Mapping[str, Any] | None, samples: pa.Table | None, baseline: Mapping[str, Any] | None = None,
             name: str = "", baseline_name: str = "", max_ranks: int = 64) -> Sequence[Section]:  # fmt: skip
    """The sections this module adds, in page order."""
    out = [coordination_section(diag), resources_section(diag, samples, max_ranks),
           comparison_section(diag, baseline, name, baseline_name)]  # fmt: skip
    return [s for s in out if s is not None]

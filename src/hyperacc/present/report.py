"""One self-contained HTML report of a run directory (plotly, with the library embedded: opens offline).

Sections (docs/presentation.md, "HTML report"): verdict, evidence and next step; rank x step heatmap of
self-time with spikes marked; step time over time with spikes annotated by cause; per-rank and
per-node distributions with the flagged ones highlighted; spike-rate table with intervals; time lost per
cause; projection curve; stabilizer and pacing events; CUDA runtime API latency (Kineto imports).

Scale: the run is read one rank at a time (``analysis.columns.read_rank``) and reduced on the way:
steps are binned to at most ``step_bins`` columns, the heatmap and the per-rank boxes show at most
``max_ranks`` ranks (stragglers first, then the spikiest, then the slowest), per-node distributions come
from merged log-spaced histograms. Memory and file size therefore depend on the bins, not on
ranks x steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import html
import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from hyperacc import store
from hyperacc.analysis.columns import discover, read_rank, step_bounds
from hyperacc.analysis.options import DetectionOptions, outlier_rule_text
from hyperacc.present.report_figures import (
    _causes,
    _event_timeline,
    _heatmap,
    _heatmap_note,
    _node_boxes,
    _pacing,
    _projection,
    _rank_boxes,
    _step_time,
    _subset_note,
    _table,
)
from hyperacc.present.report_reductions import (
    _HIST_EDGES,
    _choose_ranks,
    _events,
    _options,
    _RankSummary,
    _runtime,
    _StepMax,
    _summarise,
)

STEP_BINS = 600  # most heatmap / timeline columns
MAX_RANKS = 64  # most ranks drawn one by one (heatmap rows, boxes)
TOP_SPIKES = 300  # most spike markers
_COLUMNS = ("step", "node", "step_ns", "self_ns", "comm_wait_ns", "gc_ns", "pace_on", "pace_delay_ns")


class ReportError(ValueError):
    """The report cannot be written; the message says why and what to do."""


@dataclasses.dataclass
class ReportResult:
    path: Path
    bytes: int
    ranks: int
    steps: int
    ranks_drawn: int
    step_bin: int  # steps per heatmap/timeline column


def build_report(
    run_dir: str | os.PathLike,
    out: str | os.PathLike | None = None,
    *,
    diagnosis: Mapping[str, Any] | None = None,
    step_bins: int = STEP_BINS,
    max_ranks: int = MAX_RANKS,
    progress: Callable[[str, float], None] | None = None,
    baseline: Mapping[str, Any] | None = None,
) -> ReportResult:
    """Writes the report of ``run_dir`` to ``out`` (default ``RUN_DIR/report.html``).

    ``run_dir``: one run directory or the run directories of one job's agents (``analysis.columns``).
    ``diagnosis`` is ``Diagnosis.to_dict()`` (``None``: sections that need it say so); ``baseline`` the
    diagnosis of a run to compare with (the comparison section).
    ``progress(stage, fraction_done)`` is called as the work advances.
    """
    say = progress or (lambda _stage, _f: None)
    layout = discover(run_dir)
    if not layout.sources:
        raise store.RunDirError(f"{run_dir} holds no step records; nothing to report")
    ranks = sorted(layout.sources)
    bounds = [b for r in ranks if (b := step_bounds(layout.sources[r].segments))]
    if not bounds:
        raise store.RunDirError(f"no segment under {Path(run_dir) / 'steps'} could be read")
    first, last = min(b[0] for b in bounds), max(b[1] for b in bounds)
    n_steps = last - first + 1
    width = max(1, math.ceil(n_steps / max(1, step_bins)))
    n_bins = math.ceil(n_steps / width)

    # ---- one pass over the ranks, reducing as we go
    bin_mean = np.full((len(ranks), n_bins), np.nan, dtype=np.float32)
    bin_max = np.full((len(ranks), n_bins), np.nan, dtype=np.float32)
    step_max = _StepMax()  # cluster step time (slowest rank's step) per recorded step
    pace_bins = np.zeros((3, n_bins))  # rows pacing, rows with a pacing value, delay sum
    node_hist: dict[int, np.ndarray] = {}
    summaries: list[_RankSummary] = []
    metric = "self_ns"
    for i, r in enumerate(ranks):
        cols = read_rank(layout.sources[r].segments, _COLUMNS)
        meta = layout.metas.get(r)
        node = meta.node if meta else (int(cols["node"][0]) if cols["node"].size else 0)
        if i == 0 and not np.isfinite(cols["self_ns"]).any():
            metric = "step_ns"  # no self-time measured (e.g. a CPU-only profiler import)
        values = cols[metric]
        pos = cols["step"] - first
        b = pos // width
        ok = np.isfinite(values)
        if ok.any():
            sums = np.bincount(b[ok], weights=values[ok], minlength=n_bins)
            cnt = np.bincount(b[ok], minlength=n_bins)
            with np.errstate(invalid="ignore", divide="ignore"):
                bin_mean[i] = np.where(cnt > 0, sums / cnt, np.nan)
            mx = np.full(n_bins, -np.inf)
            np.maximum.at(mx, b[ok], values[ok])
            bin_max[i] = np.where(np.isfinite(mx), mx, np.nan)
            summaries.append(_summarise(r, node, values[ok]))
            hist = node_hist.setdefault(node, np.zeros(len(_HIST_EDGES) - 1, dtype=np.int64))
            hist += np.histogram(values[ok], _HIST_EDGES)[0]
        step_max.add(cols["step"], cols["step_ns"])
        pace = cols["pace_on"]
        pok = np.isfinite(pace)
        if pok.any():
            pace_bins[0] += np.bincount(b[pok], weights=pace[pok], minlength=n_bins)
            pace_bins[1] += np.bincount(b[pok], minlength=n_bins)
            delay = np.nan_to_num(cols["pace_delay_ns"][pok])
            pace_bins[2] += np.bincount(b[pok], weights=delay, minlength=n_bins)
        say(f"reading rank {r}", 0.8 * (i + 1) / len(ranks))

    say("drawing", 0.85)
    diag = dict(diagnosis) if diagnosis else None
    flagged = {int(s["rank"]): s for s in (diag or {}).get("stragglers", []) if s.get("active", True)}
    chosen = _choose_ranks(ranks, summaries, diag, flagged, max_ranks)
    row_of = {r: i for i, r in enumerate(ranks)}
    x_bins = first + np.arange(n_bins) * width
    spikes = sorted((diag or {}).get("spikes", {}).get("events", []) or [], key=lambda e: -(e.get("excess_ns") or 0))
    spikes = spikes[:TOP_SPIKES]
    events = _events(run_dir)
    runtime = _runtime(layout.run_dir, _options(diag))
    metric_word = "self-time" if metric == "self_ns" else "step time"

    figs: list[tuple[str, str, dict, str]] = []  # (section id, title, figure, note)
    figs.append(("heatmap", f"Rank x step: {metric_word}", _heatmap(bin_mean, bin_max, [row_of[r] for r in chosen], chosen,
                 x_bins, width, spikes, flagged, metric_word), _heatmap_note(len(ranks), len(chosen), width)))  # fmt: skip
    bands = [*((diag or {}).get("episodes") or []), *((diag or {}).get("slowdowns") or [])]
    figs.append(("steptime", "Step time over time", _step_time(step_max, first, width, spikes, bands),
                 "shaded: episodes, a rank slow for a stretch, and slowdowns of the whole job (docs/detection.md)"
                 if bands else ""))  # fmt: skip
    by_rank = {s.rank: s for s in summaries}
    figs.append(("ranks", f"Per-rank {metric_word}", _rank_boxes([by_rank[r] for r in chosen if r in by_rank], flagged,
                 metric_word), _subset_note(len(ranks), len(chosen))))  # fmt: skip
    figs.append(("nodes", f"Per-node {metric_word}", _node_boxes(node_hist, flagged, summaries, metric_word), ""))
    if diag:
        figs.append(("causes", "Time lost per cause", _causes(diag), ""))
        proj = _projection(diag, summaries, step_max)
        if proj is not None:
            figs.append(("projection", "Projection to larger clusters", proj[0], proj[1]))
    extra = _second_view(layout, diag, baseline, figs, max_ranks)
    pacing = _pacing(pace_bins, x_bins)
    if pacing is not None:
        figs.append(("pacing", "Pacing", pacing, "share of ranks pacing and mean delay per step bin"))
    if events is not None and events.num_rows:
        figs.append(("events", "Stabilizer and pacing events", _event_timeline(events, first, width), ""))

    say("writing", 0.95)
    recorded = int(step_max.steps.size)
    page = _page(layout.name, layout, ranks, recorded, first, last, diag, figs, events, runtime, summaries, metric_word,
                 extra=extra)  # fmt: skip
    path = Path(out) if out else layout.run_dir / "report.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(page, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # a full disk leaves no half-written page behind
            tmp.unlink(missing_ok=True)
        raise
    say("done", 1.0)
    return ReportResult(path, path.stat().st_size, len(ranks), recorded, len(chosen), width)


# ------------------------------------------------------------------------------------ reductions


# ------------------------------------------------------------------------------------ figures


# ------------------------------------------------------------------------------------ the page


_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#1d2733;color:#fff;padding:18px 32px}header h1{margin:0;font-size:22px}
header .meta{opacity:.8;font-size:13px;margin-top:4px}
main{padding:8px 32px 40px;max-width:1400px}
section{background:#fff;border:1px solid #e3e3e3;border-radius:6px;margin:18px 0;padding:14px 20px}
h2{font-size:17px;margin:4px 0 10px}.note{color:#666;font-size:12px;margin:4px 0}
.verdict{font-size:17px;font-weight:600;margin:6px 0 12px}
.kpis{display:flex;gap:28px;flex-wrap:wrap;margin:6px 0}.kpi b{display:block;font-size:20px}
.kpi span{color:#666;font-size:12px}
table{border-collapse:collapse;font-size:13px;margin:8px 0}td,th{padding:3px 10px;border-bottom:1px solid #eee;
text-align:right}th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}
tr.flag td{color:#b00;font-weight:600}ul{margin:4px 0 8px 18px;padding:0}li{margin:3px 0}
#js-errors{color:#b00}
"""


def _fmt_pct(p) -> str:
    if p is None:
        return "-"
    return f"{100 * p:.2f} %" if p >= 1e-4 or p == 0 else f"{100 * p:.1e} %"


def _second_view(layout, diag, baseline, figs: list, max_ranks: int) -> dict[str, str]:
    """Adds the coordination, resources and comparison sections (``report_coordination``) to ``figs``;
    returns their HTML by section id."""
    from hyperacc.present.report_coordination import sections

    samples = store.read_resources(layout.run_dirs or [layout.run_dir])
    extra: dict[str, str] = {}
    name = layout.name
    for sid, title, fig, note, body in sections(diag, samples, baseline, name, (baseline or {}).get("run_dir") or "",
                                                max_ranks):  # fmt: skip
        figs.append((sid, title, fig, note))
        extra[sid] = body
    return extra


def _page(run_dir, layout, ranks, n_steps, first, last, diag, figs, events, runtime, summaries, metric_word,
          extra: Mapping[str, str] | None = None) -> str:  # fmt: skip
    from plotly.offline import get_plotlyjs

    e = html.escape
    nodes = len({s.node for s in summaries}) or 1
    meds = [s.q[2] for s in summaries]
    parts: list[str] = []
    generated = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    source = sorted({m.source for m in layout.metas.values()}) or ["tracer"]
    parts.append(
        f"<header><h1>hyperacc report</h1><div class='meta'>{e(str(run_dir))} &middot; {len(ranks)} ranks on {nodes} "
        f"node(s) &middot; steps {first}-{last} &middot; source: {e(', '.join(source))} &middot; generated {generated}"
        "</div></header><main>"
    )
    # ---- verdict, evidence, next step
    sec = ["<section id='verdict'><h2>Verdict</h2>"]
    if diag:
        sec.append(f"<p class='verdict'>{e(diag.get('verdict') or '')}</p>")
        cl = (diag.get("spikes") or {}).get("cluster") or {}
        kpis = [
            (f"{len(ranks)}", "ranks"), (f"{n_steps}", "steps"),
            (f"{np.median(meds) / 1e6:.3g} ms" if meds else "-", f"median {metric_word}"),
            (_fmt_pct(cl.get("rate")), "steps with a spike (cluster)"),
            (f"{len(diag.get('stragglers') or [])}", "stragglers"),
        ]  # fmt: skip
        sec.append("<div class='kpis'>" + "".join(f"<div class='kpi'><b>{e(v)}</b><span>{e(k)}</span></div>" for v, k in kpis) + "</div>")
        if diag.get("evidence"):
            sec.append("<h3>Evidence</h3><ul>" + "".join(f"<li>{e(x)}</li>" for x in diag["evidence"]) + "</ul>")
        if diag.get("next_step"):
            sec.append("<h3>Next step</h3><ul>" + "".join(f"<li>{e(x)}</li>" for x in diag["next_step"]) + "</ul>")
        if diag.get("missing_ranks"):
            sec.append(f"<p class='note'>ranks without records: {e(str(diag['missing_ranks']))}</p>")
        strag = diag.get("stragglers") or []
        if strag:
            from hyperacc.analysis.diagnosis import kind_word

            rows = [[s["rank"], s["node"], kind_word(s["kind"]), s.get("metric", ""), f"{s['slowdown']:.2f}x" if s.get("slowdown") else "-",
                     s.get("since_step", "-"), f"{s.get('windows_flagged', '-')}/{s.get('windows_seen', '-')}"] for s in strag]  # fmt: skip
            sec.append("<h3>Stragglers</h3>" + _table(["rank", "node", "kind", "metric", "slowdown", "since step", "windows"],
                                                       rows, set(range(len(rows)))))  # fmt: skip
    else:
        sec.append("<p class='note'>The analysis module is not available in this installation: the plots below show "
                   "the step records only (no verdict, spikes, causes or projection).</p>")  # fmt: skip
    sec.append("</section>")
    parts.append("".join(sec))

    plot_ids = []
    fig_json = {}
    for sid, title, fig, note in figs:
        pid = f"plot-{sid}"
        block = f"<section id='{sid}'><h2>{e(title)}</h2>"
        if note:
            block += f"<p class='note'>{e(note)}</p>"
        if fig is not None:  # a section of tables only has no plot
            plot_ids.append(pid)
            fig_json[pid] = fig
            block += f"<div id='{pid}' class='plot'></div>"
        block += (extra or {}).get(sid, "")
        block += "</section>"
        parts.append(block)
        if sid == "nodes" and diag:
            parts.append(_spike_tables(diag))

    if events is not None and events.num_rows:
        parts.append(_event_table(events))
    if runtime is not None:
        parts.append(_runtime_table(runtime, _options(diag)))
    parts.append(_remediation_section(run_dir))
    parts.append("<pre id='js-errors'></pre></main>")

    payload = json.dumps(_finite(fig_json), allow_nan=False, separators=(",", ":"))
    payload = payload.replace("</", "<\\/")
    script = (
        "<script>(function(){var figs=" + payload + ";var n=0;"
        "for(var id in figs){var f=figs[id];Plotly.newPlot(id,f.data,f.layout,{responsive:true,displaylogo:false});n++;}"
        "document.body.setAttribute('data-plots-rendered',String(n));})();</script>"
    )
    guard = (
        "<script>window.__hyperaccErrors=[];window.addEventListener('error',function(ev){"
        "window.__hyperaccErrors.push(String(ev.message));var el=document.getElementById('js-errors');"
        "if(el){el.textContent='JavaScript error: '+window.__hyperaccErrors.join('; ');}});</script>"
    )
    head = (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>hyperacc report: {e(Path(str(run_dir)).name)}</title><style>{_CSS}</style>{guard}"
        f"<script>{get_plotlyjs()}</script></head><body data-plots='{len(plot_ids)}'>"
    )
    return head + "".join(parts) + script + "</body></html>"


def _spike_tables(diag) -> str:
    spikes = diag.get("spikes") or {}
    per_rank = sorted(spikes.get("per_rank") or [], key=lambda p: (-(p.get("rate") or 0), p["rank"]))
    shown = per_rank[:30]
    flagged = {int(s["rank"]) for s in diag.get("stragglers") or []}
    rows = [[p["rank"], p["node"], p["steps"], p["spikes"], _fmt_pct(p["rate"]),
             f"{_fmt_pct(p['ci_low'])} - {_fmt_pct(p['ci_high'])}", p.get("cause") or "-"] for p in shown]  # fmt: skip
    out = ["<section id='spike-rates'><h2>Spike rates</h2>"]
    cl = spikes.get("cluster") or {}
    if cl:
        period = cl.get("period")
        every = (f" More than half of the ranks spiked at once every {period['every']} steps, from step "
                 f"{period['first']} to {period['last']} ({period['repeats']} of {period['expected']}).") if period else ""  # fmt: skip
        out.append(f"<p>Cluster: {cl.get('spike_steps')} of {cl.get('steps')} steps had a spike on at least one rank "
                   f"({_fmt_pct(cl.get('rate'))}).{every}</p>")  # fmt: skip
    note = f" (the {len(shown)} highest of {len(per_rank)} ranks)" if len(shown) < len(per_rank) else ""
    out.append(f"<h3>Per rank{note}</h3><p class='note'>rate with its 95 % Wilson interval</p>")
    out.append(_table(["rank", "node", "steps", "spikes", "rate", "95 % interval", "main cause"], rows,
                      {i for i, p in enumerate(shown) if int(p["rank"]) in flagged}))  # fmt: skip
    excess = diag.get("rank_causes") or []
    if excess:
        rows = [[e["rank"], e["node"], e["cause"], e["spikes"], _fmt_pct(e["rate"]), _fmt_pct(e["others_rate"]),
                 f"{e['mean_excess_ns'] / 1e6:.3g}", f"{e['time_lost_ns'] / 1e9:.3g}",
                 f"{e['period']['every']} steps" if e.get("period") else "-"] for e in excess[:30]]  # fmt: skip
        out.append("<h3>Rank-specific causes</h3><p class='note'>a rank whose spikes of one cause stand out from the "
                   "other ranks' rate of that cause (docs/detection.md)</p>")  # fmt: skip
        out.append(_table(["rank", "node", "cause", "spikes", "rate", "other ranks", "ms each", "s lost", "every"], rows,
                          set(range(len(rows)))))  # fmt: skip
    per_node = sorted(spikes.get("per_node") or [], key=lambda p: (-(p.get("rate") or 0), p["node"]))[:30]
    if per_node:
        rows = [[p["node"], p["steps"], p["spikes"], _fmt_pct(p["rate"]), f"{_fmt_pct(p['ci_low'])} - {_fmt_pct(p['ci_high'])}"]
                for p in per_node]  # fmt: skip
        out.append("<h3>Per node</h3>" + _table(["node", "steps", "spikes", "rate", "95 % interval"], rows))
    out.append("</section>")
    return "".join(out)


def _event_table(events: pa.Table) -> str:
    kinds = events.column("kind").to_numpy(zero_copy_only=False)
    steps = events.column("step").cast(pa.float64()).to_numpy(zero_copy_only=False)
    durs = events.column("duration_ns").cast(pa.float64()).to_numpy(zero_copy_only=False)
    ranks = events.column("rank").to_numpy(zero_copy_only=False)
    rows = []
    for kind in sorted(set(kinds.tolist())):
        sel = kinds == kind
        s = steps[sel][np.isfinite(steps[sel])]
        d = durs[sel][np.isfinite(durs[sel])]
        rows.append([kind, int(sel.sum()), len(np.unique(ranks[sel])), f"{d.sum() / 1e6:.2f}" if d.size else "-",
                     f"{np.median(d) / 1e6:.3g}" if d.size else "-",
                     f"{int(s.min())}-{int(s.max())}" if s.size else "-"])  # fmt: skip
    return ("<section id='event-table'><h2>What the stabilizers and pacing did</h2>"
            + _table(["event", "count", "ranks", "total ms", "median ms", "steps"], rows) + "</section>")  # fmt: skip


def _remediation_section(run_dir) -> str:
    """What ``--remediate`` decided and did (docs/remediation.md); empty when it never ran."""
    import logging

    from hyperacc.present.diagnosis import remediation_of

    try:
        rows = remediation_of(run_dir)
    except Exception as exc:  # noqa: BLE001 - the rest of the report stands without it
        logging.getLogger(__name__).warning("remediation events not shown (%s)", exc)
        return ""
    if not rows:
        return ""
    body = [[r.get("time", "")[:23], r.get("kind", ""), r.get("status", "") or "started", r["line"]] for r in rows]
    return ("<section id='remediation'><h2>Remediation: what was decided and done</h2>"
            + _table(["time (UTC)", "event", "status", "what"], body) + "</section>")  # fmt: skip


def _runtime_table(runtime: pa.Table, opts: DetectionOptions) -> str:
    from hyperacc.present.kineto import KEY_RUNTIME_APIS

    rows_all = runtime.to_pylist()
    key = [r for r in rows_all if r["api"] in KEY_RUNTIME_APIS]
    key.sort(key=lambda r: (KEY_RUNTIME_APIS.index(r["api"]), r["rank"]))
    flagged = [r for r in rows_all if r["outlier"]]
    shown = key[:200]
    rows = [[r["api"], r["rank"], r["calls"], f"{r['median_ns'] / 1e3:.2f}", f"{r['p99_ns'] / 1e3:.2f}",
             "-" if r["z"] is None or not math.isfinite(r["z"]) else f"{r['z']:.1f}",
             "-" if r["excess"] is None or not math.isfinite(r["excess"]) else f"{100 * r['excess']:+.0f} %",
             "OUTLIER" if r["outlier"] else ""] for r in shown]  # fmt: skip
    out = ["<section id='runtime-api'><h2>CUDA runtime API latency (from the profiler traces)</h2>"]
    if flagged:
        out.append("<p class='verdict'>" + html.escape("; ".join(
            f"rank {r['rank']}: {r['api']} median {r['median_ns'] / 1e3:.2f} us, {100 * r['excess']:+.0f} % vs the other ranks"
            for r in flagged[:10])) + "</p>")  # fmt: skip
    tested = any(r.get("judged", True) for r in rows_all)
    out.append("<p class='note'>" + html.escape("cross-rank test on each API's median: the straggler rule of docs/detection.md on "
               f"one window ({outlier_rule_text(opts, opts.launch_floor_ns)})"
               if tested else f"not tested: the cross-rank test needs at least {opts.min_ranks} ranks") + "</p>")  # fmt: skip
    out.append(_table(["API", "rank", "calls", "median us", "p99 us", "z", "vs median", ""], rows,
                      {i for i, r in enumerate(shown) if r["outlier"]}))  # fmt: skip
    out.append("</section>")
    return "".join(out)


def _finite(o):
    """JSON-ready copy: numpy scalars and arrays as Python values, NaN and infinities as null (a gap)."""
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    if isinstance(o, np.ndarray):
        return _finite(o.tolist())
    if isinstance(o, (float, np.floating)):
        f = float(o)
        return f if math.isfinite(f) else None
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.bool_):
        return bool(o)
    return o

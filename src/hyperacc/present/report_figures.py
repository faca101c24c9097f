"""The report's figures (plotly figure dicts) and its HTML table, shared by the report's two pages
(``report``: the run; ``report_coordination``: the second view)."""

from __future__ import annotations

import html
import warnings
from typing import Any

import numpy as np
import pyarrow as pa

from hyperacc import theory
from hyperacc.analysis.robust import MAD_TO_SIGMA
from hyperacc.present.report_reductions import (
    _hist_quantiles,
    _RankSummary,
    _StepMax,
)

_CAUSE_COLOURS = {
    "data": "#1f77b4",
    "gc": "#d62728",
    "allocator": "#9467bd",
    "page_faults": "#e377c2",
    "host": "#8c564b",
    "communication": "#ff7f0e",
    "compute": "#2ca02c",
    "host_work": "#bcbd22",
    "unknown": "#7f7f7f",
}


def _ms(v):
    return np.round(np.asarray(v, dtype=np.float64) / 1e6, 4)


def _base_layout(**kw) -> dict:
    lay = {"margin": {"l": 70, "r": 30, "t": 30, "b": 50}, "template": "plotly_white", "height": 420}
    lay.update(kw)
    return lay


def _heatmap(bin_mean, bin_max, rows, chosen, x_bins, width, spikes, flagged, metric_word) -> dict:
    sub = bin_mean[rows].astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        col_median = np.nanmedian(bin_mean.astype(np.float64), axis=0)
        ratio = sub / col_median[None, :]
    ylabels = [f"rank {r}" + (" *" if r in flagged else "") for r in chosen]
    hover = np.char.add(np.char.add(np.round(_ms(sub), 2).astype(str), " ms, max "), np.round(_ms(bin_max[rows]), 2).astype(str))
    data = [
        {
            "type": "heatmap",
            "z": np.round(ratio, 3).tolist(),
            "x": x_bins.tolist(),
            "y": ylabels,
            "text": hover.tolist(),
            "hovertemplate": "%{y}, step %{x}: %{text} (%{z:.2f}x the cluster median)<extra></extra>",
            "colorscale": "RdBu",
            "zmid": 1.0,
            "zmin": 0.5,
            "zmax": 1.5,
            "colorbar": {"title": {"text": "x cluster<br>median"}},
        }
    ]
    shown = set(chosen)
    sp = [e for e in spikes if int(e.get("rank", -1)) in shown]
    for cause in sorted({e.get("cause") or "unknown" for e in sp}):
        pts = [e for e in sp if (e.get("cause") or "unknown") == cause]
        data.append(
            {
                "type": "scatter",
                "mode": "markers",
                "name": f"spike: {cause}",
                "x": [int(e["step"]) for e in pts],
                "y": [f"rank {int(e['rank'])}" + (" *" if int(e["rank"]) in flagged else "") for e in pts],
                "text": [f"+{(e.get('excess_ns') or 0) / 1e6:.1f} ms ({e.get('phase') or '-'})" for e in pts],
                "hovertemplate": "%{y}, step %{x}: spike %{text}<extra>" + cause + "</extra>",
                "marker": {"symbol": "x", "size": 9, "color": _CAUSE_COLOURS.get(cause, "#000"),
                           "line": {"width": 1, "color": "#000"}},
            }
        )  # fmt: skip
    height = min(1200, max(320, 16 * len(chosen) + 120))
    return {
        "data": data,
        "layout": _base_layout(
            height=height,
            xaxis={"title": {"text": "step" + (f" (bins of {width})" if width > 1 else "")}},
            yaxis={"autorange": "reversed", "type": "category"},
            legend={"orientation": "h", "y": 1.06},
            title={"text": f"{metric_word} per rank and step, relative to the cluster median (* flagged)", "font": {"size": 13}},
        ),
    }


def _heatmap_note(n_ranks: int, drawn: int, width: int) -> str:
    parts = []
    if drawn < n_ranks:
        parts.append(f"{drawn} of {n_ranks} ranks drawn: the flagged ones, the spikiest and the slowest")
    if width > 1:
        parts.append(f"each column is the mean over {width} steps")
    return "; ".join(parts)


def _subset_note(n_ranks: int, drawn: int) -> str:
    return f"{drawn} of {n_ranks} ranks drawn" if drawn < n_ranks else ""


def _step_time(step_max: _StepMax, first, width, spikes, episodes=()) -> dict:
    steps, values = step_max.steps, step_max.values
    n = steps.size
    data: list[dict] = []
    if width == 1:
        data.append({"type": "scattergl" if n > 2000 else "scatter", "mode": "lines", "name": "step time (slowest rank)",
                     "x": steps.tolist(), "y": _ms(values).tolist(), "line": {"width": 1, "color": "#444"}})  # fmt: skip
    else:
        ok = np.isfinite(values)
        b = (steps - first) // width
        n_bins = int(b.max()) + 1 if n else 0
        cnt = np.bincount(b[ok], minlength=n_bins)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = np.where(cnt > 0, np.bincount(b[ok], weights=values[ok], minlength=n_bins) / cnt, np.nan)
        top = np.full(n_bins, -np.inf)
        np.maximum.at(top, b[ok], values[ok])
        top = np.where(cnt > 0, top, np.nan)  # bins without a measured step stay gaps
        x = (first + np.arange(n_bins) * width).tolist()
        data.append({"type": "scatter", "mode": "lines", "name": f"max over {width} steps", "x": x, "y": _ms(top).tolist(),
                     "line": {"width": 1, "color": "#bbb"}})  # fmt: skip
        data.append({"type": "scatter", "mode": "lines", "name": f"mean over {width} steps", "x": x,
                     "y": _ms(mean).tolist(), "line": {"width": 1.5, "color": "#444"}})  # fmt: skip
    by_step: dict[int, list[dict]] = {}
    for e in spikes:
        by_step.setdefault(int(e["step"]), []).append(e)
    for cause in sorted({e.get("cause") or "unknown" for e in spikes}):
        steps = sorted(s for s, es in by_step.items() if (max(es, key=lambda e: e.get("excess_ns") or 0).get("cause") or "unknown") == cause)
        ys = [None if (v := step_max.at(s)) is None else v / 1e6 for s in steps]
        text = [", ".join(f"rank {e['rank']} +{(e.get('excess_ns') or 0) / 1e6:.1f} ms" for e in by_step[s][:3]) for s in steps]
        data.append({"type": "scatter", "mode": "markers", "name": f"spike: {cause}", "x": steps, "y": ys, "text": text,
                     "hovertemplate": "step %{x}: %{y:.1f} ms<br>%{text}<extra>" + cause + "</extra>",
                     "marker": {"size": 9, "color": _CAUSE_COLOURS.get(cause, "#000"), "line": {"width": 1, "color": "#000"}}})  # fmt: skip
    shapes, notes = _episode_bands(episodes)
    return {"data": data, "layout": _base_layout(xaxis={"title": {"text": "step"}}, yaxis={"title": {"text": "ms"}},
                                                 legend={"orientation": "h", "y": 1.1}, shapes=shapes,
                                                 annotations=notes)}  # fmt: skip


def _episode_bands(episodes, most: int = 20) -> tuple[list[dict], list[dict]]:
    """Each episode (docs/detection.md, "Episodes") as a shaded band over its steps, named at its top; a
    slowdown of the whole job (no ``rank``: "Slowdowns of the job") in orange."""
    shapes, notes = [], []
    for e in list(episodes)[:most]:
        x0, x1 = e["since_step"], e["until_step"]
        colour = "#d62728" if "rank" in e else "#ff7f0e"
        shapes.append({"type": "rect", "xref": "x", "yref": "paper", "x0": x0, "x1": x1, "y0": 0, "y1": 1,
                       "fillcolor": colour, "opacity": 0.12, "line": {"width": 0}, "layer": "below"})  # fmt: skip
        lost = e.get("job_time_lost_ns")
        who = f"rank {e['rank']}" if "rank" in e else "job"
        text = f"{who}: {e.get('kind', '')}" + (f", {lost / 1e9:.3g} s lost" if lost else "")
        notes.append({"x": (x0 + x1) / 2, "xref": "x", "y": 1, "yref": "paper", "yanchor": "bottom",
                      "text": html.escape(text), "showarrow": False, "font": {"size": 10, "color": "#a00"}})  # fmt: skip
    return shapes, notes


def _box(name: str, q, colour: str, n: int) -> dict:
    lo, q1, med, q3, hi = (float(v) / 1e6 for v in q)
    return {"type": "box", "name": name, "q1": [q1], "median": [med], "q3": [q3], "lowerfence": [lo],
            "upperfence": [hi], "x": [name], "marker": {"color": colour}, "line": {"color": colour},
            "fillcolor": colour + "55", "showlegend": False, "hoverinfo": "y+name", "text": [f"{n} steps"]}  # fmt: skip


def _rank_boxes(summaries: list[_RankSummary], flagged, metric_word) -> dict:
    data = [_box(f"rank {s.rank}", s.q, "#d62728" if s.rank in flagged else "#1f77b4", s.n) for s in summaries]
    return {"data": data, "layout": _base_layout(yaxis={"title": {"text": f"{metric_word} (ms)"}},
                                                 xaxis={"type": "category", "tickangle": -60 if len(data) > 24 else 0})}  # fmt: skip


def _node_boxes(node_hist, flagged, summaries, metric_word) -> dict:
    flagged_nodes = {int(s.get("node", -1)) for s in flagged.values()}
    data = []
    for node in sorted(node_hist):
        counts = node_hist[node]
        if counts.sum() == 0:
            continue
        q1, med, q3 = _hist_quantiles(counts, (0.25, 0.5, 0.75))
        lo_q, hi_q = _hist_quantiles(counts, (0.01, 0.99))
        colour = "#d62728" if node in flagged_nodes else "#2ca02c"
        data.append(_box(f"node {node}", (lo_q, q1, med, q3, hi_q), colour, int(counts.sum())))
    return {"data": data, "layout": _base_layout(height=360, yaxis={"title": {"text": f"{metric_word} (ms)"}},
                                                 xaxis={"type": "category"})}  # fmt: skip


def _causes(diag) -> dict:
    causes = diag.get("causes") or []
    x = [c["cause"] for c in causes]
    return {
        "data": [{"type": "bar", "x": x, "y": [c["time_lost_ns"] / 1e6 for c in causes],
                  "text": [f"{c['spikes']} spikes, {100 * c['share']:.0f} %" for c in causes], "textposition": "auto",
                  "marker": {"color": [_CAUSE_COLOURS.get(c, "#7f7f7f") for c in x]}}],
        "layout": _base_layout(height=340, yaxis={"title": {"text": "time lost (ms)"}}),
    }  # fmt: skip


def _projection(diag, summaries, step_max) -> tuple[dict, str] | None:
    proj = diag.get("projection") or {}
    p_rank = proj.get("p_rank")
    if p_rank is None:
        return None
    rpn = int(proj.get("ranks_per_node") or 1)
    p_node = float(proj.get("p_node") or 0.0)
    target = float(proj.get("target") or theory.DEFAULT_TARGET)
    nodes = np.unique(np.round(np.geomspace(1, 4096, 60)).astype(int))
    p = [theory.cluster_spike_probability(p_rank, ranks_per_node=rpn, nodes=int(n), p_node=p_node) for n in nodes]
    data: list[dict] = [
        {"type": "scatter", "mode": "lines", "name": "P(cluster step spikes)", "x": nodes.tolist(), "y": p,
         "line": {"color": "#d62728"}},
        {"type": "scatter", "mode": "lines", "name": f"target {100 * target:.0f} %", "x": [1, 4096], "y": [target, target],
         "line": {"dash": "dot", "color": "#555"}},
    ]  # fmt: skip
    cur = proj.get("current") or {}
    if cur.get("measured") is not None:
        data.append({"type": "scatter", "mode": "markers", "name": "measured here", "x": [cur.get("nodes")],
                     "y": [cur["measured"]], "marker": {"size": 11, "color": "#000", "symbol": "diamond"}})  # fmt: skip
    note = (f"per-rank spike rate {100 * p_rank:.3g} %, {rpn} ranks per node"
            + (f", per-node rate {100 * p_node:.3g} %" if p_node else ""))  # fmt: skip
    # Expected cluster step time: the theory's order-statistics model, anchored at the measured median.
    finite = step_max.values[np.isfinite(step_max.values)]
    spikes = (diag.get("spikes") or {}).get("events") or []
    if summaries and finite.size:
        noise_ns = MAD_TO_SIGMA * float(np.median([s.mad for s in summaries]))
        size_ns = float(np.mean([e.get("excess_ns") or 0 for e in spikes])) if spikes else 0.0
        try:
            model = theory.ClusterStepModel(base=0.0, noise=noise_ns / 1e6, p_rank=float(p_rank), spike_size=size_ns / 1e6,
                                            ranks_per_node=rpn, p_node=p_node, grid_points=4001)  # fmt: skip
            cur_nodes = int(cur.get("nodes") or diag.get("nodes") or 1)
            offset = float(np.median(finite)) / 1e6 - model.stats(cur_nodes).p50
            sizes = [int(n) for n in np.unique(np.round(np.geomspace(1, 4096, 14)).astype(int))]
            stats = [model.stats(n) for n in sizes]
            data.append({"type": "scatter", "mode": "lines+markers", "name": "expected step time (ms)", "x": sizes,
                         "y": [offset + s.mean for s in stats], "yaxis": "y2", "line": {"color": "#1f77b4"}})  # fmt: skip
            data.append({"type": "scatter", "mode": "lines", "name": "p99 step time (ms)", "x": sizes,
                         "y": [offset + s.p99 for s in stats], "yaxis": "y2", "line": {"color": "#1f77b4", "dash": "dash"}})  # fmt: skip
            note += (f"; step time: median {np.median(finite) / 1e6:.3g} ms here, rank noise {noise_ns / 1e6:.3g} ms, "
                     f"spike size {size_ns / 1e6:.3g} ms (hyperacc.theory.ClusterStepModel)")  # fmt: skip
        except theory.TheoryError:
            pass
    layout = _base_layout(
        xaxis={"type": "log", "title": {"text": "nodes"}},
        yaxis={"title": {"text": "P(cluster step spikes)"}, "range": [0, 1.02]},
        yaxis2={"title": {"text": "step time (ms)"}, "overlaying": "y", "side": "right"},
        legend={"orientation": "h", "y": 1.12},
    )
    return {"data": data, "layout": layout}, note


def _pacing(pace_bins, x_bins) -> dict | None:
    have = pace_bins[1] > 0
    if not have.any():
        return None
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(have, pace_bins[0] / pace_bins[1], np.nan)
        delay = np.where(have, pace_bins[2] / pace_bins[1] / 1e6, np.nan)
    return {
        "data": [
            {"type": "scatter", "mode": "lines", "name": "share of ranks pacing", "x": x_bins.tolist(),
             "y": np.round(share, 4).tolist(), "line": {"color": "#9467bd"}},
            {"type": "scatter", "mode": "lines", "name": "mean pacing delay (ms)", "x": x_bins.tolist(),
             "y": np.round(delay, 4).tolist(), "yaxis": "y2", "line": {"color": "#ff7f0e"}},
        ],
        "layout": _base_layout(height=320, xaxis={"title": {"text": "step"}}, yaxis={"range": [0, 1.02]},
                               yaxis2={"overlaying": "y", "side": "right", "title": {"text": "ms"}},
                               legend={"orientation": "h", "y": 1.15}),
    }  # fmt: skip


def _event_timeline(events: pa.Table, first: int, width: int) -> dict:
    kinds = events.column("kind").to_numpy(zero_copy_only=False)
    steps = events.column("step").cast(pa.float64()).to_numpy(zero_copy_only=False)
    durs = events.column("duration_ns").cast(pa.float64()).to_numpy(zero_copy_only=False)
    data = []
    for kind in sorted(set(kinds.tolist())):
        sel = (kinds == kind) & np.isfinite(steps)
        if not sel.any():
            continue
        s = steps[sel].astype(np.int64)
        b = (s - first) // width
        uniq, counts = np.unique(b, return_counts=True)
        cost = np.bincount(np.searchsorted(uniq, b), weights=np.nan_to_num(durs[sel]), minlength=uniq.size)
        data.append({"type": "scatter", "mode": "markers", "name": kind, "x": (first + uniq * width).tolist(),
                     "y": [kind] * uniq.size, "text": [f"{c} events, {t / 1e6:.2f} ms" for c, t in zip(counts, cost, strict=True)],
                     "hovertemplate": "step %{x}: %{text}<extra>%{y}</extra>",
                     "marker": {"size": (4 + 6 * np.log10(counts.clip(1))).round(1).tolist()}})  # fmt: skip
    return {"data": data, "layout": _base_layout(height=max(220, 60 + 40 * len(data)), showlegend=False,
                                                 xaxis={"title": {"text": "step"}}, yaxis={"type": "category"})}  # fmt: skip


def _table(headers: list[str], rows: list[list[Any]], flag_rows: set[int] | None = None) -> str:
    flag_rows = flag_rows or set()
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        cls = ' class="flag"' if i in flag_rows else ""
        body.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"

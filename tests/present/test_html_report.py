"""The self-contained HTML report: sections, what the plots hold, scaling, the CLI."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner
from plotly.offline import get_plotlyjs
from present_inputs import synthetic_run

from hyperacc.analysis import diagnose
from hyperacc.cli import cli
from hyperacc.present.report import build_report

SECTIONS = ("verdict", "heatmap", "steptime", "ranks", "nodes", "spike-rates", "causes", "projection")


def figures(html: str) -> dict:
    """The plotly figures the page draws (the JSON handed to Plotly.newPlot)."""
    payload = re.search(r"var figs=(\{.*?\});var n=0;", html, re.S).group(1)
    return json.loads(payload.replace("<\\/", "</"))


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("report") / "run"
    synthetic_run(d, ranks=6, steps=400, straggler=3, gc_spikes={1: [100, 150, 200, 250, 300], 4: [120]})
    return d, diagnose(d).to_dict()


def test_report_holds_every_section_offline(small_run, tmp_path):
    run, diag = small_run
    res = build_report(run, tmp_path / "r.html", diagnosis=diag)
    html = res.path.read_text()
    for sid in SECTIONS:
        assert f"id='{sid}'" in html, sid
    # self-contained: the plotly library is embedded and nothing else refers outside the file
    bundle = get_plotlyjs()
    assert bundle in html
    rest = html.replace(bundle, "")
    assert "<script src" not in rest and "http://" not in rest and "https://" not in rest
    assert "Plotly.newPlot" in rest
    assert diag["verdict"] in html.replace("&#x27;", "'")
    figs = figures(html)
    assert int(re.search(r"data-plots='(\d+)'", html).group(1)) == len(figs)
    # heatmap: one row per rank, the straggler starred, spikes marked where the diagnosis puts them
    heat = figs["plot-heatmap"]["data"]
    assert heat[0]["y"] == [f"rank {r}" + (" *" if r == 3 else "") for r in range(6)]
    assert len(heat[0]["x"]) == 400  # short run: one column per step
    marks = sorted((int(y.split()[1]), x) for t in heat[1:] for x, y in zip(t["x"], t["y"], strict=True))
    assert marks == sorted((e["rank"], e["step"]) for e in diag["spikes"]["events"])
    assert {t["name"] for t in heat[1:]} == {"spike: gc"}
    # step time over time: spikes annotated with their cause at their steps
    st = {t["name"]: t for t in figs["plot-steptime"]["data"]}
    assert sorted(st["spike: gc"]["x"]) == sorted({e["step"] for e in diag["spikes"]["events"]})
    # per-rank boxes: the flagged rank in red, its median is the slowest
    boxes = figs["plot-ranks"]["data"]
    red = [b["name"] for b in boxes if b["marker"]["color"] == "#d62728"]
    assert red == ["rank 3"] and max(boxes, key=lambda b: b["median"][0])["name"] == "rank 3"
    assert [b["name"] for b in figs["plot-nodes"]["data"]] == ["node 0", "node 1", "node 2"]
    # time lost per cause and projection from the diagnosis and hyperacc.theory
    causes = figs["plot-causes"]["data"][0]
    assert causes["x"] == [c["cause"] for c in diag["causes"]]
    proj = {t["name"]: t for t in figs["plot-projection"]["data"]}
    curve = proj["P(cluster step spikes)"]
    assert curve["x"][0] == 1 and curve["x"][-1] == 4096 and curve["y"] == sorted(curve["y"])
    assert "expected step time (ms)" in proj
    # the spike-rate table lists each rank with its interval
    assert "95 % interval" in html and "Per node" in html


def test_report_scales_by_binning_and_top_ranks(tmp_path):
    run = tmp_path / "big"
    synthetic_run(run, ranks=120, steps=3000, ranks_per_node=8, straggler=77, gc_spikes={5: [500, 1500, 2500]},
                  segment_steps=3000)  # fmt: skip
    diag = diagnose(run).to_dict()
    seen: list[float] = []
    res = build_report(run, tmp_path / "big.html", diagnosis=diag, step_bins=200, max_ranks=30,
                       progress=lambda _stage, done: seen.append(done))  # fmt: skip
    figs = figures(res.path.read_text())
    heat = figs["plot-heatmap"]["data"][0]
    assert res.step_bin == 15 and len(heat["x"]) == 200 and len(heat["y"]) == 30
    assert "rank 77 *" in heat["y"] and "rank 5" in heat["y"]  # the straggler and the spiky rank are kept
    assert len(figs["plot-ranks"]["data"]) == 30 and len(figs["plot-nodes"]["data"]) == 15
    assert res.bytes < 20e6
    assert seen == sorted(seen) and seen[-1] == 1.0


def test_report_without_the_analysis_still_draws_the_records(small_run, tmp_path):
    run, _ = small_run
    res = build_report(run, tmp_path / "plain.html", diagnosis=None)
    html = res.path.read_text()
    assert "analysis module is not available" in html
    figs = figures(html)
    assert set(figs) == {"plot-heatmap", "plot-steptime", "plot-ranks", "plot-nodes"}


def test_report_of_a_kineto_import_shows_runtime_api_latency(kineto_run, tmp_path):
    res = build_report(kineto_run, tmp_path / "k.html", diagnosis=diagnose(kineto_run, warmup_steps=0).to_dict())
    html = res.path.read_text()
    assert "id='runtime-api'" in html
    assert "rank 2: cudaLaunchKernel" in html and "OUTLIER" in html


def test_cli_report_prints_the_path_and_fails_in_one_line(small_run, tmp_path):
    run, _ = small_run
    runner = CliRunner()
    out = tmp_path / "cli.html"
    res = runner.invoke(cli, ["report", str(run), "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert str(out) in res.output and out.stat().st_size > 1e6
    bad = runner.invoke(cli, ["report", str(tmp_path / "missing")])
    assert bad.exit_code != 0 and "does not exist" in bad.output and "Traceback" not in bad.output
    assert len(bad.output.strip().splitlines()) == 1


def test_cli_import_kineto_imports_analyses_and_names_the_slow_launch_rank(four_rank_traces, tmp_path):
    runner = CliRunner()
    res = runner.invoke(cli, ["import-kineto", str(four_rank_traces), "--run-dir", str(tmp_path / "run")],
                        terminal_width=140)  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "imported 4 rank(s), 12 steps" in res.output
    assert "hyperacc analyze: 4 of 4 ranks" in res.output
    assert "CUDA runtime API latency" in res.output
    assert "rank 2: cudaLaunchKernel median" in res.output and "+30 %" in res.output
    js = runner.invoke(cli, ["import-kineto", str(four_rank_traces), "--run-dir", str(tmp_path / "run2"), "--json"])
    doc = json.loads(js.output)
    flagged = [(r["rank"], r["api"]) for r in doc["runtime_api"] if r["outlier"]]
    assert flagged == [(2, "cudaLaunchKernel")] and doc["diagnosis"]["world_size"] == 4
    bad = runner.invoke(cli, ["import-kineto", str(tmp_path / "nothing.json"), "--run-dir", str(tmp_path / "r3")])
    assert bad.exit_code != 0 and "nothing.json" in bad.output and "Traceback" not in bad.output

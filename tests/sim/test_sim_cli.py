"""``hyperacc simulate`` as a user runs it: tables, JSON, plots, and one-line errors for bad input."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from hyperacc.cli import cli


def invoke(*args: str):
    return CliRunner().invoke(cli, ["simulate", *args])


def test_json_has_one_result_per_node_count_with_theory_and_pacing() -> None:
    res = invoke("--nodes", "1,4", "--gpus-per-node", "4", "--steps", "300", "--spike-rate", "0.01", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert [r["nodes"] for r in out["results"]] == [1, 4]
    for r in out["results"]:
        assert r["theory_spike_probability"] == pytest.approx(1 - 0.99 ** (4 * r["nodes"]))
        assert r["paced"] is not None and r["baseline"]["p99_ms"] >= r["baseline"]["p50_ms"]
    assert out["results"][0]["baseline"]["efficiency"] == pytest.approx(1.0)


def test_table_and_html_plot(tmp_path) -> None:
    plot = tmp_path / "scaling.html"
    res = invoke("--nodes", "1,2", "--steps", "200", "--no-pacing", "--plot", str(plot))
    assert res.exit_code == 0, res.output
    assert "samples/s" in res.output and "paced" not in res.output
    assert plot.exists() and "plotly" in plot.read_text()[:200000].lower()


def test_png_plot_without_matplotlib_falls_back_to_html(tmp_path) -> None:
    pytest.importorskip("plotly")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        res = invoke("--nodes", "1", "--steps", "100", "--plot", str(tmp_path / "s.png"))
        assert res.exit_code == 0, res.output
        assert (tmp_path / "s.html").exists()
    else:
        res = invoke("--nodes", "1", "--steps", "100", "--plot", str(tmp_path / "s.png"))
        assert res.exit_code == 0, res.output
        assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


def test_write_run_then_simulate_from_it(tmp_path) -> None:
    run = tmp_path / "run"
    shape = ["--nodes", "1", "--gpus-per-node", "4", "--steps", "200"]
    res = invoke(*shape, "--locality-gpu", "0.1", "--write-run", str(run))
    assert res.exit_code == 0, res.output
    res = invoke("--from-run", str(run), "--nodes", "1,8", "--gpus-per-node", "4", "--steps", "200", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert [r["ranks"] for r in out["results"]] == [4, 32]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--nodes", "1,x"], "--nodes"),
        (["--nodes", "0"], "--nodes"),
        (["--nodes", "9000", "--gpus-per-node", "8"], "65536"),
        (["--spike-rate", "2"], "--spike-rate"),
        (["--steps", "abc"], "--steps"),
        (["--pace-gain", "3"], "--pace-gain"),
        (["--oversubscription", "0.5"], "--oversubscription"),
        (["--from-run", "/nonexistent/run"], "--from-run"),
        (["--plot", "out.pdf"], "--plot"),
        (["--write-run", "x", "--nodes", "1,2"], "--write-run"),
    ],
)
def test_bad_input_is_one_clear_line_and_a_nonzero_exit(args, needle) -> None:
    res = invoke("--steps", "50", *args) if "--steps" not in args else invoke(*args)
    assert res.exit_code != 0
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1, res.output
    assert lines[0].startswith("Error:") and needle in lines[0], lines[0]
    assert "Traceback" not in res.output


@pytest.fixture
def measured(tmp_path):
    run = tmp_path / "run"
    res = invoke("--nodes", "1", "--gpus-per-node", "4", "--steps", "200", "--locality-gpu", "0.1",
                 "--write-run", str(run), "--no-pacing")  # fmt: skip
    assert res.exit_code == 0, res.output
    return run


def test_from_run_prints_every_assumption(measured) -> None:
    res = invoke("--from-run", str(measured), "--nodes", "1,8", "--gpus-per-node", "4", "--steps", "200")
    assert res.exit_code == 0, res.output
    text = res.output
    assert "assumptions (trace-driven" in text
    assert "same measured step" in text and "runs of 50 consecutive steps" in text
    assert "1 nodes: all-reduce: the measured transfer of the replayed step (copy 0), unscaled" in text
    assert "8 nodes: all-reduce: the measured transfer x " in text and "exposed 100 MB" in text
    assert "no contention" in text
    out = json.loads(invoke("--from-run", str(measured), "--nodes", "8", "--gpus-per-node", "4", "--steps",
                            "100", "--comm-scale", "none", "--json").stdout)  # fmt: skip
    assert any("unscaled (--comm-scale none)" in line for line in out["assumptions"]["8"])


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--base-ms", "50"], "--base-ms has no effect with --from-run"),
        (["--spike-rate", "0.01"], "--spike-rate has no effect with --from-run"),
        (["--locality-gpu", "0.1"], "--locality-gpu has no effect with --from-run"),
        (["--background-load", "0.3"], "--background-load has no effect with --from-run"),
        (["--comm-scale", "none", "--exposed-mb", "10"], "--exposed-mb only scales the measured transfer"),
        (["--replay-block", "0"], "'--replay-block': 0 is not in the range"),
    ],
)
def test_from_run_refuses_options_it_would_ignore(measured, args, needle) -> None:
    res = invoke("--from-run", str(measured), "--steps", "50", *args)
    assert res.exit_code != 0
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], res.output


def test_replay_options_need_from_run() -> None:
    res = invoke("--steps", "50", "--replay-block", "20")
    assert res.exit_code != 0 and "--replay-block applies to --from-run only" in res.output

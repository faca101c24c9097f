"""``hyperacc analyze`` through click, as a user runs it."""

import json

from analysis_runs import SLOW_RANK
from click.testing import CliRunner

from hyperacc.cli import cli


def test_terminal_output_has_verdict_evidence_tables_and_projection(faulty_run):
    result = CliRunner().invoke(cli, ["analyze", str(faulty_run)], terminal_width=160)
    assert result.exit_code == 0, result.output
    out = result.output
    assert f"Rank {SLOW_RANK} (node 1) is a persistent compute straggler" in out
    for heading in ("Evidence", "Next step", "Stragglers", "Spike rate per rank", "Spike rate per node",
                    "Causes, ranked by time lost", "Projection"):  # fmt: skip
        assert heading in out


def test_json_is_the_diagnosis_document(faulty_run):
    result = CliRunner().invoke(cli, ["analyze", str(faulty_run), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["schema_version"] == 1 and doc["stragglers"][0]["rank"] == SLOW_RANK


def test_threshold_options_reach_the_rules(faulty_run):
    result = CliRunner().invoke(cli, ["analyze", str(faulty_run), "--json", "--min-slowdown", "0.5",
                                      "--persist", "2/4", "--spike-floor-ms", "2", "--target", "0.1"])  # fmt: skip
    doc = json.loads(result.output)
    assert doc["stragglers"] == []
    o = doc["options"]
    assert (o["min_slowdown"], o["persist_k"], o["persist_n"], o["spike_floor_ns"], o["target"]) == (
        0.5, 2, 4, 2_000_000, 0.1)  # fmt: skip


def test_bad_input_is_one_line_and_nonzero(tmp_path):
    runner = CliRunner()
    for args in (["analyze", str(tmp_path / "missing")], ["analyze", str(tmp_path)],
                 ["analyze", str(tmp_path), "--persist", "7/5"]):  # fmt: skip
        result = runner.invoke(cli, args)
        assert result.exit_code != 0
        assert "Traceback" not in result.output and len(result.output.strip().splitlines()) <= 3
    result = runner.invoke(cli, ["analyze", str(tmp_path / "missing")])
    assert "does not exist" in result.output and result.exit_code == 2  # a mistyped path: bad input
    result = runner.invoke(cli, ["analyze", str(tmp_path)])
    assert "not a hyperacc run directory" in result.output and result.exit_code == 1  # nothing to analyse

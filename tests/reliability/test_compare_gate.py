"""``compare --fail-on`` as a CI gate: a limit either holds or is broken; a limit that cannot be checked
is an error (exit 2, naming what is missing), never a pass (issue 23, item 3; docs/reliability.md).
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from reliability_runs import check_cli_result

from hyperacc.analysis.synthetic import SyntheticRun, write_run
from hyperacc.cli import cli

FAST = SyntheticRun(ranks=2, steps=300, ranks_per_node=2, seed=1, segment_steps=100)
# every phase 16x longer: throughput falls by about 94 %
SLOW = SyntheticRun(ranks=2, steps=300, ranks_per_node=2, seed=2, segment_steps=100, data_ms=32, forward_ms=160,
                    backward_ms=320, optimizer_ms=48, other_ms=16, collective_ms=32)  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("gate")
    return str(write_run(root / "a", FAST)), str(write_run(root / "b", SLOW))


def _compare(*args: str):
    result = CliRunner().invoke(cli, ["compare", *args], terminal_width=200)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    if result.exit_code == 2:
        check_cli_result(result)  # one line naming the option, no traceback
    return result


def test_a_gate_on_a_figure_that_cannot_be_computed_is_an_error(runs) -> None:
    a, b = runs
    result = _compare(a, b, "--fail-on", "samples_per_s=-5%")
    assert result.exit_code == 2, result.output
    assert "Within limits" not in result.output
    assert "samples_per_s" in result.output and "--batch-size" in result.output
    assert "--fail-on" in result.output
    # with the batch size the figure exists, and a 94 % drop breaks the gate
    result = _compare(a, b, "--fail-on", "samples_per_s=-5%", "--batch-size", "32")
    assert result.exit_code == 1, result.output
    assert "samples_per_s=-5%" in result.output


@pytest.mark.parametrize("text", ["", " ", ",", " , ", "p99=+10%,", ",p99=+10%", "p99=+10%,,cv=+1"])
def test_an_empty_gate_is_refused_like_a_malformed_one(runs, text: str) -> None:
    a, b = runs
    result = _compare(a, b, "--fail-on", text)
    assert result.exit_code == 2, result.output
    assert "--fail-on" in result.output and "empty" in result.output


def test_a_gate_that_holds_passes_and_one_that_breaks_fails(runs) -> None:
    a, b = runs
    assert _compare(a, a, "--fail-on", "p99=+10%,steps_per_s=-5%").exit_code == 0
    assert _compare(a, b, "--fail-on", "steps_per_s=-5%").exit_code == 1

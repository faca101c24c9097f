"""Every command's exit status matches the table in docs/reliability.md ("Exit status"): 2 for input
that cannot be used (a mistyped path included), checked before anything is read; 1 when the command
could not do its work with what it was given (a run directory without step records); one line either
way (issue 23, item 7)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from reliability_runs import ROOT, check_cli_result, small_run

from hyperacc.cli import cli

# command -> its arguments around a run directory
COMMANDS = {
    "analyze": lambda d, out: ["analyze", d],
    "report": lambda d, out: ["report", d, "-o", str(out / "r.html")],
    "export": lambda d, out: ["export", d, "--chrome", str(out / "t.json")],
    "compare": lambda d, out: ["compare", d, d],
    "watch": lambda d, out: ["watch", d, "--once"],
    "simulate": lambda d, out: ["simulate", "--from-run", d, "--steps", "100"],
}


def _invoke(args: list[str]):
    result = CliRunner().invoke(cli, args, terminal_width=200)
    check_cli_result(result)
    return result


@pytest.fixture
def without_records(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "steps" / "rank-00000").mkdir(parents=True)
    (run / "meta").mkdir()
    return run


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_run_directory_without_step_records_is_exit_status_1(name: str, without_records: Path, tmp_path: Path):
    result = _invoke(COMMANDS[name](str(without_records), tmp_path))
    assert result.exit_code == 1, result.output
    assert str(without_records) in result.output or "no " in result.output


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_run_directory_that_does_not_exist_is_exit_status_2(name: str, tmp_path: Path):
    missing = str(tmp_path / "nowhere")
    result = _invoke(COMMANDS[name](missing, tmp_path))
    assert result.exit_code == 2, result.output
    assert missing in result.output


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_run_with_records_is_exit_status_0(name: str, tmp_path: Path):
    run = str(small_run(tmp_path / "run"))
    assert _invoke(COMMANDS[name](run, tmp_path)).exit_code == 0


def test_the_documented_table_names_every_command() -> None:
    text = (ROOT / "docs" / "reliability.md").read_text()
    section = text[text.index("### Exit status"):]
    table = next(block for block in section.split("\n\n") if block.startswith("| command |"))
    rows = {m.group(1) for m in re.finditer(r"^\| `?([a-z-]+)`? \|", table, re.M)}
    from hyperacc.cli import COMMANDS as ALL

    assert rows >= set(ALL), sorted(set(ALL) - rows)

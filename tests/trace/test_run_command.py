"""``hyperacc run`` arguments and ``python -m hyperacc.bootstrap`` usage errors (nothing is launched)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hyperacc import bootstrap
from hyperacc.cli import cli


def test_dry_run_shows_the_torchrun_command_and_environment(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    result = CliRunner().invoke(cli, [
        "run", "--run-dir", str(tmp_path / "runs"), "--nproc-per-node", "4", "--trace", '{"window": 20}',
        "--chaos", '{"faults": []}', "--torchrun-arg", "--numa-binding node", "--dry-run",
        "--", str(script), "--lr", "0.1", "--nproc-per-node", "9",
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert lines[0] == f"HYPERACC_RUN_DIR={(tmp_path / 'runs').resolve()}"
    assert "HYPERACC_TRACE=" in lines[1] and "HYPERACC_CHAOS=" in lines[2]
    cmd = shlex.split(lines[-1])
    assert cmd[1:6] == ["-m", "torch.distributed.run", "--nproc-per-node", "4", "--standalone"]
    assert cmd[cmd.index("--numa-binding") + 1] == "node"
    # everything after the script is the script's, even options that look like ours
    tail = cmd[cmd.index("--no-python") + 1 :]
    assert tail == [sys.executable, "-u", "-mhyperacc.bootstrap", str(script), "--lr", "0.1", "--nproc-per-node", "9"]


def test_multi_node_options_reach_torchrun_without_standalone(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    result = CliRunner().invoke(cli, [
        "run", "--run-dir", str(tmp_path), "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
        "--master-port", "29500", "--dry-run", "--", str(script),
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    cmd = shlex.split(result.output.strip().splitlines()[-1])
    assert "--standalone" not in cmd
    assert cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--node-rank") + 1] == "1"
    assert cmd[cmd.index("--master-addr") + 1] == "10.0.0.1"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--chaos", "{oops"], "not valid JSON"),
        (["--trace", '{"windw": 3}'], "unknown trace option(s) windw"),
        (["--trace", "[1, 2]"], "must be a JSON object"),
    ],
)
def test_bad_options_fail_with_one_clear_line(tmp_path: Path, args: list[str], message: str) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    result = CliRunner().invoke(cli, ["run", "--run-dir", str(tmp_path), *args, "--", str(script)])
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


def test_missing_script_is_named(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["run", "--run-dir", str(tmp_path), "--", "nowhere.py"])
    assert result.exit_code == 2 and "training script 'nowhere.py' not found" in result.output


def test_bootstrap_usage_errors() -> None:
    with pytest.raises(SystemExit, match="usage"):
        bootstrap.main([])
    with pytest.raises(SystemExit, match="training script 'missing.py' not found"):
        bootstrap.main(["missing.py"])

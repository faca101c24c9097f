"""Integers are integers, every option is checked before anything starts, and the message names it
(issue 23, item 6; docs/options.md).

``--remediate '{"mode": "auto", "max_drains": 1.5}'`` used to build ``--max-restarts 1.5`` for torchrun
to reject, and a policy file with ``max_drains = "two"`` failed with "'<' not supported between
instances of 'str' and 'int'". Both now end ``hyperacc run`` with one line naming
``remediation.max_drains`` before the training script starts. The same typed check covers every
configurable part: one case per parser below.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from reliability_runs import ROOT, check_cli_result

from hyperacc.analysis.options import DetectionOptions
from hyperacc.chaos import ChaosConfigError, parse_config
from hyperacc.cli import cli
from hyperacc.options import OptionsError
from hyperacc.pacing import PacingConfigError
from hyperacc.pacing.runtime import config_from_json
from hyperacc.preflight import DoctorConfigError, DoctorOptions
from hyperacc.remediation import RemediationConfig, RemediationConfigError
from hyperacc.sim import SimConfigError
from hyperacc.stabilize import config_from_dict
from hyperacc.trace import TraceConfigError, TraceOptions

# A script that leaves a mark when it runs: its absence shows that nothing was started.
SCRIPT = "import pathlib, sys\npathlib.Path(sys.argv[1]).write_text('started')\n"


def _run(tmp_path: Path, remediate: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "hyperacc", "run", "--run-dir", str(tmp_path / "run"), "--quiet",
           "--remediate", remediate, "--", str(script), str(tmp_path / "started")]  # fmt: skip
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)


def _one_line_naming(proc: subprocess.CompletedProcess, tmp_path: Path, name: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert name in lines[0] and "--remediate" in lines[0], lines[0]
    assert not (tmp_path / "started").exists(), "the training script ran"
    return lines[0]


def test_remediate_json_with_a_fractional_max_drains_is_refused_before_the_job_starts(tmp_path):
    line = _one_line_naming(_run(tmp_path, '{"mode": "auto", "max_drains": 1.5}'), tmp_path, "remediation.max_drains")
    assert "must be an integer" in line and "1.5" in line


def test_remediate_toml_with_a_word_for_max_drains_is_refused_before_the_job_starts(tmp_path):
    policy = tmp_path / "policy.toml"
    policy.write_text('[remediate]\nmode = "auto"\nmax_drains = "two"\n')
    line = _one_line_naming(_run(tmp_path, str(policy)), tmp_path, "remediation.max_drains")
    assert "must be an integer" in line and "'two'" in line and "not supported" not in line


@pytest.mark.parametrize(
    ("option", "value", "name"),
    [
        ("--trace", '{"window": 1.5}', "trace.window"),
        ("--trace", '{"probe_every": "two"}', "trace.probe_every"),
        ("--pace", '{"on_steps": 2.5}', "pacing.on_steps"),
        ("--chaos", '{"faults": [{"kind": "competitor", "procs": "two"}]}', "chaos.faults[0].procs"),
        ("--chaos", '{"seed": 1.5}', "chaos.seed"),
        ("--stabilize", '{"memory": {"interval": 1.5}}', "stabilize.memory.interval"),
        ("--stabilize", '{"affinity": {"workers_per_rank": true}}', "stabilize.affinity.workers_per_rank"),
        ("--remediate", '{"mode": "auto", "gc_lead_steps": "20"}', "remediation.gc_lead_steps"),
    ],
)
def test_every_launch_option_is_typed_and_named(tmp_path, option, value, name):
    """In-process (click's runner, ``--dry-run``): exit 2, one line naming the option."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    args = ["run", "--run-dir", str(tmp_path / "run"), "--dry-run", option, value, "--", str(script), "x"]
    result = CliRunner().invoke(cli, args)
    check_cli_result(result)
    assert result.exit_code == 2, result.output
    assert name in result.output and option in result.output, result.output


@pytest.mark.parametrize(
    ("read", "name", "allowed"),
    [
        (lambda: TraceOptions.from_json('{"capacity": 1.5}'), "trace.capacity", "an integer"),
        (lambda: DetectionOptions.from_mapping({"window_steps": "two"}), "detection.window_steps", "an integer"),
        (lambda: DetectionOptions(min_ranks=True), "detection.min_ranks", "an integer"),  # a bool is no int
        (lambda: DetectionOptions(z_threshold="3.5"), "detection.z_threshold", "a finite number"),
        (lambda: config_from_dict({"memory": {"interval": 2.5}}), "stabilize.memory.interval", "an integer"),
        (lambda: config_from_dict({"gc": {"valve_poll_s": "often"}}), "stabilize.gc.valve_poll_s", "number"),
        (lambda: RemediationConfig.parse('{"max_drains": 1.5}'), "remediation.max_drains", "an integer"),
        (lambda: RemediationConfig(max_drains="two"), "remediation.max_drains", "an integer"),
        (lambda: RemediationConfig.parse('{"drain_kinds": "compute"}'), "remediation.drain_kinds", "a list"),
        (lambda: DoctorOptions.from_json('{"rounds": 2.5}'), "doctor.rounds", "an integer"),
        (lambda: DoctorOptions(min_ranks=2), "doctor.min_ranks", ">= 3"),  # checked by the analyze rules
        (lambda: config_from_json('{"max_delay_ns": 1.5}'), "pacing.max_delay_ns", "an integer"),
        (lambda: parse_config({"faults": [{"kind": "spike", "ranks": [1.5]}]}), "chaos.faults[0].ranks", "integers"),
    ],
)
def test_each_part_refuses_a_mistyped_value_by_its_name(read, name, allowed):
    with pytest.raises(OptionsError) as info:
        read()
    text = str(info.value)
    assert name in text and allowed in text and "\n" not in text, text


def test_unknown_keys_are_refused_with_the_known_ones(tmp_path):
    with pytest.raises(OptionsError, match=r"unknown remediation option\(s\) \['max_drain'\]; known: .*max_drains"):
        RemediationConfig.parse(json.dumps({"max_drain": 1}))
    policy = tmp_path / "p.toml"
    policy.write_text("max_drain = 1\n")
    with pytest.raises(OptionsError, match=r"^.*p\.toml: unknown remediation option\(s\) \['max_drain'\]"):
        RemediationConfig.parse(str(policy))
    with pytest.raises(OptionsError, match=r"unknown pacing option\(s\) \['gian'\]; known: .*gain"):
        config_from_json('{"gian": 0.5}')


def test_the_old_error_names_are_the_one_type():
    for alias in (TraceConfigError, PacingConfigError, DoctorConfigError, RemediationConfigError,
                  ChaosConfigError, SimConfigError):  # fmt: skip
        assert alias is OptionsError
    assert issubclass(OptionsError, ValueError)  # callers that catch ValueError keep working

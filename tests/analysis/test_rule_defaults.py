"""The outlier rule's defaults have one definition (DetectionOptions): the doctor takes them from there,
and the defaults that ``hyperacc analyze --help`` shows are checked against it."""

from __future__ import annotations

import re

import pytest

from hyperacc.analysis.options import DetectionOptions
from hyperacc.preflight.options import DoctorOptions


def test_the_doctor_judges_with_analyze_defaults():
    rule, doctor = DetectionOptions(), DoctorOptions()
    assert (doctor.min_ranks, doctor.z_threshold, doctor.iqr_k) == (rule.min_ranks, rule.z_threshold, rule.iqr_k)
    det = doctor.detection()
    assert (det.outlier_rule, det.min_mad_rel) == (rule.outlier_rule, rule.min_mad_rel)


@pytest.mark.parametrize(
    "option, shown",
    [
        ("--z-threshold", lambda o: f"{o.z_threshold:g}"),
        ("--iqr-k", lambda o: f"{o.iqr_k:g}"),
        ("--rule", lambda o: o.outlier_rule),
        ("--min-slowdown", lambda o: f"{o.min_slowdown:g}"),
        ("--window-steps", lambda o: f"{o.window_steps}"),
        ("--persist", lambda o: f"{o.persist_k}/{o.persist_n}"),
        ("--spike-mad", lambda o: f"{o.spike_mad:g}"),
        ("--spike-floor-ms", lambda o: f"{o.spike_floor_ns / 1e6:g}"),
        ("--spike-floor-rel", lambda o: f"{o.spike_floor_rel:g}"),
        ("--spike-window", lambda o: f"{o.spike_window}"),
        ("--spike-metric", lambda o: o.spike_metric),
        ("--warmup-steps", lambda o: f"{o.warmup_steps}"),
        ("--target", lambda o: f"{o.target:g}"),
        ("--top", lambda o: f"{o.top_events}"),
    ],
)
def test_analyze_help_shows_the_defaults_that_run(option, shown):
    from hyperacc.commands.analyze import command

    param = next(p for p in command.params if option in p.opts)
    found = re.search(r"\[([^\]]+)\]\.?$", param.help)
    assert found, f"{option}: no [default] at the end of its help"
    assert found.group(1) == shown(DetectionOptions())


@pytest.mark.parametrize("name", ["analyze", "doctor"])
def test_help_names_no_missing_bound(name):
    # an unbounded number's range read "x<=None" beside every such option before 2026-12-05
    from click.testing import CliRunner

    from hyperacc.cli import cli

    out = CliRunner().invoke(cli, [name, "--help"], terminal_width=200)
    assert out.exit_code == 0 and "None" not in out.output, out.output

"""Automatic tracing of a compiled model: no recompilation, no warning, forward still timed.

TorchDynamo guards on the number of global module hooks, and ``OptimizedModule`` warns while any
exists; automatic tracing uses global hooks for its first step. A compiled model must be compiled as
often under hyperacc as without it (a recompilation of a large model costs minutes), print nothing more,
and train to the same parameters.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hyperacc import store

JOB = Path(__file__).parent / "jobs" / "compiled_job.py"
pytestmark = pytest.mark.slow


def _run(tmp_path: Path, mode: str, traced: bool) -> dict:
    name = f"{mode}-{'traced' if traced else 'plain'}"
    args = [sys.executable, str(JOB), mode, str(tmp_path / f"{name}.store")]
    if traced:
        args.append(str(tmp_path / name))
    out = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["wrap", "blocks", "outer"])
def test_a_compiled_model_is_compiled_as_often_and_warns_no_more_under_automatic_tracing(
    tmp_path: Path, mode: str
) -> None:
    plain, traced = _run(tmp_path, mode, False), _run(tmp_path, mode, True)
    assert traced["graphs"] == plain["graphs"], (plain, traced)  # one more is a recompilation
    assert traced["warnings"] == plain["warnings"]
    assert traced["checksum"] == plain["checksum"]
    rows = store.read_steps(tmp_path / f"{mode}-traced", ["step", "forward_ns", "backward_ns"]).to_pylist()
    assert [r["step"] for r in rows] == list(range(6))
    assert all(r["forward_ns"] and r["forward_ns"] > 0 for r in rows), rows  # the compiled forward is timed

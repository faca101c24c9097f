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


MODES = ["wrap", "blocks", "outer"]


def _run(tmp_path: Path, run_dir: str, *modes: str) -> dict[str, dict]:
    store = tmp_path / f"{run_dir.replace('/', '_')}.store"
    out = subprocess.run([sys.executable, str(JOB), str(store), run_dir, *modes], capture_output=True, text=True,
                         timeout=240)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return {r["mode"]: r for r in map(json.loads, out.stdout.strip().splitlines())}


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every mode without hyperacc, in one process (Dynamo reset between them)."""
    return _run(tmp_path_factory.mktemp("plain"), "-", *MODES)


@pytest.mark.parametrize("mode", MODES)
def test_a_compiled_model_is_compiled_as_often_and_warns_no_more_under_automatic_tracing(
    tmp_path: Path, plain: dict[str, dict], mode: str
) -> None:
    traced = _run(tmp_path, str(tmp_path / "run"), mode)[mode]
    assert traced["graphs"] == plain[mode]["graphs"], (plain[mode], traced)  # one more is a recompilation
    assert traced["warnings"] == plain[mode]["warnings"]
    assert traced["checksum"] == plain[mode]["checksum"]
    rows = store.read_steps(tmp_path / "run", ["step", "forward_ns", "backward_ns"]).to_pylist()
    assert [r["step"] for r in rows] == list(range(6))
    assert all(r["forward_ns"] and r["forward_ns"] > 0 for r in rows), rows  # the compiled forward is timed

"""``hyperacc export --chrome`` interrupted by SIGINT or SIGTERM, or failing on a full disk (a write
beyond the file-size limit, RLIMIT_FSIZE: a real write error without root), leaves nothing behind: no
``.tmp``, no half trace (docs/presentation.md, "Timeline export"). ``--ranks`` exports only the ranks
asked for."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from reliability_runs import ROOT

from hyperacc.analysis.synthetic import SyntheticRun, write_run


@pytest.fixture(scope="module")
def big_run(tmp_path_factory) -> Path:
    """Long enough that an export takes several seconds here (80,000 step records, ~400,000 trace events)."""
    return write_run(tmp_path_factory.mktemp("export") / "run", SyntheticRun(ranks=4, steps=20_000, seed=3))


def _as_from_a_terminal() -> None:
    # Ctrl-C reaches a command typed in a terminal; a suite started in the background of a
    # non-interactive shell hands SIGINT down ignored, and Python then keeps it ignored
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _export(run: Path, out: Path, *extra: str, preexec_fn=None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}

    def child_setup() -> None:
        _as_from_a_terminal()
        if preexec_fn is not None:
            preexec_fn()

    return subprocess.Popen([sys.executable, "-m", "hyperacc", "export", str(run), "--chrome", str(out), "--no-diagnosis",
                             *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=child_setup)  # fmt: skip


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_export_leaves_nothing_behind(big_run: Path, tmp_path: Path, sig: signal.Signals) -> None:
    out = tmp_path / "trace.json"
    tmp = out.with_name(out.name + ".tmp")
    proc = _export(big_run, out)
    deadline = time.monotonic() + 240
    while not (tmp.exists() and tmp.stat().st_size > 100_000):  # mid-write
        assert proc.poll() is None, f"the export ended before it could be interrupted:\n{proc.communicate()[0]}"
        assert time.monotonic() < deadline, "the export never started writing"
        time.sleep(0.05)
    proc.send_signal(sig)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, output
    assert "Traceback" not in output, output
    assert sorted(p.name for p in tmp_path.iterdir()) == [], output  # neither the .tmp nor a half trace


def test_a_full_disk_during_export_leaves_nothing_behind(big_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "trace.json"

    def limit() -> None:  # writes beyond 2 MB fail with EFBIG, as they would on a full disk with ENOSPC
        resource.setrlimit(resource.RLIMIT_FSIZE, (2_000_000, 2_000_000))

    proc = _export(big_run, out, preexec_fn=limit)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, output
    errors = [line for line in output.splitlines() if line.strip()]
    assert len(errors) == 1 and "cannot write the trace" in errors[0] and "too large" in errors[0], output
    assert sorted(p.name for p in tmp_path.iterdir()) == [], output


def test_ranks_and_steps_select_what_is_exported(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", SyntheticRun(ranks=4, steps=300, seed=3))
    out = tmp_path / "trace.json"
    proc = _export(run, out, "--ranks", "1,3", "--steps", "100:150")
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    events = json.loads(out.read_text())["traceEvents"]
    steps = [e for e in events if e.get("cat") == "step"]
    assert {e["pid"] for e in events} == {1, 3}
    assert sorted({e["args"]["step"] for e in steps}) == list(range(100, 150)) and len(steps) == 2 * 50
    bad = _export(run, out, "--ranks", "2-1")
    output, _ = bad.communicate(timeout=300)
    assert bad.returncode == 2 and "--ranks '2-1'" in output, output
    none = _export(run, tmp_path / "none.json", "--ranks", "9")
    output, _ = none.communicate(timeout=300)
    assert none.returncode == 1 and "--ranks: none of 9" in output and not (tmp_path / "none.json").exists(), output

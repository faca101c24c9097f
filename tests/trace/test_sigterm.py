"""SIGTERM flushes everything recorded, then the previous handler runs (or the default terminates)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hyperacc import store

pytestmark = pytest.mark.slow  # each test starts its own interpreter

LOOP = """
import signal, sys, time
from hyperacc.trace import Tracer

run_dir, marker, user = sys.argv[1], sys.argv[2], sys.argv[3] == "user"
if user:
    def on_term(signum, frame):
        open(marker, "w").write("user handler ran")
        sys.exit(17)
    signal.signal(signal.SIGTERM, on_term)
tracer = Tracer(run_dir, rank=0, flush_every_s=3600, window=0)  # no periodic flush: only SIGTERM's
step = 0
while True:
    with tracer.step():
        with tracer.phase("forward"):
            time.sleep(0.002)
    step += 1
    if step == 20:
        print("ready", flush=True)
"""


@pytest.mark.parametrize("handler", ["user", "default"])
def test_sigterm_flushes_then_chains(tmp_path: Path, handler: str) -> None:
    run_dir, marker = tmp_path / "run", tmp_path / "marker"
    proc = subprocess.Popen(
        [sys.executable, "-c", LOOP, str(run_dir), str(marker), handler],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.strip() == "ready", proc.stderr.read()
        time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
    finally:
        proc.kill()
    if handler == "user":
        assert code == 17 and marker.read_text() == "user handler ran"
    else:
        assert code == -signal.SIGTERM
    steps = store.read_steps(run_dir)["step"].to_pylist()
    assert len(steps) >= 20 and steps == list(range(len(steps)))


CLOSING = """
import os, signal, sys
from hyperacc import records
from hyperacc.trace import Tracer

run_dir, where = sys.argv[1], sys.argv[2]
tracer = Tracer(run_dir, rank=0, flush_every_s=3600, window=0, probe_every=0)
for _ in range(3000):
    with tracer.step():
        pass
write = records.RecordWriter.write_int64
def write_after_sigterm(self, rows):
    # SIGTERM arrives while close() is flushing: before this segment reaches the disk
    os.kill(os.getpid(), signal.SIGTERM)
    return write(self, rows)
records.RecordWriter.write_int64 = write_after_sigterm
if where == "close":
    tracer.close()
else:  # interpreter exit: atexit runs close()
    sys.exit(0)
print("not terminated", flush=True)
"""


@pytest.mark.parametrize("where", ["close", "exit"])
def test_sigterm_during_close_keeps_every_row_then_terminates(tmp_path: Path, where: str) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", CLOSING, str(run_dir), where], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -signal.SIGTERM, proc.stderr[-3000:]
    assert "not terminated" not in proc.stdout
    assert store.read_steps(run_dir)["step"].to_pylist() == list(range(3000))
    assert not list(run_dir.rglob("*.tmp"))

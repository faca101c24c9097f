"""Signals to ``hyperacc run`` started in a real terminal (a pty whose foreground process group is the
launcher's, as in an interactive shell), beside the same job through torchrun alone in its own
terminal, one rank each to keep the machine free (issue 23, item 2; docs/reliability.md, "Faults").

A SIGINT that did not come from the terminal (``kill -INT``) must stop the job as it stops plain
torchrun; the terminal's own Ctrl-C must too, and the exit status is torchrun's in both cases.
"""

from __future__ import annotations

import os
import pty
import signal
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from reliability_runs import ddp_command, flushes, job_env, rank_processes

from hyperacc.analysis.columns import discover, read_rank

pytestmark = pytest.mark.multirank
TRACE = '{"flush_every_s": 0.5, "window": 0}'
STEPS = 1_000_000  # far more than the test waits for: the job must be stopped, not finish


class Terminal:
    """``cmd`` started as the foreground process group of a new pty (its controlling terminal)."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: a session leader whose controlling terminal is the pty
            try:
                os.execve(cmd[0], cmd, env)
            finally:
                os._exit(127)
        self.output = bytearray()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.status: int | None = None

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:
                return
            if not chunk:
                return
            self.output += chunk

    def ctrl_c(self) -> None:
        os.write(self.fd, b"\x03")  # the line discipline sends SIGINT to the foreground process group

    def wait(self, timeout: float) -> int | None:
        """The exit status as a shell shows it, or None when still running after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
                return self.status if self.status >= 0 else 128 - self.status
            time.sleep(0.1)
        return None

    def kill_all(self) -> None:
        try:
            kids = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            kids = []
        for p in [*kids]:
            try:
                p.kill()
            except psutil.Error:
                pass
        if self.status is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        psutil.wait_procs(kids, timeout=10)
        os.close(self.fd)


def _steps(run_dir: Path) -> dict[int, np.ndarray]:
    return {r: read_rank(src.segments, ("step",))["step"] for r, src in discover(run_dir).sources.items()}


def _started(term: Terminal, ready, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(rank_processes(psutil.Process(term.pid))) == 1 and ready():
            return
        if term.wait(0) is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"the job never got ready:\n{term.output.decode(errors='replace')[-3000:]}")


def _interrupt(term: Terminal, how: str) -> None:
    if how.startswith("kill"):
        os.kill(term.pid, signal.SIGINT)
    else:
        term.ctrl_c()


def _plain_code(how: str, env: dict[str, str]) -> int | None:
    """Plain torchrun's exit status for ``how``, in a run of its own."""
    plain = Terminal(ddp_command(None, STEPS, nproc=1), env)
    try:
        _started(plain, lambda: True)
        time.sleep(1.0)
        _interrupt(plain, how)
        return plain.wait(120)
    finally:
        plain.kill_all()


@pytest.mark.parametrize("how", ["kill -INT the launcher", "Ctrl-C in the terminal"])
def test_sigint_stops_a_job_in_a_terminal_as_it_stops_torchrun(tmp_path: Path, how: str) -> None:
    run_dir = tmp_path / "run"
    env = job_env(TERM="xterm", COLUMNS="120", LINES="40")
    traced = Terminal(ddp_command(run_dir, STEPS, nproc=1, trace=TRACE), env)
    plain = Terminal(ddp_command(None, STEPS, nproc=1), env)
    try:
        _started(traced, lambda: flushes(run_dir / "steps" / "rank-00000") >= 2)
        _started(plain, lambda: True)
        time.sleep(1.0)
        for term in (traced, plain):
            _interrupt(term, how)
        codes = [term.wait(120) for term in (traced, plain)]
        assert codes[1] is not None, "plain torchrun did not stop"
        log = traced.output.decode(errors="replace")[-3000:]
        assert codes[0] is not None, f"the SIGINT was ignored: the traced job still trains\n{log}"
        if codes[1] == 128 + signal.SIGABRT and codes[0] != codes[1]:
            # Plain torchrun itself sometimes aborts in its own teardown after a Ctrl-C (seen once in a
            # CI run: 134 against its usual status); that abort is not the behaviour to match, so its
            # status is asked again in a run of its own.
            codes[1] = _plain_code(how, env)
        assert codes[0] == codes[1] != 0, (codes, log, plain.output.decode(errors="replace")[-2000:])
        steps = _steps(run_dir)
        assert sorted(steps) == [0]
        for s in steps.values():  # every row flushed on the way out, contiguous from step 0
            assert np.array_equal(np.sort(s), np.arange(len(s))) and 0 < len(s) < STEPS
    finally:
        traced.kill_all()
        plain.kill_all()
